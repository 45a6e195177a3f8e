"""The opencl backend: page pools in device buffers, kernels in ``opencl/*.cl``.

Runs on any OpenCL 1.2+ device: a GPU of any vendor, or a CPU through PoCL.

* device selection: :mod:`pagedkv.backends._opencl_device` (``device=``,
  ``$PAGEDKV_DEVICE``, ``$PYOPENCL_CTX``, else a GPU, else any device);
* program loading, building and caching: :mod:`pagedkv.backends._opencl_program`;
* the attention kernel's work-group shape, from the device's limits:
  :mod:`pagedkv.backends._opencl_layout`.

The pools of each layer are two buffers (K and V) of
``[num_pages, num_kv_heads, page_size, head_dim]`` float32 or float16.  The
step tables are uploaded once per ``append`` (``prepare_step``) and shared
by every layer.  Every kernel checks the slots and page ids it reads against
the pool, so even a corrupt table cannot make it touch memory out of bounds.
"""
import functools
import os
from typing import (TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple,
                    Union, cast)

import numpy as np
import numpy.typing as npt

from pagedkv.backends._opencl_device import (FORKED_CHILD_REASON, has_preferred_device,
                                              select_device, unavailable_reason)
from pagedkv.backends._opencl_layout import KernelLayout, _floor_pow2
from pagedkv.backends._opencl_program import build_program
from pagedkv.backends.base import Backend, StepTables, StoredRows, empty_rows
from pagedkv.backends.kernel_source import variant_dtype, variant_scalars
from pagedkv.backends.schedule import ITEM, plan_attention
from pagedkv.backends.state_store import OpenCLStateStore
from pagedkv.cascade import CascadePolicy
from pagedkv.errors import ArgumentTypeError, BackendUnavailableError

try:  # for array_types only; the rest imports pyopencl when a backend is made
    import pyopencl.array as _cl_array
except Exception:  # pyopencl missing or broken: unavailable_reason() says how to fix it
    _cl_array = None  # type: ignore[assignment]

if TYPE_CHECKING:   # annotations only: pyopencl is imported when a backend is made
    import pyopencl
    import pyopencl.array

    from pagedkv.backends._opencl_program import KernelCall
    from pagedkv.backends._opencl_recurrent import OpenCLRecurrences
    from pagedkv.attention_spec import AttentionSpec, Band
    from pagedkv.storage import StorageFormat

    # float32 device memory a kernel reads: a private buffer, or the caller's array
    _DeviceMemory = Union[pyopencl.Buffer, pyopencl.array.Array]

# Split-K parts never shorter than this many keys: below it the merge costs
# more than the parallelism gains.
_MIN_PART_TOKENS = 256
# Work items wanted per compute unit before long key ranges are split.
_ITEMS_PER_COMPUTE_UNIT = 8
# Work-group size of the data-movement kernels (scatter, gather, copies).
_COPY_WORK_GROUP = 64
# Scatter work-groups per compute unit of an attention launch that stores the
# step's K/V too.
_SCATTER_GROUPS_PER_COMPUTE_UNIT = 1
# Two buffers per layer: far more layers than any model has would only
# exhaust the driver's object tables.
_MAX_LAYERS = 4096


