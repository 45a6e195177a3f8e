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
import numpy as np

from pagedkv.backends._opencl_device import (has_preferred_device, select_device,
                                              unavailable_reason)
from pagedkv.backends._opencl_layout import KernelLayout, _floor_pow2
from pagedkv.backends._opencl_program import build_program
from pagedkv.backends.base import Backend
from pagedkv.backends.schedule import plan_attention
from pagedkv.errors import ArgumentTypeError, BackendUnavailableError

try:  # for array_types only; the rest imports pyopencl when a backend is made
    import pyopencl.array as _cl_array
except Exception:  # pyopencl missing or broken: unavailable_reason() says how to fix it
    _cl_array = None  # type: ignore[assignment]

ITEM_FIELDS = 8          # opencl/attention.cl: seq, group, row0, row1, key0, key1, part, unused
_ITEM_PART = 6
# Split-K parts never shorter than this many keys: below it the merge costs
# more than the parallelism gains.
_MIN_PART_TOKENS = 256
# Work items wanted per compute unit before long key ranges are split.
_ITEMS_PER_COMPUTE_UNIT = 8
# Work-group size of the data-movement kernels (scatter, gather, copies).
_COPY_WORK_GROUP = 64
# KernelLayout attributes to force in every new backend (tests run the GPU
# layout on a CPU device with it).
LAYOUT_OVERRIDES: dict = {}


class _Plan:
    """One step's attention work list for one query-head count, on the device.

    Cached in ``tables.cache``, so every layer of the step reuses it.  A GQA
    group of more heads than a work-group holds (``layout.max_queries``) is
    cut into ``sub_groups`` head groups of ``group`` heads, each planned as if
    it were a KV head of its own.

    Attributes
    ----------
    items : pyopencl Array, shape [num_items, ITEM_FIELDS], int32
        One work-group each: seq, head group, row0, row1, key0, key1, partial
        slot (-1: writes the output itself).
    seg_items, seg_parts : pyopencl Array, shape [num_segments] / [num_segments + 1], int32
        For ``merge_partials``: first item of each split (row block, head
        group) and its range of partial slots.
    """

    def __init__(self, backend, tables, num_heads):
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
            min_part_tokens=_MIN_PART_TOKENS)
        counts = np.diff(item_offsets)
        split = counts > 1
        in_split = np.repeat(split, counts)
        table = np.zeros((len(items), ITEM_FIELDS), dtype=np.int32)
        table[:, :items.shape[1]] = items
        table[:, _ITEM_PART] = -1
        table[in_split, _ITEM_PART] = np.arange(int(in_split.sum()), dtype=np.int32)
        self.num_items = len(items)
        self.num_parts = int(in_split.sum())
        self.num_segments = int(split.sum())
        self.items = backend._upload(table) if self.num_items else None
        if self.num_segments:
            self.seg_items = backend._upload(item_offsets[:-1][split].astype(np.int32))
            self.seg_parts = backend._upload(
                np.concatenate([[0], np.cumsum(counts[split])]).astype(np.int32))


