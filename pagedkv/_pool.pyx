# distutils: language = c++
"""A pool of the page tables: one allocator's pages and the rule for which of them a
sequence gives back, and what a step does to one pool (see ``pagedkv._page_table``).

Every sequence has a page list in every pool (``PkvSequence.pools[index]``);
the :class:`Pool` methods are what the page tables do to one such list, the
same for every pool.  What tells pools apart is data: the ``span`` of their
layers' queries (0: a query sees every earlier position, and the list keeps
every page; else a query at ``p`` sees ``p - span + 1 .. p``, and the list
gives back the leading pages, -1, that ``keep_from`` says no query needs any
more), ``rollback`` (tokens a rollback can always undo) and ``names`` (how
errors name the pool).  ``pagedkv.pools`` makes one from each ``PoolSpec``.
"""
import numpy as np
cimport cython
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from cython.operator cimport dereference as deref

from pagedkv._allocator cimport PageAllocator
from pagedkv.errors import OutOfPagesError

cnp.import_array()


cdef void release_pages(PageAllocator allocator, vector[int32_t]& pages,
                        int64_t keep) noexcept nogil:
    """Drop the pages past the first ``keep``, last page first, so that a freed
    chain enters the LRU end-first and loses its tail first."""
    while <int64_t>pages.size() > keep:
        if pages.back() != RELEASED:
            allocator.decref_page(pages.back())
        pages.pop_back()


cdef bint must_copy(PageAllocator allocator, vector[int32_t]& pages, int64_t length,
                    int64_t page_size, int64_t num_new,
                    unordered_map[int32_t, int32_t]& copies_of) noexcept nogil:
    """Does writing ``num_new`` tokens need a private copy of the last page first?

    Yes when that page is partly filled and either cached (its content is
    promised to later prefix hits) or held by a sequence other than the
    writers of this step that already copied it.
    """
    if num_new == 0 or length % page_size == 0:
        return False
    cdef int32_t last = pages.back()
    if allocator.entry_of(last) != 0:
        return True
    cdef int32_t holders = allocator.refcount_of(last)
    if holders == 1:
        return False
    it = copies_of.find(last)
    return holders - (deref(it).second if it != copies_of.end() else 0) > 1


cdef int32_t take_copy(PageAllocator allocator, vector[int32_t]& pages,
                       PkvPoolOut& out) noexcept nogil:
    """Give the sequence a new last page to copy its shared one into (recorded in
    the pool's copy lists); returns the shared page, whose reference the caller
    drops once the step's pages are all taken (so that no page of the step is
    the copy of a page it copies)."""
    cdef int32_t page = allocator.take_page(), source = pages.back()
    out.copy_src[out.num_copied] = source
    out.copy_dst[out.num_copied] = page
    out.num_copied += 1
    pages[pages.size() - 1] = page
    return source


cdef void grow(PageAllocator allocator, vector[int32_t]& pages, int64_t num_pages) noexcept nogil:
    """New pages at the end of one sequence's list in one pool, up to ``num_pages``."""
    while <int64_t>pages.size() < num_pages:
        pages.push_back(allocator.take_page())


