"""The shape of the attention kernel's work-groups, chosen from one device's limits.

Every size that ``opencl/attention.cl`` bakes in at build time comes from
here: the work-group size, how many queries a work-group holds, how many
keys it takes per iteration, the register tiles, whether K/V rows are staged
in local memory.  Nothing is fixed: a device with a smaller work-group limit
or less local memory gets smaller values (down to 1), not a failure.
"""
import functools
import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:   # annotations only: pyopencl is imported lazily
    import pyopencl

    from pagedkv.storage import StorageFormat

# an int64 array, or one int (numpy's scalar when it comes out of an array operation)
_Ints = Union[int, np.integer, np.ndarray]

#: Most loop iterations one work-item may run for one attention work item or
#: merge, summed over every loop (unrolled loops do not count).  llvmpipe
#: (Mesa's rusticl on a CPU) ends a work-item after 65,535 of them, silently
#: (its rows come out wrong); a GPU's watchdog ends long-running kernels.
#: Half of llvmpipe's limit leaves room for the model below being approximate.
MAX_WORK_ITEM_ITERATIONS = 1 << 15
#: The same for PoCL on a CPU, which has neither limit: longer items mean fewer
#: partial results to write and merge (a 2,048-token prefill took 0.86x the
#: time of the default bound, a 64-query block over 4,096 shared keys 0.82x).
POCL_CPU_WORK_ITEM_ITERATIONS = 1 << 18


#: Floats of output accumulators one CPU work-item may hold: 16 queries of a
#: 576-wide latent row (DeepSeek-V2-Lite's 16 heads over one KV head), which
#: is also 64 queries of head_dim 128 with room to spare.
_CPU_ACCUMULATOR_FLOATS = 16 * 576


def _floor_pow2(n: Any) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _fit(wanted: Any, total: int) -> int:
    """The largest divisor of ``total`` that is at most ``wanted``."""
    return max(d for d in range(1, min(max(int(wanted), 1), total) + 1) if total % d == 0)


