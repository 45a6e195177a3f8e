"""The opencl backend's recurrences: launching ``opencl/recurrent.cl`` on a step.

:class:`OpenCLRecurrences` belongs to one :class:`pagedkv.backends.opencl.OpenCLBackend`
and runs on its queue: inputs go through the backend's ``_device_f32`` (numpy
uploaded; a pyopencl array read where it is), states are the buffers of an
:class:`pagedkv.backends.state_store.OpenCLStateStore`, and a pyopencl input
gives a pyopencl result (numpy: numpy).  The delta-rule kernel keeps a state
column in private memory, so its program is built per ``k_dim``
(``-DPKV_DK``); both programs are cached per context like the others.
"""
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from pagedkv.backends._opencl_program import build_program
from pagedkv.backends.state_store import OpenCLStateStore, StateStep

if TYPE_CHECKING:   # annotations only: pyopencl is imported when a backend is made
    import pyopencl

    from pagedkv.backends.opencl import OpenCLBackend

# Work-items of a recurrence work-group on a GPU: one per channel or state
# column, so consecutive ones read consecutive floats of x, v and the states.
_WORK_GROUP = 64
# On a CPU device a work-item takes a vector of this many columns or channels
# (recurrent.cl's PKV_W: PoCL vectorises within an item, not across items),
# in work-groups of this many items (PoCL 3.1, 2 cores, a 1,024-token prefill
# of 32 heads of 128 x 128: vectors of 8 or 16 and groups of 4 to 16 items
# all within 10% of 170 ms; one column per item 183 ms with the partial sums
# of recurrent.cl, 1,060 ms without; float16 vectors draw ABI warnings on AVX2).
_CPU_VECTOR = 8
_CPU_WORK_GROUP = 4
# On a CPU device a step whose longest run has more rows than this runs
# gated_delta_rule_heads, one work-item per (sequence, head) in the host
# kernel's form, which holds a head's state in private memory (recurrent.cl
# says why); shorter runs (decode) update the state where it lies, a vector
# of columns per work-item (PoCL 3.1: decode of 32 x 32 heads of 128 x 128,
# 8.9 ms against 18.8 ms by heads; a 2,048-row prefill, 222 ms against 389).
_CPU_HEADS = True
_HEADS_MIN_ROWS = 4