class _Plan:
    """One step's attention work list for one query-head count and window, on the device.

    Made by ``StepTables.plan``, so every layer of the step reuses it.  A GQA
    group of more heads than a work-group holds (``layout.max_queries``) is
    cut into ``sub_groups`` head groups of ``group`` heads, each planned as if
    it were a KV head of its own.

    Attributes
    ----------
    items : pyopencl Buffer, [num_items, ITEM.COUNT] int32
        One work-group each (``opencl/pkv_work_item.h``); ``KV_HEAD`` is the
        head group.  ``host_items`` is the host copy (an ndarray).
    seg_items, seg_parts : pyopencl Buffer, [num_segments] / [num_segments + 1] int32
        For ``merge_partials``: first item of each split (row block, head
        group) and its range of partial slots (``host_seg_items``,
        ``host_seg_parts``: the host copies).
    num_partial_floats : int
        Rows of the partial-result buffers: partial slots x the layout's
        queries per item (at least one slot; a buffer cannot be empty).
    """

    def __init__(self, backend: "OpenCLBackend", tables: StepTables, num_heads: int,
                 band: "Optional[Band]"):
        layout = backend.layout
        full_group = num_heads // backend.num_kv_heads
        self.group = max(g for g in range(1, min(full_group, layout.max_queries) + 1)
                         if full_group % g == 0)
        self.sub_groups = full_group // self.group
        self.num_groups = backend.num_kv_heads * self.sub_groups
        items, item_offsets = plan_attention(
            tables.query_start, tables.seq_lens, num_kv_heads=self.num_groups,
            page_size=backend.page_size, rows_per_block=max(1, layout.max_queries // self.group),
            target_items=_ITEMS_PER_COMPUTE_UNIT * backend.device.max_compute_units,
            min_part_tokens=_MIN_PART_TOKENS, band=band,
            max_part_keys=lambda rows: layout.max_item_keys(rows * self.group),
            max_parts=lambda rows: layout.max_parts(rows * self.group), key_cut=tables.key_cut)
        counts = np.diff(item_offsets)
        split = counts > 1
        self.num_items = len(items)
        self.num_parts = int((items[:, ITEM.PART] >= 0).sum())
        self.num_segments = int(split.sum())
        self.host_items = items
        self.items = backend._upload(items) if self.num_items else None
        if self.num_segments:
            self.host_seg_items = item_offsets[:-1][split].astype(np.int32)
            self.host_seg_parts = np.concatenate([[0], np.cumsum(counts[split])]).astype(np.int32)
            self.seg_items = backend._upload(self.host_seg_items)
            self.seg_parts = backend._upload(self.host_seg_parts)
        self.num_partial_floats = max(self.num_parts, 1) * layout.max_queries


def _buffer_holding(context: "pyopencl.Context", host: np.ndarray) -> "pyopencl.Buffer":
    """A new buffer in ``context`` created holding the bytes of ndarray ``host``.

    ``COPY_HOST_PTR``: the driver copies the data as it creates the buffer,
    so no command is queued (on PoCL an enqueued write costs tens of
    microseconds of host time, and each command in a layer's chain adds
    latency) and the caller may change its array at once.
    """
    import pyopencl as cl
    return cl.Buffer(context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                     hostbuf=host)


def _zeroed_buffer(context: "pyopencl.Context", nbytes: int) -> "pyopencl.Buffer":
    """A new zeroed buffer of ``nbytes`` in ``context``; as a pyopencl allocator,
    what the backend's arrays allocate with.

    Every buffer the backend makes is written whole as it is created:
    Oclgrind's uninitialized-value checker keeps the record of a freed
    buffer for the next buffer at its address, until a host write of the
    whole buffer replaces it (a buffer created empty, as a memory pool
    makes them, inherits the record of an upload freed before).
    """
    return _buffer_holding(context, np.zeros(max(nbytes, 1), np.uint8))


class _DeviceTables(NamedTuple):
    """A step's tables on the device (``prepare_step``), shared by every layer of
    the step; each a device buffer, or None where the table is empty."""
    slot_mapping: Any
    page_indptr: Any
    page_indices: Any
    query_start: Any
    seq_lens: Any


class _PendingStore:
    """A ``store`` of numpy K/V not launched yet: the layer's ``attention`` runs it in
    its own launch, and any other call launches it first (``_flush``).

    ``k`` and ``v`` are private device copies made by ``store``, so the
    caller's arrays are free at once, as with an immediate launch.
    """

    __slots__ = ("layer", "tables", "k", "v")

    def __init__(self, layer: int, tables: StepTables, k: "_DeviceMemory",
                 v: "_DeviceMemory"):
        self.layer, self.tables, self.k, self.v = layer, tables, k, v


class OpenCLBackend(Backend):
    """K/V pools in OpenCL buffers; scatter, gather, page copies and attention as kernels.

    Commands, and what a layer of decode costs: on a CPU device (PoCL) each
    command costs tens of microseconds of host time and of latency, as much
    as the attention of a short decode itself.  So uploads are made with the
    buffer (no queued write), and a ``store`` of numpy K/V waits for the
    layer's ``attention``, whose one launch also scatters them (float
    formats): a layer is one launch and one read.  Every other call launches
    a waiting store first, in call order.

    Attributes
    ----------
    context, device, queue
        The pyopencl objects the backend runs on (the queue has profiling on).
    layout : KernelLayout
        The attention kernel's work-group shape, from the device's limits.
    last_attention_kernel_seconds : float or None
        Device time of the last ``attention`` call's kernels (for benchmarks).
    """

    name = "opencl"
    # measured crossover: docs/cascade.md
    cascade_policy = CascadePolicy(min_run_bytes=32 << 20, min_shared_keys=256, max_rows=8)
    array_types = (_cl_array.Array,) if _cl_array is not None else ()

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return unavailable_reason()

    @classmethod
    def suits_auto(cls) -> bool:
        return has_preferred_device()

    def __init__(self, *, num_kv_heads: int, head_dim: int, layer_pages: Sequence[int],
                 page_size: int, storage: "StorageFormat", device: Any = None,
                 options: Optional[dict] = None):
        layout_overrides = self._check_options(options)
        reason = unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(reason)
        import pyopencl as cl
        import pyopencl.tools
        self._cl = cl
        self._pid = os.getpid()
        self.context, self.device = select_device(device)
        self.storage = storage
        num_layers = len(layer_pages)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layer_pages, self.page_size = list(layer_pages), page_size
        #: V rows' (and attention's output rows') width: v_head_dim (StorageFormat.v_width)
        self.v_width = storage.v_width(head_dim)
        # V rows of their own width: scatter, gather and the output's rotation run
        # kv_pages.cl built for that width, pool by pool (_one_pool_args)
        self._own_v_width = self.v_width != head_dim
        self._page_elems = num_kv_heads * page_size * max(head_dim, self.v_width)
        num_pages = max(layer_pages)
        layer_bytes = num_pages * self._page_elems * storage.element.itemsize
        device_name = self.device.name.strip()
        if num_layers > _MAX_LAYERS:
            raise ValueError(f"num_layers: the opencl backend keeps two buffers per layer and "
                             f"takes at most {_MAX_LAYERS} layers, got {num_layers}")
        if layer_bytes > self.device.max_mem_alloc_size:
            raise MemoryError(
                f"num_pages: {num_pages} pages make a pool of {layer_bytes} bytes per layer, "
                f"over the {self.device.max_mem_alloc_size} bytes {device_name} allows in one "
                f"buffer; use fewer pages")
        if self.memory_bytes > self.device.global_mem_size:
            raise MemoryError(
                f"num_pages: {num_pages} pages need {self.memory_bytes} bytes of K/V, over "
                f"{device_name}'s {self.device.global_mem_size} bytes; use fewer pages")

        self.queue = cl.CommandQueue(self.context, self.device,
                                     properties=cl.command_queue_properties.PROFILING_ENABLE)
        self._zeros = functools.partial(_zeroed_buffer, self.context)
        self._build_kernels(layout_overrides)
        # buffers cannot be empty: what a kernel gets for sinks or scales it does not use
        self._placeholder = self._upload(np.zeros(1, np.float32))
        self._last_events: "Optional[List[pyopencl.Event]]" = None
        #: count_loops layouts: (attention, merge) loop iterations of each work-item
        #: of the last attention call (int32 arrays; merge None when it ran none)
        self.last_loop_counts: Optional[Tuple[np.ndarray, Optional[np.ndarray]]] = None
        self._pending: Optional[_PendingStore] = None
        self._recurrences: Optional[OpenCLRecurrences] = None   # made at first use
        self._work: "Dict[str, pyopencl.Buffer]" = {}   # name -> reusable buffer (_work_buffer)
        # per layer, a buffer per pool of the format's copy set (values, and row
        # scales where the format has them), by field
        self._copy_set = storage.copy_set(head_dim)
        self._pools: "List[Dict[str, pyopencl.Buffer]]" = []
        try:
            for pages in layer_pages:
                pools = {}
                for part in self._copy_set:
                    # (a recurrent layer has no pages; buffers cannot be empty)
                    size = max(pages, 1) * num_kv_heads * page_size * part.row_bytes
                    buf = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, size)
                    # zeros, like the host backend: a slot never stored reads back as 0
                    cl.enqueue_fill_buffer(self.queue, buf, np.zeros(1, np.uint8), 0, size)
                    pools[part.field] = buf
                self._pools.append(pools)
            self.queue.finish()
        except cl.MemoryError as exc:
            raise MemoryError(f"num_pages: cannot allocate {self.memory_bytes} bytes of K/V "
                              f"on {device_name}: {exc}") from None
        self._k = [pools["k"] for pools in self._pools]
        # latent rows: the kernels read (and write) the values in the K pool itself
        self._values = "k" if storage.latent else "v"
        self._v = [pools[self._values] for pools in self._pools]

    @staticmethod
    def _check_options(options: Any) -> Dict[str, Any]:
        """The ``layout`` overrides of ``backend_options`` (see ``PagedKVCache``)."""
        if options is None:
            return {}
        if not isinstance(options, dict) or set(options) - {"layout"}:
            raise ValueError(f"backend_options: the opencl backend takes {{'layout': {{...}}}}, "
                             f"got {options!r}")
        layout = options.get("layout", {})
        unknown = set(layout) - set(KernelLayout.OVERRIDABLE) if isinstance(layout, dict) \
            else {layout}
        if unknown:
            raise ValueError(f"backend_options: layout: expected a dict with keys among "
                             f"{sorted(KernelLayout.OVERRIDABLE)}, got {layout!r}")
        return dict(layout)

    def _build_kernels(self, overrides: Dict[str, Any]) -> None:
        """Build (or fetch from the cache) both programs and keep their kernels.

        The attention kernel's local memory is what the driver counts for the
        built kernel: a layout that takes more than its budget is rebuilt
        smaller (``KernelLayout.smaller_for_local_memory``)."""
        first_chunk: Optional[int] = None
        while True:
            self.layout = KernelLayout(self.device, self.head_dim, self.storage, **overrides)
            first_chunk = self.layout.chunk if first_chunk is None else first_chunk
            attention = build_program(self.context, "attention.cl", self.layout.options())
            self._k_attention = attention["paged_attention"]
            self._k_merge = attention["merge_partials"]
            used = self._k_attention.local_memory(self.device)
            if used > self.layout.local_memory:
                overrides = self.layout.smaller_for_local_memory(overrides, used, first_chunk)
                continue
            # a register-hungry kernel may allow fewer work-items than the device does
            fits = self._k_attention.work_group_limit(self.device)
            merge_fits = self._k_merge.work_group_limit(self.device)
            if fits >= self.layout.work_group_size and \
                    merge_fits >= self.layout.merge_work_group_size:
                break
            overrides = dict(overrides, work_group_size=_floor_pow2(
                min(fits, self.layout.work_group_size)), merge_work_group_size=_floor_pow2(
                min(merge_fits, self.layout.merge_work_group_size)))
        pages = build_program(self.context, "kv_pages.cl", self.layout.storage_options())
        kernels = self.storage.opencl_kernels
        self._k_scatter = pages[kernels.scatter]
        self._k_gather = pages[kernels.gather]
        self._k_copy = pages["copy_pages"]
        self._k_half = pages["half_to_float"]
        self._k_scale = pages["scale_floats"]
        self._k_rotations = [pages[name] for name in kernels.rotations]
        self._v_rotations = self._k_rotations
        if self._own_v_width:
            v_pages = build_program(self.context, "kv_pages.cl",
                                    self.layout.storage_options(self.v_width))
            self._v_scatter, self._v_gather = v_pages[kernels.scatter], v_pages[kernels.gather]
            self._v_rotations = [v_pages[name] for name in kernels.rotations]
            self._v_rows_or_vectors = kernels.items_per_row(self.v_width,
                                                            self.layout.vector_width)
        # raw rows (read_rows / write_rows), by the bytes of the unit they move
        self._k_rows = {4: (pages["read_rows_u32"], pages["write_rows_u32"]),
                        1: (pages["read_rows_u8"], pages["write_rows_u8"])}
        self._copy_wg = _floor_pow2(min(
            _COPY_WORK_GROUP, self.device.max_work_item_sizes[0],
            *(k.work_group_limit(self.device) for k in pages.values())))
        # the attention kernel stages K/V rows, where it can take the new ones
        # from the store's input (formats that store vector by vector)
        self._fuses_store = kernels.fused_store and not self._own_v_width and \
            self.layout.stage_k and \
            self.layout.stage_v
        # work-items per stored row of scatter and gather
        self._rows_or_vectors = kernels.items_per_row(self.head_dim, self.layout.vector_width)

    # -- helpers --------------------------------------------------------------------
    @property
    def memory_bytes(self) -> int:
        return sum(self.layer_pages) * self.storage.page_bytes(
            self.num_kv_heads, self.page_size, self.head_dim)

    def _scales(self, layer: int) -> "Tuple[pyopencl.Buffer, pyopencl.Buffer]":
        """The layer's K and V scale buffers as the attention kernel takes them
        (placeholders for a format without scales)."""
        pools = self._pools[layer]
        return (pools.get("k_scales", self._placeholder),
                pools.get(self._values + "_scales", self._placeholder))

    def _pool_args(self, layer: int) -> Dict[str, Any]:     # (buffers, as **kwargs)
        """The layer's copy set as scatter and gather take it, by argument name
        (latent rows: the K pool, and its scales, as V's too)."""
        pools = self._pools[layer]
        args = {part.argument: pools[part.field] for part in self._copy_set}
        if self.storage.latent:
            args["v_pool"] = args["k_pool"]
            if "k_scales" in args:
                args["v_scales"] = args["k_scales"]
        return args

    def _one_pool_args(self, layer: int, side: str) -> Dict[str, Any]:
        """``_pool_args`` with pool ``side`` ("k" or "v") as both K's and V's: the
        kernels of kv_pages.cl then move that pool's rows alone (as for latent
        rows), which is how V rows of their own width go through their program."""
        args = self._pool_args(layer)
        args["k_pool"] = args["v_pool"] = args[side + "_pool"]
        if "k_scales" in args:
            args["k_scales"] = args["v_scales"] = args[side + "_scales"]
        return args

    def _rotate(self, x: "_DeviceMemory", rows: int,
                values: bool = False) -> "List[pyopencl.Event]":
        """The format's rotations (``OpenCLKernels.rotations``; often none) of the
        first ``rows`` rows of float32 device buffer (or array) ``x``, in place:
        rows of ``head_dim`` (queries), or with ``values`` of the V rows' width
        (attention's output); returns their events."""
        kernels = self._v_rotations if values else self._k_rotations
        return [self._launch(kernel, rows, x=x, n=rows) for kernel in kernels]

    def _upload(self, array: Any, dtype: "Optional[npt.DTypeLike]" = None) -> "pyopencl.Buffer":
        """A device copy (a pyopencl Buffer, :func:`_buffer_holding`) of a non-empty
        host array, converted to ``dtype`` (None: its own)."""
        return _buffer_holding(self.context, np.ascontiguousarray(array, dtype=dtype))

    def _work_buffer(self, name: str, num_floats: int) -> "pyopencl.Buffer":
        """The backend's reusable float32 buffer ``name`` of at least ``num_floats``.

        Partial results and numpy outputs of attention live here, made anew
        only when a step needs more than any before: zero-filling a new
        buffer costs as much as a prefill's kernels.  The cache's queue is in
        order, so the commands that use one step's contents have run before
        the next step's commands write them.
        """
        buffer = self._work.get(name)
        if buffer is None or buffer.size < 4 * num_floats:
            buffer = self._work[name] = self._zeros(4 * num_floats)
        return buffer

    def _empty(self, shape: Tuple[int, ...]) -> "pyopencl.array.Array":
        """A new float32 pyopencl Array (zeros) on the cache's queue."""
        return _cl_array.Array(self.queue, shape, np.float32,
                               data=self._zeros(4 * int(np.prod(shape))))

    def _launch(self, kernel: "KernelCall", num_work_items: int, *,
                wait_for: "Optional[Sequence[pyopencl.Event]]" = None,
                **args: Any) -> "pyopencl.Event":
        """Run a data-movement kernel over >= ``num_work_items`` (it bounds-checks its id)."""
        wg = self._copy_wg
        return kernel(self.queue, (-(-num_work_items // wg) * wg,), (wg,), wait_for=wait_for,
                      **args)

    def _device_f32(self, x: Any, name: str,
                    scale: float = 1.0) -> "Tuple[_DeviceMemory, List[pyopencl.Event]]":
        """``scale * x`` as C-contiguous float32 device memory of this context.

        numpy input is converted (and scaled) on the host and uploaded (a
        private Buffer); a pyopencl array is used in place when it is float32
        and ``scale`` is 1, else converted and scaled on the device (a new
        Array).

        Returns
        -------
        array : pyopencl Buffer or Array
        wait_for : list of pyopencl Event
            What a kernel reading ``array`` must wait for.
        """
        if isinstance(x, np.ndarray):
            if scale != 1.0:   # in float32, as the host kernel scales its float32 queries
                x = np.multiply(x, np.float32(scale), dtype=np.float32)
            return self._upload(x, np.float32), []   # one host copy converts and packs
        if not self.is_native(x):
            raise ArgumentTypeError(f"{name}: expected a numpy or pyopencl array, "
                                    f"got {type(x).__name__}")
        if x.queue is None:
            raise ValueError(f"{name}: the pyopencl array has no queue, so the cache cannot "
                             f"order its reads after the commands that write it; pass "
                             f"{name}.with_queue(queue)")
        if x.context != self.context:
            raise ValueError(f"{name}: the pyopencl array lives in another OpenCL context than "
                             f"this cache (on {self.device.name.strip()}); copy it there first")
        if x.queue is not None and x.queue != self.queue:
            # the caller's queue may still be writing x: the cache's commands wait for it
            self._cl.enqueue_barrier(self.queue, wait_for=[self._cl.enqueue_marker(x.queue)])
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous pyopencl array, got strides "
                             f"{x.strides} for shape {list(x.shape)}")
        if x.offset or not isinstance(x.base_data, self._cl.Buffer) or \
                x.base_data.get_info(self._cl.mem_info.ASSOCIATED_MEMOBJECT) is not None:
            # the kernels load whole aligned vectors from the start of a buffer:
            # give a view (offset, sub-buffer) a buffer of its own
            x = x.copy(queue=self.queue)
        if x.dtype == np.float32:
            if scale == 1.0:
                return x, list(x.events)
            out = self._empty(x.shape)
            return out, self._scaled(x, out, scale, list(x.events))
        if x.dtype == np.float16:   # kv_pages.cl's half_to_float needs no cl_khr_fp16
            out = self._empty(x.shape)
            if x.size:
                self._launch(self._k_half, x.size, wait_for=x.events, src=x, dst=out, n=x.size)
            return out, self._scaled(out, out, scale, [])
        if x.dtype == np.float64:
            if "cl_khr_fp64" not in self.device.extensions:
                raise ArgumentTypeError(
                    f"{name}: a float64 pyopencl array needs a device with cl_khr_fp64, which "
                    f"{self.device.name.strip()} lacks; convert it to float32 first")
            # on the cache's queue, which already waits for the caller's
            out = x.with_queue(self.queue).astype(np.float32)
            return out, self._scaled(out, out, scale, [])
        raise ArgumentTypeError(f"{name}: expected float16, float32 or float64, got {x.dtype}")

    def _scaled(self, src: "_DeviceMemory", dst: "_DeviceMemory", scale: float,
                wait_for: "List[pyopencl.Event]") -> "List[pyopencl.Event]":
        """dst = scale * src on the device (nothing when scale is 1); returns what a
        reader of dst waits for."""
        if scale == 1.0 or not src.size:
            return wait_for
        return [self._launch(self._k_scale, src.size, wait_for=wait_for, src=src, dst=dst,
                             n=src.size, scale=np.float32(scale))]

    # -- protocol -------------------------------------------------------------------
    def _check_process(self) -> None:
        """RuntimeError in a fork()ed child, where the driver would hang."""
        if os.getpid() != self._pid:
            raise RuntimeError(f"opencl backend: {FORKED_CHILD_REASON}")

    def _flush(self) -> None:
        """Launch the store that waits for its layer's attention, if any."""
        pending = self._pending
        if pending is not None:
            self._scatter(pending.layer, pending.tables, pending.k, pending.v)
            self._pending = None     # only once launched: a failed launch keeps it owed

    def prepare_step(self, tables: StepTables) -> None:
        """Upload the step's tables once (``tables.device``); every layer reuses them."""
        self._check_process()
        self._flush()
        def upload(array: np.ndarray) -> "Optional[pyopencl.Buffer]":
            return self._upload(array) if len(array) else None

        tables.device = _DeviceTables(
            upload(tables.slot_mapping), upload(tables.page_indptr),
            upload(tables.page_indices), upload(tables.query_start), upload(tables.seq_lens))

    def copy_pages(self, src: np.ndarray, dst: np.ndarray, layers: Sequence[int]) -> None:
        self._check_process()
        self._flush()
        if not len(src):
            return
        src_d, dst_d = self._upload(src.astype(np.int32)), self._upload(dst.astype(np.int32))
        # copy_pages moves elements of the values' size (pkv_bits): a K pool and
        # its V pool at once, values and then the scales, by the rows' units
        rows = self.num_kv_heads * self.page_size
        item = self.storage.element.itemsize
        parts = self._copy_set
        # latent rows, and V rows of their own width (whose pages hold other counts
        # of elements): the kernel copies each pool as both of its pair (a second
        # copy of the same page, harmless), the one kernel for every layout
        pairs = [(part, part) for part in parts] if self.storage.latent or self._own_v_width \
            else list(zip(parts[0::2], parts[1::2]))
        for layer in layers:
            pools = self._pools[layer]
            for k_part, v_part in pairs:
                elems = rows * k_part.row_bytes // item
                self._launch(self._k_copy, len(src) * elems, k_pool=pools[k_part.field],
                             v_pool=pools[v_part.field], src=src_d, dst=dst_d,
                             num_copies=len(src), page_elems=elems,
                             num_pages=self.layer_pages[layer])

    def store(self, layer: int, tables: StepTables, k: Any, v: Any) -> None:
        self._check_process()
        self._flush()
        if tables.num_tokens == 0:
            return
        kd, k_wait = self._device_f32(k, "k")
        # latent rows: the scatter is given the K pool as V's too, and writes each row once
        vd, v_wait = (kd, []) if v is None else self._device_f32(v, "v")
        if self._fuses_store and isinstance(k, np.ndarray) and \
                (v is None or isinstance(v, np.ndarray)):
            self._pending = _PendingStore(layer, tables, kd, vd)
            return
        # device arrays: the caller may write them once this returns, so the
        # scatter is queued now, and their next writes wait for it
        self._hand_back(k, *([] if v is None else [v]),
                        event=self._scatter(layer, tables, kd, vd, k_wait + v_wait))

    def _scatter(self, layer: int, tables: StepTables, k: "_DeviceMemory", v: "_DeviceMemory",
                 wait_for: "Optional[List[pyopencl.Event]]" = None) -> "pyopencl.Event":
        """Queue the scatter of device K/V ``k``, ``v`` into layer ``layer``; its event."""
        if self._own_v_width:   # each pool by the program of its width; the queue keeps order
            self._launch(self._k_scatter,
                         tables.num_tokens * self.num_kv_heads * self._rows_or_vectors,
                         wait_for=wait_for, k=k, v=k, slot_mapping=tables.device.slot_mapping,
                         num_tokens=tables.num_tokens, num_kv_heads=self.num_kv_heads,
                         page_size=self.page_size,
                         num_slots=self.layer_pages[layer] * self.page_size,
                         **self._one_pool_args(layer, "k"))
            return self._launch(
                self._v_scatter, tables.num_tokens * self.num_kv_heads * self._v_rows_or_vectors,
                k=v, v=v, slot_mapping=tables.device.slot_mapping, num_tokens=tables.num_tokens,
                num_kv_heads=self.num_kv_heads, page_size=self.page_size,
                num_slots=self.layer_pages[layer] * self.page_size,
                **self._one_pool_args(layer, "v"))
        return self._launch(
            self._k_scatter, tables.num_tokens * self.num_kv_heads * self._rows_or_vectors,
            wait_for=wait_for, k=k, v=v, slot_mapping=tables.device.slot_mapping,
            num_tokens=tables.num_tokens,
            num_kv_heads=self.num_kv_heads, page_size=self.page_size,
            num_slots=self.layer_pages[layer] * self.page_size, **self._pool_args(layer))

    def _hand_back(self, *arrays: Any, event: "pyopencl.Event") -> None:
        """Order the caller's later writes to its pyopencl ``arrays`` after ``event``
        (the last of the cache's commands that read them): pyopencl's own
        operations wait for ``array.events``; the array's own queue, when it is
        not the cache's, waits for a barrier."""
        native = [x for x in arrays if self.is_native(x)]
        for x in native:
            x.add_event(event)
        if any(x.queue is not None and x.queue != self.queue for x in native):
            done = self._cl.enqueue_marker(self.queue)
            for queue in {x.queue for x in native if x.queue is not None and x.queue != self.queue}:
                self._cl.enqueue_barrier(queue, wait_for=[done])

    def make_plan(self, tables: StepTables, num_heads: int, band: "Optional[Band]") -> _Plan:
        return _Plan(self, tables, num_heads, band)

    def attention(self, layer: int, tables: StepTables, q: Any, spec: "AttentionSpec",
                  out: Optional[np.ndarray] = None, lse: Optional[np.ndarray] = None) -> Any:
        self._check_process()
        native = self.is_native(q)
        plan = self.plan(tables, q.shape[1], spec.band)
        result = out
        if plan.num_items == 0:   # no new tokens: nothing to launch (and no empty buffers)
            self._flush()
            self._last_events = []
            zeros = np.zeros(q.shape[:2] + (self.v_width,), dtype=np.float32)
            if native:
                return _cl_array.to_device(self.queue, zeros)
            if result is None:
                return zeros
            result[...] = 0.0
            if lse is not None:
                lse[...] = -np.inf
            return result
        qd, q_wait = self._device_f32(q, "q", scale=spec.scale)
        rows = q.shape[0] * q.shape[1]
        if self._k_rotations:   # rotated like the stored rows (a private copy)
            if qd is q:
                qd = qd.copy(queue=self.queue)
            self._rotate(qd, rows)
        # the layer's store, if it waits, runs in this launch (taken only now
        # that q is ready: a bad q must not lose it)
        fused = self._pending
        if fused is None or fused.layer != layer or fused.tables is not tables:
            fused = None
            self._flush()
        t = tables.device
        # numpy results are read back before this returns, so one buffer serves
        # every call; a pyopencl result is the caller's to keep (made like the
        # float32 q: pyopencl's general constructor costs more than a decode layer's kernel)
        if native:
            # (a native q comes back from _device_f32 as an Array); V rows of their
            # own width make an output of another shape, by the general constructor
            out_a: Any = _cl_array.empty_like(cast("pyopencl.array.Array", qd), queue=self.queue,
                                         allocator=self._zeros) if not self._own_v_width \
                else _cl_array.empty(self.queue, q.shape[:2] + (self.v_width,), np.float32,
                                     allocator=self._zeros)
            out_a.allocator = None    # what pyopencl makes from it later: its default buffers
            out_d = out_a
        else:
            out_d = self._work_buffer("out", rows * self.v_width)
        lse_d = self._placeholder if lse is None else self._work_buffer("lse", rows)
        parts = plan.num_partial_floats
        part_acc, part_max, part_sum = (self._work_buffer("part_acc", parts * self.v_width),
                                        self._work_buffer("part_max", parts),
                                        self._work_buffer("part_sum", parts))
        variant = np.array(tuple(variant_scalars(spec).values()), variant_dtype())
        sinks = self._placeholder if spec.sinks is None else self._upload(spec.sinks)
        slopes = (self._placeholder if spec.alibi_slopes is None
                  else self._upload(spec.alibi_slopes))
        wg = self.layout.work_group_size
        k_scales, v_scales = self._scales(layer)
        store = self._fused_store_args(fused)
        num_groups = plan.num_items + store.pop("num_groups")
        mwg = self.layout.merge_work_group_size
        counting = self.layout.count_loops
        loop_counts = self._zeros(4 * num_groups * wg) if counting else self._placeholder
        merge_counts = self._zeros(4 * max(plan.num_segments, 1) * mwg) if counting \
            else self._placeholder
        events = [self._k_attention(
            self.queue, (num_groups * wg,), (wg,), wait_for=q_wait,
            q=qd, k_pool=self._k[layer], v_pool=self._v[layer], k_scales=k_scales,
            v_scales=v_scales, page_indptr=t.page_indptr,
            page_indices=t.page_indices, items=plan.items, num_items=plan.num_items,
            query_start=t.query_start, seq_lens=t.seq_lens,
            num_slots=self.layer_pages[layer] * self.page_size, **store, group=plan.group,
            num_groups=plan.num_groups, sub_groups=plan.sub_groups, page_size=self.page_size,
            num_pages=self.layer_pages[layer], nnz=len(tables.page_indices), variant=variant,
            sinks=sinks, bias_slopes=slopes, out=out_d, lse=lse_d,
            has_lse=lse is not None, part_acc=part_acc, part_max=part_max, part_sum=part_sum,
            loop_counts=loop_counts)]
        if fused is not None:    # the store is launched: no longer owed
            self._pending = None
        if plan.num_segments:
            events.append(self._k_merge(
                self.queue, (plan.num_segments * mwg,), (mwg,),
                items=plan.items, seg_items=plan.seg_items, seg_parts=plan.seg_parts,
                part_acc=part_acc, part_max=part_max, part_sum=part_sum, group=plan.group,
                num_groups=plan.num_groups, variant=variant, sinks=sinks, out=out_d, lse=lse_d,
                has_lse=lse is not None, loop_counts=merge_counts))
        events += self._rotate(out_d, rows, values=True)   # back from the rotated basis
        self._last_events = events
        if counting:
            counts = (np.empty(num_groups * wg, np.int32),
                      np.empty(plan.num_segments * mwg, np.int32) if plan.num_segments else None)
            self._cl.enqueue_copy(self.queue, counts[0], loop_counts)
            if counts[1] is not None:
                self._cl.enqueue_copy(self.queue, counts[1], merge_counts)
            self.last_loop_counts = counts
        if native:
            out_d.add_event(events[-1])
            self._hand_back(q, event=events[0])
            return out_d
        if result is None:
            result = np.empty(q.shape[:2] + (self.v_width,), np.float32)
        if lse is not None:
            self._cl.enqueue_copy(self.queue, lse, lse_d)
        self._cl.enqueue_copy(self.queue, result, out_d)
        return result

    def _fused_store_args(self, pending: Optional[_PendingStore]) -> Dict[str, Any]:
        """The attention kernel's store arguments for ``pending`` (None: no store),
        with ``num_groups``, its scatter work-groups."""
        if pending is None:
            return dict(num_groups=0, new_k=self._placeholder, new_v=self._placeholder,
                        slot_mapping=self._placeholder, num_new_tokens=0, scatter_rows=0)
        num_tokens = pending.tables.num_tokens
        rows = num_tokens * self.num_kv_heads
        vectors = self.head_dim // self.layout.vector_width
        wg = self.layout.work_group_size
        wanted = _SCATTER_GROUPS_PER_COMPUTE_UNIT * self.device.max_compute_units
        # enough rows that every work-item has a vector, few enough that none
        # loops more than the layout allows
        most = max(1, self.layout.max_work_item_iterations * wg // vectors)
        per_group = min(max(-(-rows // wanted), -(-wg // vectors)), most)
        return dict(num_groups=-(-rows // per_group), new_k=pending.k, new_v=pending.v,
                    slot_mapping=pending.tables.device.slot_mapping,
                    num_new_tokens=num_tokens, scatter_rows=per_group)

    def leading_columns(self, x: Any, width: int) -> Any:
        if not self.is_native(x):
            return super().leading_columns(x, width)
        # a pyopencl array: the columns by one rectangular copy on the device
        rows, columns = int(np.prod(x.shape[:-1])), x.shape[-1]
        out = _cl_array.empty(self.queue, x.shape[:-1] + (width,), np.float32,
                              allocator=self._zeros)
        out.allocator = None
        if rows:
            copy: Any = self._cl.enqueue_copy     # (pyopencl's stubs lack the rectangular form)
            event = copy(
                self.queue, out.base_data, x.base_data, src_origin=(x.offset, 0), dst_origin=(0, 0),
                region=(width * 4, rows), src_pitches=(columns * 4,), dst_pitches=(width * 4,),
                wait_for=x.events)
            out.add_event(event)
        return out

    @property
    def last_attention_kernel_seconds(self) -> Optional[float]:
        """Device seconds of the last ``attention`` call's kernels, from profiling events.

        None before the first call, 0.0 after a call with nothing to compute.
        Reading it waits for those kernels to finish.
        """
        if self._last_events is None:
            return None
        if self._last_events:
            self._cl.wait_for_events(self._last_events)
        return sum(e.profile.end - e.profile.start for e in self._last_events) * 1e-9

    def gather(self, layer: int, slots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        self._check_process()
        self._flush()
        n = len(slots)
        k = np.empty((n, self.num_kv_heads, self.head_dim), dtype=np.float32)
        v = np.empty((n, self.num_kv_heads, self.v_width), dtype=np.float32)
        if n == 0:
            return k, v
        slots_d = self._upload(slots.astype(np.int64))
        kd, vd = self._zeros(k.nbytes), self._zeros(v.nbytes)
        if self._own_v_width:   # each pool by the program of its width, into its own rows
            for kernel, out_d, side, items in ((self._k_gather, kd, "k", self._rows_or_vectors),
                                               (self._v_gather, vd, "v",
                                                self._v_rows_or_vectors)):
                self._launch(kernel, n * self.num_kv_heads * items, slots=slots_d, k_out=out_d,
                             v_out=out_d, num_slots_wanted=n, num_kv_heads=self.num_kv_heads,
                             page_size=self.page_size,
                             num_slots=self.layer_pages[layer] * self.page_size,
                             **self._one_pool_args(layer, side))
            self._cl.enqueue_copy(self.queue, k, kd, is_blocking=False)
            self._cl.enqueue_copy(self.queue, v, vd)
            return k, v
        self._launch(self._k_gather, n * self.num_kv_heads * self._rows_or_vectors,
                     slots=slots_d, k_out=kd,
                     v_out=vd, num_slots_wanted=n, num_kv_heads=self.num_kv_heads,
                     page_size=self.page_size, num_slots=self.layer_pages[layer] * self.page_size,
                     **self._pool_args(layer))
        # one wait: the queue is in order, so the blocking read comes last
        self._cl.enqueue_copy(self.queue, k, kd, is_blocking=False)
        self._cl.enqueue_copy(self.queue, v, vd)
        return k, v

    # -- stored rows (export, import, swap) -------------------------------------------
    def _row_buffers(self, layer: int) -> "List[Tuple[str, pyopencl.Buffer, int]]":
        """The layer's copy set, in :class:`StoredRows` order, each pool with the bytes
        of one of its rows."""
        pools = self._pools[layer]
        return [(part.field, pools[part.field], part.row_bytes) for part in self._copy_set]

    def _rows_call(self, which: int, layer: int, slots_d: "pyopencl.Buffer", n: int,
                   pool: "pyopencl.Buffer", row_bytes: int,
                   rows: "pyopencl.Buffer") -> "pyopencl.Event":
        """Queue the raw-row kernel ``which`` (0 read, 1 write) over ``n`` rows."""
        unit = 4 if row_bytes % 4 == 0 else 1
        return self._launch(self._k_rows[unit][which], n * self.num_kv_heads, pool=pool,
                            slots=slots_d, rows=rows, num_rows=n, num_kv_heads=self.num_kv_heads,
                            page_size=self.page_size, row_units=row_bytes // unit,
                            num_slots=self.layer_pages[layer] * self.page_size)

    def read_rows(self, layer: int, slots: np.ndarray,
                  out: Optional[StoredRows] = None) -> StoredRows:
        self._check_process()
        self._flush()
        n = len(slots)
        if out is None:
            out = empty_rows(self.storage, n, self.num_kv_heads, self.head_dim)
        if n:
            slots_d = self._upload(slots.astype(np.int64))
            for field, pool, row_bytes in self._row_buffers(layer):
                rows = getattr(out, field)
                rows_d = self._cl.Buffer(self.context, self._cl.mem_flags.WRITE_ONLY, rows.nbytes)
                self._rows_call(0, layer, slots_d, n, pool, row_bytes, rows_d)
                self._cl.enqueue_copy(self.queue, rows, rows_d, is_blocking=False)
            self.queue.finish()
        return out

    def write_rows(self, layer: int, slots: np.ndarray, rows: StoredRows) -> None:
        self._check_process()
        self._flush()
        n = len(slots)
        if not n:
            return
        slots_d = self._upload(slots.astype(np.int64))
        for field, pool, row_bytes in self._row_buffers(layer):
            x = getattr(rows, field)
            self._rows_call(1, layer, slots_d, n, pool, row_bytes, self._upload(x))

    # -- recurrent layers (opencl/recurrent.cl, via _opencl_recurrent) ------------------
    def state_store(self, shapes: Sequence[Optional[Sequence[Tuple[int, ...]]]],
                    num_slots: int) -> OpenCLStateStore:
        self._check_process()
        return OpenCLStateStore(self.context, self.queue, self.device, shapes, num_slots)

    def _recurrent(self) -> "OpenCLRecurrences":
        if self._recurrences is None:
            from pagedkv.backends._opencl_recurrent import OpenCLRecurrences
            self._recurrences = OpenCLRecurrences(self)
        return self._recurrences

    def causal_conv1d(self, store: OpenCLStateStore, layer: int, index: int, step: Any, x: Any,
                      weight: Any, bias: Any, silu: bool) -> Any:
        return self._recurrent().causal_conv1d(store, layer, index, step, x, weight, bias, silu)

    def gated_delta_rule(self, store: OpenCLStateStore, layer: int, index: int, step: Any,
                         q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float,
                         l2norm: bool) -> Any:
        return self._recurrent().gated_delta_rule(store, layer, index, step, q, k, v, g, beta,
                                                  scale, l2norm)
