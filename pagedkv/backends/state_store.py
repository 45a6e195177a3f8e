"""The state store: recurrent layers' states, one slot per copy of every layer's arrays.

A hybrid model's recurrent layer (gated DeltaNet, a short convolution, Mamba2)
keeps a fixed-size state per sequence instead of K/V rows.  The cache's state
pool hands out slots; the backend's store holds, per recurrent layer and per
state array of that layer, one float32 array ``[num_slots, *shape]``:

* host: a zero-initialised numpy array each (:class:`HostStateStore`);
* opencl: a zero-filled device buffer each (:class:`OpenCLStateStore`, which
  imports pyopencl when it is made).

Both have the same methods (``copy``, ``zero``, ``read``, ``write``) and
``num_slots``, ``memory_bytes``; the backends' recurrence kernels
(``causal_conv1d``, ``gated_delta_rule``) read and advance a step's slots in
place.  Callers (the cache) validate slots and shapes; the OpenCL kernels
still check every slot against ``num_slots``.
"""
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:   # annotations only: pyopencl is imported when an OpenCL store is made
    import pyopencl

#: Per layer: None (an attention layer) or the shapes of its state arrays.
StateShapes = Sequence[Optional[Sequence[Tuple[int, ...]]]]


def _checked_shapes(shapes: StateShapes) -> List[Optional[Tuple[Tuple[int, ...], ...]]]:
    """``shapes`` as tuples of int tuples (ValueError naming a negative extent)."""
    out: List[Optional[Tuple[Tuple[int, ...], ...]]] = []
    for layer, arrays in enumerate(shapes):
        if arrays is None:
            out.append(None)
            continue
        layer_shapes = tuple(tuple(int(n) for n in shape) for shape in arrays)
        for shape in layer_shapes:
            if any(n < 0 for n in shape):
                raise ValueError(f"shapes[{layer}]: a state array's extents must be >= 0, got "
                                 f"{shape}")
        out.append(layer_shapes)
    return out


def _memory_error(num_slots: int, nbytes: int, where: str, detail: str) -> MemoryError:
    return MemoryError(f"num_state_slots: {num_slots} slots of recurrent state need {nbytes} "
                       f"bytes {where}: {detail}; use fewer state slots")


class StateStep(NamedTuple):
    """A step's arrays as the recurrence kernels take them (int32, C-contiguous).

    Attributes
    ----------
    query_start : ndarray, shape [B+1]
    slots : ndarray, shape [B]
    save_start : ndarray, shape [B+1]
        Sequence ``b``'s saves are ``save_rows[save_start[b]:save_start[b+1]]``.
    save_rows, save_slots : ndarray, shape [M]
    """
    query_start: np.ndarray
    slots: np.ndarray
    save_start: np.ndarray
    save_rows: np.ndarray
    save_slots: np.ndarray

    @classmethod
    def of(cls, step: Any) -> "StateStep":
        """From any object with the int32 attributes ``query_start`` [B+1], ``slots``
        [B], ``save_rows`` [M] (ascending) and ``save_slots`` [M]."""
        def ints(x: Any) -> np.ndarray:
            return np.ascontiguousarray(x, dtype=np.int32)

        query_start, save_rows = ints(step.query_start), ints(step.save_rows)
        # the saves of a sequence are the save rows among its rows: rows are
        # contiguous and ascending, and so are the save rows
        save_start = np.searchsorted(save_rows, query_start).astype(np.int32)
        return cls(query_start, ints(step.slots), save_start, save_rows, ints(step.save_slots))

    @property
    def num_rows(self) -> int:
        return int(self.query_start[-1]) if len(self.query_start) else 0


