"""``StepBatch``: the slots and page tables of one ``append`` step, as an engine sees them."""
from typing import TYPE_CHECKING, Dict, Optional, Set, Tuple

import numpy as np

from pagedkv.backends.base import StepTables

if TYPE_CHECKING:   # annotations only: importing them here would be circular
    from pagedkv._page_table import AppendTables
    from pagedkv.cache import PagedKVCache
    from pagedkv.cascade import CascadeAttention, Sharing
    from pagedkv.holdings import CacheHoldings
    from pagedkv.state_pool import StateStep


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


class _ReadOnlyTables:
    """Read-only copies of a step's tables, made on first access of each.

    The kernels read the private originals, so no edit of these copies can
    make ``store`` or ``attention`` touch other memory.
    """

    def __init__(self, private: Dict[str, np.ndarray]):
        self._private = private
        self._public: Dict[str, np.ndarray] = {}

    def _view(self, name: str) -> np.ndarray:
        if name not in self._public:
            self._public[name] = _frozen(self._private[name].copy())
        return self._public[name]

    slot_mapping = property(lambda self: self._view("slot_mapping"))
    page_indptr = property(lambda self: self._view("page_indptr"))
    page_indices = property(lambda self: self._view("page_indices"))
    last_page_len = property(lambda self: self._view("last_page_len"))
    block_table = property(lambda self: self._view("block_table"))


class WindowTables(_ReadOnlyTables):
    """The windowed layers' tables of one step, in the window pool (read-only).

    Attributes
    ----------
    slot_mapping : ndarray, shape [total_new], int64
    page_indptr : ndarray, shape [B+1], int32
    page_indices : ndarray, shape [nnz], int32
        ``-1`` for pages given back (positions no window of the step sees).
    last_page_len : ndarray, shape [B], int32
    block_table : ndarray, shape [B, max_pages], int32
        ``-1`` for pages given back and past each sequence's pages.

    A sequence's window page list has as many entries as its full one, so
    ``page_indptr`` and ``last_page_len`` equal the batch's own.
    """


class StepBatch(_ReadOnlyTables):
    """The slots and page tables of one ``append`` step (host numpy arrays, read-only).

    Attributes
    ----------
    seq_ids : ndarray, shape [B], int64
        The sequences, in the order given to ``append``.
    query_start : ndarray, shape [B+1], int32
        New tokens of sequence ``b`` are rows ``query_start[b]:query_start[b+1]``.
    seq_lens : ndarray, shape [B], int32
        Lengths after this step.
    slot_mapping : ndarray, shape [total_new], int64
        ``page * page_size + offset`` of each new token (vLLM layout).
    page_indptr : ndarray, shape [B+1], int32
    page_indices : ndarray, shape [nnz], int32
    last_page_len : ndarray, shape [B], int32
        CSR page table (FlashInfer / TVM layout).
    block_table : ndarray, shape [B, max_pages], int32
        Padded page table (vLLM layout), ``-1`` past each sequence's pages.
    window_tables : WindowTables or None
        The same tables in the window pool, which the sliding-window layers
        (``layer_windows``) use; None when no layer is windowed.

    These describe the full-attention layers' pool.  The arrays are read-only
    copies: the kernels read private ones, so no edit of these can make
    ``store`` or ``attention`` touch other memory.

    A batch is valid until the cache's pages next change (``append``,
    ``truncate``, ``restore``, ``free``, ``clear``): store every layer of a
    step before the next of those calls.
    """

    def __init__(self, cache: "PagedKVCache", holdings: "CacheHoldings",
                 attend: "CascadeAttention", generation: int, seq_ids: np.ndarray,
                 tables: "AppendTables"):
        private = {name: _frozen(getattr(tables, name))
                   for name in ("query_start", "seq_lens", "page_indptr", "last_page_len")}
        p = private
        # each pool's tables as the kernels read them (read-only).  A page of the
        # step with two holders would have to be on the allocator's count now:
        # nothing makes two sequences of the step share one later (a fork, import
        # or prefix hit makes a new sequence, outside the step)
        pool_tables = []
        for pool, own in zip(holdings.pools, tables.pools):
            _frozen(own.block_table)
            pool_tables.append(StepTables(
                p["query_start"], p["seq_lens"], _frozen(own.slot_mapping), p["page_indptr"],
                _frozen(own.page_indices), may_share=pool.allocator.num_shared_pages > 0))
        self._pool_tables: Tuple[StepTables, ...] = tuple(pool_tables)
        self._tables = pool_tables[0]
        first = tables.pools[0]
        p["slot_mapping"] = first.slot_mapping
        p["page_indices"] = first.page_indices
        p["block_table"] = first.block_table
        p["seq_ids"] = _frozen(seq_ids)
        super().__init__(private)
        self._cache = cache             # whose step it is: the only cache that takes it
        self._attend = attend
        self._generation = generation
        self._stored_layers: Set[int] = set()
        # the recurrent layers' slots and save points (StatePool.commit), if any
        self._state_step: "Optional[StateStep]" = None
        self.window_tables: Optional[WindowTables] = None
        window_pool = holdings.window_pool
        if window_pool is not None:
            own = tables.pools[window_pool.index]
            self.window_tables = WindowTables({
                "page_indptr": p["page_indptr"], "last_page_len": p["last_page_len"],
                "slot_mapping": own.slot_mapping, "page_indices": own.page_indices,
                "block_table": own.block_table})

    seq_ids = property(lambda self: self._view("seq_ids"))
    query_start = property(lambda self: self._view("query_start"))
    seq_lens = property(lambda self: self._view("seq_lens"))

    @property
    def sharing(self) -> "Sharing":
        """What the step's sequences share, as attention reads it: a
        :class:`pagedkv.cascade.Sharing` (groups of sequences, key positions
        read once per group, reads saved per layer and KV head) for the
        full-attention layers under the cache's ``cascade`` setting (all zero
        with ``"off"`` or nothing shared)."""
        return self._attend.sharing(self._tables)

    @property
    def num_seqs(self) -> int:
        """B, the sequences in the step."""
        return len(self._private["seq_ids"])

    @property
    def num_tokens(self) -> int:
        """total_new, the new tokens of the step."""
        return len(self._private["slot_mapping"])

    def __repr__(self) -> str:
        return f"StepBatch(num_seqs={self.num_seqs}, num_tokens={self.num_tokens})"
