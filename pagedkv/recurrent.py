"""The recurrent layers' calls of a step: argument checks and dispatch.

``PagedKVCache.causal_conv1d``, ``gated_delta_rule``, ``read_states`` and
``write_states`` check their arguments here and hand the step's
:class:`~pagedkv.state_pool.StateStep` (each sequence's slot and the save
points) to the backend's kernels or its state store.  The math is in the
kernels (host: ``pagedkv/_kernels_recurrent.pxi``; OpenCL:
``opencl/recurrent.cl``); its definition in ``docs/hybrid.md``.
"""
import math
import sys
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

import numpy as np

from pagedkv._arrays import is_torch_tensor
from pagedkv._validate import check_int, check_tensor
from pagedkv.errors import ArgumentTypeError
from pagedkv.state_spec import StateSpec

if TYPE_CHECKING:
    from pagedkv.backends.base import Backend
    from pagedkv.state_pool import StatePool, StateStep
    from pagedkv.step import StepBatch

ACTIVATIONS = (None, "silu")


def layer_spec(layer_states: Sequence[Optional[StateSpec]], layer: int) -> StateSpec:
    """The recurrent layer's spec; ValueError naming an attention layer."""
    spec = layer_states[layer]
    if spec is None:
        raise ValueError(f"layer: layer {layer} is an attention layer (layer_states[{layer}] "
                         f"is None); state calls need a recurrent layer")
    return spec


def _state_array(pool: "StatePool", layer: int, state: Any, call: str,
                 dims: str) -> Tuple[int, Tuple[int, ...]]:
    """The index and shape of the layer's state array ``state``, which ``call``
    keeps as ``dims`` (ValueError naming ``state`` for another rank)."""
    spec = layer_spec(pool.spec.layer_states, layer)
    index = check_int("state", state, minimum=0, maximum=spec.num_arrays - 1)
    shape = spec.shapes[index]
    if len(shape) != dims.count(",") + 1:
        raise ValueError(f"state: {call} keeps state {index} of layer {layer} as {dims}; its "
                         f"shape is {list(shape)}")
    return index, shape


def _advance(step: "StateStep", layer: int, index: int, call: str, run: Any,
             torch_in: bool) -> Any:
    """Run a built-in recurrence ``run()`` on state array ``index`` of ``layer``, once
    per step; its output as a torch tensor when the input was one."""
    check_unadvanced(step, layer, index, call)
    out = run()
    step.by_kernel.add((layer, index))
    return _as_output(out, torch_in)


def _as_kernel_input(name: str, x: Any, shape: Tuple[Optional[int], ...], backend: "Backend"):
    """``x`` checked (shape and float dtype) as the kernels read it: the backend's
    own float32 arrays as they are, else a float32 C-contiguous ndarray."""
    x = check_tensor(name, x, shape, native_types=backend.array_types)
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, np.float32)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ArgumentTypeError(f"{name}: a device array must be float32 and contiguous, "
                                f"got {x.dtype}")
    return x


def _finite_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"{name}: expected a float, got {type(value).__name__} "
                                f"{value!r}"[:200])
    value = float(value)
    if not math.isfinite(value) or not math.isfinite(np.float32(value)):
        raise ValueError(f"{name}: expected a finite float32 value, got {value}")
    return value


def _as_output(out: Any, torch_in: bool) -> Any:
    return sys.modules["torch"].from_numpy(out) if torch_in else out


def _step_of(batch: "StepBatch") -> "StateStep":
    step = batch._state_step
    assert step is not None         # a cache with recurrent layers gives every step one
    return step


def check_unadvanced(step: "StateStep", layer: int, index: int, what: str) -> None:
    if step.advanced(layer, index):
        raise ValueError(f"state: state {index} of layer {layer} was already advanced in this "
                         f"step; {what} runs once per layer and step (append again for the "
                         f"next tokens)")


def causal_conv1d(backend: "Backend", pool: "StatePool", layer: int, batch: "StepBatch",
                  x: Any, weight: Any, bias: Any, activation: Optional[str], state: Any) -> Any:
    """``PagedKVCache.causal_conv1d`` after the layer and batch checks."""
    index, shape = _state_array(pool, layer, state, "causal_conv1d", "[channels, kernel - 1]")
    channels, kernel = shape[0], shape[1] + 1
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}"[:200])
    step = _step_of(batch)
    torch_in = is_torch_tensor(x)
    x = _as_kernel_input("x", x, (batch.num_tokens, channels), backend)
    weight = np.ascontiguousarray(check_tensor("weight", weight, (channels, kernel)),
                                  np.float32)
    if bias is not None:
        bias = np.ascontiguousarray(check_tensor("bias", bias, (channels,)), np.float32)
    return _advance(step, layer, index, "causal_conv1d", lambda: backend.causal_conv1d(
        pool.store, layer, index, step, x, weight, bias, activation == "silu"), torch_in)


