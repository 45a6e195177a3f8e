"""The page pools of a cache, described as data, and one manager per attention type.

A cache keeps its K/V in pools of pages.  Each pool serves the layers of one
attention type and is described by a frozen :class:`PoolSpec` (as vLLM's
``KVCacheSpec`` describes its KV cache groups):

* the ``"full"`` pool: full-attention layers; a sequence keeps every page;
* the ``"window"`` pool: sliding-window layers (window ``W``, the largest of
  its layers); a sequence gives back the pages no later query can see,
  keeping what a rollback of up to ``rollback`` tokens needs.

The recurrent layers of a hybrid model keep fixed-size states instead, in
the state pool: its spec and manager are :mod:`pagedkv.state_pool`'s.

A pool's :class:`PoolManager` (one class per attention type, in
``MANAGERS``) turns its spec into the page tables' compiled
:class:`pagedkv._pool.Pool` (the span of its queries, its rollback, how
errors name it) and answers what the cache asks of the pool: which
positions a sequence still holds, the slots of a range of positions, what
attention a layer of the pool runs, and which of a step's tables are the
pool's.  A new attention type is a new ``attention`` value and a new
manager; ``docs/architecture.md`` has the recipe.

The page tables themselves (``pagedkv._page_table.PageTables``) keep each
sequence's page list in every pool, in the order of the specs; the managers
read them by their pool's ``index``.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

import numpy as np

from pagedkv._allocator import PageAllocator
from pagedkv._page_table import PageTables
from pagedkv._pool import Pool
from pagedkv._protocols import PageTablesLike

if TYPE_CHECKING:   # annotations only
    from pagedkv._page_table import AppendTables
    from pagedkv._pool import PoolTables
    from pagedkv.attention_spec import AttentionSpec
    from pagedkv.backends.base import StepTables
    from pagedkv.step import StepBatch

FULL = "full"
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class PoolSpec:
    """One pool of pages and the layers it serves.

    Attributes
    ----------
    name : str
        ``"full"`` or ``"window"``: how the page tables and step tables name it.
    num_pages : int
        Pages in the pool.
    layers : tuple of int
        The layers whose K/V live in the pool, ascending.
    attention : str
        ``"full"`` (every position stays visible) or ``"sliding_window"``.
    window : int or None
        Sliding window: the largest window ``W`` of the pool's layers (a query
        at position ``p`` sees ``p - W + 1 .. p``); None for full attention.
    rollback : int
        Sliding window: tokens a sequence can always be rolled back by (its
        pages are kept for queries up to this many tokens before its end).
    """
    name: str
    num_pages: int
    layers: Tuple[int, ...]
    attention: str = FULL
    window: Optional[int] = None
    rollback: int = 1


@dataclass(frozen=True)
class PoolNames:
    """How errors name a pool (see :class:`pagedkv._pool.Pool`).

    Attributes
    ----------
    noun : str
        Its pages ("window pages").
    where : str
        "" (the only pool) or " in the ... pool".
    pool : str
        "the ... pool".
    hint : str
        What sizes it, in parentheses, or "".
    layers : str
        Its layers ("the windowed layers").
    span : str
        What its span is ("window").
    rollback : str
        The argument that sets its rollback.
    """
    noun: str
    where: str
    pool: str
    hint: str = ""
    layers: str = ""
    span: str = ""
    rollback: str = ""


def pool_specs(layer_windows: Sequence[Optional[int]], num_pages: int,
               num_window_pages: int, rollback: int,
               recurrent: Sequence[int] = ()) -> Tuple[PoolSpec, ...]:
    """The pools of a cache whose layer ``l`` has window ``layer_windows[l]``
    (None: full attention): the full pool always (it holds every sequence's
    length and prefix chain), the window pool when some layer is windowed.
    The ``recurrent`` layers keep states, not K/V (:mod:`pagedkv.state_pool`):
    no pool serves them."""
    full = tuple(layer for layer, w in enumerate(layer_windows)
                 if w is None and layer not in recurrent)
    windowed = tuple(layer for layer, w in enumerate(layer_windows) if w is not None)
    pools = [PoolSpec("full", num_pages, full)]
    if windowed:
        pools.append(PoolSpec("window", num_window_pages, windowed, SLIDING_WINDOW,
                              max(layer_windows[layer] for layer in windowed),  # type: ignore
                              rollback))
    return tuple(pools)


class PoolManager:
    """What the cache asks of one pool; one subclass per attention type.

    Parameters
    ----------
    spec : PoolSpec
    pool : Pool
        The page tables' pool made from ``spec`` (by :meth:`page_pool`).
    tables : PageTables
        The page tables of every sequence (all pools).
    """

    def __init__(self, spec: PoolSpec, pool: Pool, tables: PageTablesLike):
        self.spec = spec
        self.pool = pool
        self.tables = tables
        # read on every step: plain attributes
        #: The pool's place in the page tables (and in each step's ``AppendTables.pools``).
        self.index: int = pool.index
        self.allocator: PageAllocator = pool.allocator
        self.layers: Tuple[int, ...] = spec.layers

    @classmethod
    def page_pool(cls, spec: PoolSpec, index: int, allocator: PageAllocator,
                  num_pools: int) -> Pool:
        """The page tables' pool for ``spec``, ``index``-th of ``num_pools``."""
        return Pool(allocator, index, cls.span(spec), spec.rollback, cls.names(num_pools))

    @staticmethod
    def span(spec: PoolSpec) -> int:
        """The most positions a query of the pool's layers sees (0: all of them)."""
        raise NotImplementedError

    @staticmethod
    def names(num_pools: int) -> PoolNames:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self.spec.name

    def keep_from(self, old_len: int, new_len: int) -> int:
        """The first position a sequence must keep here after a step from ``old_len``
        to ``new_len`` tokens (what that step's queries, and those after a
        rollback of up to ``rollback`` tokens, can see)."""
        return self.pool.keep_from(old_len, new_len)

    def held_from(self, seq_id: int) -> int:
        """The first position whose K/V the sequence still holds in this pool."""
        return self.tables.held_from(seq_id, self.index)

    def held_pages(self, seq_id: int) -> int:
        """Pages the sequence holds in this pool (those given back not counted)."""
        return self.tables.held_pages(seq_id, self.index)

    def page_ids(self, seq_id: int) -> np.ndarray:
        """The sequence's page ids here in position order, -1 for pages given back;
        ndarray, shape [num_pages], int32."""
        return self.tables.pages(seq_id, self.index)

    def slots(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        """Slots of positions ``start:stop`` in this pool; ndarray, shape [stop - start], int64."""
        return self.tables.slots(seq_id, start, stop, self.index)

    def layer_spec(self, layer: int, spec: "AttentionSpec",
                   window: Optional[int]) -> "AttentionSpec":
        """The attention a layer of this pool (own window ``window``) runs for ``spec``,
        or ValueError when ``spec`` asks for more than the pool keeps."""
        raise NotImplementedError

    def step_tables(self, batch: "StepBatch") -> "StepTables":
        """The :class:`~pagedkv.backends.base.StepTables` the kernels of this pool's
        layers read for ``batch`` (a StepBatch)."""
        return batch._pool_tables[self.index]

    def copies(self, tables: "AppendTables") -> Tuple[np.ndarray, np.ndarray]:
        """The (source, destination) pages, int32 [num_copies] each, that an
        ``append`` (whose result is the AppendTables ``tables``) copies in this pool."""
        pool_tables = self.pool_tables(tables)
        return pool_tables.copy_src, pool_tables.copy_dst

    def pool_tables(self, tables: "AppendTables") -> "PoolTables":
        """This pool's ``PoolTables`` in an ``append``'s AppendTables ``tables``."""
        return tables.pools[self.index]

    def import_start(self, start: int) -> int:
        """The first position this pool holds of an imported sequence that the pools
        giving pages back hold from position ``start`` (see ``transfer.window_start``)."""
        return start if self.pool.gives_back else 0


class FullAttentionManager(PoolManager):
    """Full attention: a sequence keeps every page; every position stays visible."""

    @staticmethod
    def span(spec: PoolSpec) -> int:
        return 0

    @staticmethod
    def names(num_pools: int) -> PoolNames:
        return PoolNames("pages", "" if num_pools == 1 else " in the full-attention pool",
                         "the full-attention pool", layers="the full-attention layers")

    def layer_spec(self, layer: int, spec: "AttentionSpec",
                   window: Optional[int]) -> "AttentionSpec":
        return spec


class SlidingWindowManager(PoolManager):
    """Sliding window: a sequence gives back the pages no later query can see
    (``keep_from``), so its page list starts with given-back entries."""

    @staticmethod
    def span(spec: PoolSpec) -> int:
        assert spec.window is not None      # a sliding-window pool's spec has its window
        return spec.window

    @staticmethod
    def names(num_pools: int) -> PoolNames:
        return PoolNames("window pages", " in the window pool", "the window pool",
                         " (the sliding-window layers; num_window_pages)",
                         "the windowed layers", "window", "window_rollback_tokens")

    def layer_spec(self, layer: int, spec: "AttentionSpec",
                   window: Optional[int]) -> "AttentionSpec":
        assert window is not None           # a sliding-window layer's own window
        if spec.sliding_window is not None and spec.sliding_window > window:
            raise ValueError(f"sliding_window: layer {layer} keeps only a window of "
                             f"{window} positions, got {spec.sliding_window}")
        return spec.with_window(window)


MANAGERS = {FULL: FullAttentionManager, SLIDING_WINDOW: SlidingWindowManager}


def page_tables_of(specs: Sequence[PoolSpec], allocators: Sequence[PageAllocator],
                   prefix_hash: Optional[Callable[[int, tuple], int]] = None
                   ) -> Tuple[PageTables, Tuple[PoolManager, ...]]:
    """The page tables over the pools ``specs`` (with their ``allocators``) and
    each pool's manager, in the specs' order (the first keeps every page)."""
    kinds = [MANAGERS[spec.attention] for spec in specs]
    pools = [kind.page_pool(spec, i, allocator, len(specs))
             for i, (kind, spec, allocator) in enumerate(zip(kinds, specs, allocators))]
    tables = PageTables(pools, prefix_hash)
    return tables, tuple(kind(spec, pool, tables)
                         for kind, spec, pool in zip(kinds, specs, pools))
