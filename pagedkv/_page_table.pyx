# distutils: language = c++
"""Per-sequence page tables and the per-step tables kernels read.

Each sequence owns an ordered list of page ids in every pool and a length.
``append`` reserves the slots for one step, all or nothing, copying a shared
or cached last page first (copy-on-write), and builds every table format an
engine may want: the slot mapping (vLLM), the CSR page table (FlashInfer,
TVM) and the padded block table.

Pools (see ``pagedkv.pools``): the page tables hold one :class:`Pool` per
pool of the cache (``PageTables.pools``, indexed like the pools, and each
sequence's page lists in the same order).  A pool is its allocator and its
rule for which pages a sequence may give back; the pools differ only in
that data.  A sequence's page list has as many entries in every pool.  The
first pool is full attention: it keeps every page, and holds the prefix
chain.  A pool with a window (the sliding-window layers, a window of at most
``window`` positions) gives back the leading pages (-1) no later query can
see: after a step from ``L0`` to ``L`` tokens, every page wholly before
``keep_from = min(L0, L - rollback) - window + 1`` goes back to the pool, so
a rollback of up to ``rollback`` tokens still finds what its queries need.

With prefix caching, a sequence also keeps its token ids and the hash chain
of its full pages (``hash(parent page's hash, page's token ids)``).  A page
that a step fills is entered in the allocator's prefix index only once that
step's K/V is stored in every layer (``close_step``).  A step abandoned
before that (another append, a truncate, a free) leaves nothing reusable:
its pages are not cached, and its sequences forget the step's tokens, so
that no later page holding those unwritten positions is cached either
(they cache again once truncated back below them).  A page of another pool
is cached under the prefix-index entry of the first pool's page at the same
place in the chain, which identifies its content exactly.

Sequences that leave the cache (see the last block of ``PageTables``): a
sequence made for K/V that come from elsewhere (``adopt``) gets new pages,
its window pages before its first needed position given back from the
start; a swapped-out sequence keeps its id, length and token ids but no
pages: it sits in ``swapped`` instead of the sequence map, so no table of it
can reach a kernel, and ``find`` says it is swapped out.  Placing K/V
(``adopt``, ``swap_in``, ``add_cached_chains``) is three calls, as a step
is: the call reserves the pages, all or nothing; the caller writes the K/V;
then ``commit_place`` / ``commit_cached_chains`` enter them in the prefix
cache, or ``undo_place`` / ``undo_cached_chains`` take everything back.
"""
import numbers

import numpy as np
cimport cython
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy
from cpython.dict cimport PyDict_Clear
from cpython.ref cimport PyObject
from libcpp.pair cimport pair
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from cython.operator cimport dereference as deref

from pagedkv._allocator cimport PageAllocator
from pagedkv.errors import OutOfPagesError, UnknownSequenceError

cnp.import_array()


cdef extern from *:
    """
    #include <vector>
    #include <cstdint>
    #include <unordered_map>
    // one sequence's page list in one pool; the first `released` entries are
    // -1 (given back: only a pool with a window gives pages back).  It holds
    // the rows from position first_row on, in page `released` or later: a
    // sequence placed with K/V that begin mid-page (an import) lacks the rows
    // of its first page before it
    struct PkvPages {
        std::vector<int32_t> pages;
        int64_t released = 0;
        int64_t first_row = 0;
    };
    struct PkvSequence {
        std::vector<PkvPages> pools;   // indexed like PageTables.pools
        int64_t length = 0;
        int64_t last_step = -1;   // the append call that last named it (duplicate check)
        // prefix caching only: the token ids (known while tokens.size() ==
        // length) and the hash of each full page, in order
        std::vector<int32_t> tokens;
        std::vector<uint64_t> hashes;
    };
    // a page a step filled, waiting for its K/V to be stored before it is cached
    struct PkvPendingPage {
        int64_t seq_id;
        int64_t index;            // position of the page in the sequence's list
        uint64_t hash;
    };
    // what one sequence of the last append was before it (see PageTables.undo_append)
    struct PkvUndoSeq {
        int64_t seq_id;
        int64_t length;
        int64_t num_tokens;
        int64_t num_hashes;
    };
    // ... and its page list in one pool
    struct PkvUndoPages {
        int64_t num_pages;
        int64_t released;
        int32_t copy_source;      // the shared last page it copied, or -1
    };
    // a page the last append gave back: entry `index` of sequence `b`
    struct PkvReleased {
        int64_t b;
        int64_t index;
        int32_t page;
    };
    // the tokens and hashes an abandoned step made a sequence forget
    struct PkvForgotten {
        int64_t seq_id;
        std::vector<int32_t> tokens;
        std::vector<uint64_t> hashes;
    };
    static inline void pkv_forget(std::vector<PkvForgotten>& out, int64_t seq_id,
                                  PkvSequence& seq, size_t num_tokens, size_t num_hashes) {
        PkvForgotten f;
        f.seq_id = seq_id;
        if (seq.tokens.size() > num_tokens)
            f.tokens.assign(seq.tokens.begin() + num_tokens, seq.tokens.end());
        if (seq.hashes.size() > num_hashes)
            f.hashes.assign(seq.hashes.begin() + num_hashes, seq.hashes.end());
        out.push_back(f);
    }
    static inline void pkv_remember(PkvForgotten& f, PkvSequence& seq) {
        seq.tokens.insert(seq.tokens.end(), f.tokens.begin(), f.tokens.end());
        seq.hashes.insert(seq.hashes.end(), f.hashes.begin(), f.hashes.end());
    }
    // what an append's plan found and counted in one pool, before anything changes
    struct PkvPoolPlan {
        std::vector<char> copy;                     // per sequence: copy its last page
        // copies per shared page: the last writer of a page shared only within
        // the step keeps it instead of copying
        std::unordered_map<int32_t, int32_t> copies_of;
        // references to pages the step gives back, per page
        std::unordered_map<int32_t, int32_t> releases;
        int64_t num_copies = 0, new_pages = 0, freed = 0;
    };
    // ... and in every pool
    struct PkvStepPlan {
        std::vector<PkvSequence*> batch;
        std::vector<std::vector<uint64_t>> hashes;  // per sequence: of the pages it fills
        std::vector<PkvPoolPlan> pools;
        int64_t total_new = 0, nnz = 0, max_pages = 0;
    };
    // where the commit writes one pool's tables (into the arrays append returns)
    struct PkvPoolOut {
        int64_t* slot_mapping = nullptr;
        int32_t* page_indices = nullptr;
        int32_t* block_table = nullptr;     // [B, max_pages]
        int32_t* copy_src = nullptr;
        int32_t* copy_dst = nullptr;
        int64_t num_copied = 0;
    };
    // where the commit writes the step's tables: those the pools share, and each pool's
    struct PkvStepOut {
        int32_t* query_start = nullptr;
        int32_t* seq_lens = nullptr;
        int32_t* page_indptr = nullptr;
        int32_t* last_page_len = nullptr;
        int64_t max_pages = 0;
        std::vector<PkvPoolOut> pools;
    };
    """
    cdef cppclass PkvPages:
        PkvPages() except +
        vector[int32_t] pages
        int64_t released
        int64_t first_row
    cdef cppclass PkvSequence:
        PkvSequence() except +
        vector[PkvPages] pools
        int64_t length
        int64_t last_step
        vector[int32_t] tokens
        vector[uint64_t] hashes
    cdef cppclass PkvPendingPage:
        int64_t seq_id
        int64_t index
        uint64_t hash
    cdef cppclass PkvUndoSeq:
        int64_t seq_id
        int64_t length
        int64_t num_tokens
        int64_t num_hashes
    cdef cppclass PkvUndoPages:
        int64_t num_pages
        int64_t released
        int32_t copy_source
    cdef cppclass PkvReleased:
        int64_t b
        int64_t index
        int32_t page
    cdef cppclass PkvForgotten:
        int64_t seq_id
    cdef cppclass PkvPoolPlan:
        vector[char] copy
        unordered_map[int32_t, int32_t] copies_of
        unordered_map[int32_t, int32_t] releases
        int64_t num_copies, new_pages, freed
    cdef cppclass PkvStepPlan:
        vector[PkvSequence*] batch
        vector[vector[uint64_t]] hashes
        vector[PkvPoolPlan] pools
        int64_t total_new, nnz, max_pages
    cdef cppclass PkvPoolOut:
        int64_t* slot_mapping
        int32_t* page_indices
        int32_t* block_table
        int32_t* copy_src
        int32_t* copy_dst
        int64_t num_copied
    cdef cppclass PkvStepOut:
        int32_t* query_start
        int32_t* seq_lens
        int32_t* page_indptr
        int32_t* last_page_len
        int64_t max_pages
        vector[PkvPoolOut] pools
    void pkv_forget(vector[PkvForgotten]& out, int64_t seq_id, PkvSequence& seq,
                    size_t num_tokens, size_t num_hashes) nogil
    void pkv_remember(PkvForgotten& f, PkvSequence& seq) nogil

