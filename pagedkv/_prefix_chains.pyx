# distutils: language = c++
"""The prefix cache's chains of pages as they travel in files (``pagedkv.kv_file``).

``export`` lists the cached pages a prompt can reach, parents first, with
each pool's page of the same place.  ``reserve``, ``commit`` and ``undo``
enter chains from a file, as a step is entered: ``reserve`` finds the pages
cached here already and takes new ones, all or nothing; the caller writes
the new pages' K/V; ``commit`` caches them (or ``undo`` lets everything go).
"""
import numpy as np
cimport cython
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.vector cimport vector

from pagedkv._allocator cimport PageAllocator
from pagedkv._page_table cimport PageTables
from pagedkv._pool cimport Pool, ROOT_HASH, ROOT_ENTRY
from pagedkv.errors import OutOfPagesError

cnp.import_array()


@cython.final
cdef class PrefixChains:
    """The chains of ``tables``' prefix cache (a PageTables), out and in."""
    cdef PageTables tables
    # what ``reserve`` took, while its K/V are being written (None: nothing):
    # token ids, parents, hashes, the pages held and those new
    cdef tuple pending

    def __cinit__(self, PageTables tables):
        self.tables = tables

    def export(self):
        """The prefix cache's pages that a prompt can reach, parents first.

        Returns
        -------
        dict of ndarray
            ``pages`` [P, N] int32 (row ``q``: pool ``q``'s cached page of each
            place, -1 where it is not cached; row 0, the first pool's, holds
            the chain), ``parents`` [N] int64 (index of each page's parent in
            these arrays, -1 for a prompt's first page), ``tokens`` [N,
            page_size] int32.
        """
        cdef PageTables t = self.tables
        cdef PageAllocator a = t.allocator
        cdef Pool pool
        cdef int32_t p
        cdef int64_t entry, parent
        cdef list found = []
        if t.caching:
            for p in range(a.num_pages):
                if a._entry[p]:
                    found.append((a._entry[p], p))
        found.sort()          # entries grow with each insertion: parents come first
        index_of = {}
        pages, parents = [[] for _ in t.pools], []
        for entry, p in found:
            parent = a._parent_entry[p]
            if parent != ROOT_ENTRY and parent not in index_of:
                continue      # its parent was evicted: no prompt reaches it
            index_of[entry] = len(parents)
            parents.append(-1 if parent == ROOT_ENTRY else index_of[parent])
            pages[0].append(p)
            for pool in t.pools[1:]:
                pages[pool.index].append(
                    pool.allocator.lookup(<uint64_t>entry, ROOT_ENTRY, &a._tokens[p, 0]))
        page_ids = np.asarray(pages[0], dtype=np.int32)
        return {"pages": np.asarray(pages, dtype=np.int32).reshape(len(t.pools), len(parents)),
                "parents": np.asarray(parents, dtype=np.int64),
                "tokens": np.asarray(a._tokens)[page_ids].reshape(len(parents), t.page_size)}

    def reserve(self, token_ids, parents, held, reserves):
        """Reserve the pages to enter page chains from elsewhere (a file) in the prefix
        cache, as free, evictable pages that prompts starting with their tokens hit.

        A page already cached here (same tokens after the same parent) is
        kept and not written again.  All or nothing.  The caller then writes
        the K/V of the new pages it returns and calls ``commit``, or ``undo``
        if the writing failed (nothing stays taken or cached).  A
        reservation neither committed nor undone is undone by the next one.

        Parameters
        ----------
        token_ids : ndarray, shape [N, page_size], int32
        parents : ndarray, shape [N], int64
            Each page's parent: an earlier index, or -1 for a prompt's first page.
        held : ndarray, shape [P, N], bool
            Whether pool ``q``'s K/V of page ``i`` come (row 0 is all True).
        reserves : sequence of int, shape [P]
            Pages of each pool that must stay free besides (for sequences the
            caller places next); the pages entered here are evicted after any
            other free page.

        Returns
        -------
        pages : ndarray, shape [P, N], int32
            Where to write pool ``q``'s K/V of page ``i``: ``pages[q, i]``,
            where it is >= 0 (the pages not cached here yet).

        Raises
        ------
        OutOfPagesError
            Too few free pages; nothing changed.
        """
        cdef PageTables t = self.tables
        cdef PageAllocator chain = t.allocator
        cdef Py_ssize_t P = len(t.pools)
        cdef const int32_t[:, ::1] tokens = token_ids
        cdef const int64_t[::1] parent = parents
        cdef const cnp.uint8_t[:, ::1] comes
        cdef Py_ssize_t N = tokens.shape[0], i, q
        cdef int64_t entry
        cdef Pool pool
        held = np.asarray(held, dtype=bool)
        if tokens.shape[1] != t.page_size or parent.shape[0] != N or \
                held.shape != (P, N) or len(reserves) != P or not held[:1].all():
            raise ValueError(f"token_ids, parents, held, reserves: expected shapes [N, "
                             f"{t.page_size}], [N], [{P}, N] (row 0 all True), [{P}], got "
                             f"{list(token_ids.shape)}, {list(parents.shape)}, "
                             f"{list(held.shape)}, {len(reserves)}")
        comes = np.ascontiguousarray(held).view(np.uint8)
        self.undo()
        hashes = np.zeros(N, dtype=np.uint64)
        cdef uint64_t[::1] h = hashes
        # per pool: the page of each place, and the new ones to write
        found = np.full((P, N), -1, dtype=np.int32)
        fresh = np.full((P, N), -1, dtype=np.int32)
        cdef int32_t[:, ::1] page = found, new_page = fresh
        cdef vector[int64_t] needed, busy        # per pool
        needed.assign(P, 0)
        busy.assign(P, 0)
        # Plan: hash every page, find those cached here already; nothing changes yet.
        for i in range(N):
            if not -1 <= parent[i] < i:
                raise ValueError(f"parents: page {i} names parent {parent[i]}; expected -1 or "
                                 f"an earlier page")
            h[i] = t.page_hash(ROOT_HASH if parent[i] < 0 else h[parent[i]], &tokens[i, 0])
            entry = ROOT_ENTRY if parent[i] < 0 else \
                (chain.entry_of(page[0, parent[i]]) if page[0, parent[i]] >= 0 else 0)
            if entry != 0:
                page[0, i] = chain.lookup(h[i], entry, &tokens[i, 0])
            for q in range(P):
                if not comes[q, i]:
                    continue
                pool = <Pool>t.pool_refs[q]
                if q and page[0, i] >= 0:
                    page[q, i] = pool.allocator.lookup(
                        <uint64_t>chain.entry_of(page[0, i]), ROOT_ENTRY, &tokens[i, 0])
                if page[q, i] >= 0:
                    busy[q] += pool.allocator.refcount_of(page[q, i]) == 0
                else:
                    needed[q] += 1
        for pool in t.pools:
            q = pool.index
            if needed[q] + reserves[q] + busy[q] > pool.allocator.num_free_pages:
                raise OutOfPagesError(
                    f"load: the prefix cache's chains need {needed[q]} {pool.names.noun} "
                    f"besides the sequences' {reserves[q]}, {pool.free_text(busy[q], False)}")
        # Reserve: hold the pages found (before any take could evict one), take the
        # new ones; the commit caches them and lets go.
        for i in range(N):
            for q in range(P):
                if page[q, i] >= 0:
                    (<Pool>t.pool_refs[q]).allocator.acquire(page[q, i])
        for i in range(N):
            for q in range(P):
                if comes[q, i] and page[q, i] < 0:
                    page[q, i] = new_page[q, i] = (<Pool>t.pool_refs[q]).allocator.take_page()
        self.pending = (token_ids, parents, hashes, found, fresh)
        return fresh.copy()

    def commit(self):
        """The K/V of the pages ``reserve`` took are written: the new pages join the
        prefix cache, and every page of the chains is let go (free, evictable).
        Returns how many pages of the chains are now cached here (new or
        already there); 0 when nothing is reserved."""
        if self.pending is None:
            return 0
        entries = np.zeros(len(self.pending[0]), dtype=np.int64)   # (before any change)
        token_ids, parents, hashes, found, fresh = self.pending
        self.pending = None
        cdef PageTables t = self.tables
        cdef PageAllocator chain = t.allocator
        cdef const int32_t[:, ::1] tokens = token_ids
        cdef const int64_t[::1] parent = parents
        cdef const uint64_t[::1] h = hashes
        cdef int32_t[:, ::1] page = found
        cdef const int32_t[:, ::1] new_page = fresh
        cdef Py_ssize_t i, q, N = tokens.shape[0], P = len(t.pools)
        cdef int64_t entry, joined = 0
        cdef int32_t other
        # each page's entry in the index: its own, or that of a page of the same
        # prefix cached meanwhile (a sequence placed between the reserve and this
        # commit), under which its children are cached
        cdef int64_t[::1] entry_at = entries
        for i in range(N):
            entry = ROOT_ENTRY if parent[i] < 0 else entry_at[parent[i]]
            if new_page[0, i] >= 0 and entry != 0:
                chain.cache_page(page[0, i], h[i], entry, &tokens[i, 0])
            entry_at[i] = chain.entry_of(page[0, i])
            if entry_at[i] == 0 and entry != 0:
                other = chain.lookup(h[i], entry, &tokens[i, 0])
                entry_at[i] = chain.entry_of(other) if other >= 0 else 0
            if chain.entry_of(page[0, i]) == 0:
                joined += entry_at[i] != 0
                continue
            joined += 1
            for q in range(1, P):
                if new_page[q, i] >= 0:
                    (<Pool>t.pool_refs[q]).allocator.cache_page(
                        page[q, i], <uint64_t>chain.entry_of(page[0, i]), ROOT_ENTRY,
                        &tokens[i, 0])
        self.release(page)
        return joined

    def undo(self):
        """Take back what ``reserve`` took when its K/V could not be written: no page
        stays taken or cached.  A no-op when nothing is reserved."""
        if self.pending is None:
            return
        found = self.pending[3]
        self.pending = None
        self.release(found)

    cdef void release(self, int32_t[:, ::1] page) noexcept nogil:
        """Drop the references ``reserve`` took, last page first (so that a chain's
        tail is evicted before its head)."""
        cdef Py_ssize_t i, q
        for i in range(page.shape[1] - 1, -1, -1):
            for q in range(page.shape[0]):
                if page[q, i] >= 0:
                    (<Pool>self.tables.pool_refs[q]).allocator.decref_page(page[q, i])
