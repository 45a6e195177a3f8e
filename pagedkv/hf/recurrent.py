"""The recurrent mixers of hybrid transformers models, run over a ``PagedCache``'s states.

transformers 5 routes the state-keeping parts of its recurrent mixers through
module-level functions it documents as replaceable ("so that ``kernelize`` can
replace it, e.g. with a runtime that manages the conv state itself"):

- ``causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, activation)``:
  the causal convolution of gated DeltaNet (Qwen3.5, Qwen3-Next), of LFM2's
  short convolutions and of Mamba2 (GraniteMoeHybrid);
- ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``: the
  gated delta rule (the mixer fetches the state with
  ``cache.get_recurrent_state`` just before, and stores what they return with
  ``cache.update_recurrent_state`` after);
- ``mamba2_scan_forward(module, hidden_states, B, C, dt, cache)``: Mamba2's scan.

:func:`install` puts a dispatcher in place of each in the model's modeling
module: under a :class:`~pagedkv.hf.PagedCache` it hands the step's rows to the
cache (``PagedKVCache.causal_conv1d`` / ``gated_delta_rule`` on the layer's
pooled state, or Mamba2's own math between ``read_states`` and
``write_states``); under any other cache, or none, it calls transformers' own
function unchanged.  The delta rule takes no cache argument: gated DeltaNet
runs its convolution just before it, so the convolution's dispatcher leaves a
note on this thread for the delta rule that follows (a PagedCache's layer, or
none under another cache, which also clears a note a failed pass left).
"""
import importlib
import threading
from typing import Any, Callable, Dict, Optional, Tuple

#: transformers' modeling module of each model type whose recurrent layers pagedkv serves.
MODELING_MODULES: Dict[str, str] = {
    "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe_text": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "lfm2": "transformers.models.lfm2.modeling_lfm2",
    "lfm2_moe": "transformers.models.lfm2_moe.modeling_lfm2_moe",
    "granitemoehybrid": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
}

_ORIGINAL = "__pagedkv_original__"
_install_lock = threading.Lock()
# the last convolution's cache and layer, for the delta rule that follows on the same thread
_pending = threading.local()


def _is_paged(cache: Any) -> bool:
    from pagedkv.hf.cache import PagedCache
    return isinstance(cache, PagedCache)


def _take_state_call() -> Optional[Tuple[Any, int]]:
    call = getattr(_pending, "call", None)
    _pending.call = None
    return call


def _conv_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    def causal_conv1d_forward(conv1d: Any, hidden_states: Any, cache: Any, layer_idx: int,
                              activation: Optional[str] = None, state_idx: int = 0,
                              **kwargs: Any) -> Any:
        if _is_paged(cache):
            _pending.call = (cache, layer_idx)
            return cache.recurrent_conv(layer_idx, conv1d, hidden_states, activation, state_idx)
        _pending.call = None
        return original(conv1d, hidden_states, cache, layer_idx, activation=activation,
                        state_idx=state_idx, **kwargs)
    return causal_conv1d_forward


def _delta_rule_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    def gated_delta_rule(query: Any, key: Any, value: Any, g: Any, beta: Any,
                         *args: Any, **kwargs: Any) -> Tuple[Any, None]:
        call = _take_state_call()
        if call is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        cache, layer = call
        if args:
            raise ValueError(f"layer {layer}: the gated delta rule was called with positional "
                             f"options {args!r}; pagedkv takes transformers' keyword call")
        # the state is the cache's: no initial state in, no final state out (the mixer
        # hands None to update_recurrent_state, which keeps nothing)
        return cache.recurrent_delta_rule(layer, query, key, value, g, beta,
                                          bool(kwargs.get("use_qk_l2norm_in_kernel", False)),
                                          kwargs.get("scale")), None
    return gated_delta_rule


def _mamba2_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    def mamba2_scan_forward(module: Any, hidden_states: Any, B: Any, C: Any, dt: Any,
                            cache: Any, **kwargs: Any) -> Any:
        if _is_paged(cache):
            return cache.recurrent_mamba2_scan(module, hidden_states, B, C, dt, original)
        return original(module, hidden_states, B, C, dt, cache, **kwargs)
    return mamba2_scan_forward


_DISPATCHERS = {
    "causal_conv1d_forward": _conv_dispatcher,
    "torch_chunk_gated_delta_rule": _delta_rule_dispatcher,
    "torch_recurrent_gated_delta_rule": _delta_rule_dispatcher,
    "mamba2_scan_forward": _mamba2_dispatcher,
}


def install(model_type: str) -> None:
    """Put the dispatchers in ``model_type``'s modeling module (idempotent, thread-safe).

    Raises
    ------
    UnsupportedModelError
        ``model_type`` is none of :data:`MODELING_MODULES`, or its module lacks the
        functions pagedkv replaces (another transformers version).
    """
    from pagedkv.hf.config import UnsupportedModelError
    if model_type not in MODELING_MODULES:
        raise UnsupportedModelError(f"config.model_type: {model_type!r} has recurrent layers "
                                    f"pagedkv does not serve")
    module = importlib.import_module(MODELING_MODULES[model_type])
    with _install_lock:
        found = [name for name in _DISPATCHERS if hasattr(module, name)]
        if "causal_conv1d_forward" not in found:
            raise UnsupportedModelError(
                f"config.model_type: {model_type!r}: transformers' {module.__name__} has no "
                f"causal_conv1d_forward to route through pagedkv (a transformers version "
                f"pagedkv.hf was not written for)")
        for name in found:
            function = getattr(module, name)
            if getattr(function, _ORIGINAL, None) is not None:
                continue                                  # installed before
            dispatcher = _DISPATCHERS[name](function)
            dispatcher.__name__ = dispatcher.__qualname__ = name
            dispatcher.__doc__ = (f"pagedkv.hf's dispatcher for {name}: the cache's states "
                                  f"under a PagedCache, transformers' own function otherwise.")
            setattr(dispatcher, _ORIGINAL, function)
            setattr(module, name, dispatcher)


class StateShim:
    """What ``mamba2_scan_forward`` asks of a cache, over given states (one call's).

    Parameters
    ----------
    state : torch.Tensor, shape [B, num_heads, head_dim, state_size], or None
        The initial SSM states of the call's rows.

    Attributes
    ----------
    final : torch.Tensor, shape [B, num_heads, head_dim, state_size], or None
        The states after the call (``update_recurrent_state``).
    """

    def __init__(self, state: Any):
        self.state = state
        self.final: Any = None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Any:
        return self.state

    def get_recurrent_states_to_keep(self, layer_idx: Optional[int] = None) -> int:
        return 0

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int,
                               state_idx: int = 0, **kwargs: Any) -> Any:
        self.final = recurrent_states
        return recurrent_states