cdef extern from "pkv_hash.h" nogil:
    uint64_t pkv_hash_page(uint64_t parent_hash, const int32_t* tokens, int n)

# The chain's root: the "parent hash" of every sequence's first page, and the
# parent entry that marks a first page in the prefix index.
cdef uint64_t ROOT_HASH = 0
cdef int64_t ROOT_ENTRY = -1
cdef int32_t RELEASED = -1


cdef inline int64_t rows_from(const PkvPages& own, int64_t page_size) noexcept nogil:
    """The first position whose rows the list ``own`` holds."""
    return max(own.released * page_size, own.first_row)


cdef inline int64_t pages_for(int64_t num_tokens, int64_t page_size) noexcept nogil:
    return (num_tokens + page_size - 1) // page_size


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
        CSR page lists (rows by the step's ``page_indptr``); ``-1`` for window
        pages given back.
    block_table : ndarray, shape [B, max_pages], int32
        Padded page table, ``-1`` past each sequence's pages (and for window
        pages given back).
    copy_src, copy_dst : ndarray, shape [num_copies], int32
        Pages to copy (source to destination) in every layer of the pool
        before anything of the step is stored.
    """
    cdef readonly cnp.ndarray slot_mapping, page_indices, block_table, copy_src, copy_dst


cdef class AppendTables:
    """The tables of one ``append`` step: those the pools share, and each pool's.

    Attributes
    ----------
    query_start : ndarray, shape [B+1], int32
    seq_lens : ndarray, shape [B], int32
    page_indptr : ndarray, shape [B+1], int32
    last_page_len : ndarray, shape [B], int32
        A sequence's page list has as many entries in every pool, so the CSR
        row pointers and last-page lengths serve them all.
    pools : tuple of PoolTables
        Each pool's tables, indexed like ``PageTables.pools``.
    full : PoolTables
        The full-attention pool's tables (``pools[0]``).
    window : PoolTables or None
        The window pool's (``pools[1]``; None without one).
    """
    cdef readonly cnp.ndarray query_start, seq_lens, page_indptr, last_page_len
    cdef readonly tuple pools
    cdef readonly PoolTables full, window


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
    back, and its part of the undo record of the last ``append``.

    Every sequence has a page list in every pool (``PkvSequence.pools[index]``);
    the methods here are what the page tables do to one such list, the same
    for every pool.  What tells the pools apart is data: ``window`` (0 for full
    attention, whose lists keep every page; else the largest window of the
    pool's layers, whose lists give back what ``keep_from`` says no query
    needs any more), ``rollback`` (tokens a rollback can always undo), and
    how errors name the pool.

    Parameters
    ----------
    allocator : PageAllocator
    index : int
        Its place in ``PageTables.pools`` (and in each sequence's page lists).
    window : int
        0, or the largest window of the pool's layers.
    rollback : int, >= 1
    noun, where, hint : str
        How errors name its pages ("pages", "window pages"), the pool ("" or
        " in the ... pool") and what sizes it (a parenthesis, or "").
    """
    cdef readonly PageAllocator allocator
    cdef readonly int index
    cdef readonly int64_t window
    cdef readonly int64_t rollback
    cdef readonly bint gives_back      # window > 0
    cdef int64_t page_size
    cdef str noun, where, hint
    # the last append's changes to this pool, per sequence of it, and the pages
    # it gave back (for PageTables.undo_append)
    cdef vector[PkvUndoPages] undo
    cdef vector[PkvReleased] undo_released

    def __cinit__(self, PageAllocator allocator, int index, int64_t window, int64_t rollback,
                  str noun, str where, str hint):
        self.allocator = allocator
        self.index = index
        self.window = window
        self.rollback = rollback
        self.gives_back = window > 0
        self.page_size = allocator.page_size
        self.noun = noun
        self.where = where
        self.hint = hint

    cdef inline int64_t keep_from(self, int64_t old_len, int64_t new_len) noexcept nogil:
        """The oldest position a query of the pool may still need after a step
        old_len -> new_len (a rollback of up to ``rollback`` tokens included)."""
        if not self.gives_back:
            return 0
        cdef int64_t first = min(old_len, new_len - self.rollback)
        return max(<int64_t>0, first - self.window + 1)

    cdef inline int64_t first_held(self, int64_t window_from) noexcept nogil:
        """The first page an imported sequence holds here, when what a window
        needs of it starts at page ``window_from``."""
        return window_from if self.gives_back else 0

    cdef int check_first_held(self, int64_t length, int64_t window_from,
                              int64_t first_row) except -1:
        """ValueError unless a sequence of ``length`` tokens placed with its pages
        before ``window_from`` given back, and its rows from ``first_row`` on,
        still holds what its next query (at position ``length``) sees.  That
        keeps the page of its last token whenever that page is partly full: an
        append writes there, and a list without it would hand out page -1."""
        if not self.gives_back:
            return 0
        cdef int64_t sees_from = max(<int64_t>0, length - self.window + 1)
        cdef int64_t last = sees_from // self.page_size
        if window_from > last:
            raise ValueError(
                f"window_from: a sequence of {length} tokens keeps{self.where} the K/V a "
                f"query at position {length} sees (window {self.window}), from position "
                f"{sees_from}, on page {last} of pages of {self.page_size} tokens; expected "
                f"window_from <= {last}, got {window_from}")
        if first_row > sees_from:
            raise ValueError(
                f"first_row: a sequence of {length} tokens keeps{self.where} the K/V a "
                f"query at position {length} sees (window {self.window}), from position "
                f"{sees_from}; expected first_row <= {sees_from}, got {first_row}")
        return 0

    cdef str free_text(self, int64_t busy=0, bint hint=True):
        """How an error says what is free here (``busy`` of the free pages taken already)."""
        return (f"{self.allocator.num_free_pages - busy} of {self.allocator.num_pages} free"
                f"{self.where}{self.hint if hint else ''}")

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
        # a query at new_len (the first after the rollback) sees from new_len - window + 1;
        # only positions given back (before held_from) that it would see are missing
        if 0 < new_len < length and max(new_len - self.window + 1, <int64_t>0) < held_from:
            raise ValueError(
                f"new_len: the windowed layers gave back this sequence's K/V before position "
                f"{held_from}, and a query at position {new_len} would see from position "
                f"{max(new_len - self.window + 1, 0)}; it can be rolled back to "
                f"{held_from + self.window - 1} tokens at least, or to 0 (a larger "
                f"window_rollback_tokens keeps more)")
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
                f"append: this step needs {plan.num_copies + plan.new_pages} new {self.noun}"
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

    cdef inline void undo_copy(self, vector[int32_t]& pages, int32_t source) noexcept nogil:
        """The shared page ``source`` last again, instead of its copy (if it had one)."""
        if source >= 0:
            self.allocator.decref_page(pages.back())
            pages[pages.size() - 1] = source


