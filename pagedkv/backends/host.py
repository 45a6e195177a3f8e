"""The host backend: numpy page pools and the Cython kernels of ``pagedkv._kernels``.

The kernels are those of this CPU's instruction-set level (:mod:`pagedkv._cpu`).
"""
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import numpy as np

from pagedkv import _process, _rows
from pagedkv._cpu import kernels as _kernels
from pagedkv.backends.base import Backend, StepTables, StoredRows, empty_rows
from pagedkv.backends.kernel_source import variant_scalars
from pagedkv.backends.schedule import ITEM, plan_attention
from pagedkv.backends.state_store import HostStateStore, StateStep
from pagedkv.cascade import CascadePolicy

if TYPE_CHECKING:   # annotations only (_kernels.pyi describes every level's module)
    from pagedkv._kernels import AttentionParams
    from pagedkv.attention_spec import AttentionSpec, Band
    from pagedkv.storage import StorageFormat

# Query rows x query heads of one item: 64 query vectors of head_dim floats
# keep the accumulator in L1/L2 while a K/V page streams past.
_QUERIES_PER_ITEM = 64
# Items of many queries per KV head take the kernels' block path
# (pagedkv/pkv_block.h), which reads and copies each block of keys and values
# once per item: the more query rows an item has, the less it reads per
# multiply-add.  Its queries and accumulators, 2 x queries x head_dim
# floats, must stay in L2 with the blocks: this many floats fit a 512 KiB L2.
_BLOCK_ITEM_FLOATS = 1 << 16
# ...but no fewer items per thread than this, so that dynamic scheduling
# evens out items of unequal length (causal prefill).
_BLOCK_ITEMS_PER_THREAD = 16
# Split-K parts never shorter than this many keys: below it the merge costs
# more than the parallelism gains.
_MIN_PART_TOKENS = 256


# Below this many float multiply-adds a call runs on one thread: waking the
# OpenMP team costs more than it saves, and a busy machine can stall it.
_PARALLEL_MIN_WORK = 1 << 18


@dataclass(frozen=True)
class _HostPlan:
    """One step's work list for one query-head count and window (see ``StepTables.plan``)."""
    items: np.ndarray           # [num_items, ITEM.COUNT] int32
    item_offsets: np.ndarray    # [num_blocks + 1] int32
    heads_per_item: int
    max_rows: int               # most query rows of any item
    num_threads: int


