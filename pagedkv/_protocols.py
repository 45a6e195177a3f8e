"""What the Python modules use of the compiled page allocator and page tables.

The compiled classes (``pagedkv._allocator.PageAllocator``,
``pagedkv._page_table.PageTables``; their stubs are the ``.pyi`` files) are
what a cache holds; these protocols name the part of them that a module
taking one as an argument relies on (e.g. a pool's manager,
:mod:`pagedkv.pools`), so that it can be handed anything that has that
part.  mypy checks that the compiled classes satisfy them (below).
"""
from typing import TYPE_CHECKING, Protocol, Sequence, Tuple, Union, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:   # annotations only
    from pagedkv._allocator import PageAllocator
    from pagedkv._page_table import PageTables

#: A sequence id as the page tables take it: a Python or numpy int.
SeqId = Union[int, np.integer]


class PageAllocatorLike(Protocol):
    """One pool's pages: sizes, counts, the prefix cache (what a pool's manager
    and the cache's statistics read)."""

    @property
    def num_pages(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_cached_free(self) -> int: ...

    @property
    def num_shared_pages(self) -> int: ...

    @property
    def num_evictions(self) -> int: ...

    def reset_prefix_cache(self) -> int: ...

    @overload
    def refcount(self, pages: Union[int, np.integer]) -> int: ...

    @overload
    def refcount(
            self, pages: Union[npt.NDArray[np.integer], Sequence[int]]) -> npt.NDArray[np.int32]: ...


class PageTablesLike(Protocol):
    """Each sequence's page lists in every pool (what a pool's manager reads)."""

    def pages(self, seq_id: SeqId, pool: int = 0) -> npt.NDArray[np.int32]: ...

    def slots(self, seq_id: SeqId, start: int, stop: int,
              pool: int = 0) -> npt.NDArray[np.int64]: ...

    def held_from(self, seq_id: SeqId, pool: int) -> int: ...

    def held_pages(self, seq_id: SeqId, pool: int) -> int: ...


if TYPE_CHECKING:
    def _conforms(allocator: "PageAllocator",
                  tables: "PageTables") -> Tuple[PageAllocatorLike, PageTablesLike]:
        """mypy's check that the compiled classes have what the protocols name."""
        return allocator, tables
