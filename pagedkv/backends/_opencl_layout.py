"""The shape of the attention kernel's work-groups, chosen from one device's limits.

Every size that ``opencl/attention.cl`` bakes in at build time comes from
here: the work-group size, how many queries a work-group holds, how many
keys it takes per iteration, the register tiles, whether K/V rows are staged
in local memory.  Nothing is fixed: a device with a smaller work-group limit
or less local memory gets smaller values (down to 1), not a failure.
"""
import numpy as np


def _floor_pow2(n):
    return 1 << (max(int(n), 1).bit_length() - 1)


def _fit(wanted, total):
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
    """

    #: The attributes ``**overrides`` may force.
    OVERRIDABLE = ("kind", "work_group_size", "vector_width", "column_tile", "query_tile",
                   "key_tile", "chunk", "max_queries", "stage_k", "stage_v")

    def __init__(self, device, head_dim, **overrides):
        import pyopencl as cl
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
        self.work_group_size = _floor_pow2(
            min(overrides.get("work_group_size", 1 if is_cpu else 128), limit))
        # float8 is an AVX register on a CPU; GPUs load float4 best
        wanted = overrides.get("vector_width", 8 if is_cpu else 4)
        self.vector_width = next(w for w in (8, 4, 2, 1) if w <= wanted and head_dim % w == 0)
        vectors = head_dim // self.vector_width
        self.column_tile = _fit(overrides.get("column_tile", 2 if is_cpu else 1), vectors)
        # powers of two, so that halving below keeps the tiles dividing
        self.query_tile = _floor_pow2(overrides.get("query_tile", 4 if is_cpu else 1))
        self.key_tile = _floor_pow2(overrides.get("key_tile", 2 if is_cpu else 1))
        self.chunk = max(_floor_pow2(overrides.get("chunk", 32)), self.key_tile)
        self.max_queries = max(_floor_pow2(overrides.get("max_queries", 64 if is_cpu else 32)),
                               self.query_tile)
        self.stage_k = overrides.get("stage_k", True)
        self.stage_v = overrides.get("stage_v", True)
        # Output accumulators live in registers (GPU) or per-work-item memory
        # (CPU): at most this many floats of them per work-item.
        acc_floats = 8192 if is_cpu else 64
        while self.max_queries > self.query_tile and \
                self.max_queries * head_dim > acc_floats * self.work_group_size:
            self.max_queries //= 2
        if self.max_queries * head_dim > acc_floats * self.work_group_size:
            # even the smallest tile would not fit: a work-item's accumulators
            # would overflow its private memory (its stack, on a CPU driver)
            largest = acc_floats * self.work_group_size // self.max_queries
            raise ValueError(f"head_dim: the OpenCL attention kernel holds at most {largest} "
                             f"values per head on {device.name.strip()}, got {head_dim}")
        # Local memory: shrink the chunk (down to 8 keys while staging), then
        # the queries; give up staging last.
        budget = device.local_mem_size // 2
        chunk = self.chunk
        while self.local_bytes > budget:
            staging = self.stage_k or self.stage_v
            if self.chunk > max(self.key_tile, 8 if staging else 1):
                self.chunk //= 2
            elif self.max_queries > self.query_tile:
                self.max_queries //= 2
            elif staging:
                self.stage_k = self.stage_v = False
                self.chunk = chunk
            else:
                raise ValueError(f"head_dim: {device.name.strip()} has too little local memory "
                                 f"({device.local_mem_size} bytes) for the attention kernel")

    @property
    def local_bytes(self):
        """Local memory of one attention work-group, in bytes."""
        staged = 4 * self.chunk * self.head_dim * (self.stage_k + self.stage_v)
        return staged + 4 * self.max_queries * self.chunk + 12 * self.chunk + 16 * self.max_queries

    @property
    def split(self):
        """Work-items that share the copy of one staged row: a divisor of its vectors."""
        vectors = self.head_dim // self.vector_width
        return max(s for s in range(1, min(vectors, self.work_group_size) + 1) if vectors % s == 0)

    @property
    def softmax_width(self):
        """Keys the softmax step handles at once (float8 when the chunk allows)."""
        return 8 if self.chunk % 8 == 0 else 1

    def options(self, dtype):
        """Build options of ``opencl/attention.cl``."""
        return self.storage_options(dtype) + (
            f"-DPKV_WG={self.work_group_size}", f"-DPKV_NQ={self.max_queries}",
            f"-DPKV_CHUNK={self.chunk}", f"-DPKV_QB={self.query_tile}",
            f"-DPKV_TB={self.key_tile}", f"-DPKV_CB={self.column_tile}",
            f"-DPKV_STAGE_K={int(self.stage_k)}", f"-DPKV_STAGE_V={int(self.stage_v)}",
            f"-DPKV_SPLIT={self.split}", f"-DPKV_SW={self.softmax_width}", "-cl-mad-enable")

    def storage_options(self, dtype):
        """Build options of ``opencl/pkv_common.h`` (all that ``kv_pages.cl`` needs)."""
        return (f"-DPKV_HALF={int(np.dtype(dtype) == np.float16)}",
                f"-DPKV_HEAD_DIM={self.head_dim}", f"-DPKV_VW={self.vector_width}")

    def __repr__(self):
        return "KernelLayout(" + ", ".join(f"{k}={v}" for k, v in vars(self).items()) + ")"