def _max_threads() -> int:
    """Cores this process may use, capped by ``OMP_NUM_THREADS`` when set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    try:
        return max(1, min(cores, int(os.environ.get("OMP_NUM_THREADS", cores))))
    except ValueError:
        return cores


# libgomp is not fork-safe: a child forked after the parent ran a parallel
# region hangs in its first one.  Kernels in such a child run on one thread
# (a region of one thread starts no team); pagedkv._process knows whether
# this process is such a child.


def _threads_for(work: int, max_threads: int) -> int:
    return max_threads if work >= _PARALLEL_MIN_WORK else 1


def _fork_safe(num_threads: int) -> int:
    """The OpenMP threads a kernel may use in this process."""
    return 1 if _process.in_forked_child() else num_threads


class HostBackend(Backend):
    """K/V pools in host memory; kernels in Cython, GIL released, OpenMP-parallel."""

    name = "host"
    # measured crossover: docs/cascade.md
    cascade_policy = CascadePolicy(min_run_bytes=32 << 20, min_shared_keys=256, max_rows=8)

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return None

    def __init__(self, *, num_kv_heads: int, head_dim: int, layer_pages: Sequence[int],
                 page_size: int, storage: "StorageFormat", device: Any = None,
                 options: Optional[dict] = None):
        if device is not None:
            raise ValueError(f"device: the host backend takes no device, got {device!r}")
        if options:
            raise ValueError(f"backend_options: the host backend takes none, got {options!r}")
        self.storage = storage
        # per layer, the format's copy set: values as storage.kernel_element
        # (float16 as its uint16 bits), and row scales where the format has
        # them, per page, in [pages, H, page_size]
        self._copy_set = storage.copy_set(head_dim)
        self._pools = [{part.field: np.zeros((n, num_kv_heads, page_size) + part.row_shape,
                                             part.kernel_dtype) for part in self._copy_set}
                       for n in layer_pages]
        self._k = [pools["k"] for pools in self._pools]
        # the kernels take scale pools of every format: placeholders where it has none
        self._k_scales = [pools.get("k_scales", _no_scales()) for pools in self._pools]
        # latent rows: the kernels read the values from the K pool itself
        values = "k" if storage.latent else "v"
        self._v = [pools[values] for pools in self._pools]
        self._v_scales = [pools.get(values + "_scales", _no_scales()) for pools in self._pools]
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_width = storage.v_width(head_dim)
        self.page_size = page_size
        self.num_threads = _max_threads()

    @property
    def memory_bytes(self) -> int:
        return sum(pool.nbytes for pools in self._pools for pool in pools.values())

    @staticmethod
    def _host_f32(x: Any) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.float32)

    def prepare_step(self, tables: StepTables) -> None:
        pass  # the tables are host arrays already

    def copy_pages(self, src: np.ndarray, dst: np.ndarray, layers: Sequence[int]) -> None:
        for layer in layers:
            for pool in self._pools[layer].values():
                pool[dst] = pool[src]

    def store(self, layer: int, tables: StepTables, k: Any, v: Any) -> None:
        k = self._host_f32(k)
        # latent rows: the scatter is given the K pool as V's too, and writes each row once
        v = k if v is None else self._host_f32(v)
        _kernels.scatter(self._k[layer], self._v[layer], self._k_scales[layer],
                         self._v_scales[layer], tables.slot_mapping, k, v,
                         *self.storage.rotation,
                         _fork_safe(_threads_for(k.size, self.num_threads)))

    def attention(self, layer: int, tables: StepTables, q: Any, spec: "AttentionSpec",
                  out: Optional[np.ndarray] = None,
                  lse: Optional[np.ndarray] = None) -> np.ndarray:
        q = self._host_f32(q)
        plan = self.plan(tables, q.shape[1], spec.band)
        out = np.empty(q.shape[:2] + (self.v_width,), np.float32) if out is None else out
        params: "AttentionParams" = dict(heads_per_item=plan.heads_per_item, max_rows_per_item=plan.max_rows,
                      scale=spec.scale, variant=variant_scalars(spec),
                      rotation_block=self.storage.rotation_block,
                      rotation_scale=self.storage.rotation_scale,
                      num_threads=_fork_safe(plan.num_threads))
        _kernels.paged_attention(
            q=q, k_pool=self._k[layer], v_pool=self._v[layer], k_scales=self._k_scales[layer],
            v_scales=self._v_scales[layer], page_indptr=tables.page_indptr,
            page_indices=tables.page_indices, items=plan.items, item_offsets=plan.item_offsets,
            sinks=spec.sinks, out=out, params=params, bias_slopes=spec.alibi_slopes, lse=lse)
        return out

    def make_plan(self, tables: StepTables, num_heads: int,
                  band: "Optional[Band]") -> _HostPlan:
        """Work items for one step, reused by every layer.

        An item covers as many KV heads as the query budget allows while the
        batch still has enough items for every thread: one item then streams
        whole pages (all heads contiguous) instead of one head's slice at a
        stride, which is what decode speed depends on.  A step too small for
        more than one thread (``_PARALLEL_MIN_WORK``) is planned for one:
        whole pages, no split key ranges.
        """
        group = num_heads // self.num_kv_heads
        rows_per_block = max(1, _QUERIES_PER_ITEM // group)
        num_rows = np.diff(tables.query_start)
        # every row's keys at most: its sequence, or its window and the step's rows
        window = None if band is None else band.sliding_window
        visible = tables.seq_lens if window is None else \
            np.minimum(tables.seq_lens, window + num_rows)
        threads = _threads_for(int((num_rows * visible).sum()) * num_heads * self.head_dim,
                               self.num_threads)
        longest = int(num_rows.max(initial=0))
        if min(longest, rows_per_block) * group >= _kernels.BLOCK_MIN_QUERIES:
            rows_per_block = self._block_rows(num_rows, group, rows_per_block, threads)
        num_blocks = int((-(-num_rows // rows_per_block)).sum())
        heads_per_item = 1
        for heads in range(self.num_kv_heads, 0, -1):
            if self.num_kv_heads % heads == 0 and \
                    heads * min(longest, rows_per_block) * group <= _QUERIES_PER_ITEM and \
                    (threads == 1 or num_blocks * (self.num_kv_heads // heads) >= 4 * threads):
                heads_per_item = heads
                break
        items, item_offsets = plan_attention(
            tables.query_start, tables.seq_lens, num_kv_heads=self.num_kv_heads,
            page_size=self.page_size, rows_per_block=rows_per_block,
            target_items=4 * threads if threads > 1 else 1, min_part_tokens=_MIN_PART_TOKENS,
            heads_per_item=heads_per_item, band=band, key_cut=tables.key_cut)
        rows = items[:, ITEM.ROW1] - items[:, ITEM.ROW0]
        keys = items[:, ITEM.KEY1] - items[:, ITEM.KEY0]
        work = int((rows * keys).sum()) * heads_per_item * group * self.head_dim
        return _HostPlan(items, item_offsets, heads_per_item, int(rows.max(initial=0)),
                         _threads_for(work, threads))

    def _block_rows(self, num_rows: np.ndarray, group: int, rows_per_block: int,
                    threads: int) -> int:
        """Query rows per item when the rows are many (block path): as many as
        L2 holds, halved while the items would be too few for ``threads``."""
        most = max(rows_per_block,
                   _BLOCK_ITEM_FLOATS // ((self.head_dim + self.v_width) * group))
        while most > rows_per_block and \
                (-(-num_rows // most)).sum() * self.num_kv_heads < \
                _BLOCK_ITEMS_PER_THREAD * threads:
            most = max(rows_per_block, most // 2)
        return most

    def gather(self, layer: int, slots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        k = np.empty((len(slots), self.num_kv_heads, self.head_dim), dtype=np.float32)
        v = np.empty((len(slots), self.num_kv_heads, self.v_width), dtype=np.float32)
        threads = _fork_safe(_threads_for(k.size, self.num_threads))
        rotation = self.storage.rotation
        _kernels.gather(self._k[layer], self._k_scales[layer], slots, k, *rotation, threads)
        _kernels.gather(self._v[layer], self._v_scales[layer], slots, v, *rotation, threads)
        return k, v

    def _row_pools(self, layer: int) -> List[Tuple[str, np.ndarray]]:
        """The layer's copy set as ``[pages, H, page_size, row]`` arrays, in
        :class:`StoredRows` order (a scale is a row of one float), each with
        its field."""
        return [(part.field, self._pools[layer][part.field].reshape(
                    self._pools[layer][part.field].shape[:3] + (-1,)))
                for part in self._copy_set]

    def read_rows(self, layer: int, slots: np.ndarray,
                  out: Optional[StoredRows] = None) -> StoredRows:
        if out is None:
            out = empty_rows(self.storage, len(slots), self.num_kv_heads, self.head_dim)
        for field, pool in self._row_pools(layer):
            rows = getattr(out, field)
            rows = rows.view(pool.dtype).reshape(len(slots), self.num_kv_heads, pool.shape[3])
            _rows.read_rows(_as_bytes(pool), slots, _as_bytes(rows))
        return out

    def write_rows(self, layer: int, slots: np.ndarray, rows: StoredRows) -> None:
        for field, pool in self._row_pools(layer):
            x = getattr(rows, field)
            x = np.ascontiguousarray(x).view(pool.dtype).reshape(len(slots), self.num_kv_heads,
                                                                 pool.shape[3])
            _rows.write_rows(_as_bytes(pool), slots, _as_bytes(x))

    # -- recurrent layers -------------------------------------------------------------
    def state_store(self, shapes: Sequence[Optional[Sequence[Tuple[int, ...]]]],
                    num_slots: int) -> HostStateStore:
        return HostStateStore(shapes, num_slots)

    def causal_conv1d(self, store: HostStateStore, layer: int, index: int, step: Any, x: Any,
                      weight: Any, bias: Any, silu: bool) -> np.ndarray:
        x, weight = self._host_f32(x), self._host_f32(weight)
        out = np.empty(x.shape, np.float32)
        s = StateStep.of(step)
        if s.num_rows == 0:
            return out
        kernel = weight.shape[1]
        # kernel 1 keeps no history: its state arrays have no elements
        state = store.array(layer, index) if kernel > 1 else _no_scales()
        threads = _fork_safe(_threads_for(x.size * kernel, self.num_threads))
        _kernels.causal_conv1d(state, *s, x, weight, None if bias is None else
                               self._host_f32(bias), bool(silu), out, threads)
        return out

    def gated_delta_rule(self, store: HostStateStore, layer: int, index: int, step: Any, q: Any,
                         k: Any, v: Any, g: Any, beta: Any, scale: float,
                         l2norm: bool) -> np.ndarray:
        q, k, v = self._host_f32(q), self._host_f32(k), self._host_f32(v)
        out = np.empty(v.shape, np.float32)
        s = StateStep.of(step)
        if s.num_rows == 0:
            return out
        # three multiply-adds per state element and token
        threads = _fork_safe(_threads_for(3 * v.size * k.shape[2], self.num_threads))
        _kernels.gated_delta_rule(store.array(layer, index), *s, q, k, v, self._host_f32(g),
                                  self._host_f32(beta), float(scale), bool(l2norm), out,
                                  threads)
        return out


def _no_scales() -> np.ndarray:
    """The scale pool the kernels take for a format without scales (never read)."""
    return np.zeros((1, 1, 1), np.float32)


def _as_bytes(x: np.ndarray) -> np.ndarray:
    """A C-contiguous array viewed as uint8, its last axis widened to bytes:
    [..., n] -> [..., n * itemsize] (a view: writes reach ``x``)."""
    return x.view(np.uint8)


def decode_rows(storage: "StorageFormat", values: np.ndarray,
                scales: Optional[np.ndarray] = None) -> np.ndarray:
    """Stored rows as float32, exactly as ``gather`` of a host pool in ``storage`` returns them.

    Parameters
    ----------
    storage : StorageFormat
    values : ndarray, shape [n, num_kv_heads, head_dim], ``storage.element``
    scales : ndarray, shape [n, num_kv_heads], float32, optional
        Required when ``storage.copy_set`` has scales.

    Returns
    -------
    ndarray, shape [n, num_kv_heads, head_dim], float32
    """
    n, num_kv_heads, head_dim = values.shape
    # the rows as a pool of one-token pages, gathered by the host kernel (whose
    # memoryview wants a writable pool: a read-only one, e.g. from Ray, is copied)
    pool = np.require(values, requirements=("C", "W")).view(storage.kernel_element) \
        .reshape(n, num_kv_heads, 1, head_dim)
    scale_pool = _no_scales() if scales is None else \
        np.ascontiguousarray(scales, dtype=np.float32).reshape(n, num_kv_heads, 1)
    out = np.empty((n, num_kv_heads, head_dim), np.float32)
    threads = _fork_safe(_threads_for(out.size, _max_threads()))
    _kernels.gather(pool, scale_pool, np.arange(n, dtype=np.int64), out,
                    *storage.rotation, threads)
    return out
