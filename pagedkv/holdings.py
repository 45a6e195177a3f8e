"""``CacheHoldings``: what a cache holds and how, as the modules that move K/V in
and out of it (:mod:`pagedkv.transfer`, :mod:`pagedkv.kv_file`) and a step's
batch (:mod:`pagedkv.step`) reach it.

``PagedKVCache`` builds one in its constructor from the objects it keeps
itself (the same objects: the page tables, the pools' managers, the backend,
the dict of swapped-out sequences) and hands it down.  Those modules take it
instead of the cache, so they depend on this one object and never on the
cache's private attributes, and the cache is free to rearrange them.  It is
frozen: the cache never replaces any of them, it only changes their contents.
"""
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from pagedkv.pools import SLIDING_WINDOW, PoolManager
from pagedkv.storage import StorageFormat

if TYPE_CHECKING:   # annotations only (transfer imports this module)
    from pagedkv._page_table import PageTables
    from pagedkv._placement import Placement
    from pagedkv._prefix_chains import PrefixChains
    from pagedkv.backends.base import Backend
    from pagedkv.state_pool import StatePool
    from pagedkv.transfer import SequenceKV


@dataclass(frozen=True, eq=False)
class CacheHoldings:
    """A cache's shape and settings, and the objects that hold its sequences' K/V.

    Attributes
    ----------
    num_layers, num_kv_heads, head_dim, page_size : int
    storage : StorageFormat
        How the pages store K/V.
    kv_rotation : bool
        The constructor's ``kv_rotation`` (a file records it whatever the dtype).
    kv_layout : {"separate", "latent"}
    v_head_dim : int
        The values' width: V rows' (separate), or the leading columns of each
        latent row that are its values (latent).
    layer_windows : tuple of (int or None), shape [num_layers]
        Each layer's sliding window, None for full attention.
    window_rollback_tokens : int
        The constructor's ``window_rollback_tokens``.
    max_seq_len : int or None
    prefix_caching : bool
    tables : PageTables
        Every sequence's page lists in every pool, lengths, prefix cache.
    placement : Placement
        Places sequences whose K/V come from elsewhere in ``tables``.
    chains : PrefixChains
        The prefix cache's chains of pages, out of ``tables`` and into them.
    pools : tuple of PoolManager
        One manager per pool, in the tables' order (``pools[0]`` the full pool).
    layer_pool : tuple of PoolManager, shape [num_layers]
        Each layer's pool's manager (one of ``pools``).
    backend : Backend
        The pages' K/V and the kernels.
    swapped : dict of int to SequenceKV
        Swapped-out sequences' K/V in host memory, by sequence id (the cache's
        own dict: swapping and freeing change it).
    states : StatePool or None
        The recurrent layers' state pool; None when no layer is recurrent.
    """
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    storage: StorageFormat
    kv_rotation: bool
    kv_layout: str
    v_head_dim: int
    layer_windows: Tuple[Optional[int], ...]
    window_rollback_tokens: int
    max_seq_len: Optional[int]
    prefix_caching: bool
    tables: "PageTables"
    placement: "Placement"
    chains: "PrefixChains"
    pools: Tuple[PoolManager, ...]
    layer_pool: Tuple[PoolManager, ...]
    backend: "Backend"
    swapped: Dict[int, "SequenceKV"]
    states: "Optional[StatePool]" = None

    @property
    def recurrent_layers(self) -> Tuple[int, ...]:
        """The layers that keep states instead of K/V, ascending."""
        return () if self.states is None else self.states.layers

    @property
    def full_pool(self) -> PoolManager:
        """The full-attention pool's manager (always there; it holds the prefix chain)."""
        return self.pools[0]

    @functools.cached_property
    def window_pool(self) -> Optional[PoolManager]:
        """The sliding-window pool's manager, or None when no layer is windowed."""
        # (a loop: an unfinished generator is closed later, where an error raised in it is lost)
        for pool in self.pools:
            if pool.spec.attention == SLIDING_WINDOW:
                return pool
        return None
