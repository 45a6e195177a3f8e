"""The attention implementation ``"pagedkv"`` and its mask function, as transformers calls them.

transformers 5 builds each forward pass's masks through
``masking_utils.AttentionMaskInterface`` (sized by the cache's
``get_mask_sizes`` / ``get_query_offset``) and runs each layer's attention
through ``AttentionInterface``.  An implementation without a mask function
gets no mask at all, so :func:`padding_mask` is registered beside
:func:`paged_attention_forward`: it reduces the 2D padding mask to which of the
pass's new tokens are real, all the paged attention needs (causality, windows
and positions are the cache's).
"""
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from pagedkv.hf.cache import note_padding, take_update
from pagedkv.hf.config import UnsupportedModelError

if TYPE_CHECKING:   # annotations only: torch comes with transformers
    import torch

#: The name to pass as ``attn_implementation``.
NAME = "pagedkv"


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                 kv_offset: int = 0, mask_function: Optional[Callable[..., Any]] = None,
                 attention_mask: "Optional[torch.Tensor]" = None, use_vmap: bool = False,
                 **kwargs: Any) -> "Optional[torch.Tensor]":
    """The mask function of ``"pagedkv"``: which of the pass's new tokens are real.

    Parameters
    ----------
    batch_size, q_length : int
    attention_mask : torch.Tensor, shape [batch_size, past + q_length], optional
        The 2D padding mask (1 = token, 0 = padding), as ``generate`` keeps it.
    use_vmap : bool
        transformers sets it for a mask with custom overlays
        (``or_mask_function`` / ``and_mask_function``), which pagedkv does not
        serve.

    Returns
    -------
    torch.Tensor, shape [batch_size, q_length], bool, or None
        None when no new token is padding.
    """
    if use_vmap:
        raise UnsupportedModelError("attention mask: this model overlays a custom mask "
                                    "(or_mask_function / and_mask_function); pagedkv's "
                                    "attention is causal, with windows only")
    if attention_mask is None:
        note_padding(batch_size, q_length, None)
        return None
    if attention_mask.ndim != 2 or attention_mask.shape[0] != batch_size \
            or attention_mask.shape[1] < q_length:
        raise ValueError(f"attention_mask: expected a 2D padding mask [batch, past + new] = "
                         f"{[batch_size, kv_length + kv_offset]}, got {list(attention_mask.shape)}")
    tokens = attention_mask[:, attention_mask.shape[1] - q_length:].bool()
    new = None if bool(tokens.all()) else tokens
    # a hybrid model's recurrent layers may come first in the pass, and get no mask of ours
    note_padding(batch_size, q_length, new)
    return new


def paged_attention_forward(module: "torch.nn.Module", query: "torch.Tensor",
                            key: "torch.Tensor", value: "torch.Tensor",
                            attention_mask: "Optional[torch.Tensor]", dropout: float = 0.0,
                            scaling: Optional[float] = None,
                            sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None,
                            s_aux: "Optional[torch.Tensor]" = None,
                            is_causal: Optional[bool] = None,
                            **kwargs: Any) -> "Tuple[torch.Tensor, None]":
    """Attention of one layer over its :class:`~pagedkv.hf.PagedCache` (``"pagedkv"``).

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (``layer_idx``).
    query : torch.Tensor, shape [B, num_heads, q, head_dim]
    key, value : torch.Tensor, shape [B, num_kv_heads, q, head_dim]
        What ``past_key_values.update`` was just given: this pass's new tokens.
    attention_mask : torch.Tensor, shape [B, q], bool, or None
        From :func:`padding_mask`.
    dropout : float
        Must be 0 (inference).
    scaling : float, optional
        The model's logit scale (default: the config's).
    sliding_window : int, optional
        The layer's window, which must be the one the cache read from the config.
    softcap : float, optional
        Logit soft cap (Gemma 2 passes it; default: ``attn_logit_softcapping``).
    s_aux : torch.Tensor, shape [num_heads], optional
        Learned attention sinks (gpt-oss).

    Returns
    -------
    out : torch.Tensor, shape [B, q, num_heads, head_dim]
        Latent attention: ``[B, q, num_heads, v_head_dim]``, in the absorbed
        form over the latent rows the cache took (``key`` and ``value``, the
        model's expansion of the new tokens, are not read).
    None
        No attention weights.
    """
    cache, layer, latent_rows = take_update(module, key)
    if dropout:
        raise ValueError(f"dropout: pagedkv computes inference attention, got {dropout} "
                         f"(call model.eval())")
    if is_causal is False:
        raise UnsupportedModelError(f"layer {layer}: is_causal=False; pagedkv's attention "
                                    f"is causal")
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(f"attention_mask: pagedkv takes a 2D padding mask [batch, past + new], "
                         f"got a {attention_mask.ndim}D mask")
    spec = cache.attention_config
    window = spec.layer_windows[layer]
    if sliding_window is not None and sliding_window != window:
        raise UnsupportedModelError(f"layer {layer}: the model attends with sliding_window="
                                    f"{sliding_window}, but its config gives the layer "
                                    f"{'full attention' if window is None else window}")
    variants: Dict[str, Any] = {"scale": spec.scale if scaling is None else float(scaling)}
    cap = spec.logits_soft_cap if softcap is None else softcap
    if cap is not None:
        variants["logits_soft_cap"] = float(cap)
    if spec.layer_chunks[layer] is not None:
        variants["attention_chunk_size"] = spec.layer_chunks[layer]
    if s_aux is not None:
        variants["sinks"] = s_aux.detach().float().cpu()
    if latent_rows is not None:
        return _absorbed_attention(cache, module, layer, query, latent_rows, attention_mask,
                                   variants, kwargs.get("position_ids")), None
    out = cache.attend(layer, query, key, value, attention_mask, variants,
                       kwargs.get("position_ids"))
    return out, None