def gated_delta_rule(backend: "Backend", pool: "StatePool", layer: int, batch: "StepBatch",
                     q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any, qk_l2norm: Any,
                     state: Any) -> Any:
    """``PagedKVCache.gated_delta_rule`` after the layer and batch checks."""
    index, shape = _state_array(pool, layer, state, "gated_delta_rule",
                                "[num_v_heads, k_dim, v_dim]")
    num_v_heads, k_dim, v_dim = shape
    if not isinstance(qk_l2norm, (bool, np.bool_)):
        raise ArgumentTypeError(f"qk_l2norm: expected a bool, got {qk_l2norm!r}"[:200])
    scale = k_dim ** -0.5 if scale is None else _finite_float("scale", scale)
    step = _step_of(batch)
    torch_in = is_torch_tensor(q)
    total = batch.num_tokens
    q = _as_kernel_input("q", q, (total, None, k_dim), backend)
    num_k_heads = q.shape[1]
    if num_k_heads == 0 or num_v_heads % num_k_heads:
        raise ValueError(f"q: expected num_k_heads dividing the state's num_v_heads="
                         f"{num_v_heads}, got {num_k_heads}")
    k = _as_kernel_input("k", k, (total, num_k_heads, k_dim), backend)
    v = _as_kernel_input("v", v, (total, num_v_heads, v_dim), backend)
    g = _as_kernel_input("g", g, (total, num_v_heads), backend)
    beta = _as_kernel_input("beta", beta, (total, num_v_heads), backend)
    return _advance(step, layer, index, "gated_delta_rule", lambda: backend.gated_delta_rule(
        pool.store, layer, index, step, q, k, v, g, beta, scale, bool(qk_l2norm)), torch_in)


def read_states(pool: "StatePool", layer: int, batch: "StepBatch") -> Tuple[np.ndarray, ...]:
    """``PagedKVCache.read_states``: per state array, ``[B, *shape]`` float32, the
    states before the step (zeros for a sequence without one)."""
    spec = layer_spec(pool.spec.layer_states, layer)
    step = _step_of(batch)
    for index in range(spec.num_arrays):
        if step.advanced(layer, index):
            raise ValueError(f"layer: state {index} of layer {layer} was already advanced in "
                             f"this step; read_states reads the states before it, so call it "
                             f"first")
    return tuple(pool.store.read(layer, i, step.slots) for i in range(spec.num_arrays))


def write_states(pool: "StatePool", layer: int, batch: "StepBatch", states: Any) -> None:
    """``PagedKVCache.write_states``: the states after the step, per state array
    ``[B, *shape]``; rows of sequences without new tokens are ignored."""
    spec = layer_spec(pool.spec.layer_states, layer)
    step = _step_of(batch)
    if not isinstance(states, (tuple, list)) or len(states) != spec.num_arrays:
        raise ArgumentTypeError(f"states: expected a tuple of {spec.num_arrays} arrays (layer "
                                f"{layer}'s state arrays), got {type(states).__name__}")
    num_seqs = batch.num_seqs
    arrays = []
    for index, (shape, array) in enumerate(zip(spec.shapes, states)):
        array = check_tensor(f"states[{index}]", array, (num_seqs,) + shape)
        arrays.append(np.ascontiguousarray(array, np.float32))
    for index in range(spec.num_arrays):
        check_unadvanced(step, layer, index, "write_states")
    qs = step.query_start
    rows = np.flatnonzero(qs[1:] > qs[:-1])          # sequences with new tokens
    slots = step.slots[rows]
    # a save point at a sequence's last row (a rollback state or a snapshot at the
    # step's end) gets the state after the step too
    last = qs[1:][rows] - 1
    where = {int(r): b for b, r in enumerate(last.tolist())}
    end_rows = [where[int(r)] for r in step.end_save_rows.tolist()]
    for index, array in enumerate(arrays):
        pool.store.write(layer, index, slots, np.ascontiguousarray(array[rows]))
        if end_rows:
            pool.store.write(layer, index, step.end_save_slots,
                             np.ascontiguousarray(array[rows][end_rows]))
        step.written.add((layer, index))


def read_state(pool: "StatePool", layer: int, seq_id: int) -> Tuple[np.ndarray, ...]:
    """``PagedKVCache.read_state``: the sequence's state arrays now (float32 copies)."""
    spec = layer_spec(pool.spec.layer_states, layer)
    slot = np.array([pool.current_slot(seq_id)], np.int32)
    return tuple(pool.store.read(layer, i, slot)[0] for i in range(spec.num_arrays))