class KernelLayout:
    """The attention kernel's work-group shape for one device and head size.

    On a CPU device (PoCL) the work-items of a work-group run one after
    another on one core, so the default is one work-item per group with
    large register tiles (many independent vector FMAs) and float8 vectors
    (AVX); on a GPU, 128 work-items with one output element each.  Local
    arrays take at most half the device's local memory.

    Parameters
    ----------
    device : pyopencl.Device
    head_dim : int
    **overrides
        Any attribute below, to force it (tests run the GPU shape on a CPU).

    Attributes
    ----------
    kind : {"cpu", "gpu"}
        Whose defaults the other attributes start from: ``"gpu"`` when the
        device reports the GPU bit (or is no CPU), else ``"cpu"``.
    work_group_size : int
        Work-items per work-group: a power of two within the device's limits.
    vector_width : int
        Floats per vector (1, 2, 4 or 8), dividing ``head_dim``.
    max_queries : int
        Most queries (query rows x query heads of one head group) one
        work-group holds.
    chunk : int
        Keys per iteration of the attention loop.
    query_tile, key_tile, column_tile : int
        One work-item's register tile: ``query_tile x key_tile`` scores, or
        ``query_tile x column_tile`` vectors of output.
    stage_k, stage_v : bool
        Copy each chunk's K (V) rows into local memory as floats first: the
        pools are then read as sequential streams (CPU prefetchers, GPU
        coalescing), and float16 is converted once per element.
    local_memory : int
        Most bytes of local memory one attention work-group may use (default:
        half the device's).  The backend checks the built kernel's own count
        (``CL_KERNEL_LOCAL_MEM_SIZE``) against it and, while it is over,
        builds the next layout of :meth:`smaller_for_local_memory`.
    count_loops : bool
        Build the kernels with ``PKV_COUNT_LOOPS``: each attention call then
        leaves every work-item's loop iterations in the backend's
        ``last_loop_counts`` (tests of the bound below).  Default False.
    """

    #: The attributes ``**overrides`` may force.
    OVERRIDABLE = ("kind", "work_group_size", "vector_width", "column_tile", "query_tile",
                   "key_tile", "chunk", "max_queries", "stage_k", "stage_v",
                   "merge_work_group_size", "max_work_item_iterations", "local_memory",
                   "count_loops")

    def __init__(self, device: "pyopencl.Device", head_dim: int,
                 storage: "Optional[StorageFormat]" = None, **overrides: Any):
        import pyopencl as cl
        from pagedkv.storage import storage_format
        self.storage = storage_format("float32", head_dim) if storage is None else storage
        # formats whose stores divide round the quotients exactly as the host
        # does with IEEE division (OpenCLKernels.exact_division)
        self.exact_division = bool(getattr(device, "single_fp_config", 0) & getattr(
            cl.device_fp_config, "CORRECTLY_ROUNDED_DIVIDE_SQRT", 0))
        # The GPU shape whenever the device says GPU, even if it says CPU as well
        # (Oclgrind says both): it is the one whose work spreads over work-items.
        kind = "gpu" if device.type & cl.device_type.GPU or \
            not device.type & cl.device_type.CPU else "cpu"
        self.kind = overrides.get("kind", kind)
        if self.kind not in ("cpu", "gpu"):
            raise ValueError(f"backend_options: layout: kind must be 'cpu' or 'gpu', "
                             f"got {self.kind!r}")
        is_cpu = self.kind == "cpu"
        limit = min(device.max_work_group_size, device.max_work_item_sizes[0])
        self.head_dim = head_dim
        # V rows' (and the output's) width: v_head_dim where the separate layout
        # sets one, else head_dim; the vector width, column tiles and staging
        # split must divide both rows' vectors
        self.v_head_dim = self.storage.v_width(head_dim)
        self.work_group_size = _floor_pow2(
            min(overrides.get("work_group_size", 1 if is_cpu else 128), limit))
        # float8 is an AVX register on a CPU; GPUs load float4 best
        wanted = overrides.get("vector_width", 8 if is_cpu else 4)
        self.vector_width = next(w for w in (8, 4, 2, 1) if w <= wanted and head_dim % w == 0
                                 and self.v_head_dim % w == 0)
        self.column_tile = _fit(overrides.get("column_tile", 2 if is_cpu else 1),
                                self.v_head_dim // self.vector_width)
        # powers of two, so that halving below keeps the tiles dividing
        self.query_tile = _floor_pow2(overrides.get("query_tile", 4 if is_cpu else 1))
        self.key_tile = _floor_pow2(overrides.get("key_tile", 2 if is_cpu else 1))
        self.chunk = max(_floor_pow2(overrides.get("chunk", 32)), self.key_tile)
        self.max_queries = max(_floor_pow2(overrides.get("max_queries", 64 if is_cpu else 32)),
                               self.query_tile)
        self.stage_k = overrides.get("stage_k", True)
        self.stage_v = overrides.get("stage_v", True)
        if self.storage.opencl_kernels.staged_only and not (self.stage_k and self.stage_v):
            raise ValueError(f"backend_options: layout: {self.storage.name} rows are "
                             f"dequantized into the staged tiles; stage_k and stage_v must stay on")
        # the merge spreads a query block's vectors over work-items, even on a CPU,
        # so that its loop over parts may be long
        self.merge_work_group_size = _floor_pow2(min(
            overrides.get("merge_work_group_size", max(self.work_group_size, 256)), limit))
        # From what the device is, not the shape asked for: PoCL also drives GPUs
        # (its CUDA device), whose watchdog the CPU shape does not lift.
        pocl_cpu = device.type & cl.device_type.CPU and not device.type & cl.device_type.GPU \
            and "portable computing language" in \
            str(getattr(getattr(device, "platform", None), "name", "")).lower()
        self.max_work_item_iterations = int(overrides.get(
            "max_work_item_iterations",
            POCL_CPU_WORK_ITEM_ITERATIONS if pocl_cpu else MAX_WORK_ITEM_ITERATIONS))
        # Output accumulators live in registers (GPU) or per-work-item memory
        # (CPU): at most this many floats of them per work-item.  On a CPU,
        # enough for latent attention's 16 heads over one 576-wide row, which
        # would otherwise be cut into two head groups, each reading every row
        # (and staging it as K and as V) again.
        acc_floats = _CPU_ACCUMULATOR_FLOATS if is_cpu else 64
        # (the accumulators are output rows: v_head_dim wide)
        while self.max_queries > self.query_tile and \
                self.max_queries * self.v_head_dim > acc_floats * self.work_group_size:
            self.max_queries //= 2
        if self.max_queries * self.v_head_dim > acc_floats * self.work_group_size:
            # even the smallest tile would not fit: a work-item's accumulators
            # would overflow its private memory (its stack, on a CPU driver)
            largest = acc_floats * self.work_group_size // self.max_queries
            name = "head_dim" if self.v_head_dim == head_dim else "v_head_dim"
            raise ValueError(f"{name}: the OpenCL attention kernel holds at most {largest} "
                             f"values per head on {device.name.strip()}, got {self.v_head_dim}")
        self.local_memory = int(overrides.get("local_memory", device.local_mem_size // 2))
        # a diagnostic build: the kernels report each work-item's loop iterations
        self.count_loops = bool(overrides.get("count_loops", False))
        self._device_name = device.name.strip()

    def smaller_for_local_memory(self, overrides: Dict[str, Any], used: int,
                                 first_chunk: int) -> Dict[str, Any]:
        """The overrides of the next smaller layout, for a built kernel that uses
        ``used`` bytes of local memory, more than ``local_memory``.

        The chunk is halved first (down to 8 keys while staging), then the
        queries; staging goes last, with the chunk back at ``first_chunk``.

        Raises
        ------
        ValueError
            No smaller layout is left.
        """
        staging = self.stage_k or self.stage_v
        if self.chunk > max(self.key_tile, 8 if staging else 1):
            return dict(overrides, chunk=self.chunk // 2)
        if self.max_queries > self.query_tile:
            return dict(overrides, chunk=self.chunk, max_queries=self.max_queries // 2)
        if staging and not self.storage.opencl_kernels.staged_only:
            return dict(overrides, stage_k=False, stage_v=False, chunk=first_chunk,
                        max_queries=self.max_queries)
        raise ValueError(f"head_dim: {self._device_name} has too little local memory "
                         f"({self.local_memory} bytes for a work-group) for the attention "
                         f"kernel, whose smallest layout takes {used}")

    # -- bounded work per work-item -----------------------------------------------
    def _per_item(self, n: npt.ArrayLike, width: Optional[int] = None) -> np.ndarray:
        """Iterations of a loop that shares ``n`` things out over a work-group."""
        width = width or self.work_group_size
        return -(-np.asarray(n, dtype=np.int64) // width)

    def attention_iterations(self, num_queries: npt.ArrayLike,
                             num_keys: npt.ArrayLike) -> "_Ints":
        """Loop iterations of the busiest work-item of one attention work item.

        A model of ``paged_attention``'s loops (``opencl/attention.cl``),
        counting every iteration of a loop that is not unrolled at build
        time, for ``num_queries`` queries (rows x heads of the head group)
        over ``num_keys`` keys; it counts every chunk as full.  Vectorized
        over arrays of either argument.
        """
        nq = np.asarray(num_queries, dtype=np.int64)
        chunks = -(-np.asarray(num_keys, dtype=np.int64) // self.chunk)
        vectors = self.head_dim // self.vector_width
        v_vectors = self.v_head_dim // self.vector_width
        query_blocks = -(-nq // self.query_tile)
        out_per_item = -(-(self.max_queries // self.query_tile) * (v_vectors // self.column_tile)
                         // self.work_group_size)
        # output tiles: a fixed, unrolled loop when few (only its key loops count)
        out_tiles = self._per_item(query_blocks * (v_vectors // self.column_tile))
        out_loop = np.minimum(out_tiles, out_per_item) if out_per_item <= 8 else out_tiles
        out_head = 0 if out_per_item <= 8 else 1
        staged = self.stage_k or self.stage_v
        per_chunk = (1 + self._per_item(self.chunk)
                     + (self._per_item(self.chunk * self.split) if staged else 0)
                     + self._per_item(query_blocks * (self.chunk // self.key_tile)) * (1 + vectors)
                     # per query: zeroing the last vector's lanes, the soft cap, max, weights
                     + self._per_item(nq) * (self.softmax_width + 3 * (self.chunk // self.softmax_width) + 1)
                     + out_loop * (out_head + self.chunk))
        prologue = self._per_item(nq) + (out_per_item if out_per_item > 8 else 0)
        epilogue = out_loop + self._per_item(nq)
        return prologue + chunks * per_chunk + epilogue

    def merge_iterations(self, num_queries: npt.ArrayLike, num_parts: npt.ArrayLike) -> "_Ints":
        """Loop iterations of the busiest work-item of ``merge_partials`` for one segment."""
        vectors = self.v_head_dim // self.vector_width
        elements = self._per_item(np.asarray(num_queries, np.int64) * vectors,
                                  self.merge_work_group_size)
        return elements * (1 + 2 * np.asarray(num_parts, dtype=np.int64))

    def max_item_keys(self, num_queries: "_Ints") -> "_Ints":
        """Most keys one attention work item of ``num_queries`` queries may cover.

        A multiple of ``chunk`` (at least one chunk) whose
        :meth:`attention_iterations` stay within ``max_work_item_iterations``.
        ``num_queries``: an int or int array of values in ``0 .. max_queries``.
        """
        return self._limits[0][num_queries]

    def max_parts(self, num_queries: "_Ints") -> "_Ints":
        """Most split-K parts one merge of ``num_queries`` queries may combine (at least 2).

        ``num_queries`` as for :meth:`max_item_keys`.
        """
        return self._limits[1][num_queries]

    @functools.cached_property
    def _limits(self) -> Tuple[np.ndarray, np.ndarray]:
        """:meth:`max_item_keys` and :meth:`max_parts` of every query count a
        work-group can hold, as two lookup tables: every step plans with them,
        and their models cost a dozen numpy calls each."""
        nq = np.arange(self.max_queries + 1)
        one = self.attention_iterations(nq, self.chunk)
        per_chunk = np.maximum(self.attention_iterations(nq, 2 * self.chunk) - one, 1)
        chunks = (self.max_work_item_iterations - (one - per_chunk)) // per_chunk
        item_keys = np.maximum(chunks, 1) * self.chunk
        fixed = self.merge_iterations(nq, 0)
        per_part = np.maximum(self.merge_iterations(nq, 1) - fixed, 1)
        parts = np.maximum((self.max_work_item_iterations - fixed) // per_part, 2)
        return item_keys, parts

    @property
    def split(self) -> int:
        """Work-items that share the copy of one staged row: a divisor of its vectors
        (of a K row's and a V row's both)."""
        vectors = math.gcd(self.head_dim, self.v_head_dim) // self.vector_width
        return max(s for s in range(1, min(vectors, self.work_group_size) + 1) if vectors % s == 0)

    @property
    def softmax_width(self) -> int:
        """Keys the softmax step handles at once (float8 when the chunk allows)."""
        return 8 if self.chunk % 8 == 0 else 1

    def options(self) -> Tuple[str, ...]:
        """Build options of ``opencl/attention.cl``."""
        return self.storage_options() + (
            f"-DPKV_WG={self.work_group_size}", f"-DPKV_NQ={self.max_queries}",
            f"-DPKV_CHUNK={self.chunk}", f"-DPKV_QB={self.query_tile}",
            f"-DPKV_TB={self.key_tile}", f"-DPKV_CB={self.column_tile}",
            f"-DPKV_STAGE_K={int(self.stage_k)}", f"-DPKV_STAGE_V={int(self.stage_v)}",
            f"-DPKV_SPLIT={self.split}", f"-DPKV_SW={self.softmax_width}",
            f"-DPKV_MERGE_WG={self.merge_work_group_size}",
            f"-DPKV_COUNT_LOOPS={int(self.count_loops)}",
            f"-DPKV_V_HEAD_DIM={self.v_head_dim}",
            # -cl-mad-enable only: never -cl-fast-relaxed-math or -cl-finite-math-only.
            # The kernels use -INFINITY as the "no key yet" max and mask with it,
            # which finite-math lets a compiler assume away (Intel's then warns
            # and computes wrong rows); the results must not depend on it.
            "-cl-mad-enable")

    def storage_options(self, width: Optional[int] = None) -> Tuple[str, ...]:
        """Build options of ``opencl/pkv_common.h`` (all that ``kv_pages.cl`` needs),
        for rows of ``width`` values (default ``head_dim``; V rows of their own
        width take a program of theirs)."""
        return self.storage.opencl_options(self.exact_division) + (
            f"-DPKV_HEAD_DIM={width or self.head_dim}", f"-DPKV_VW={self.vector_width}")

    def __repr__(self) -> str:
        return "KernelLayout(" + ", ".join(f"{k}={v}" for k, v in vars(self).items()) + ")"