cdef void write_tables(vector[int32_t]& pages, int64_t old_len, int64_t new_len, int64_t ps,
                       int64_t row, PkvPoolOut& out, int64_t indptr,
                       int64_t block_row) noexcept nogil:
    """The slots of positions old_len:new_len (from ``row`` on) and the CSR (from
    ``indptr``) and block-table (from ``block_row``) rows of one sequence in one pool."""
    cdef int64_t pos
    for pos in range(old_len, new_len):
        out.slot_mapping[row] = <int64_t>pages[pos // ps] * ps + pos % ps
        row += 1
    if pages.size():
        memcpy(out.page_indices + indptr, pages.data(), pages.size() * sizeof(int32_t))
        memcpy(out.block_table + block_row, pages.data(), pages.size() * sizeof(int32_t))


cdef class PoolTables:
    """One pool's tables of one ``append`` step (host numpy arrays).

    Attributes
    ----------
    slot_mapping : ndarray, shape [total_new], int64
        ``page * page_size + offset`` of each new token in this pool.
    page_indices : ndarray, shape [nnz], int32
        CSR page lists (rows by the step's ``page_indptr``); ``-1`` for pages
        given back.
    block_table : ndarray, shape [B, max_pages], int32
        Padded page table, ``-1`` past each sequence's pages (and for pages
        given back).
    copy_src, copy_dst : ndarray, shape [num_copies], int32
        Pages to copy (source to destination) in every layer of the pool
        before anything of the step is stored.
    """


cdef PoolTables new_pool_tables(PkvPoolOut& out, Py_ssize_t B, int64_t total_new, int64_t nnz,
                                int64_t max_pages, int64_t num_copies):
    """One pool's tables of a step, allocated; ``out``: where the commit writes them."""
    cdef PoolTables t = PoolTables.__new__(PoolTables)
    t.slot_mapping = np.empty(total_new, dtype=np.int64)
    t.page_indices = np.empty(nnz, dtype=np.int32)
    t.block_table = np.full((B, max_pages), -1, dtype=np.int32)
    t.copy_src = np.empty(num_copies, dtype=np.int32)
    t.copy_dst = np.empty(num_copies, dtype=np.int32)
    out.slot_mapping = <int64_t*>cnp.PyArray_DATA(t.slot_mapping)
    out.page_indices = <int32_t*>cnp.PyArray_DATA(t.page_indices)
    out.block_table = <int32_t*>cnp.PyArray_DATA(t.block_table)
    out.copy_src = <int32_t*>cnp.PyArray_DATA(t.copy_src)
    out.copy_dst = <int32_t*>cnp.PyArray_DATA(t.copy_dst)
    return t


@cython.final
cdef class Pool:
    """One pool of the page tables: its allocator, which pages a sequence may give
    back, and its part of the undo record of the last ``append`` (see the module
    notes).

    Parameters
    ----------
    allocator : PageAllocator
    index : int
        Its place in ``PageTables.pools`` (and in each sequence's page lists).
    span : int
        0 (a query sees every earlier position), or the most positions a query
        of the pool's layers sees, its own included.
    rollback : int, >= 1
        Tokens a rollback can always undo.
    names : object
        How errors name the pool: attributes ``noun`` ("pages"), ``where`` (""
        or " in the ... pool"), ``pool`` ("the ... pool"), ``hint`` (what sizes
        it, or ""), ``layers`` (its layers), ``span`` (what its span is) and
        ``rollback`` (the argument that sets ``rollback``); see
        ``pagedkv.pools.PoolNames``.
    """

    def __cinit__(self, PageAllocator allocator, int index, int64_t span, int64_t rollback,
                  names):
        self.allocator = allocator
        self.index = index
        self.span = span
        self.rollback = rollback
        self.gives_back = span > 0
        self.page_size = allocator.page_size
        self.names = names

    cpdef int64_t keep_from(self, int64_t old_len, int64_t new_len) noexcept nogil:
        """The oldest position a query of the pool may still need after a step
        old_len -> new_len (a rollback of up to ``rollback`` tokens included)."""
        if not self.gives_back:
            return 0
        cdef int64_t first = min(old_len, new_len - self.rollback)
        return max(<int64_t>0, first - self.span + 1)

    cdef int64_t first_held(self, int64_t first_page) noexcept nogil:
        """The first page a placed sequence holds here, when the pools that give
        pages back hold it from page ``first_page`` on."""
        return first_page if self.gives_back else 0

    cdef int check_first_held(self, int64_t length, int64_t first_page,
                              int64_t first_row) except -1:
        """ValueError unless a sequence of ``length`` tokens placed with its pages
        before ``first_page`` given back, and its rows from ``first_row`` on,
        still holds what its next query (at position ``length``) sees.  That
        keeps the page of its last token whenever that page is partly full: an
        append writes there, and a list without it would hand out page -1."""
        if not self.gives_back:
            return 0
        cdef int64_t sees_from = max(<int64_t>0, length - self.span + 1)
        cdef int64_t last = sees_from // self.page_size
        names = self.names
        if first_page > last:
            raise ValueError(
                f"first_page: a sequence of {length} tokens keeps{names.where} the K/V a "
                f"query at position {length} sees ({names.span} {self.span}), from position "
                f"{sees_from}, on page {last} of pages of {self.page_size} tokens; expected "
                f"first_page <= {last}, got {first_page}")
        if first_row > sees_from:
            raise ValueError(
                f"first_row: a sequence of {length} tokens keeps{names.where} the K/V a "
                f"query at position {length} sees ({names.span} {self.span}), from position "
                f"{sees_from}; expected first_row <= {sees_from}, got {first_row}")
        return 0

    cpdef str free_text(self, int64_t busy=0, bint hint=True):
        """How an error says what is free here (``busy`` of the free pages taken already)."""
        return (f"{self.allocator.num_free_pages - busy} of {self.allocator.num_pages} free"
                f"{self.names.where}{self.names.hint if hint else ''}")

    # -- one sequence's list -------------------------------------------------------
    cdef int start(self, PkvPages& own, int64_t first, int64_t num_pages,
                   int64_t first_row) except -1:
        """New pages for pages ``first:num_pages`` of a new list, the ones before it
        given back, holding rows from ``first_row`` on."""
        own.pages.assign(first, RELEASED)
        own.released = first
        own.first_row = first_row
        while <int64_t>own.pages.size() < num_pages:
            own.pages.push_back(self.allocator.take_page())
        return 0

    cdef int start_on(self, PkvPages& own, int64_t first, vector[int32_t]& found) except -1:
        """A new list that holds the cached pages ``found`` from page ``first`` on."""
        cdef size_t j
        own.pages.assign(first, RELEASED)
        own.released = first
        for j in range(found.size()):
            self.allocator.acquire(found[j])
            own.pages.push_back(found[j])
        return 0

    cdef void share(self, PkvPages& own) noexcept nogil:
        """One more holder of every page of the list (a fork)."""
        cdef size_t i
        for i in range(own.pages.size()):
            if own.pages[i] != RELEASED:
                self.allocator.incref_page(own.pages[i])

    cdef void drop(self, PkvPages& own) noexcept nogil:
        release_pages(self.allocator, own.pages, 0)
        own.released = 0
        own.first_row = 0

    cdef void truncate(self, PkvPages& own, int64_t num_pages) noexcept nogil:
        release_pages(self.allocator, own.pages, num_pages)
        own.released = min(own.released, <int64_t>own.pages.size())
        own.first_row = min(own.first_row, num_pages * self.page_size)

    cdef int check_rollback(self, PkvPages& own, int64_t length, int64_t new_len) except -1:
        """ValueError unless truncating to ``new_len`` keeps what the pool's queries need."""
        cdef int64_t held_from = rows_from(own, self.page_size)
        # a query at new_len (the first after the rollback) sees from new_len - span + 1;
        # only positions given back (before held_from) that it would see are missing
        if self.gives_back and 0 < new_len < length and \
                max(new_len - self.span + 1, <int64_t>0) < held_from:
            raise ValueError(
                f"new_len: {self.names.layers} gave back this sequence's K/V before position "
                f"{held_from}, and a query at position {new_len} would see from position "
                f"{max(new_len - self.span + 1, 0)}; it can be rolled back to "
                f"{held_from + self.span - 1} tokens at least, or to 0 (a larger "
                f"{self.names.rollback} keeps more)")
        return 0

    cdef int check_held(self, PkvPages& own, int64_t start, int64_t stop) except -1:
        """ValueError unless the list holds the rows of positions ``start:stop``."""
        if start < stop and start < rows_from(own, self.page_size):
            raise ValueError(f"positions {start}:{stop}: {self.names.pool} holds this "
                             f"sequence's K/V only from position "
                             f"{rows_from(own, self.page_size)}")
        return 0

    # -- prefix caching --------------------------------------------------------------
    cdef bint find_cached(self, PageAllocator chain, vector[int32_t]& found,
                          const int32_t* prompt, int64_t hit,
                          vector[int32_t]& out) noexcept nogil:
        """The cached pages a sequence starting on the first ``hit`` pages ``found``
        of the chain (in the first pool's allocator ``chain``) needs here (those at
        or after keep_from), into ``out``; False if any is missing."""
        cdef int64_t j, ps = self.page_size
        cdef int64_t length = hit * ps
        cdef int32_t page
        out.clear()
        for j in range(self.keep_from(length, length) // ps, hit):
            page = self.allocator.lookup(<uint64_t>chain.entry_of(found[j]), ROOT_ENTRY,
                                         &prompt[j * ps])
            if page < 0:
                return False
            out.push_back(page)
        return True

    cdef void cache_under(self, PkvPages& own, int64_t j, int64_t entry,
                          const int32_t* tokens) noexcept nogil:
        """Cache the list's page ``j`` (if held, with all its rows: not the first page
        of a list that begins mid-page) under ``entry``, the prefix-index entry of
        the chain's page at the same place."""
        if own.pages[j] != RELEASED and j * self.page_size >= own.first_row:
            self.allocator.cache_page(own.pages[j], <uint64_t>entry, ROOT_ENTRY, tokens)

    # -- one step: the plan (changes nothing) ---------------------------------------
    cdef void plan(self, PkvPoolPlan& plan, vector[PkvSequence*]& batch,
                   int64_t[::1] counts) noexcept nogil:
        """Each sequence's copy and new pages here, the pages the step gives back
        (only where the sequence gets new tokens), and how many of those it
        frees: those every holder gives back."""
        cdef Py_ssize_t b
        cdef int64_t ps = self.page_size, length
        cdef PkvPages* own
        for b in range(<Py_ssize_t>batch.size()):
            own = &batch[b].pools[self.index]
            length = batch[b].length
            plan.copy[b] = must_copy(self.allocator, own.pages, length, ps, counts[b],
                                     plan.copies_of)
            if plan.copy[b]:
                plan.copies_of[own.pages.back()] += 1
                plan.num_copies += 1
            plan.new_pages += pages_for(length + counts[b], ps) - <int64_t>own.pages.size()
            if counts[b]:
                self.count_releases(deref(own), length, length + counts[b], plan.releases)
        for kv in plan.releases:
            plan.freed += self.allocator.refcount_of(kv.first) == kv.second

    cdef void count_releases(self, PkvPages& own, int64_t old_len, int64_t new_len,
                             unordered_map[int32_t, int32_t]& releases) noexcept nogil:
        """Count, per page, the references a step old_len -> new_len gives back (a
        page shared by sequences of the step may lose several)."""
        cdef int64_t j
        cdef int64_t upto = min(self.keep_from(old_len, new_len) // self.page_size,
                                <int64_t>own.pages.size())
        for j in range(own.released, upto):
            if own.pages[j] != RELEASED:
                releases[own.pages[j]] += 1

    cdef int check_room(self, PkvPoolPlan& plan) except -1:
        """OutOfPagesError unless the pool can give what the plan takes: its copies
        are taken before the pages the step gives back are free."""
        cdef int64_t free = self.allocator.num_free_pages
        if plan.num_copies > free or plan.num_copies + plan.new_pages - plan.freed > free:
            raise OutOfPagesError(
                f"append: this step needs {plan.num_copies + plan.new_pages} new "
                f"{self.names.noun}"
                + (f" ({plan.num_copies} of them copies of shared pages, taken before the "
                   f"{plan.freed} it gives back are free)" if self.gives_back else "")
                + f", {self.free_text()}")
        return 0

    # -- one step: the commit (cannot fail) ---------------------------------------------
    cdef void commit(self, PkvPoolPlan& plan, vector[PkvSequence*]& batch, int64_t[::1] counts,
                     PkvPoolOut& out, int64_t max_pages) noexcept nogil:
        """The pool's part of the step: its copies, the pages it gives back, new
        pages and its tables (``out``), each change recorded for ``undo_commit``.

        A pool that gives pages back takes its copies' destinations first, then
        gives back, then takes the new pages: so a copy never writes a page
        this step gave back (undoing the step finds those as they were), and
        the room given back serves the new pages.  One that gives nothing back
        takes each sequence's copy and new pages in turn."""
        cdef Py_ssize_t b, B = batch.size()
        cdef int64_t ps = self.page_size, row = 0, indptr = 0, length
        cdef bint copies_first = self.gives_back
        cdef PkvPages* own
        cdef PkvUndoPages* u
        for b in range(B):
            own = &batch[b].pools[self.index]
            u = &self.undo[b]
            u.num_pages = own.pages.size()
            u.released = own.released
            u.copy_source = -1
        if copies_first:
            for b in range(B):
                if plan.copy[b]:
                    self.undo[b].copy_source = take_copy(
                        self.allocator, batch[b].pools[self.index].pages, out)
            for b in range(B):
                if counts[b]:
                    length = batch[b].length
                    self.give_back(batch[b].pools[self.index],
                                   self.keep_from(length, length + counts[b]), b)
        for b in range(B):
            own = &batch[b].pools[self.index]
            length = batch[b].length
            if plan.copy[b] and not copies_first:
                self.undo[b].copy_source = take_copy(self.allocator, own.pages, out)
            grow(self.allocator, own.pages, pages_for(length + counts[b], ps))
            write_tables(own.pages, length, length + counts[b], ps, row, out, indptr,
                         b * max_pages)
            row += counts[b]
            indptr += own.pages.size()
        # the shared pages copied, let go now that the step's pages are all taken
        for b in range(out.num_copied):
            self.allocator.decref_page(out.copy_src[b])

    cdef void give_back(self, PkvPages& own, int64_t keep_from, int64_t b) noexcept nogil:
        """Give back the list's pages wholly before position ``keep_from``, keeping
        each in ``undo_released`` (``b``: the sequence's place in the step)."""
        cdef int64_t upto = min(keep_from // self.page_size, <int64_t>own.pages.size())
        cdef PkvReleased entry
        while own.released < upto:
            if own.pages[own.released] != RELEASED:
                entry.b = b
                entry.index = own.released
                entry.page = own.pages[own.released]
                self.undo_released.push_back(entry)
                self.allocator.decref_page(entry.page)
                own.pages[own.released] = RELEASED
            own.released += 1

    cdef void undo_commit(self, vector[PkvSequence*]& batch) noexcept nogil:
        """Take back ``commit``, its steps in reverse: the copies' sources held
        again, new pages dropped, pages given back taken back, copies dropped
        (in the order ``commit`` took them, so the free queue is as before)."""
        cdef Py_ssize_t b, i, B = batch.size()
        cdef bint copies_first = self.gives_back
        cdef PkvPages* own
        cdef PkvUndoPages* u
        for b in range(B - 1, -1, -1):
            if self.undo[b].copy_source >= 0:
                self.allocator.hold(self.undo[b].copy_source)
        for b in range(B - 1, -1, -1):
            own = &batch[b].pools[self.index]
            release_pages(self.allocator, own.pages, self.undo[b].num_pages)
            if not copies_first:
                self.undo_copy(own.pages, self.undo[b].copy_source)
        for i in range(<Py_ssize_t>self.undo_released.size() - 1, -1, -1):
            own = &batch[self.undo_released[i].b].pools[self.index]
            self.allocator.hold(self.undo_released[i].page)
            own.pages[self.undo_released[i].index] = self.undo_released[i].page
        for b in range(B - 1, -1, -1):
            own = &batch[b].pools[self.index]
            own.released = self.undo[b].released
            if copies_first:
                self.undo_copy(own.pages, self.undo[b].copy_source)
        self.undo_released.clear()

    cdef void undo_copy(self, vector[int32_t]& pages, int32_t source) noexcept nogil:
        """The shared page ``source`` last again, instead of its copy (if it had one)."""
        if source >= 0:
            self.allocator.decref_page(pages.back())
            pages[pages.size() - 1] = source