def _absorbed_attention(cache: Any, module: "torch.nn.Module", layer: int,
                        query: "torch.Tensor", rows: "torch.Tensor",
                        attention_mask: "Optional[torch.Tensor]", variants: Dict[str, Any],
                        position_ids: "Optional[torch.Tensor]") -> "torch.Tensor":
    """Multi-head latent attention in the absorbed form, over the cache's latent rows.

    Head ``h``'s key of a token is ``[W_uk[h] c ; k_rope]`` and its value
    ``W_uv[h] c`` (``kv_b_proj``'s two halves over the latent ``c``), so
    ``q . k = [W_uk[h]^T q_nope ; q_rope] . [c ; k_rope]`` and the output is
    ``W_uv[h]`` times the attention-weighted sum of latents: multi-query
    attention over the rows, with no per-head K/V made of the history.

    Parameters
    ----------
    module : torch.nn.Module
        The model's attention (``kv_b_proj``, ``layer_idx``).
    query : torch.Tensor, shape [B, num_heads, q, qk_nope_head_dim + qk_rope_head_dim]
        After the rotary embedding, as the model passes it.
    rows : torch.Tensor, shape [B, 1, q, kv_lora_rank + qk_rope_head_dim]
        The new tokens' latent rows (``PagedCache.update``).

    Returns
    -------
    torch.Tensor, shape [B, q, num_heads, v_head_dim], ``query.dtype``
    """
    import torch
    widths = cache.attention_config.latent
    num_heads = query.shape[1]
    nope, rank = widths.qk_nope_head_dim, widths.kv_lora_rank
    if query.shape[-1] != nope + widths.qk_rope_head_dim:
        raise ValueError(f"query: layer {layer}: expected {nope + widths.qk_rope_head_dim} "
                         f"columns per head (qk_nope_head_dim + qk_rope_head_dim), got "
                         f"{query.shape[-1]}")
    projection: Any = module.kv_b_proj      # an nn.Linear (torch types it as Tensor | Module)
    weight = projection.weight.detach()
    if tuple(weight.shape) != (num_heads * (nope + widths.v_head_dim), rank):
        raise UnsupportedModelError(
            f"kv_b_proj: layer {layer}: expected a weight of shape "
            f"{[num_heads * (nope + widths.v_head_dim), rank]} (num_heads x (qk_nope_head_dim "
            f"+ v_head_dim), kv_lora_rank), got {list(weight.shape)}")
    weight = weight.float().view(num_heads, nope + widths.v_head_dim, rank)
    dtype, query = query.dtype, query.detach().float()
    absorbed = torch.cat([torch.einsum("bhqn,hnr->bhqr", query[..., :nope], weight[:, :nope]),
                          query[..., nope:]], dim=-1)
    out = cache.attend(layer, absorbed, rows.float(), None, attention_mask, variants,
                       position_ids)               # [B, q, num_heads, kv_lora_rank]
    return torch.einsum("bqhr,hvr->bqhv", out.float(), weight[:, nope:]).to(dtype)


def register() -> None:
    """Register ``"pagedkv"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)