class HostStateStore:
    """States in host memory: per recurrent layer and state array, one numpy
    float32 array ``[num_slots, *shape]``, zero-initialised.

    Parameters
    ----------
    shapes : sequence, [num_layers]
        None (an attention layer) or a tuple of state-array shapes.
    num_slots : int
    """

    def __init__(self, shapes: StateShapes, num_slots: int):
        from pagedkv._memory import check_fits
        self.shapes = _checked_shapes(shapes)
        self.num_slots = int(num_slots)
        self.memory_bytes = 4 * self.num_slots * sum(
            int(np.prod(shape)) for arrays in self.shapes if arrays for shape in arrays)
        check_fits(self.memory_bytes, "num_state_slots")
        try:
            self.arrays: List[Optional[List[np.ndarray]]] = [
                None if arrays is None else
                [np.zeros((self.num_slots,) + shape, np.float32) for shape in arrays]
                for arrays in self.shapes]
        except MemoryError as exc:
            raise _memory_error(self.num_slots, self.memory_bytes, "in host memory",
                                str(exc)) from None

    def _all(self) -> List[np.ndarray]:
        return [a for arrays in self.arrays if arrays for a in arrays]

    def array(self, layer: int, index: int) -> np.ndarray:
        """The store's own array of (layer, index), [num_slots, *shape] (no copy)."""
        arrays = self.arrays[layer]
        assert arrays is not None, f"layer {layer} has no state"
        return arrays[index]

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot ``src[i]`` -> ``dst[i]`` (int32 [n]) in every array of every layer."""
        for a in self._all():
            a[dst] = a[src]

    def zero(self, slots: np.ndarray) -> None:
        """Zero ``slots`` (int32 [n]) in every array of every layer."""
        for a in self._all():
            a[slots] = 0.0

    def read(self, layer: int, index: int, slots: np.ndarray) -> np.ndarray:
        """Array ``index`` of ``layer`` at ``slots`` (int32 [n]; -1 reads zeros):
        a float32 copy ``[n, *shape]``."""
        a = self.array(layer, index)
        slots = np.asarray(slots)
        out = np.zeros((len(slots),) + a.shape[1:], np.float32)
        held = slots >= 0
        out[held] = a[slots[held]]
        return out

    def write(self, layer: int, index: int, slots: np.ndarray, values: np.ndarray) -> None:
        """``values`` (float32 [n, *shape]) into array ``index`` of ``layer`` at ``slots``
        (int32 [n], distinct)."""
        self.array(layer, index)[slots] = values


class OpenCLStateStore:
    """States on an OpenCL device: per recurrent layer and state array, one buffer
    of float32 ``[num_slots, *shape]``, zero-filled (an array of no elements
    gets a 4-byte placeholder: buffers cannot be empty).

    Its slot moves are kernels of ``opencl/recurrent.cl`` on the backend's
    (in-order) queue, so they follow and precede the backend's other commands.

    Parameters
    ----------
    context, queue, device
        The backend's pyopencl objects.
    shapes : sequence, [num_layers]
        None (an attention layer) or a tuple of state-array shapes.
    num_slots : int
    """

    def __init__(self, context: "pyopencl.Context", queue: "pyopencl.CommandQueue",
                 device: "pyopencl.Device", shapes: StateShapes, num_slots: int):
        import pyopencl as cl

        from pagedkv.backends._opencl_program import build_program
        self._cl, self.context, self.queue = cl, context, queue
        self.shapes = _checked_shapes(shapes)
        self.num_slots = int(num_slots)
        sizes = [int(np.prod(shape)) for arrays in self.shapes if arrays for shape in arrays]
        self.memory_bytes = 4 * self.num_slots * sum(sizes)
        name = device.name.strip()
        largest = 4 * self.num_slots * max(sizes, default=0)
        if largest > device.max_mem_alloc_size:
            raise _memory_error(self.num_slots, self.memory_bytes, f"on {name}",
                                f"one state array takes {largest} bytes, over the "
                                f"{device.max_mem_alloc_size} bytes it allows in one buffer")
        if self.memory_bytes > device.global_mem_size:
            raise _memory_error(self.num_slots, self.memory_bytes, f"on {name}",
                                f"over its {device.global_mem_size} bytes")
        kernels = build_program(context, "recurrent.cl", ())
        self._k_copy, self._k_zero = kernels["state_copy"], kernels["state_zero"]
        self._k_read, self._k_write = kernels["state_read"], kernels["state_write"]
        self._wg = min(64, device.max_work_group_size)   # items per work-group of the moves
        try:
            self.buffers: "List[Optional[List[pyopencl.Buffer]]]" = []
            for arrays in self.shapes:
                if arrays is None:
                    self.buffers.append(None)
                    continue
                layer_buffers = []
                for shape in arrays:
                    size = max(4 * self.num_slots * int(np.prod(shape)), 4)
                    buf = cl.Buffer(context, cl.mem_flags.READ_WRITE, size)
                    cl.enqueue_fill_buffer(queue, buf, np.zeros(1, np.float32), 0, size)
                    layer_buffers.append(buf)
                self.buffers.append(layer_buffers)
            queue.finish()
        except cl.MemoryError as exc:
            raise _memory_error(self.num_slots, self.memory_bytes, f"on {name}",
                                str(exc)) from None

    def buffer(self, layer: int, index: int) -> "pyopencl.Buffer":
        """The device buffer of (layer, index), [num_slots, *shape] float32."""
        buffers = self.buffers[layer]
        assert buffers is not None, f"layer {layer} has no state"
        return buffers[index]

    def slot_floats(self, layer: int, index: int) -> int:
        """Floats of one slot of array ``index`` of ``layer``."""
        arrays = self.shapes[layer]
        assert arrays is not None, f"layer {layer} has no state"
        return int(np.prod(arrays[index]))

    def _arrays(self) -> "List[Tuple[pyopencl.Buffer, int]]":
        """Every array of every layer with its floats per slot (empty ones left out)."""
        return [(buf, self.slot_floats(layer, i))
                for layer, buffers in enumerate(self.buffers) if buffers
                for i, buf in enumerate(buffers) if self.slot_floats(layer, i)]

    def _upload(self, ints: np.ndarray) -> "pyopencl.Buffer":
        cl = self._cl
        return cl.Buffer(self.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                         hostbuf=np.ascontiguousarray(ints, dtype=np.int32))

    def _launch(self, kernel: Any, num_work_items: int, **args: Any) -> Any:
        wg = self._wg
        return kernel(self.queue, (-(-num_work_items // wg) * wg,), (wg,), **args)

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot ``src[i]`` -> ``dst[i]`` (int32 [n]) in every array of every layer."""
        n = len(src)
        if not n:
            return
        src_d, dst_d = self._upload(src), self._upload(dst)
        for buf, floats in self._arrays():
            self._launch(self._k_copy, n * floats, states=buf, src=src_d, dst=dst_d,
                         num_copies=n, slot_floats=floats, num_slots=self.num_slots)

    def zero(self, slots: np.ndarray) -> None:
        """Zero ``slots`` (int32 [n]) in every array of every layer."""
        n = len(slots)
        if not n:
            return
        slots_d = self._upload(slots)
        for buf, floats in self._arrays():
            self._launch(self._k_zero, n * floats, states=buf, slots=slots_d, num_wanted=n,
                         slot_floats=floats, num_slots=self.num_slots)

    def read(self, layer: int, index: int, slots: np.ndarray) -> np.ndarray:
        """Array ``index`` of ``layer`` at ``slots`` (int32 [n]; -1 reads zeros):
        a float32 host copy ``[n, *shape]``."""
        shape = self.shapes[layer]
        assert shape is not None, f"layer {layer} has no state"
        n, floats = len(slots), self.slot_floats(layer, index)
        out = np.zeros((n,) + shape[index], np.float32)
        if not out.size:
            return out
        out_d = self._cl.Buffer(self.context, self._cl.mem_flags.READ_WRITE, out.nbytes)
        self._launch(self._k_read, n * floats, states=self.buffer(layer, index),
                     slots=self._upload(slots), out=out_d, num_wanted=n, slot_floats=floats,
                     num_slots=self.num_slots)
        self._cl.enqueue_copy(self.queue, out, out_d)
        return out

    def write(self, layer: int, index: int, slots: np.ndarray, values: np.ndarray) -> None:
        """``values`` (float32 [n, *shape], C-contiguous) into array ``index`` of
        ``layer`` at ``slots`` (int32 [n], distinct)."""
        n, floats = len(slots), self.slot_floats(layer, index)
        if not n * floats:
            return
        values_d = self._cl.Buffer(self.context, self._cl.mem_flags.READ_ONLY |
                                   self._cl.mem_flags.COPY_HOST_PTR,
                                   hostbuf=np.ascontiguousarray(values, dtype=np.float32))
        self._launch(self._k_write, n * floats, states=self.buffer(layer, index),
                     slots=self._upload(slots), values=values_d, num_wanted=n,
                     slot_floats=floats, num_slots=self.num_slots)