class OpenCLBackend(Backend):
    """K/V pools in OpenCL buffers; scatter, gather, page copies and attention as kernels.

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
    array_types = (_cl_array.Array,) if _cl_array is not None else ()

    @classmethod
    def unavailable_reason(cls):
        return unavailable_reason()

    @classmethod
    def suits_auto(cls):
        return has_preferred_device()

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_pages, page_size,
                 dtype, device=None):
        reason = unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(reason)
        import pyopencl as cl
        import pyopencl.tools
        self._cl = cl
        self.context, self.device = select_device(device)
        self.dtype = np.dtype(dtype)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        self._page_elems = num_kv_heads * page_size * head_dim
        layer_bytes = num_pages * self._page_elems * self.dtype.itemsize
        device_name = self.device.name.strip()
        if layer_bytes > self.device.max_mem_alloc_size:
            raise ValueError(
                f"num_pages: {num_pages} pages make a pool of {layer_bytes} bytes per layer, "
                f"over the {self.device.max_mem_alloc_size} bytes {device_name} allows in one "
                f"buffer; use fewer pages")
        if self.memory_bytes > self.device.global_mem_size:
            raise ValueError(
                f"num_pages: {num_pages} pages need {self.memory_bytes} bytes of K/V, over "
                f"{device_name}'s {self.device.global_mem_size} bytes; use fewer pages")

        self.queue = cl.CommandQueue(self.context, self.device,
                                     properties=cl.command_queue_properties.PROFILING_ENABLE)
        # temporaries (uploads, outputs, partials) come from a pool: reused
        # buffers are safe because every command goes through this in-order queue
        self._pool = cl.tools.MemoryPool(cl.tools.ImmediateAllocator(self.queue))
        self._layout_overrides = dict(LAYOUT_OVERRIDES)
        self._build_kernels()
        self._last_events = None
        try:
            self._k, self._v = [], []
            for _ in range(num_layers):
                for pools in (self._k, self._v):
                    buf = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, layer_bytes)
                    # zeros, like the host backend: a slot never stored reads back as 0
                    cl.enqueue_fill_buffer(self.queue, buf, np.zeros(1, np.uint8), 0, layer_bytes)
                    pools.append(buf)
            self.queue.finish()
        except cl.MemoryError as exc:
            raise MemoryError(f"num_pages: cannot allocate {self.memory_bytes} bytes of K/V "
                              f"on {device_name}: {exc}") from None

    def _build_kernels(self):
        """Build (or fetch from the cache) both programs; keep one Kernel object per kernel."""
        cl = self._cl
        overrides = self._layout_overrides
        while True:
            self.layout = KernelLayout(self.device, self.head_dim, **overrides)
            attention = build_program(self.context, "attention.cl", self.layout.options(self.dtype))
            self._k_attention = cl.Kernel(attention, "paged_attention")
            self._k_merge = cl.Kernel(attention, "merge_partials")
            # a register-hungry kernel may allow fewer work-items than the device does
            fits = min(self._work_group_limit(k) for k in (self._k_attention, self._k_merge))
            if fits >= self.layout.work_group_size:
                break
            overrides = dict(overrides, work_group_size=_floor_pow2(fits))
        pages = build_program(self.context, "kv_pages.cl", self.layout.storage_options(self.dtype))
        self._k_scatter = cl.Kernel(pages, "scatter_kv")
        self._k_gather = cl.Kernel(pages, "gather_kv")
        self._k_copy = cl.Kernel(pages, "copy_pages")
        self._k_half = cl.Kernel(pages, "half_to_float")
        self._copy_wg = _floor_pow2(min(
            _COPY_WORK_GROUP, self.device.max_work_item_sizes[0],
            *(self._work_group_limit(k) for k in (self._k_scatter, self._k_gather,
                                                  self._k_copy, self._k_half))))
        # typed scalar arguments: pyopencl then sets them without guessing
        i32, i64, f32 = np.int32, np.int64, np.float32
        self._k_attention.set_scalar_arg_dtypes([None] * 8 + [i32] * 6 + [f32] + [None] * 4)
        self._k_merge.set_scalar_arg_dtypes([None] * 6 + [i32, i32, None])
        self._k_scatter.set_scalar_arg_dtypes([None] * 5 + [i32, i32, i32, i64])
        self._k_gather.set_scalar_arg_dtypes([None] * 5 + [i32, i32, i32, i64])
        self._k_copy.set_scalar_arg_dtypes([None] * 4 + [i32, i64, i32])
        self._k_half.set_scalar_arg_dtypes([None, None, i64])

    def _work_group_limit(self, kernel):
        return kernel.get_work_group_info(self._cl.kernel_work_group_info.WORK_GROUP_SIZE,
                                          self.device)

    # -- helpers --------------------------------------------------------------------
    @property
    def memory_bytes(self):
        return 2 * self.num_layers * self.num_pages * self._page_elems * self.dtype.itemsize

    def is_native(self, array):
        return _cl_array is not None and isinstance(array, _cl_array.Array)

    def _upload(self, array):
        """A device copy (pyopencl Array from the pool) of a non-empty host array.

        The transfer does not block: each blocking transfer costs a round
        trip through the driver (about 50 us on PoCL), four of them per layer
        before.  It reads a private host copy, so the caller may change its
        array at once; pyopencl keeps that copy alive until the transfer ran.
        """
        return _cl_array.to_device(self.queue, np.array(array, order="C", copy=True),
                                   allocator=self._pool, async_=True)

    def _empty(self, shape):
        return _cl_array.empty(self.queue, shape, np.float32, allocator=self._pool)

    def _launch(self, kernel, num_work_items, *args, wait_for=None):
        """Run a data-movement kernel over >= ``num_work_items`` (it bounds-checks its id)."""
        wg = self._copy_wg
        return kernel(self.queue, (-(-num_work_items // wg) * wg,), (wg,), *args,
                      wait_for=wait_for or None)

    @property
    def _vectors_per_row(self):
        return self.head_dim // self.layout.vector_width

    def _device_f32(self, x, name):
        """``x`` as a C-contiguous float32 pyopencl Array of this context.

        numpy input is converted on the host and uploaded; a pyopencl array is
        used in place when it is float32, else converted on the device.

        Returns
        -------
        array : pyopencl Array
        wait_for : list of pyopencl Event
            What a kernel reading ``array`` must wait for.
        """
        if isinstance(x, np.ndarray):
            return self._upload(np.asarray(x, dtype=np.float32)), []
        if not self.is_native(x):
            raise ArgumentTypeError(f"{name}: expected a numpy or pyopencl array, "
                                    f"got {type(x).__name__}")
        if x.context != self.context:
            raise ValueError(f"{name}: the pyopencl array lives in another OpenCL context than "
                             f"this cache (on {self.device.name.strip()}); copy it there first")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous pyopencl array, got strides "
                             f"{x.strides} for shape {list(x.shape)}")
        if x.offset or not isinstance(x.base_data, self._cl.Buffer) or \
                x.base_data.get_info(self._cl.mem_info.ASSOCIATED_MEMOBJECT) is not None:
            # the kernels load whole aligned vectors from the start of a buffer:
            # give a view (offset, sub-buffer) a buffer of its own
            x = x.copy(queue=self.queue)
        if x.dtype == np.float32:
            return x, list(x.events)
        if x.dtype == np.float16:   # kv_pages.cl's half_to_float needs no cl_khr_fp16
            out = self._empty(x.shape)
            if x.size:
                self._launch(self._k_half, x.size, x.data, out.data, x.size, wait_for=x.events)
            return out, []
        if x.dtype == np.float64:
            if "cl_khr_fp64" not in self.device.extensions:
                raise ArgumentTypeError(
                    f"{name}: a float64 pyopencl array needs a device with cl_khr_fp64, which "
                    f"{self.device.name.strip()} lacks; convert it to float32 first")
            return x.astype(np.float32, queue=self.queue), []
        raise ArgumentTypeError(f"{name}: expected float16, float32 or float64, got {x.dtype}")

    # -- protocol -------------------------------------------------------------------
    def prepare_step(self, tables):
        """Upload the step's tables once (into ``tables.cache``); every layer reuses them."""
        tables.cache["opencl"] = {
            name: self._upload(getattr(tables, name)) if len(getattr(tables, name)) else None
            for name in ("query_start", "seq_lens", "slot_mapping", "page_indptr",
                         "page_indices")}

    def copy_pages(self, src, dst):
        if not len(src):
            return
        src_d, dst_d = self._upload(src.astype(np.int32)), self._upload(dst.astype(np.int32))
        for layer in range(self.num_layers):
            self._launch(self._k_copy, len(src) * self._page_elems, self._k[layer],
                         self._v[layer], src_d.data, dst_d.data, len(src), self._page_elems,
                         self.num_pages)

    def store(self, layer, tables, k, v):
        num_tokens = tables.num_tokens
        if num_tokens == 0:
            return
        kd, k_wait = self._device_f32(k, "k")
        vd, v_wait = self._device_f32(v, "v")
        event = self._launch(
            self._k_scatter, num_tokens * self.num_kv_heads * self._vectors_per_row,
            kd.data, vd.data, tables.cache["opencl"]["slot_mapping"].data,
            self._k[layer], self._v[layer], num_tokens, self.num_kv_heads, self.page_size,
            self.num_pages * self.page_size, wait_for=k_wait + v_wait)
        for x in (k, v):
            if self.is_native(x):
                x.add_event(event)   # the caller's later writes to x wait for this read

    def attention(self, layer, tables, q, scale):
        num_heads = q.shape[1]
        native = self.is_native(q)
        key = ("opencl_plan", num_heads)
        if key not in tables.cache:
            tables.cache[key] = _Plan(self, tables, num_heads)
        plan = tables.cache[key]
        if plan.num_items == 0:   # no new tokens: nothing to launch (and no empty buffers)
            self._last_events = []
            out = np.zeros(q.shape, dtype=np.float32)
            return _cl_array.to_device(self.queue, out, allocator=self._pool) if native else out
        qd, q_wait = self._device_f32(q, "q")
        t = tables.cache["opencl"]
        out = self._empty(q.shape)
        parts = max(plan.num_parts, 1)   # an OpenCL buffer cannot be empty
        nq = self.layout.max_queries
        part_acc = self._empty((parts, nq, self.head_dim))
        part_max, part_sum = self._empty((parts, nq)), self._empty((parts, nq))
        wg = self.layout.work_group_size
        events = [self._k_attention(
            self.queue, (plan.num_items * wg,), (wg,),
            qd.data, self._k[layer], self._v[layer], t["query_start"].data, t["seq_lens"].data,
            t["page_indptr"].data, t["page_indices"].data, plan.items.data,
            plan.group, plan.num_groups, plan.sub_groups, self.page_size, self.num_pages,
            len(tables.page_indices), scale,
            out.data, part_acc.data, part_max.data, part_sum.data, wait_for=q_wait or None)]
        if plan.num_segments:
            events.append(self._k_merge(
                self.queue, (plan.num_segments * wg,), (wg,),
                plan.items.data, plan.seg_items.data, plan.seg_parts.data,
                part_acc.data, part_max.data, part_sum.data, plan.group, plan.num_groups,
                out.data))
        self._last_events = events
        out.add_event(events[-1])
        if native:
            q.add_event(events[0])
            return out
        return out.get()

    @property
    def last_attention_kernel_seconds(self):
        """Device seconds of the last ``attention`` call's kernels, from profiling events.

        None before the first call, 0.0 after a call with nothing to compute.
        Reading it waits for those kernels to finish.
        """
        if self._last_events is None:
            return None
        if self._last_events:
            self._cl.wait_for_events(self._last_events)
        return sum(e.profile.end - e.profile.start for e in self._last_events) * 1e-9

    def gather(self, layer, slots):
        n = len(slots)
        k = np.empty((n, self.num_kv_heads, self.head_dim), dtype=np.float32)
        v = np.empty_like(k)
        if n == 0:
            return k, v
        slots_d = self._upload(slots.astype(np.int64))
        kd, vd = self._empty(k.shape), self._empty(v.shape)
        self._launch(self._k_gather, n * self.num_kv_heads * self._vectors_per_row,
                     self._k[layer], self._v[layer], slots_d.data, kd.data, vd.data, n,
                     self.num_kv_heads, self.page_size, self.num_pages * self.page_size)
        kd.get(ary=k)
        vd.get(ary=v)
        return k, v
