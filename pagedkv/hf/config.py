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

Hybrid models mix attention layers with recurrent ones, which keep a fixed-size
state per sequence instead of K/V (``layer_states`` of the cache, one
:class:`RecurrentLayer` per such layer):

- ``linear_attention`` layers of Qwen3.5 and Qwen3-Next (gated DeltaNet): a
  causal convolution over q, k and v (state ``[conv_dim, kernel - 1]``,
  ``conv_dim = 2 * linear_num_key_heads * linear_key_head_dim +
  linear_num_value_heads * linear_value_head_dim``) and the delta rule's state
  ``[linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]``;
- ``conv`` layers of LFM2 (short convolutions): ``[hidden_size, conv_L_cache - 1]``;
- ``linear_attention`` (or ``mamba``) layers of GraniteMoeHybrid (Mamba2): the
  convolution's ``[conv_dim, mamba_d_conv - 1]`` (``conv_dim = mamba_expand *
  hidden_size + 2 * mamba_n_groups * mamba_d_state``) and the SSM state
  ``[mamba_n_heads, mamba_d_head, mamba_d_state]``.

A recurrent layer type of any other model is an :class:`UnsupportedModelError`:
the same name means other state (and other mixer code) in other models.
"""
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

#: Layer types of transformers' configs that map onto a pagedkv attention layer.
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

#: Recurrent layer types, per model type whose mixer pagedkv serves: the kind of recurrence.
RECURRENT_LAYER_KINDS: Dict[str, Dict[str, str]] = {
    "qwen3_5_text": {"linear_attention": "gated_delta_net"},
    "qwen3_5_moe_text": {"linear_attention": "gated_delta_net"},
    "qwen3_next": {"linear_attention": "gated_delta_net"},
    "lfm2": {"conv": "short_conv"},
    "lfm2_moe": {"conv": "short_conv"},
    "granitemoehybrid": {"linear_attention": "mamba2", "mamba": "mamba2"},
}


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
class RecurrentLayer:
    """A layer that keeps a fixed-size state per sequence instead of K/V.

    Attributes
    ----------
    kind : {"gated_delta_net", "short_conv", "mamba2"}
        The recurrence: gated DeltaNet (a causal convolution, then the gated
        delta rule; Qwen3.5, Qwen3-Next), a short convolution (LFM2), or Mamba2
        (a causal convolution, then the selective scan; GraniteMoeHybrid).
    shapes : tuple of tuple of int
        The layer's state arrays, one sequence's (the ``StateSpec`` shapes):
        the convolution's ``(conv_dim, conv_kernel - 1)`` first, then for
        gated DeltaNet ``(num_v_heads, k_head_dim, v_head_dim)`` and for Mamba2
        ``(num_heads, head_dim, state_size)``.
    conv_kernel : int
        The causal convolution's width.
    """
    kind: str
    shapes: Tuple[Tuple[int, ...], ...]
    conv_kernel: int


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
    layer_states : tuple of (RecurrentLayer or None), length num_layers, or ()
        The recurrent layers of a hybrid model (None at attention layers); ``()``
        for a model of attention layers only.
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
    layer_states: Tuple[Optional[RecurrentLayer], ...] = ()

    @property
    def is_hybrid(self) -> bool:
        """True when some layer is recurrent (``layer_states`` has an entry)."""
        return any(state is not None for state in self.layer_states)

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


def _check_layer_types(layer_types: Iterable[str], model_type: str) -> None:
    recurrent = RECURRENT_LAYER_KINDS.get(model_type, {})
    for index, kind in enumerate(layer_types):
        if kind in SERVED_LAYER_TYPES or kind in recurrent:
            continue
        served = " and ".join(map(repr, SERVED_LAYER_TYPES))
        if any(kind in kinds for kinds in RECURRENT_LAYER_KINDS.values()):
            models = ", ".join(m for m, kinds in RECURRENT_LAYER_KINDS.items() if kind in kinds)
            raise UnsupportedModelError(
                f"config.layer_types[{index}]: {kind!r} layers of {model_type} have no mapping "
                f"in pagedkv (it serves {served} layers, and {kind!r} layers of {models})")
        raise UnsupportedModelError(
            f"config.layer_types[{index}]: {kind!r} has no mapping in pagedkv (it serves "
            f"{served} layers, and the recurrent layers of "
            f"{', '.join(RECURRENT_LAYER_KINDS)})")


def _recurrent_layer(config: Any, kind: str) -> RecurrentLayer:
    """The :class:`RecurrentLayer` of one recurrent layer of ``config`` (a served model type)."""
    def field(name: str) -> int:
        return _positive_int(config, name, getattr(config, name, None))

    if kind == "gated_delta_net":
        num_k_heads, num_v_heads = field("linear_num_key_heads"), field("linear_num_value_heads")
        k_dim, v_dim = field("linear_key_head_dim"), field("linear_value_head_dim")
        kernel = field("linear_conv_kernel_dim")
        if num_v_heads % num_k_heads:
            raise UnsupportedModelError(
                f"config.linear_num_value_heads: {num_v_heads} is not a multiple of "
                f"linear_num_key_heads={num_k_heads} ({config.model_type})")
        conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
        return RecurrentLayer(kind, ((conv_dim, kernel - 1), (num_v_heads, k_dim, v_dim)), kernel)
    if kind == "short_conv":
        kernel = field("conv_L_cache")
        return RecurrentLayer(kind, ((field("hidden_size"), kernel - 1),), kernel)
    # mamba2
    hidden, expand = field("hidden_size"), field("mamba_expand")
    num_heads, head_dim = field("mamba_n_heads"), field("mamba_d_head")
    groups, state_size, kernel = field("mamba_n_groups"), field("mamba_d_state"), \
        field("mamba_d_conv")
    if num_heads % groups:
        raise UnsupportedModelError(f"config.mamba_n_heads: {num_heads} is not a multiple of "
                                    f"mamba_n_groups={groups} ({config.model_type})")
    conv_dim = expand * hidden + 2 * groups * state_size
    return RecurrentLayer(kind, ((conv_dim, kernel - 1), (num_heads, head_dim, state_size)),
                          kernel)


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
        ``full_attention``, ``sliding_attention`` and ``chunked_attention``,
        except the recurrent layers of the models in ``RECURRENT_LAYER_KINDS``:
        shared-KV layers, or the linear layers of other models), bidirectional attention, heads that GQA cannot group,
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
    _check_layer_types(getattr(config, "layer_types", None) or (), model_type)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    _check_layer_types(layer_types, model_type)
    recurrent_kinds = RECURRENT_LAYER_KINDS.get(model_type, {})
    states = [_recurrent_layer(config, recurrent_kinds[kind]) if kind in recurrent_kinds
              else None for kind in layer_types]
    if len(states) == num_layers and states[0] is not None \
            and all(state is not None for state in states):
        raise UnsupportedModelError(f"config.layer_types: every layer of this {model_type} is "
                                    f"recurrent; pagedkv serves hybrid models (some attention)")
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
        latent=latent, layer_states=tuple(states) if any(states) else ())


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