cdef class PageTables:
    """The page tables of every live sequence, over one :class:`PageAllocator` per pool.

    Parameters
    ----------
    allocator : PageAllocator
        The full-attention pool (it holds the prefix chain); its ``page_size``
        and ``prefix_caching`` apply.
    hash_fn : callable, optional
        ``hash_fn(parent_hash: int, token_ids: tuple) -> int`` replaces the
        default page hash (e.g. to force collisions in tests).
    window_allocator : PageAllocator, optional
        The pool of the windowed layers; with it, ``window`` and ``rollback``.
    window : int
        The largest window of any windowed layer.
    rollback : int, >= 1
        Tokens a sequence can always be rolled back by (see the module notes).

    Attributes
    ----------
    pools : tuple of Pool
        The full-attention pool, then the window pool if there is one.
    """
    cdef readonly tuple pools
    # ``pools``, borrowed (the tuple holds them), for the loops that run without the GIL
    cdef vector[PyObject*] pool_refs
    cdef PageAllocator allocator          # pools[0]'s: the prefix chain's
    cdef PkvPages no_pages                # an empty list: a sequence's in a pool not here
    cdef readonly int64_t window
    cdef readonly int64_t rollback
    cdef readonly int page_size
    cdef bint caching
    cdef object hash_fn
    cdef unordered_map[int64_t, PkvSequence] seqs
    # the open step: pages it filled (cached once it is stored in every layer)
    # and its sequences' lengths before it (forgotten tokens if abandoned)
    cdef vector[PkvPendingPage] pending
    cdef vector[pair[int64_t, int64_t]] open_seqs
    cdef readonly int64_t next_id        # the id the next new sequence gets
    cdef int64_t num_steps
    cdef readonly int64_t num_prompt_tokens    # passed to add(token_ids=...)
    cdef readonly int64_t num_reused_tokens    # of those, found in the prefix cache
    cdef dict swapped                         # swapped-out id -> (length, known token ids)
    # how to undo the last append (``undo_append``), while ``undo_armed``; each
    # pool keeps its own part
    cdef bint undo_armed
    cdef vector[PkvSequence*] undo_batch
    cdef vector[PkvUndoSeq] undo_seqs
    cdef vector[PkvForgotten] undo_forgotten
    cdef vector[PkvPendingPage] undo_pending
    cdef vector[pair[int64_t, int64_t]] undo_open_seqs
    # the sequence ``adopt`` or ``swap_in`` placed last, while its K/V are being
    # written (-1: none), and its swapped-out entry (None: it was adopted)
    cdef int64_t placing
    cdef object placing_swapped
    # what ``add_cached_chains`` reserved, while its K/V are being written (None:
    # nothing): token ids, parents, hashes, the pages held and those new
    cdef tuple chains_pending

    def __cinit__(self, PageAllocator allocator, hash_fn=None,
                  PageAllocator window_allocator=None, int64_t window=0, int64_t rollback=1):
        cdef Pool pool
        pools = [Pool(allocator, 0, 0, rollback, "pages",
                      "" if window_allocator is None else " in the full-attention pool", "")]
        if window_allocator is not None:
            pools.append(Pool(window_allocator, 1, window, rollback, "window pages",
                              " in the window pool",
                              " (the sliding-window layers; num_window_pages)"))
        self.pools = tuple(pools)
        for pool in self.pools:
            self.pool_refs.push_back(<PyObject*>pool)
        self.allocator = allocator
        self.window = window
        self.rollback = rollback
        self.page_size = allocator.page_size
        self.caching = allocator.prefix_caching
        self.hash_fn = hash_fn
        self.next_id = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_reused_tokens = 0
        self.swapped = {}
        self.undo_armed = False
        self.placing = -1

    cdef uint64_t page_hash(self, uint64_t parent_hash, const int32_t* tokens) except? 0:
        if self.hash_fn is None:
            return pkv_hash_page(parent_hash, tokens, self.page_size)
        value = self.hash_fn(parent_hash, tuple([tokens[i] for i in range(self.page_size)]))
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"prefix_hash: expected it to return an int, got "
                            f"{type(value).__name__} {value!r}"[:200])
        return <uint64_t>(int(value) & 0xFFFFFFFFFFFFFFFF)

    cdef PkvSequence* find(self, seq_id) except NULL:
        """The live sequence ``seq_id`` (any Python object), or UnknownSequenceError."""
        if not isinstance(seq_id, (int, np.integer)) or isinstance(seq_id, bool):
            raise UnknownSequenceError(f"seq_id: expected an int sequence id, got {seq_id!r}")
        if not -2**63 <= seq_id < 2**63:
            raise UnknownSequenceError(f"seq_id: no live sequence {seq_id!r} (never added, or freed)")
        return self.find_id(seq_id)

    cdef PkvSequence* find_id(self, int64_t seq_id) except NULL:
        it = self.seqs.find(seq_id)
        if it == self.seqs.end():
            if seq_id in self.swapped:
                raise ValueError(f"seq_id: sequence {seq_id} is swapped out (its K/V wait in "
                                 f"host memory); swap_in({seq_id}) first")
            raise UnknownSequenceError(f"seq_id: no live sequence {seq_id} (never added, or freed)")
        return &deref(it).second

    cdef PkvPages* pool_pages(self, PkvSequence* seq, bint window) noexcept nogil:
        """The sequence's list in the full pool or (``window``) the window pool;
        an empty one when the cache has no such pool."""
        cdef size_t p = window
        return &seq.pools[p] if p < seq.pools.size() else &self.no_pages

    # -- sequences ---------------------------------------------------------------
    def add(self, token_ids=None):
        """Create a sequence; return its id (ids are never reused).

        With prefix caching and ``token_ids`` (the prompt, int32 [n]), the
        sequence starts on the longest cached chain of full pages of the
        prompt, short of its last token, whose K/V in every other pool (what
        a window at its end sees) is cached too; ``seq_len`` tells how many
        tokens that covers.  Nothing is reserved for the rest.
        """
        cdef PkvSequence seq
        cdef int32_t[::1] prompt
        cdef int64_t j, hit, num_full, ps = self.page_size
        cdef int64_t parent_entry = ROOT_ENTRY
        cdef uint64_t h = ROOT_HASH
        cdef vector[uint64_t] chain
        cdef vector[vector[int32_t]] found     # per pool: the cached pages it starts on
        cdef int32_t page
        cdef Pool pool
        seq.pools.resize(len(self.pools))
        if self.caching and token_ids is not None:
            prompt = token_ids
            num_full = (prompt.shape[0] - 1) // ps if prompt.shape[0] else 0
            # hash first: a user hash function may raise, and nothing is held yet
            for j in range(num_full):
                h = self.page_hash(h, &prompt[j * ps])
                chain.push_back(h)
            found.resize(len(self.pools))
            for j in range(num_full):
                page = self.allocator.lookup(chain[j], parent_entry, &prompt[j * ps])
                if page < 0:
                    break
                found[0].push_back(page)
                parent_entry = self.allocator.entry_of(page)
            hit = found[0].size()
            while hit > 0 and not self.find_cached(found, &prompt[0], hit):
                hit -= 1        # another pool's K/V at that end is gone: a shorter hit
            found[0].resize(hit)
            for pool in self.pools:
                pool.start_on(seq.pools[pool.index], hit - <int64_t>found[pool.index].size(),
                              found[pool.index])
            for j in range(hit):
                seq.hashes.push_back(chain[j])
            seq.length = hit * ps
            seq.tokens.assign(&prompt[0], &prompt[0] + seq.length) if seq.length else None
            self.num_prompt_tokens += prompt.shape[0]
            self.num_reused_tokens += seq.length
        cdef int64_t seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = seq
        return seq_id

    cdef bint find_cached(self, vector[vector[int32_t]]& found, const int32_t* prompt,
                          int64_t hit) noexcept nogil:
        """The cached pages of every pool but the first that a sequence starting on
        the chain's first ``hit`` pages ``found[0]`` needs, into ``found``; False
        if any is missing."""
        cdef size_t p
        for p in range(1, self.pool_refs.size()):
            if not (<Pool>self.pool_refs[p]).find_cached(self.allocator, found[0], prompt, hit,
                                                         found[p]):
                return False
        return True

    def fork(self, parent_id):
        """A new sequence sharing every page of ``parent_id`` (ref counts only)."""
        cdef PkvSequence* parent = self.find(parent_id)
        cdef int64_t child_id = self.next_id
        cdef size_t i
        for i in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[i]).share(parent.pools[i])
        for i in range(self.open_seqs.size()):   # the child shares the open step's fate
            if self.open_seqs[i].first == <int64_t>parent_id:
                self.open_seqs.push_back(pair[int64_t, int64_t](child_id, self.open_seqs[i].second))
                break
        self.next_id += 1
        self.seqs[child_id] = deref(parent)   # copies the page lists, not the pages
        return child_id

    cdef void drop(self, PkvSequence* seq) noexcept nogil:
        cdef size_t p
        for p in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).drop(seq.pools[p])

    def free(self, seq_id, tuple also=()):
        """Drop the sequence; its pages go back to the pool once no one shares them.

        ``also``: dicts (the caller's own records of sequences, by int id) to
        drop ``seq_id`` from once it is gone, through the C API only, so that
        nothing (not even a RecursionError) can raise between the two.
        """
        cdef PkvSequence* seq
        cdef dict records
        key = int(seq_id) if self.swapped_entry(seq_id) is not None else None
        if key is not None:
            del self.swapped[key]
        else:
            seq = self.find(seq_id)
            key = int(seq_id)
            self.abandon_step()
            self.drop(seq)
            self.seqs.erase(<int64_t>seq_id)
        for records in also:
            if key in records:
                del records[key]

    def clear(self, tuple also=()):
        """Free every sequence; ``also``: dicts to empty with them (as in ``free``)."""
        cdef dict records
        self.abandon_step()
        for kv in self.seqs:
            self.drop(&kv.second)
        self.seqs.clear()
        PyDict_Clear(self.swapped)
        for records in also:
            PyDict_Clear(records)

    def __contains__(self, seq_id):
        if self.swapped_entry(seq_id) is not None:
            return True
        try:
            self.find(seq_id)
        except UnknownSequenceError:
            return False
        return True

    def __len__(self):
        return self.seqs.size() + len(self.swapped)

    def ids(self):
        """Ids of the live sequences (swapped-out ones included), ascending."""
        return sorted([kv.first for kv in self.seqs] + list(self.swapped))

    def seq_len(self, seq_id):
        """Tokens stored in the sequence (swapped out or not)."""
        if self.swapped:
            entry = self.swapped_entry(seq_id)
            if entry is not None:
                return entry[0]
        return self.find(seq_id).length

    def pages(self, seq_id, bint window=False):
        """The sequence's page ids in order (``window``: in the window pool, -1 for
        pages given back); ndarray, shape [num_pages], int32 (a copy)."""
        cdef vector[int32_t]* pages = &self.pool_pages(self.find(seq_id), window).pages
        out = np.empty(pages.size(), dtype=np.int32)
        cdef int32_t[::1] view = out
        cdef size_t i
        for i in range(pages.size()):
            view[i] = deref(pages)[i]
        return out

    def window_held_from(self, seq_id):
        """The first position whose window-pool K/V the sequence still holds."""
        cdef PkvSequence* seq = self.find(seq_id)
        return min(rows_from(self.pool_pages(seq, True)[0], self.page_size), seq.length)

    def slots(self, seq_id, int64_t start, int64_t stop, bint window=False):
        """Slots (``page * page_size + offset``) of positions ``start:stop``, in the
        full pool or (``window``) the window pool.

        Returns
        -------
        slots : ndarray, shape [stop - start], int64
        """
        cdef PkvSequence* seq = self.find(seq_id)
        cdef PkvPages* own = self.pool_pages(seq, window)
        if not 0 <= start <= stop <= seq.length:
            raise ValueError(f"positions {start}:{stop}: expected 0 <= start <= stop <= "
                             f"seq_len={seq.length}")
        if start < stop and start < rows_from(own[0], self.page_size):
            raise ValueError(f"positions {start}:{stop}: the window pool holds this sequence's "
                             f"K/V only from position {rows_from(own[0], self.page_size)}")
        out = np.empty(stop - start, dtype=np.int64)
        cdef int64_t[::1] view = out
        cdef int64_t pos, ps = self.page_size
        for pos in range(start, stop):
            view[pos - start] = <int64_t>own.pages[pos // ps] * ps + pos % ps
        return out

    def check_rollback(self, seq_id, int64_t new_len):
        """ValueError unless truncating to ``new_len`` keeps what every pool's queries need."""
        cdef PkvSequence* seq = self.find(seq_id)
        cdef Pool pool
        for pool in self.pools:
            pool.check_rollback(seq.pools[pool.index], seq.length, new_len)

    def truncate(self, seq_id, int64_t new_len):
        """Shorten the sequence to ``new_len`` tokens; pages past it are released."""
        cdef PkvSequence* seq = self.find(seq_id)
        cdef size_t p
        if not 0 <= new_len <= seq.length:
            raise ValueError(f"new_len: expected 0 <= new_len <= seq_len={seq.length}, got {new_len}")
        self.check_rollback(seq_id, new_len)
        self.abandon_step()
        for p in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).truncate(seq.pools[p], pages_for(new_len, self.page_size))
        seq.length = new_len
        if <int64_t>seq.tokens.size() > new_len:
            seq.tokens.resize(new_len)
        if <int64_t>seq.hashes.size() > new_len // self.page_size:
            seq.hashes.resize(new_len // self.page_size)

    def held_pages(self, seq_id):
        """Pages the sequence holds in the window pool."""
        cdef PkvPages* own = self.pool_pages(self.find(seq_id), True)
        return <int64_t>own.pages.size() - own.released

    # -- one step ----------------------------------------------------------------
    cdef int new_page_hashes(self, PkvSequence* seq, int64_t num_new, const int32_t* new_tokens,
                             vector[uint64_t]& out) except -1:
        """Hashes of the pages this step fills, for a sequence whose tokens are known."""
        cdef int64_t ps = self.page_size, j, i, pos
        cdef int64_t old_len = seq.length
        cdef vector[int32_t] page_tokens
        cdef uint64_t parent = seq.hashes.back() if seq.hashes.size() else ROOT_HASH
        page_tokens.resize(ps)
        out.clear()
        for j in range(<int64_t>seq.hashes.size(), (old_len + num_new) // ps):
            for i in range(ps):
                pos = j * ps + i
                page_tokens[i] = seq.tokens[pos] if pos < old_len else new_tokens[pos - old_len]
            parent = self.page_hash(parent, page_tokens.data())
            out.push_back(parent)
        return 0

    def append(self, seq_ids, num_new_tokens, max_seq_len=None, token_ids=None):
        """Reserve slots for ``num_new_tokens[b]`` new tokens of each ``seq_ids[b]``.

        All or nothing, over every pool: on any error no sequence or page
        changes, and once it has returned ``undo_append`` takes it back.  A
        sequence whose last page is partly filled and shared (or cached)
        gets a private copy of it first; the (source, destination) pairs are
        returned so that the backend copies the data before anything is
        stored.  Window pages no later query can see are given back before
        the step's new pages are taken, so their room serves this step.

        Two phases, each in named steps.  A plan that changes nothing:
        ``plan_step`` validates, hashes the pages the step fills (a user hash
        function may raise) and has each pool count what it must give
        exactly (``Pool.plan``: the pages the step gives back count only
        where the sequence gets new tokens, and only once no sequence holds
        them), ``Pool.check_room`` raises if a pool is short, ``new_tables``
        allocates the tables.  Then ``commit_step``, which cannot fail: per
        pool ``Pool.commit`` (its copies, the pages it gives back, its new
        pages, its tables, recorded for undo; see there for the order), then
        per sequence ``extend_sequence`` (its token ids, length and the
        tables the pools share).

        Parameters
        ----------
        seq_ids : ndarray, shape [B], int64
            Distinct live sequence ids.
        num_new_tokens : ndarray, shape [B], int64
            New tokens per sequence, each >= 0.
        max_seq_len : int or None
            Cap on any sequence's length.
        token_ids : ndarray, shape [total_new], int32, optional
            The new tokens, flat.  With prefix caching, pages they fill join
            the prefix index once the step is closed; a sequence appended
            without them stops caching until truncated back to its known tokens.

        Returns
        -------
        AppendTables
            ``query_start``, ``seq_lens``, ``page_indptr``, ``last_page_len``
            and, per pool (``pools``: ``full``, and ``window`` with a window
            pool), its ``slot_mapping``, ``page_indices``, ``block_table`` and
            the copies ``copy_src`` / ``copy_dst`` (see :class:`PoolTables`).
        """
        self.undo_armed = False
        cdef int64_t[::1] ids = seq_ids
        cdef int64_t[::1] counts = num_new_tokens
        cdef int32_t[::1] token_view
        cdef const int32_t* tokens = NULL
        cdef bint track = self.caching and token_ids is not None
        cdef PkvStepPlan plan
        cdef PkvStepOut out
        cdef Pool pool
        self.num_steps += 1
        if track:
            token_view = token_ids
            if token_view.shape[0]:
                tokens = &token_view[0]
        self.plan_step(plan, ids, counts, -1 if max_seq_len is None else max_seq_len, track,
                       tokens)
        for pool in self.pools:
            pool.check_room(plan.pools[pool.index])
        tables = self.new_tables(plan, out)
        # (these may raise MemoryError: before anything changes)
        self.undo_seqs.resize(ids.shape[0])
        for pool in self.pools:
            pool.undo.resize(ids.shape[0])
            pool.undo_released.clear()
        self.abandon_step(True)      # a previous step not stored in full is given up
        with nogil:
            self.commit_step(plan, ids, counts, track, tokens, out)
        self.undo_armed = True
        return tables

    # (the plan: nothing changes but each sequence's duplicate-check mark)
    cdef int plan_step(self, PkvStepPlan& plan, int64_t[::1] ids,
                       int64_t[::1] counts, int64_t cap, bint track,
                       const int32_t* tokens) except -1:
        """Find and validate every sequence and hash the pages the step fills, then
        have each pool decide its copies and count its pages, into ``plan``."""
        cdef Py_ssize_t B = ids.shape[0], b
        cdef PkvSequence* seq
        cdef int64_t new_len, ps = self.page_size
        cdef Pool pool
        plan.batch.reserve(B)
        plan.pools.resize(len(self.pools))
        for pool in self.pools:
            plan.pools[pool.index].copy.resize(B)
        if track:
            plan.hashes.resize(B)
        for b in range(B):
            seq = self.find_id(ids[b])
            if seq.last_step == self.num_steps:
                raise ValueError(f"seq_ids: sequence {ids[b]} appears more than once in one step")
            seq.last_step = self.num_steps
            new_len = seq.length + counts[b]
            if cap >= 0 and new_len > cap:
                raise ValueError(f"num_new_tokens: sequence {ids[b]} would reach {new_len} tokens, "
                                 f"over max_seq_len={cap}")
            if new_len >= 2**31:
                raise ValueError(f"num_new_tokens: sequence {ids[b]} would reach {new_len} tokens, "
                                 f"over the int32 limit of the tables")
            if track and <int64_t>seq.tokens.size() == seq.length:
                self.new_page_hashes(seq, counts[b], tokens + plan.total_new if counts[b] else NULL,
                                     plan.hashes[b])
            plan.total_new += counts[b]
            plan.nnz += pages_for(new_len, ps)
            plan.max_pages = max(plan.max_pages, pages_for(new_len, ps))
            plan.batch.push_back(seq)
        for pool in self.pools:
            pool.plan(plan.pools[pool.index], plan.batch, counts)
        return 0

    cdef AppendTables new_tables(self, PkvStepPlan& plan, PkvStepOut& out):
        """The step's tables, allocated (``out``: where the commit writes them)."""
        cdef Py_ssize_t B = plan.batch.size(), p
        cdef AppendTables tables = AppendTables.__new__(AppendTables)
        tables.query_start = np.empty(B + 1, dtype=np.int32)
        tables.seq_lens = np.empty(B, dtype=np.int32)
        tables.page_indptr = np.empty(B + 1, dtype=np.int32)
        tables.last_page_len = np.empty(B, dtype=np.int32)
        out.query_start = <int32_t*>cnp.PyArray_DATA(tables.query_start)
        out.seq_lens = <int32_t*>cnp.PyArray_DATA(tables.seq_lens)
        out.page_indptr = <int32_t*>cnp.PyArray_DATA(tables.page_indptr)
        out.last_page_len = <int32_t*>cnp.PyArray_DATA(tables.last_page_len)
        out.max_pages = plan.max_pages
        out.pools.resize(plan.pools.size())
        pool_tables = []
        for p in range(<Py_ssize_t>plan.pools.size()):
            pool_tables.append(new_pool_tables(out.pools[p], B, plan.total_new, plan.nnz,
                                               plan.max_pages, plan.pools[p].num_copies))
        tables.pools = tuple(pool_tables)
        tables.full = tables.pools[0]
        tables.window = tables.pools[1] if len(tables.pools) > 1 else None
        return tables

    # (the commit: cannot fail)
    cdef void commit_step(self, PkvStepPlan& plan, int64_t[::1] ids,
                          int64_t[::1] counts, bint track, const int32_t* tokens,
                          PkvStepOut& out) noexcept nogil:
        cdef Py_ssize_t b, B = plan.batch.size()
        cdef size_t p
        cdef int64_t row = 0
        for p in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).commit(plan.pools[p], plan.batch, counts, out.pools[p],
                                             out.max_pages)
        out.query_start[0] = 0
        out.page_indptr[0] = 0
        for b in range(B):
            self.extend_sequence(plan, b, ids[b], counts[b], track, tokens, row, out)
            row += counts[b]
        self.undo_batch.swap(plan.batch)

    cdef void extend_sequence(self, PkvStepPlan& plan, Py_ssize_t b, int64_t seq_id,
                              int64_t count, bint track, const int32_t* tokens, int64_t row,
                              PkvStepOut& out) noexcept nogil:
        """Sequence ``b`` of the step, once every pool has its pages: its new token
        ids (and pending full pages), its length, and its rows of the tables the
        pools share (its new tokens are rows ``row:row + count``), each change
        recorded for ``undo_append``."""
        cdef PkvSequence* seq = plan.batch[b]
        cdef PkvUndoSeq* u = &self.undo_seqs[b]
        cdef int64_t ps = self.page_size, new_len = seq.length + count
        cdef size_t n_pages = seq.pools[0].pages.size()
        u.seq_id = seq_id
        u.length = seq.length
        u.num_tokens = seq.tokens.size()
        u.num_hashes = seq.hashes.size()
        if track and <int64_t>seq.tokens.size() == seq.length:
            self.open_seqs.push_back(pair[int64_t, int64_t](seq_id, seq.length))
            if count > 0:   # (tokens + row may be one past the end of tokens otherwise)
                seq.tokens.insert(seq.tokens.end(), tokens + row, tokens + row + count)
            self.record_full_pages(seq_id, seq, plan.hashes[b])
        seq.length = new_len
        out.page_indptr[b + 1] = out.page_indptr[b] + <int32_t>n_pages
        out.query_start[b + 1] = <int32_t>(row + count)
        out.seq_lens[b] = <int32_t>new_len
        out.last_page_len[b] = <int32_t>(new_len - (<int64_t>n_pages - 1) * ps) if n_pages else 0

    def undo_append(self):
        """Take back the last ``append``, when what its caller does next with it
        fails (copying pages, uploading tables): every sequence, page, free
        queue and open step as before it.  Only right after that append; a
        no-op otherwise.  Free pages it took that held an evictable cached
        prefix stay evicted (they are free either way)."""
        if not self.undo_armed:
            return
        self.undo_armed = False
        with nogil:
            self.undo_last_append()

    cdef void undo_last_append(self) noexcept nogil:
        cdef Py_ssize_t b, i, B = self.undo_batch.size()
        cdef size_t p
        cdef PkvSequence* seq
        cdef PkvUndoSeq* u
        # each pool's part (Pool.undo_commit), then each sequence's length and
        # known tokens, then the previous open step
        for p in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).undo_commit(self.undo_batch)
        for b in range(B - 1, -1, -1):
            u = &self.undo_seqs[b]
            seq = self.undo_batch[b]
            seq.length = u.length
            seq.tokens.resize(u.num_tokens)
            seq.hashes.resize(u.num_hashes)
        for i in range(<Py_ssize_t>self.undo_forgotten.size()):
            it = self.seqs.find(self.undo_forgotten[i].seq_id)
            if it != self.seqs.end():
                pkv_remember(self.undo_forgotten[i], deref(it).second)
        self.pending.swap(self.undo_pending)
        self.open_seqs.swap(self.undo_open_seqs)
        self.undo_pending.clear()
        self.undo_open_seqs.clear()
        self.undo_forgotten.clear()
        self.undo_batch.clear()

    cdef void record_full_pages(self, int64_t seq_id, PkvSequence* seq,
                                vector[uint64_t]& new_hashes) noexcept nogil:
        """Extend the sequence's hash chain by the pages this step fills, and hold
        them as pending until ``close_step``."""
        cdef size_t i
        cdef PkvPendingPage entry
        for i in range(new_hashes.size()):
            entry.seq_id = seq_id
            entry.index = seq.hashes.size()
            entry.hash = new_hashes[i]
            seq.hashes.push_back(new_hashes[i])
            self.pending.push_back(entry)

    cdef void abandon_step(self, bint record=False) noexcept nogil:
        """Give up the open step: cache none of its pages, and make its sequences
        forget its tokens (their K/V may never have been stored).  ``record``:
        keep what it forgot and the open step itself, for ``undo_append``."""
        cdef size_t i
        cdef int64_t old_len
        cdef PkvSequence* seq
        if record:
            self.undo_forgotten.clear()
        for i in range(self.open_seqs.size()):
            it = self.seqs.find(self.open_seqs[i].first)
            if it == self.seqs.end():
                continue
            seq = &deref(it).second
            old_len = self.open_seqs[i].second
            if record and (<int64_t>seq.tokens.size() > old_len or
                           <int64_t>seq.hashes.size() > old_len // self.page_size):
                pkv_forget(self.undo_forgotten, self.open_seqs[i].first, deref(seq),
                           min(<size_t>old_len, seq.tokens.size()),
                           min(<size_t>(old_len // self.page_size), seq.hashes.size()))
            if <int64_t>seq.tokens.size() > old_len:
                seq.tokens.resize(old_len)
            if <int64_t>seq.hashes.size() > old_len // self.page_size:
                seq.hashes.resize(old_len // self.page_size)
        if record:
            self.undo_open_seqs.clear()
            self.undo_pending.clear()
            self.undo_open_seqs.swap(self.open_seqs)
            self.undo_pending.swap(self.pending)
        else:
            self.open_seqs.clear()
            self.pending.clear()

    def close_step(self):
        """The open step is stored in every layer: enter the pages it filled in the
        prefix index, in chain order.

        A page joins only if its parent page is cached: the chain is what a
        later prompt is matched against.  The pages at the same place in the
        other pools join their pool's index under the full page's entry.  Returns
        how many full pages joined.
        """
        cdef size_t i
        cdef int64_t parent_entry, j
        cdef int joined = 0
        cdef PkvSequence* seq
        cdef vector[int32_t]* chain
        for i in range(self.pending.size()):
            it = self.seqs.find(self.pending[i].seq_id)
            if it == self.seqs.end():
                continue
            seq = &deref(it).second
            j = self.pending[i].index
            chain = &seq.pools[0].pages
            if j >= <int64_t>chain.size() or j >= <int64_t>seq.hashes.size() or \
                    seq.hashes[j] != self.pending[i].hash or \
                    (j + 1) * self.page_size > <int64_t>seq.tokens.size():
                continue
            parent_entry = self.chain_entry(seq, j - 1)
            if parent_entry == 0 or not self.allocator.cache_page(
                    deref(chain)[j], self.pending[i].hash, parent_entry,
                    &seq.tokens[j * self.page_size]):
                continue
            joined += 1
            self.cache_in_other_pools(seq, j)
        self.pending.clear()
        self.open_seqs.clear()
        return joined

    @property
    def has_open_step(self):
        """Whether a step with prefix tracking waits for ``close_step``."""
        return not self.open_seqs.empty()

    # -- sequences that leave the cache (export, import, save, load, swap) -------------
    cdef object swapped_entry(self, seq_id):
        """``(length, known token ids)`` of a swapped-out ``seq_id``, else None."""
        if not self.swapped or isinstance(seq_id, bool) or \
                not isinstance(seq_id, (int, np.integer)):
            return None
        return self.swapped.get(int(seq_id))

    def is_swapped(self, seq_id):
        """Whether ``seq_id`` is swapped out (UnknownSequenceError if it is not live)."""
        if self.swapped_entry(seq_id) is not None:
            return True
        self.find(seq_id)
        return False

    def known_tokens(self, seq_id):
        """The sequence's leading token ids that the cache knows and whose K/V are
        stored (prefix caching: all of them while ``len == seq_len``); ndarray,
        shape [known], int32 (a copy).

        The tokens of a step still open (not yet stored in every layer) are left
        out: a sequence exported, saved or swapped out meanwhile must not bring
        their pages into a prefix cache, unwritten.
        """
        entry = self.swapped_entry(seq_id)
        if entry is not None:
            return entry[1].copy()
        cdef PkvSequence* seq = self.find(seq_id)
        cdef size_t n = seq.tokens.size(), i
        for i in range(self.open_seqs.size()):
            if self.open_seqs[i].first == <int64_t>seq_id:
                n = min(n, <size_t>self.open_seqs[i].second)
        out = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] view = out
        if n:
            memcpy(&view[0], seq.tokens.data(), n * sizeof(int32_t))
        return out

    def swap_out(self, seq_id):
        """Give the sequence's pages back (a page shared with another sequence stays
        with it) and keep its id, length and known token ids, until ``swap_in``."""
        cdef PkvSequence* seq = self.find(seq_id)
        entry = (seq.length, self.known_tokens(seq_id))
        self.abandon_step()
        self.drop(seq)
        self.seqs.erase(<int64_t>seq_id)
        self.swapped[int(seq_id)] = entry

    def adopt(self, int64_t length, token_ids=None, int64_t window_from=0,
              int64_t first_row=-1):
        """A new sequence of ``length`` tokens on new pages, for K/V that come from
        elsewhere (import, load); returns its id.

        All or nothing over every pool.  Its window pages before page
        ``window_from`` are given back from the start, and the window pool
        holds its rows from position ``first_row`` on (a position of page
        ``window_from``; -1: that page's first), so that no rollback reaches
        the rows of that page before it.  ``token_ids`` (int32,
        at most ``length``: the leading tokens the cache will know, with
        prefix caching) extend into its hash chain.  The caller then writes
        its K/V and calls ``commit_place`` (the full pages of known tokens
        join the prefix cache, as a stored step's pages would), or
        ``undo_place`` if the writing failed (the sequence goes, and its id
        is issued again).

        Raises
        ------
        OutOfPagesError
            Too few free pages in either pool; nothing changed.
        """
        seq_id = self.next_id
        self.place(seq_id, length, token_ids, window_from, first_row, "import")
        self.next_id += 1
        self.placing, self.placing_swapped = seq_id, None
        return seq_id

    def undo_adopt(self, int64_t first_id):
        """Drop the sequences made since ``next_id`` was ``first_id`` (``adopt``s of
        one load whose rest failed) and issue their ids again: no caller saw them."""
        cdef int64_t seq_id
        for seq_id in range(self.next_id - 1, first_id - 1, -1):   # (free queues as they were)
            it = self.seqs.find(seq_id)
            if it != self.seqs.end():
                self.drop(&deref(it).second)
                self.seqs.erase(seq_id)
        self.next_id = min(self.next_id, first_id)

    def swap_in(self, seq_id, int64_t window_from=0, int64_t first_row=-1):
        """Give a swapped-out sequence new pages (as ``adopt`` does, its window pages
        before ``window_from`` given back, its rows from ``first_row`` on) and its
        id, length and token ids again.  The caller then writes its K/V and
        calls ``commit_place``, or ``undo_place`` (it is swapped out again).
        All or nothing: it stays swapped out when this raises
        (``OutOfPagesError``)."""
        entry = self.swapped_entry(seq_id)
        if entry is None:
            self.find(seq_id)
            raise ValueError(f"seq_id: sequence {seq_id} is not swapped out")
        self.place(int(seq_id), entry[0], entry[1], window_from, first_row, "swap_in")
        del self.swapped[int(seq_id)]
        self.placing, self.placing_swapped = int(seq_id), entry

    def commit_place(self):
        """The K/V of the sequence ``adopt`` or ``swap_in`` placed are written: its full
        pages of known tokens join the prefix cache.  A no-op when nothing is
        placed (or the placed sequence is gone)."""
        cdef int64_t seq_id = self.placing
        self.placing, self.placing_swapped = -1, None
        it = self.seqs.find(seq_id)
        if seq_id >= 0 and it != self.seqs.end():
            self.cache_known_pages(&deref(it).second)

    def undo_place(self):
        """Take back the last ``adopt`` or ``swap_in`` whose K/V could not be written:
        the sequence goes (an adopted one's id is issued again; a swapped-in
        one is swapped out again, as it was).  A no-op when nothing is placed."""
        cdef int64_t seq_id = self.placing
        entry = self.placing_swapped
        self.placing, self.placing_swapped = -1, None
        it = self.seqs.find(seq_id)
        if seq_id < 0 or it == self.seqs.end():
            return
        self.drop(&deref(it).second)
        self.seqs.erase(seq_id)
        if entry is not None:
            self.swapped[seq_id] = entry
        elif seq_id == self.next_id - 1:
            self.next_id = seq_id

    cdef place(self, int64_t seq_id, int64_t length, token_ids, int64_t window_from,
               int64_t first_row, str caller):
        """``adopt`` and ``swap_in``: sequence ``seq_id`` of ``length`` tokens on new pages."""
        cdef int64_t ps = self.page_size, j, needed, num_pages = pages_for(length, ps)
        cdef const int32_t[::1] tokens
        cdef uint64_t h = ROOT_HASH
        cdef PkvSequence seq
        cdef Pool pool
        if not 0 <= window_from <= num_pages:
            raise ValueError(f"window_from: expected 0 <= window_from <= {num_pages} pages, "
                             f"got {window_from}")
        if first_row == -1:
            first_row = window_from * ps
        if not window_from * ps <= first_row < (window_from + 1) * ps:
            raise ValueError(f"first_row: expected a position of page {window_from} "
                             f"({window_from * ps} to {(window_from + 1) * ps - 1}), "
                             f"got {first_row}")
        for pool in self.pools:
            pool.check_first_held(length, window_from, first_row)
        for pool in self.pools:
            needed = num_pages - pool.first_held(window_from)
            if needed > pool.allocator.num_free_pages:
                raise OutOfPagesError(f"{caller}: this sequence of {length} tokens needs "
                                      f"{needed} {pool.noun}, {pool.free_text()}")
        if self.caching and token_ids is not None and len(token_ids):
            tokens = token_ids
            if tokens.shape[0] > length:
                raise ValueError(f"token_ids: expected at most {length} token ids, got "
                                 f"{tokens.shape[0]}")
            # hashed first: a user hash function may raise, and nothing is held yet
            for j in range(tokens.shape[0] // ps):
                h = self.page_hash(h, &tokens[j * ps])
                seq.hashes.push_back(h)
            seq.tokens.assign(&tokens[0], &tokens[0] + tokens.shape[0])
        seq.pools.resize(len(self.pools))
        for pool in self.pools:
            pool.start(seq.pools[pool.index], pool.first_held(window_from), num_pages,
                       first_row if pool.gives_back else 0)
        seq.length = length
        self.seqs[seq_id] = seq

    cdef void cache_known_pages(self, PkvSequence* seq) noexcept nogil:
        """Enter a written sequence's full pages of known tokens in the prefix index,
        in chain order, with their pages in the other pools (as ``close_step`` does)."""
        cdef int64_t j, parent_entry, ps = self.page_size
        cdef vector[int32_t]* chain = &seq.pools[0].pages
        for j in range(<int64_t>seq.hashes.size()):
            parent_entry = self.chain_entry(seq, j - 1)
            if parent_entry == 0 or not self.allocator.cache_page(
                    deref(chain)[j], seq.hashes[j], parent_entry, &seq.tokens[j * ps]):
                continue
            self.cache_in_other_pools(seq, j)

    cdef int64_t chain_entry(self, PkvSequence* seq, int64_t j) noexcept nogil:
        """The prefix index's entry of the sequence's first ``j + 1`` full pages (the
        parent entry of its page ``j + 1``; ROOT_ENTRY for ``j == -1``), or 0 when
        the index does not hold them.

        That is its page ``j``'s entry, or, where that page is not cached
        because another page of the same tokens after the same chain was
        cached first, the other page's: two sequences computed one prompt, or
        an import, load or swap-in placed a sequence beside its own cached
        copy.  Without that, none of the pages the sequence fills afterwards
        would ever join the index.
        """
        cdef int64_t i = j, entry = ROOT_ENTRY, ps = self.page_size
        cdef vector[int32_t]* chain = &seq.pools[0].pages
        cdef int32_t page
        while i >= 0:           # back to its nearest page that is cached itself ...
            entry = self.allocator.entry_of(deref(chain)[i])
            if entry:
                break
            i -= 1
        if i < 0:
            entry = ROOT_ENTRY
        for i in range(i + 1, j + 1):      # ... then along the cached copies of the rest
            page = self.allocator.lookup(seq.hashes[i], entry, &seq.tokens[i * ps])
            if page < 0:
                return 0
            entry = self.allocator.entry_of(page)
        return entry

    cdef void cache_in_other_pools(self, PkvSequence* seq, int64_t j) noexcept nogil:
        """Cache the sequence's page ``j`` of every pool but the first (where held)
        under the entry of its full page ``j``, just cached."""
        cdef size_t p
        cdef int64_t entry = self.allocator.entry_of(seq.pools[0].pages[j])
        for p in range(1, self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).cache_under(seq.pools[p], j, entry,
                                                  &seq.tokens[j * self.page_size])

    def cached_chains(self):
        """The prefix cache's pages that a prompt can reach, parents first.

        Returns
        -------
        dict of ndarray
            ``pages`` [N] int32 (full-pool page ids), ``parents`` [N] int64
            (index of each page's parent in these arrays, -1 for a prompt's
            first page), ``tokens`` [N, page_size] int32, ``window_pages``
            [N] int32 (the window pool's cached page of the same place, -1
            when it is not cached or no layer is windowed).
        """
        cdef PageAllocator a = self.allocator
        cdef Pool pool
        cdef int32_t p
        cdef int64_t entry, parent
        cdef list found = []
        if self.caching:
            for p in range(a.num_pages):
                if a._entry[p]:
                    found.append((a._entry[p], p))
        found.sort()          # entries grow with each insertion: parents come first
        index_of = {}
        pages, parents = [], []
        others = [[] for _ in self.pools[1:]]     # per other pool: its page of each
        for entry, p in found:
            parent = a._parent_entry[p]
            if parent != ROOT_ENTRY and parent not in index_of:
                continue      # its parent was evicted: no prompt reaches it
            index_of[entry] = len(pages)
            pages.append(p)
            parents.append(-1 if parent == ROOT_ENTRY else index_of[parent])
            for pool in self.pools[1:]:
                others[pool.index - 1].append(
                    pool.allocator.lookup(<uint64_t>entry, ROOT_ENTRY, &a._tokens[p, 0]))
        page_ids = np.asarray(pages, dtype=np.int32)
        return {"pages": page_ids, "parents": np.asarray(parents, dtype=np.int64),
                "tokens": np.asarray(a._tokens)[page_ids].reshape(len(pages), self.page_size),
                "window_pages": np.asarray(others[0] if others else [-1] * len(pages),
                                           dtype=np.int32)}

    def add_cached_chains(self, token_ids, parents, has_window, int64_t reserve=0,
                          int64_t reserve_window=0):
        """Reserve the pages to enter page chains from elsewhere (a file) in the prefix
        cache, as free, evictable pages that prompts starting with their tokens hit.

        A page already cached here (same tokens after the same parent) is
        kept and not written again.  All or nothing.  The caller then writes
        the K/V of the new pages it returns and calls
        ``commit_cached_chains``, or ``undo_cached_chains`` if the writing
        failed (nothing stays taken or cached).  A reservation neither
        committed nor undone is undone by the next one.

        Parameters
        ----------
        token_ids : ndarray, shape [N, page_size], int32
        parents : ndarray, shape [N], int64
            Each page's parent: an earlier index, or -1 for a prompt's first page.
        has_window : ndarray, shape [N], bool
            Whether the windowed layers' K/V of the page come too.
        reserve, reserve_window : int
            Pages of each pool that must stay free besides (for sequences the
            caller places next); the pages entered here are evicted after any
            other free page.

        Returns
        -------
        pages, window_pages : ndarray, shape [N], int32
            Where to write the K/V of page ``i``: ``pages[i]`` and
            ``window_pages[i]``, where they are >= 0 (the pages not cached
            here yet).

        Raises
        ------
        OutOfPagesError
            Too few free pages; nothing changed.
        """
        cdef const int32_t[:, ::1] tokens = token_ids
        cdef const int64_t[::1] parent = parents
        cdef const cnp.uint8_t[::1] window = has_window.view(np.uint8)
        cdef Py_ssize_t N = tokens.shape[0], i, P = len(self.pools), q
        cdef int64_t entry
        cdef Pool pool
        if tokens.shape[1] != self.page_size or parent.shape[0] != N or window.shape[0] != N:
            raise ValueError(f"token_ids, parents, has_window: expected shapes [N, "
                             f"{self.page_size}], [N], [N], got {list(token_ids.shape)}, "
                             f"{list(parents.shape)}, {list(has_window.shape)}")
        self.undo_cached_chains()
        hashes = np.zeros(N, dtype=np.uint64)
        cdef uint64_t[::1] h = hashes
        # per pool (rows; the first pool holds the chains, the others the pages
        # has_window names): the page of each, and the new ones to write (a
        # window row either way: the caller gets both)
        held = np.full((P, N), -1, dtype=np.int32)
        fresh = np.full((max(P, 2), N), -1, dtype=np.int32)
        cdef int32_t[:, ::1] page = held, new_page = fresh
        cdef vector[int64_t] needed, busy        # per pool
        needed.assign(P, 0)
        busy.assign(P, 0)
        reserves = (reserve, reserve_window)
        # Plan: hash every page, find those cached here already; nothing changes yet.
        for i in range(N):
            if not -1 <= parent[i] < i:
                raise ValueError(f"parents: page {i} names parent {parent[i]}; expected -1 or "
                                 f"an earlier page")
            h[i] = self.page_hash(ROOT_HASH if parent[i] < 0 else h[parent[i]], &tokens[i, 0])
            entry = ROOT_ENTRY if parent[i] < 0 else \
                (self.allocator.entry_of(page[0, parent[i]]) if page[0, parent[i]] >= 0 else 0)
            if entry != 0:
                page[0, i] = self.allocator.lookup(h[i], entry, &tokens[i, 0])
            if page[0, i] >= 0:
                busy[0] += self.allocator.refcount_of(page[0, i]) == 0
            else:
                needed[0] += 1
            for q in range(1, P if window[i] else 1):
                pool = <Pool>self.pool_refs[q]
                if page[0, i] >= 0:
                    page[q, i] = pool.allocator.lookup(
                        <uint64_t>self.allocator.entry_of(page[0, i]), ROOT_ENTRY,
                        &tokens[i, 0])
                if page[q, i] >= 0:
                    busy[q] += pool.allocator.refcount_of(page[q, i]) == 0
                else:
                    needed[q] += 1
        for pool in self.pools:
            q = pool.index
            if needed[q] + reserves[q] + busy[q] > pool.allocator.num_free_pages:
                raise OutOfPagesError(
                    f"load: the prefix cache's chains need {needed[q]} {pool.noun} besides the "
                    f"sequences' {reserves[q]}, {pool.free_text(busy[q], False)}")
        # Reserve: hold the pages found (before any take could evict one), take the
        # new ones; the commit caches them and lets go.
        for i in range(N):
            for q in range(P):
                if page[q, i] >= 0:
                    (<Pool>self.pool_refs[q]).allocator.acquire(page[q, i])
        for i in range(N):
            for q in range(P if window[i] else 1):
                if page[q, i] < 0:
                    page[q, i] = new_page[q, i] = (<Pool>self.pool_refs[q]).allocator.take_page()
        self.chains_pending = (token_ids, parents, hashes, held, fresh)
        return fresh[0].copy(), fresh[1].copy()

    def commit_cached_chains(self):
        """The K/V of the pages ``add_cached_chains`` reserved are written: the new
        pages join the prefix cache, and every page of the chains is let go (free,
        evictable).  Returns how many pages of the chains are now cached here
        (new or already there); 0 when nothing is reserved."""
        if self.chains_pending is None:
            return 0
        entries = np.zeros(len(self.chains_pending[0]), dtype=np.int64)   # (before any change)
        token_ids, parents, hashes, held, fresh = self.chains_pending
        self.chains_pending = None
        cdef const int32_t[:, ::1] tokens = token_ids
        cdef const int64_t[::1] parent = parents
        cdef const uint64_t[::1] h = hashes
        cdef int32_t[:, ::1] page = held
        cdef const int32_t[:, ::1] new_page = fresh
        cdef Py_ssize_t i, q, N = tokens.shape[0], P = len(self.pools)
        cdef int64_t entry, joined = 0
        cdef int32_t found
        # each page's entry in the index: its own, or that of a page of the same
        # prefix cached meanwhile (a sequence placed between the reserve and this
        # commit), under which its children are cached
        cdef int64_t[::1] entry_at = entries
        for i in range(N):
            entry = ROOT_ENTRY if parent[i] < 0 else entry_at[parent[i]]
            if new_page[0, i] >= 0 and entry != 0:
                self.allocator.cache_page(page[0, i], h[i], entry, &tokens[i, 0])
            entry_at[i] = self.allocator.entry_of(page[0, i])
            if entry_at[i] == 0 and entry != 0:
                found = self.allocator.lookup(h[i], entry, &tokens[i, 0])
                entry_at[i] = self.allocator.entry_of(found) if found >= 0 else 0
            if self.allocator.entry_of(page[0, i]) == 0:
                joined += entry_at[i] != 0
                continue
            joined += 1
            for q in range(1, P):
                if new_page[q, i] >= 0:
                    (<Pool>self.pool_refs[q]).allocator.cache_page(
                        page[q, i], <uint64_t>self.allocator.entry_of(page[0, i]), ROOT_ENTRY,
                        &tokens[i, 0])
        self.release_chains(page)
        return joined

    def undo_cached_chains(self):
        """Take back what ``add_cached_chains`` reserved when its K/V could not be
        written: no page stays taken or cached.  A no-op when nothing is reserved."""
        if self.chains_pending is None:
            return
        held = self.chains_pending[3]
        self.chains_pending = None
        self.release_chains(held)

    cdef void release_chains(self, int32_t[:, ::1] page) noexcept nogil:
        """Drop the references ``add_cached_chains`` took, last page first (so that
        a chain's tail is evicted before its head)."""
        cdef Py_ssize_t i, q
        for i in range(page.shape[1] - 1, -1, -1):
            for q in range(page.shape[0]):
                if page[q, i] >= 0:
                    (<Pool>self.pool_refs[q]).allocator.decref_page(page[q, i])
