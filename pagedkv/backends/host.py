"""The host backend: numpy page pools and the Cython kernels of ``pagedkv._kernels``.

The kernels are those of this CPU's instruction-set level (:mod:`pagedkv._cpu`).
"""
import os

import numpy as np

from pagedkv._cpu import kernels as _kernels
from pagedkv.backends.base import Backend
from pagedkv.backends.schedule import plan_attention

# Query rows x query heads of one item: 64 query vectors of head_dim floats
# keep the accumulator in L1/L2 while a K/V page streams past.
_QUERIES_PER_ITEM = 64
# Split-K parts never shorter than this many keys: below it the merge costs
# more than the parallelism gains.
_MIN_PART_TOKENS = 256


# Below this many float multiply-adds a call runs on one thread: waking the
# OpenMP team costs more than it saves, and a busy machine can stall it.
_PARALLEL_MIN_WORK = 1 << 18


def _max_threads():
    """Cores this process may use, capped by ``OMP_NUM_THREADS`` when set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        return max(1, min(cores, int(os.environ.get("OMP_NUM_THREADS", cores))))
    except ValueError:
        return cores


def _threads_for(work, max_threads):
    return max_threads if work >= _PARALLEL_MIN_WORK else 1


class HostBackend(Backend):
    """K/V pools in host memory; kernels in Cython, GIL released, OpenMP-parallel."""

    name = "host"

    @classmethod
    def unavailable_reason(cls):
        return None

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_pages, page_size,
                 dtype, device=None):
        if device is not None:
            raise ValueError(f"device: the host backend takes no device, got {device!r}")
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.dtype = np.dtype(dtype)
        # float16 pools are handed to the kernels as their uint16 bits
        self._k = np.zeros(shape, dtype=self.dtype)
        self._v = np.zeros(shape, dtype=self.dtype)
        self._kernel_view = (lambda a: a.view(np.uint16)) if self.dtype == np.float16 \
            else (lambda a: a)
        self.num_kv_heads = num_kv_heads
        self.page_size = page_size
        self.num_threads = _max_threads()

    @property
    def memory_bytes(self):
        return self._k.nbytes + self._v.nbytes

    @staticmethod
    def _host_f32(x):
        if not isinstance(x, np.ndarray):  # e.g. a pyopencl array handed to the host backend
            x = x.get()
        return np.ascontiguousarray(x, dtype=np.float32)

    def prepare_step(self, tables):
        pass  # the tables are host arrays already

    def copy_pages(self, src, dst):
        self._k[:, dst] = self._k[:, src]
        self._v[:, dst] = self._v[:, src]

    def store(self, layer, tables, k, v):
        k, v = self._host_f32(k), self._host_f32(v)
        _kernels.scatter(self._kernel_view(self._k[layer]), self._kernel_view(self._v[layer]),
                         tables.slot_mapping, k, v, _threads_for(k.size, self.num_threads))

    def attention(self, layer, tables, q, scale):
        q = self._host_f32(q)
        group = q.shape[1] // self.num_kv_heads
        key = ("host_plan", group)
        if key not in tables.cache:
            tables.cache[key] = self._plan(tables, group)
        items, item_offsets, heads_per_item, max_rows, threads = tables.cache[key]
        out = np.empty_like(q)
        _kernels.paged_attention(
            q, self._kernel_view(self._k[layer]), self._kernel_view(self._v[layer]),
            tables.query_start, tables.seq_lens, tables.page_indptr, tables.page_indices,
            items, item_offsets, heads_per_item, max_rows, float(scale), out, threads)
        return out

    def _plan(self, tables, group):
        """Work items for one step, reused by every layer.

        An item covers as many KV heads as the query budget allows while the
        batch still has enough items for every thread: one item then streams
        whole pages (all heads contiguous) instead of one head's slice at a
        stride, which is what decode speed depends on.
        """
        rows_per_block = max(1, _QUERIES_PER_ITEM // group)
        num_rows = np.diff(tables.query_start)
        num_blocks = int((-(-num_rows // rows_per_block)).sum())
        longest = int(num_rows.max(initial=0))
        heads_per_item = 1
        for heads in range(self.num_kv_heads, 0, -1):
            if self.num_kv_heads % heads == 0 and \
                    heads * min(longest, rows_per_block) * group <= _QUERIES_PER_ITEM and \
                    num_blocks * (self.num_kv_heads // heads) >= 4 * self.num_threads:
                heads_per_item = heads
                break
        items, item_offsets = plan_attention(
            tables.query_start, tables.seq_lens, num_kv_heads=self.num_kv_heads,
            page_size=self.page_size, rows_per_block=rows_per_block,
            target_items=4 * self.num_threads, min_part_tokens=_MIN_PART_TOKENS,
            heads_per_item=heads_per_item)
        rows = items[:, 3] - items[:, 2]
        keys = items[:, 5] - items[:, 4]
        work = int((rows * keys).sum()) * heads_per_item * group * self._k.shape[-1]
        return (items, item_offsets, heads_per_item, int(rows.max(initial=0)),
                _threads_for(work, self.num_threads))

    def gather(self, layer, slots):
        shape = (len(slots), self._k.shape[2], self._k.shape[4])
        k = np.empty(shape, dtype=np.float32)
        v = np.empty(shape, dtype=np.float32)
        threads = _threads_for(k.size, self.num_threads)
        _kernels.gather(self._kernel_view(self._k[layer]), slots, k, threads)
        _kernels.gather(self._kernel_view(self._v[layer]), slots, v, threads)
        return k, v
