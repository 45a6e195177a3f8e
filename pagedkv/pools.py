"""The page pools of a cache, described as data, and one manager per attention type.

A cache keeps its K/V in pools of pages.  Each pool serves the layers of one
attention type and is described by a frozen :class:`PoolSpec` (as vLLM's
``KVCacheSpec`` describes its KV cache groups):

* the ``"full"`` pool: full-attention layers; a sequence keeps every page;
* the ``"window"`` pool: sliding-window layers (window ``W``, the largest of
  its layers); a sequence gives back the pages no later query can see,
  keeping what a rollback of up to ``rollback`` tokens needs.

A pool's :class:`PoolManager` (:class:`FullAttentionManager` or
:class:`SlidingWindowManager`) answers what the cache asks of it: which
positions a sequence must keep, which it still holds, the slots of a range
of positions, what attention a layer of the pool runs, and where the step
tables of a step in the pool are.  A new attention type (e.g. chunked local
attention) is a new ``attention`` value and a new manager.

The page tables themselves (``pagedkv._page_table.PageTables``) keep each
sequence's page list in every pool; the managers read them.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

import numpy as np

from pagedkv._protocols import PageAllocatorLike, PageTablesLike

if TYPE_CHECKING:   # annotations only
    from pagedkv._page_table import AppendTables, PoolTables
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

    def keep_from(self, old_len: int, new_len: int) -> int:
        """The first position a sequence must keep after a step from ``old_len``
        to ``new_len`` tokens: what the queries of that step, and of any step
        after a rollback of up to ``rollback`` tokens, can see."""
        if self.window is None:
            return 0
        return max(0, min(old_len, new_len - self.rollback) - self.window + 1)

    def sees_from(self, position: int) -> int:
        """The first position a query at ``position`` sees."""
        return 0 if self.window is None else max(0, position - self.window + 1)


def pool_specs(layer_windows: Sequence[Optional[int]], num_pages: int,
               num_window_pages: int, rollback: int) -> Tuple[PoolSpec, ...]:
    """The pools of a cache whose layer ``l`` has window ``layer_windows[l]``
    (None: full attention): the full pool always (it holds every sequence's
    length and prefix chain), the window pool when some layer is windowed."""
    full = tuple(layer for layer, w in enumerate(layer_windows) if w is None)
    windowed = tuple(layer for layer, w in enumerate(layer_windows) if w is not None)
    pools = [PoolSpec("full", num_pages, full)]
    if windowed:
        pools.append(PoolSpec("window", num_window_pages, windowed, SLIDING_WINDOW,
                              max(layer_windows[layer] for layer in windowed),  # type: ignore
                              rollback))
    return tuple(pools)


class PoolManager:
    """What the cache asks of one pool; see :class:`FullAttentionManager` and
    :class:`SlidingWindowManager`.

    Parameters
    ----------
    spec : PoolSpec
    allocator : PageAllocator
        The pool's pages.
    tables : PageTables
        The page tables of every sequence (all pools).
    """
    #: whether the page tables keep this pool's pages in their window lists
    in_window_lists = False

    def __init__(self, spec: PoolSpec, allocator: PageAllocatorLike, tables: PageTablesLike):
        self.spec = spec
        self.allocator = allocator
        self.tables = tables

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def layers(self) -> Tuple[int, ...]:
        return self.spec.layers

    def held_from(self, seq_id: int) -> int:
        """The first position whose K/V the sequence still holds in this pool."""
        raise NotImplementedError

    def slots(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        """Slots of positions ``start:stop`` in this pool; ndarray, shape [stop - start], int64."""
        return self.tables.slots(seq_id, start, stop, self.in_window_lists)

    def layer_spec(self, layer: int, spec: "AttentionSpec",
                   window: Optional[int]) -> "AttentionSpec":
        """The attention a layer of this pool (own window ``window``) runs for ``spec``,
        or ValueError when ``spec`` asks for more than the pool keeps."""
        raise NotImplementedError

    def step_tables(self, batch: "StepBatch") -> "StepTables":
        """The :class:`~pagedkv.backends.base.StepTables` the kernels of this pool's
        layers read for ``batch`` (a StepBatch)."""
        raise NotImplementedError

    def copies(self, tables: "AppendTables") -> Tuple[np.ndarray, np.ndarray]:
        """The (source, destination) pages, int32 [num_copies] each, that an
        ``append`` (whose result is the AppendTables ``tables``) copies in this pool."""
        pool_tables = self.pool_tables(tables)
        return pool_tables.copy_src, pool_tables.copy_dst

    def pool_tables(self, tables: "AppendTables") -> "PoolTables":
        """This pool's ``PoolTables`` in an ``append``'s AppendTables ``tables``."""
        pool_tables = tables.window if self.in_window_lists else tables.full
        assert pool_tables is not None      # a window manager exists only with a window pool
        return pool_tables

    def import_start(self, start: int) -> int:
        """The first position this pool holds of an imported sequence whose window
        pages start at position ``start`` (see ``transfer.window_start``)."""
        raise NotImplementedError


class FullAttentionManager(PoolManager):
    """Full attention: a sequence keeps every page; every position stays visible."""

    def held_from(self, seq_id: int) -> int:
        return 0

    def layer_spec(self, layer: int, spec: "AttentionSpec",
                   window: Optional[int]) -> "AttentionSpec":
        return spec

    def step_tables(self, batch: "StepBatch") -> "StepTables":
        return batch._tables

    def import_start(self, start: int) -> int:
        return 0


class SlidingWindowManager(PoolManager):
    """Sliding window: a sequence gives back the pages no later query can see
    (``PoolSpec.keep_from``), so its page list starts with given-back entries."""

    in_window_lists = True

    def held_from(self, seq_id: int) -> int:
        return self.tables.window_held_from(seq_id)

    def layer_spec(self, layer: int, spec: "AttentionSpec",
                   window: Optional[int]) -> "AttentionSpec":
        assert window is not None           # a sliding-window layer's own window
        if spec.sliding_window is not None and spec.sliding_window > window:
            raise ValueError(f"sliding_window: layer {layer} keeps only a window of "
                             f"{window} positions, got {spec.sliding_window}")
        return spec.with_window(window)

    def step_tables(self, batch: "StepBatch") -> "StepTables":
        assert batch._window_tables is not None     # made whenever a layer is windowed
        return batch._window_tables

    def import_start(self, start: int) -> int:
        return start


MANAGERS = {FULL: FullAttentionManager, SLIDING_WINDOW: SlidingWindowManager}


def manager_for(spec: PoolSpec, allocator: PageAllocatorLike,
                tables: PageTablesLike) -> PoolManager:
    """The manager of the pool ``spec`` (by its attention type)."""
    return MANAGERS[spec.attention](spec, allocator, tables)