class OpenCLRecurrences:
    """``causal_conv1d`` and ``gated_delta_rule`` of one backend (see ``Backend``)."""

    def __init__(self, backend: "OpenCLBackend"):
        self.backend = backend
        import pyopencl as cl
        self._cpu = bool(backend.device.type & cl.device_type.CPU)
        self._wg = min(_CPU_WORK_GROUP if self._cpu else _WORK_GROUP,
                       backend.device.max_work_group_size)
        self._step: Optional[Tuple[StateStep, Dict[str, Any]]] = None

    def _width(self, columns: int) -> int:
        """Columns (or channels) per work-item: a vector on CPU devices, as wide as
        ``_CPU_VECTOR`` and dividing ``columns``; one on GPUs."""
        width = _CPU_VECTOR if self._cpu else 1
        while columns % width:
            width //= 2
        return width

    def _kernel(self, name: str, width: int = 1, k_dim: Optional[int] = None,
                v_dim: Optional[int] = None) -> Any:
        options = (f"-DPKV_W={width}",) + (() if k_dim is None else (f"-DPKV_DK={k_dim}",)) + \
            (() if v_dim is None else (f"-DPKV_DV={v_dim}",))
        return build_program(self.backend.context, "recurrent.cl", options)[name]

    def _step_buffers(self, s: StateStep) -> Dict[str, Any]:
        """The step's arrays on the device (buffers cannot be empty: the
        backend's placeholder stands in).  The last step's are kept: every
        recurrent layer of a model runs the same step."""
        if self._step is not None and all(
                np.array_equal(a, b) for a, b in zip(self._step[0], s)):
            return self._step[1]
        b = self.backend
        buffers = {name: b._upload(array) if len(array) else b._placeholder
                   for name, array in s._asdict().items()}
        self._step = (StateStep(*(a.copy() for a in s)), buffers)
        return buffers

    def _launch(self, kernel: Any, num_work_items: int, wait_for: List[Any],
                work_group: Optional[int] = None, **args: Any) -> "pyopencl.Event":
        wg = work_group or self._wg
        return kernel(self.backend.queue, (-(-num_work_items // wg) * wg,), (wg,),
                      wait_for=wait_for, **args)

    def _output(self, native: bool, shape: Tuple[int, ...]) -> Any:
        """Where a kernel writes its result: a new pyopencl array (native inputs)
        or the backend's reusable buffer (numpy; read back before returning)."""
        b = self.backend
        if native:
            from pyopencl import array as cl_array
            out = cl_array.empty(b.queue, shape, np.float32, allocator=b._zeros)
            out.allocator = None    # what pyopencl makes from it later: its default buffers
            return out
        return b._work_buffer("recurrent_out", max(int(np.prod(shape)), 1))

    def _finish(self, native: bool, out_d: Any, shape: Tuple[int, ...], event: Any,
                inputs: Tuple[Any, ...]) -> Any:
        """The result of a launch that ends with ``event``: the pyopencl array, or
        a numpy copy."""
        b = self.backend
        if native:
            out_d.add_event(event)
            b._hand_back(*inputs, event=event)
            return out_d
        b._hand_back(*inputs, event=event)
        result = np.empty(shape, np.float32)
        b._cl.enqueue_copy(b.queue, result, out_d)
        return result

    def _empty_result(self, native: bool, shape: Tuple[int, ...]) -> Any:
        if native:
            from pyopencl import array as cl_array
            return cl_array.zeros(self.backend.queue, shape, np.float32)
        return np.zeros(shape, np.float32)

    def causal_conv1d(self, store: OpenCLStateStore, layer: int, index: int, step: Any,
                      x: Any, weight: Any, bias: Any, silu: bool) -> Any:
        """``Backend.causal_conv1d``: ``x`` [T, C], ``weight`` [C, K], ``bias`` [C] or
        None (numpy or pyopencl, float32) -> y [T, C], float32, of ``x``'s kind."""
        b = self.backend
        b._check_process()
        native = b.is_native(x)
        s = StateStep.of(step)
        num_rows, channels = x.shape
        kernel_size = weight.shape[1]
        if s.num_rows == 0:
            return self._empty_result(native, tuple(x.shape))
        x_d, wait = b._device_f32(x, "x")
        w_d, w_wait = b._device_f32(weight, "weight")
        bias_d, b_wait = (b._placeholder, []) if bias is None else b._device_f32(bias, "bias")
        out_d = self._output(native, tuple(x.shape))
        wt = b._work_buffer("recurrent_conv_weights", channels * kernel_size)
        wait = [self._launch(self._kernel("conv_weights_t"), channels * kernel_size,
                             wait + w_wait, weight=w_d, wt=wt, channels=channels,
                             kernel_size=kernel_size)]
        t = self._step_buffers(s)
        width = self._width(channels)
        num_seqs = len(s.query_start) - 1
        state = store.buffer(layer, index)
        common = dict(query_start=t["query_start"], slots=t["slots"], num_seqs=num_seqs,
                      channels=channels, kernel_size=kernel_size, num_slots=store.num_slots)
        # the rows first (they read the history), then the saves and states
        self._launch(self._kernel("conv_rows", width), num_rows * channels // width,
                     wait + b_wait, x=x_d, wt=wt, bias=bias_d, has_bias=int(bias is not None),
                     state=state, y=out_d, num_rows=num_rows, silu=int(bool(silu)), **common)
        event = self._launch(self._kernel("conv_states", width), num_seqs * channels // width,
                             [], x=x_d, state=state, save_start=t["save_start"],
                             save_rows=t["save_rows"], save_slots=t["save_slots"], **common)
        return self._finish(native, out_d, (num_rows, channels), event, (x, weight, bias))

    def gated_delta_rule(self, store: OpenCLStateStore, layer: int, index: int, step: Any,
                         q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float,
                         l2norm: bool) -> Any:
        """``Backend.gated_delta_rule``: ``q``, ``k`` [T, Hk, dk], ``v`` [T, Hv, dv],
        ``g``, ``beta`` [T, Hv] (numpy or pyopencl, float32) -> o [T, Hv, dv],
        float32, of ``q``'s kind."""
        b = self.backend
        b._check_process()
        native = b.is_native(q)
        s = StateStep.of(step)
        num_rows, num_v_heads, v_dim = v.shape
        num_k_heads, k_dim = k.shape[1], k.shape[2]
        if s.num_rows == 0:
            return self._empty_result(native, tuple(v.shape))
        wait: List[Any] = []
        device: Dict[str, Any] = {}
        for name, array in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            device[name], events = b._device_f32(array, name)
            wait += events
        # 1/|k|, 1/|q| (l2norm; else 1) and k . q once per row and k-head
        stats = b._work_buffer("recurrent_qk_stats", 3 * num_rows * num_k_heads)
        wait = [self._launch(self._kernel("qk_row_stats"), num_rows * num_k_heads, wait,
                             q=device["q"], k=device["k"], stats=stats, num_rows=num_rows,
                             num_k_heads=num_k_heads, k_dim=k_dim, l2norm=int(bool(l2norm)))]
        out_d = self._output(native, tuple(v.shape))
        t = self._step_buffers(s)
        num_seqs = len(s.query_start) - 1
        args = dict(device, stats=stats, state=store.buffer(layer, index),
                    query_start=t["query_start"], slots=t["slots"], save_start=t["save_start"],
                    save_rows=t["save_rows"], save_slots=t["save_slots"], out=out_d,
                    num_seqs=num_seqs, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                    v_dim=v_dim, scale=float(scale), num_slots=store.num_slots)
        longest = int(np.diff(s.query_start).max())
        if self._cpu and _CPU_HEADS and longest > _HEADS_MIN_ROWS:
            # one work-item per (sequence, head), each a work-group of its own
            event = self._launch(self._kernel("gated_delta_rule_heads", 1, k_dim, v_dim),
                                 num_seqs * num_v_heads, wait, 1, **args)
        else:                          # one per (sequence, head, vector of columns)
            width = self._width(v_dim)
            event = self._launch(self._kernel("gated_delta_rule", width, k_dim),
                                 num_seqs * num_v_heads * v_dim // width, wait, **args)
        return self._finish(native, out_d, (num_rows, num_v_heads, v_dim), event,
                            (q, k, v, g, beta))
