"""What pagedkv needs to know about a transformers model, read from its config, and
every reason it cannot serve one, named before anything is allocated.

A decoder maps onto one :class:`~pagedkv.PagedKVCache`: its layers
(``num_hidden_layers``), KV heads (``num_key_value_heads``; GQA when fewer than
``num_attention_heads``), ``head_dim``, and per layer a window
(``sliding_attention`` layers take ``sliding_window`` as their
``layer_windows`` entry; ``full_attention`` layers none) or a chunk
(``chunked_attention`` layers, Llama 4, attend with ``attention_chunk_size``;
they keep their K/V in the full pool).  The variants of the
attention call come from the config too: the scale (``query_pre_attn_scalar``
** -0.5 where a model has it, else ``head_dim`` ** -0.5; the model's own
``scaling`` wins when it passes one) and the soft cap
(``attn_logit_softcapping``).  Learned sinks (gpt-oss) are weights, not config:
the attention function takes them from the call (``s_aux``).

Multi-head latent attention (DeepSeek V2/V3: ``kv_lora_rank``) maps onto a
cache of ``kv_layout="latent"``: one KV head whose rows are the normalised
latent (``kv_lora_rank``) then the rotary key (``qk_rope_head_dim``), the
values the latent itself; :class:`LatentAttention` keeps the per-head widths
the absorbed attention needs (``pagedkv.hf.attention``).
"""
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Tuple

#: Layer types of transformers' configs that map onto a pagedkv layer.
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


class UnsupportedModelError(ValueError):
    """A model whose attention pagedkv cannot serve; the message names the config field."""


@dataclass(frozen=True)
class LatentAttention:
    """The widths of a model's multi-head latent attention (DeepSeek V2/V3).

    Attributes
    ----------
    kv_lora_rank : int
        The latent's width: the values of the cache's rows.
    qk_nope_head_dim, qk_rope_head_dim : int
        Each query head's columns without and with rotary embedding.
    v_head_dim : int
        Each head's output width (what ``kv_b_proj`` makes of the latent).
    """
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelAttention:
    """The attention geometry and variants of a decoder.

    Attributes
    ----------
    model_type : str
    num_layers, num_heads, num_kv_heads, head_dim : int
    layer_windows : tuple of (int or None), length num_layers
        ``W`` for a sliding-window layer, ``None`` for a full-attention one.
    layer_chunks : tuple of (int or None), length num_layers
        ``C`` (``attention_chunk_size``) for a chunked layer, else ``None``.
    scale : float
        Default logit scale (the model's ``scaling`` argument overrides it).
    logits_soft_cap : float or None
    vocab_size : int
    max_position : int
        ``max_position_embeddings`` (the context the model was built for).
    latent : LatentAttention or None
        Multi-head latent attention's widths (the cache then keeps latent rows,
        ``kv_layout="latent"``, of ``head_dim = kv_lora_rank + qk_rope_head_dim``
        values with the first ``kv_lora_rank`` as values, in one KV head); None
        for other models.
    """
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_windows: Tuple[Optional[int], ...]
    layer_chunks: Tuple[Optional[int], ...]
    scale: float
    logits_soft_cap: Optional[float]
    vocab_size: int
    max_position: int
    latent: Optional[LatentAttention] = None

    @property
    def has_windowed_layers(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def kv_layout(self) -> str:
        """The cache's ``kv_layout``: ``"latent"`` for latent attention."""
        return "separate" if self.latent is None else "latent"

    @property
    def v_head_dim(self) -> int:
        """The cache's ``v_head_dim``: the latent's width, else ``head_dim``."""
        return self.head_dim if self.latent is None else self.latent.kv_lora_rank


def _positive_int(config: Any, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(f"config.{name}: expected a positive int, got {value!r} "
                                    f"({config.model_type})")
    return value


def _check_layer_types(layer_types: Iterable[str]) -> None:
    for index, kind in enumerate(layer_types):
        if kind not in SERVED_LAYER_TYPES:
            raise UnsupportedModelError(
                f"config.layer_types[{index}]: {kind!r} has no mapping in pagedkv (it serves "
                f"{' and '.join(map(repr, SERVED_LAYER_TYPES))} layers)")


def read_model_attention(config: Any) -> ModelAttention:
    """The :class:`ModelAttention` of a transformers config.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        A decoder's config (``model.config``); a multimodal model's text config
        is used.

    Returns
    -------
    ModelAttention

    Raises
    ------
    UnsupportedModelError
        An attention pagedkv has no mapping for (a layer type other than
        ``full_attention``, ``sliding_attention`` and ``chunked_attention``:
        linear or shared-KV layers), bidirectional attention, heads that GQA cannot group,
        keys and values of different widths outside latent attention, or a
        latent attention without the widths it needs; the message names the
        config field and its value.
    """
    from transformers import PretrainedConfig
    from transformers.cache_utils import get_layer_types_and_kwargs

    if not isinstance(config, PretrainedConfig):
        raise UnsupportedModelError(f"config: expected a transformers PretrainedConfig "
                                    f"(model.config), got {type(config).__name__}")
    config = config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"config.is_encoder_decoder: {model_type} is an "
                                    f"encoder-decoder; pagedkv serves decoder-only models")
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention",
                                                         False):
        raise UnsupportedModelError(f"config.use_bidirectional_attention: {model_type} "
                                    f"attends bidirectionally; pagedkv's attention is causal")
    num_layers = _positive_int(config, "num_hidden_layers", config.num_hidden_layers)
    num_heads = _positive_int(config, "num_attention_heads", config.num_attention_heads)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    _positive_int(config, "num_key_value_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"config.num_key_value_heads: {num_kv_heads} does not divide "
            f"num_attention_heads={num_heads}; grouped-query attention needs a multiple")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    _positive_int(config, "head_dim", head_dim)
    latent = _latent_attention(config)
    scale = None
    if latent is not None:
        # one KV head of latent rows; each query head is absorbed into that width
        num_kv_heads = 1
        head_dim = latent.kv_lora_rank + latent.qk_rope_head_dim
        scale = _latent_scale(config, latent)
    for name in ("v_head_dim", "global_head_dim") if latent is None else ("global_head_dim",):
        value = getattr(config, name, None)
        if value is not None and value != head_dim:
            raise UnsupportedModelError(
                f"config.{name}: {value}, not head_dim={head_dim}: keys and values of other "
                f"widths than head_dim have no mapping in pagedkv")

    # the config's own list first: transformers' reading of it may fail on types it
    # cannot size; then its reading (types inferred from windows, shared-KV layers)
    _check_layer_types(getattr(config, "layer_types", None) or ())
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    _check_layer_types(layer_types)
    windows, chunks = [], []
    for kind, kwargs in zip(layer_types, layer_kwargs):
        # transformers gives a chunked layer its chunk size as "sliding_window"
        span = kwargs.get("sliding_window")
        if kind == "sliding_attention":
            _positive_int(config, "sliding_window", span)
        elif kind == "chunked_attention":
            _positive_int(config, "attention_chunk_size", span)
        windows.append(span if kind == "sliding_attention" else None)
        chunks.append(span if kind == "chunked_attention" else None)
    if len(windows) != num_layers:
        raise UnsupportedModelError(f"config.layer_types: expected {num_layers} entries "
                                    f"(num_hidden_layers), got {len(windows)}")

    pre_attn = getattr(config, "query_pre_attn_scalar", None)
    if scale is None:
        scale = float(pre_attn) ** -0.5 if pre_attn else float(head_dim) ** -0.5
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None and not cap > 0:
        raise UnsupportedModelError(f"config.attn_logit_softcapping: expected a float > 0 or "
                                    f"None, got {cap!r}")
    return ModelAttention(
        model_type=model_type, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, layer_windows=tuple(windows),
        layer_chunks=tuple(chunks),
        scale=scale, logits_soft_cap=None if cap is None else float(cap),
        vocab_size=int(config.vocab_size),
        max_position=int(getattr(config, "max_position_embeddings", None) or 2**31 - 1),
        latent=latent)


def _latent_attention(config: Any) -> Optional[LatentAttention]:
    """The :class:`LatentAttention` of a config with ``kv_lora_rank``, else None."""
    if getattr(config, "kv_lora_rank", None) is None:
        return None
    widths = {name: _positive_int(config, name, getattr(config, name, None))
              for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    return LatentAttention(**widths)


def _latent_scale(config: Any, latent: LatentAttention) -> float:
    """The logit scale of latent attention: ``(qk_nope + qk_rope) ** -0.5``, times
    YaRN's ``mscale_all_dim`` factor squared (what DeepSeek's attention applies;
    the model passes the same as its ``scaling``)."""
    from transformers.modeling_rope_utils import yarn_apply_mscale
    qk_head_dim = latent.qk_nope_head_dim + latent.qk_rope_head_dim
    return float(yarn_apply_mscale(getattr(config, "rope_parameters", None) or {},
                                   qk_head_dim ** -0.5))
