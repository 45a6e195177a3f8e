# distutils: language = c++
"""Per-sequence page tables and the per-step tables kernels read.

Each sequence owns an ordered list of page ids and a length.  ``append``
reserves the slots for one step, all or nothing, copying a shared or cached
last page first (copy-on-write), and builds every table format an engine may
want: the slot mapping (vLLM), the CSR page table (FlashInfer, TVM) and the
padded block table.

Windowed layers (a sliding window of at most ``window`` positions) keep their
K/V in a second pool.  Each sequence then has a second page list of the same
length, whose leading pages are given back (-1) once no later query can see
them: after a step from ``L0`` to ``L`` tokens, every window page wholly before
``keep_from = min(L0, L - rollback) - window + 1`` goes back to the pool, so
a rollback of up to ``rollback`` tokens still finds what its queries need.

With prefix caching, a sequence also keeps its token ids and the hash chain
of its full pages (``hash(parent page's hash, page's token ids)``).  A page
that a step fills is entered in the allocator's prefix index only once that
step's K/V is stored in every layer (``close_step``).  A step abandoned
before that (another append, a truncate, a free) leaves nothing reusable:
its pages are not cached, and its sequences forget the step's tokens, so
that no later page holding those unwritten positions is cached either
(they cache again once truncated back below them).  A window page is cached
under the prefix-index entry of the full page at the same place in the
chain, which identifies its content exactly.

Sequences that leave the cache (see the last block of ``PageTables``): a
sequence made for K/V that come from elsewhere (``adopt``) gets new pages,
its window pages before its first needed position given back from the
start; a swapped-out sequence keeps its id, length and token ids but no
pages: it sits in ``swapped`` instead of the sequence map, so no table of it
can reach a kernel, and ``find`` says it is swapped out.
"""
import numbers

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy
from cpython.dict cimport PyDict_Clear
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
    struct PkvSequence {
        std::vector<int32_t> pages;
        // window pool: as many entries as `pages`; the first `window_released`
        // are -1 (given back)
        std::vector<int32_t> window_pages;
        int64_t window_released = 0;
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
        int64_t num_pages;
        int64_t num_window_pages;
        int64_t window_released;
        int64_t num_tokens;
        int64_t num_hashes;
        int32_t copy_source;          // the shared last page it copied, or -1
        int32_t window_copy_source;
    };
    // a window page the last append gave back: entry `index` of sequence `b`
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
    // what an append's plan found and counted, before anything changes
    struct PkvStepPlan {
        std::vector<PkvSequence*> batch;
        std::vector<char> copy_full, copy_window;   // per sequence: copy its last page
        std::vector<std::vector<uint64_t>> hashes;  // per sequence: of the pages it fills
        // copies per shared page: the last writer of a page shared only within
        // the step keeps it instead of copying
        std::unordered_map<int32_t, int32_t> copies_of, window_copies_of;
        // references to window pages the step gives back, per page
        std::unordered_map<int32_t, int32_t> window_releases;
        int64_t needed = 0, window_new = 0, window_freed = 0, total_new = 0;
        int64_t nnz = 0, num_copies = 0, num_window_copies = 0, max_pages = 0;
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
    // where the commit writes the step's tables: those both pools share, and each pool's
    struct PkvStepOut {
        int32_t* query_start = nullptr;
        int32_t* seq_lens = nullptr;
        int32_t* page_indptr = nullptr;
        int32_t* last_page_len = nullptr;
        int64_t max_pages = 0;
        PkvPoolOut full, window;
    };
    """
    cdef cppclass PkvSequence:
        PkvSequence() except +
        vector[int32_t] pages
        vector[int32_t] window_pages
        int64_t window_released
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
        int64_t num_pages
        int64_t num_window_pages
        int64_t window_released
        int64_t num_tokens
        int64_t num_hashes
        int32_t copy_source
        int32_t window_copy_source
    cdef cppclass PkvReleased:
        int64_t b
        int64_t index
        int32_t page
    cdef cppclass PkvForgotten:
        int64_t seq_id
    cdef cppclass PkvStepPlan:
        vector[PkvSequence*] batch
        vector[char] copy_full
        vector[char] copy_window
        vector[vector[uint64_t]] hashes
        unordered_map[int32_t, int32_t] copies_of
        unordered_map[int32_t, int32_t] window_copies_of
        unordered_map[int32_t, int32_t] window_releases
        int64_t needed, window_new, window_freed, total_new
        int64_t nnz, num_copies, num_window_copies, max_pages
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
        PkvPoolOut full
        PkvPoolOut window
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
    full : PoolTables
        The full-attention pool's tables.
    window : PoolTables or None
        The window pool's (None without one).
    """
    cdef readonly cnp.ndarray query_start, seq_lens, page_indptr, last_page_len
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


cdef class PageTables:
    """The page tables of every live sequence, over one :class:`PageAllocator`.

    Parameters
    ----------
    allocator : PageAllocator
        Pool the pages come from; its ``page_size`` and ``prefix_caching`` apply.
    hash_fn : callable, optional
        ``hash_fn(parent_hash: int, token_ids: tuple) -> int`` replaces the
        default page hash (e.g. to force collisions in tests).
    window_allocator : PageAllocator, optional
        The pool of the windowed layers; with it, ``window`` and ``rollback``.
    window : int
        The largest window of any windowed layer.
    rollback : int, >= 1
        Tokens a sequence can always be rolled back by (see the module notes).
    """
    cdef PageAllocator allocator
    cdef PageAllocator window_allocator
    cdef readonly bint windowed
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
    # how to undo the last append (``undo_append``), while ``undo_armed``
    cdef bint undo_armed
    cdef vector[PkvUndoSeq] undo_seqs
    cdef vector[PkvReleased] undo_released
    cdef vector[PkvForgotten] undo_forgotten
    cdef vector[PkvPendingPage] undo_pending
    cdef vector[pair[int64_t, int64_t]] undo_open_seqs

    def __cinit__(self, PageAllocator allocator, hash_fn=None,
                  PageAllocator window_allocator=None, int64_t window=0, int64_t rollback=1):
        self.allocator = allocator
        self.window_allocator = window_allocator
        self.windowed = window_allocator is not None
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

    cdef inline int64_t keep_from(self, int64_t old_len, int64_t new_len) noexcept nogil:
        """The oldest position a windowed query may still need after a step old_len -> new_len."""
        cdef int64_t first = min(old_len, new_len - self.rollback)
        return max(<int64_t>0, first - self.window + 1)

    # -- sequences ---------------------------------------------------------------
    def add(self, token_ids=None):
        """Create a sequence; return its id (ids are never reused).

        With prefix caching and ``token_ids`` (the prompt, int32 [n]), the
        sequence starts on the longest cached chain of full pages of the
        prompt, short of its last token, whose windowed-layer K/V (what a
        window at its end sees) is cached too; ``seq_len`` tells how many
        tokens that covers.  Nothing is reserved for the rest.
        """
        cdef PkvSequence seq
        cdef int32_t[::1] prompt
        cdef int64_t j, hit, first, num_full, ps = self.page_size
        cdef int64_t parent_entry = ROOT_ENTRY
        cdef uint64_t h = ROOT_HASH
        cdef vector[uint64_t] chain
        cdef vector[int32_t] found
        cdef vector[int32_t] window_found
        cdef int32_t page
        if self.caching and token_ids is not None:
            prompt = token_ids
            num_full = (prompt.shape[0] - 1) // ps if prompt.shape[0] else 0
            # hash first: a user hash function may raise, and nothing is held yet
            for j in range(num_full):
                h = self.page_hash(h, &prompt[j * ps])
                chain.push_back(h)
            for j in range(num_full):
                page = self.allocator.lookup(chain[j], parent_entry, &prompt[j * ps])
                if page < 0:
                    break
                found.push_back(page)
                parent_entry = self.allocator.entry_of(page)
            hit = found.size()
            while self.windowed and hit > 0 and \
                    not self.find_window_pages(found, &prompt[0], hit, window_found):
                hit -= 1        # the windowed layers' K/V at that end is gone: a shorter hit
            for j in range(hit):
                self.allocator.acquire(found[j])
                seq.pages.push_back(found[j])
                seq.hashes.push_back(chain[j])
            if self.windowed:
                first = hit - <int64_t>window_found.size()
                seq.window_pages.assign(first, RELEASED)
                seq.window_released = first
                for j in range(<int64_t>window_found.size()):
                    self.window_allocator.acquire(window_found[j])
                    seq.window_pages.push_back(window_found[j])
            seq.length = hit * ps
            seq.tokens.assign(&prompt[0], &prompt[0] + seq.length) if seq.length else None
            self.num_prompt_tokens += prompt.shape[0]
            self.num_reused_tokens += seq.length
        cdef int64_t seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = seq
        return seq_id

    cdef bint find_window_pages(self, vector[int32_t]& found, const int32_t* prompt,
                                int64_t hit, vector[int32_t]& out) noexcept nogil:
        """The cached window pages a sequence starting on ``hit`` full pages needs
        (those at or after keep_from), into ``out``; False if any is missing."""
        cdef int64_t j, ps = self.page_size
        cdef int64_t length = hit * ps
        cdef int32_t page
        out.clear()
        for j in range(self.keep_from(length, length) // ps, hit):
            page = self.window_allocator.lookup(
                <uint64_t>self.allocator.entry_of(found[j]), ROOT_ENTRY, &prompt[j * ps])
            if page < 0:
                return False
            out.push_back(page)
        return True

    def fork(self, parent_id):
        """A new sequence sharing every page of ``parent_id`` (ref counts only)."""
        cdef PkvSequence* parent = self.find(parent_id)
        cdef int64_t child_id = self.next_id
        cdef size_t i
        for i in range(parent.pages.size()):
            self.allocator.incref_page(parent.pages[i])
        for i in range(parent.window_pages.size()):
            if parent.window_pages[i] != RELEASED:
                self.window_allocator.incref_page(parent.window_pages[i])
        for i in range(self.open_seqs.size()):   # the child shares the open step's fate
            if self.open_seqs[i].first == <int64_t>parent_id:
                self.open_seqs.push_back(pair[int64_t, int64_t](child_id, self.open_seqs[i].second))
                break
        self.next_id += 1
        self.seqs[child_id] = deref(parent)   # copies the page lists, not the pages
        return child_id

    cdef void drop(self, PkvSequence* seq) noexcept nogil:
        release_pages(self.allocator, seq.pages, 0)
        if self.windowed:
            release_pages(self.window_allocator, seq.window_pages, 0)
            seq.window_released = 0

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
        cdef PkvSequence* seq = self.find(seq_id)
        cdef vector[int32_t]* pages = &seq.window_pages if window else &seq.pages
        out = np.empty(pages.size(), dtype=np.int32)
        cdef int32_t[::1] view = out
        cdef size_t i
        for i in range(pages.size()):
            view[i] = deref(pages)[i]
        return out

    def window_held_from(self, seq_id):
        """The first position whose window-pool K/V the sequence still holds."""
        cdef PkvSequence* seq = self.find(seq_id)
        return min(seq.window_released * self.page_size, seq.length)

    def slots(self, seq_id, int64_t start, int64_t stop, bint window=False):
        """Slots (``page * page_size + offset``) of positions ``start:stop``, in the
        full pool or (``window``) the window pool.

        Returns
        -------
        slots : ndarray, shape [stop - start], int64
        """
        cdef PkvSequence* seq = self.find(seq_id)
        if not 0 <= start <= stop <= seq.length:
            raise ValueError(f"positions {start}:{stop}: expected 0 <= start <= stop <= "
                             f"seq_len={seq.length}")
        if window and start < stop and start < seq.window_released * self.page_size:
            raise ValueError(f"positions {start}:{stop}: the window pool holds this sequence's "
                             f"K/V only from position {seq.window_released * self.page_size}")
        cdef vector[int32_t]* pages = &seq.window_pages if window else &seq.pages
        out = np.empty(stop - start, dtype=np.int64)
        cdef int64_t[::1] view = out
        cdef int64_t pos, ps = self.page_size
        for pos in range(start, stop):
            view[pos - start] = <int64_t>deref(pages)[pos // ps] * ps + pos % ps
        return out

    def check_rollback(self, seq_id, int64_t new_len):
        """ValueError unless truncating to ``new_len`` keeps what windowed queries need."""
        cdef PkvSequence* seq = self.find(seq_id)
        cdef int64_t held_from = seq.window_released * self.page_size
        # a query at new_len (the first after the rollback) sees from new_len - window + 1;
        # only positions given back (before held_from) that it would see are missing
        if self.windowed and 0 < new_len < seq.length and \
                max(new_len - self.window + 1, <int64_t>0) < held_from:
            raise ValueError(
                f"new_len: the windowed layers gave back this sequence's K/V before position "
                f"{held_from}, and a query at position {new_len} would see from position "
                f"{max(new_len - self.window + 1, 0)}; it can be rolled back to "
                f"{held_from + self.window - 1} tokens at least, or to 0 (a larger "
                f"window_rollback_tokens keeps more)")

    def truncate(self, seq_id, int64_t new_len):
        """Shorten the sequence to ``new_len`` tokens; pages past it are released."""
        cdef PkvSequence* seq = self.find(seq_id)
        if not 0 <= new_len <= seq.length:
            raise ValueError(f"new_len: expected 0 <= new_len <= seq_len={seq.length}, got {new_len}")
        self.check_rollback(seq_id, new_len)
        self.abandon_step()
        release_pages(self.allocator, seq.pages, pages_for(new_len, self.page_size))
        if self.windowed:
            release_pages(self.window_allocator, seq.window_pages,
                          pages_for(new_len, self.page_size))
            seq.window_released = min(seq.window_released, <int64_t>seq.window_pages.size())
        seq.length = new_len
        if <int64_t>seq.tokens.size() > new_len:
            seq.tokens.resize(new_len)
        if <int64_t>seq.hashes.size() > new_len // self.page_size:
            seq.hashes.resize(new_len // self.page_size)

    def held_pages(self, seq_id):
        """Pages the sequence holds in the window pool."""
        cdef PkvSequence* seq = self.find(seq_id)
        return <int64_t>seq.window_pages.size() - seq.window_released

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

    cdef void count_window_releases(self, PkvSequence* seq, int64_t new_len,
                                    unordered_map[int32_t, int32_t]& releases) noexcept nogil:
        """Count, per window page, the references a step from seq.length to ``new_len``
        gives back (a page shared by sequences of the step may lose several)."""
        cdef int64_t j
        cdef int64_t upto = min(self.keep_from(seq.length, new_len) // self.page_size,
                                <int64_t>seq.window_pages.size())
        for j in range(seq.window_released, upto):
            if seq.window_pages[j] != RELEASED:
                releases[seq.window_pages[j]] += 1

    cdef void release_window_recorded(self, PkvSequence* seq, int64_t keep_from,
                                      int64_t b) noexcept nogil:
        """``release_window``, keeping each page given back in ``undo_released``."""
        cdef int64_t upto = min(keep_from // self.page_size, <int64_t>seq.window_pages.size())
        cdef PkvReleased entry
        while seq.window_released < upto:
            if seq.window_pages[seq.window_released] != RELEASED:
                entry.b = b
                entry.index = seq.window_released
                entry.page = seq.window_pages[seq.window_released]
                self.undo_released.push_back(entry)
                self.window_allocator.decref_page(entry.page)
                seq.window_pages[seq.window_released] = RELEASED
            seq.window_released += 1

    def append(self, seq_ids, num_new_tokens, max_seq_len=None, token_ids=None):
        """Reserve slots for ``num_new_tokens[b]`` new tokens of each ``seq_ids[b]``.

        All or nothing, over both pools: on any error no sequence or page
        changes, and once it has returned ``undo_append`` takes it back.  A
        sequence whose last page is partly filled and shared (or cached)
        gets a private copy of it first; the (source, destination) pairs are
        returned so that the backend copies the data before anything is
        stored.  Window pages no later query can see are given back before
        the step's new pages are taken, so their room serves this step.

        Two phases, each in named steps.  A plan that changes nothing:
        ``plan_step`` validates, hashes the pages the step fills (a user hash
        function may raise) and counts what each pool must give exactly (the
        window pages the step gives back count only where the sequence gets
        new tokens, and only once no sequence holds them:
        ``count_freed_window_pages``), ``check_room`` raises if a pool is
        short, ``new_tables`` allocates the tables.  Then ``commit_step``,
        which cannot fail: ``record_undo``, ``take_window_copies`` (the
        copies' destinations first), ``give_back_window_pages``, then per
        sequence ``extend_sequence`` (its full-pool copy, its new pages, its
        token ids, its rows of the tables), and ``drop_copy_sources`` last:
        so a copy never writes a page that this step gave back or copies
        from, and undoing the step finds every page it gave back as it was.

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
            and, per pool (``full``, and ``window`` with a window pool), its
            ``slot_mapping``, ``page_indices``, ``block_table`` and the
            copies ``copy_src`` / ``copy_dst`` (see :class:`PoolTables`).
        """
        self.undo_armed = False
        cdef int64_t[::1] ids = seq_ids
        cdef int64_t[::1] counts = num_new_tokens
        cdef int32_t[::1] token_view
        cdef const int32_t* tokens = NULL
        cdef bint track = self.caching and token_ids is not None
        cdef PkvStepPlan plan
        cdef PkvStepOut out
        self.num_steps += 1
        if track:
            token_view = token_ids
            if token_view.shape[0]:
                tokens = &token_view[0]
        self.plan_step(plan, ids, counts, -1 if max_seq_len is None else max_seq_len, track,
                       tokens)
        self.check_room(plan)
        tables = self.new_tables(plan, out)
        self.undo_seqs.resize(ids.shape[0])   # (may raise MemoryError: before anything changes)
        self.undo_released.clear()
        self.abandon_step(True)      # a previous step not stored in full is given up
        with nogil:
            self.commit_step(plan, ids, counts, track, tokens, out)
        self.undo_armed = True
        return tables

    # (the plan: nothing changes but each sequence's duplicate-check mark)
    cdef int plan_step(self, PkvStepPlan& plan, int64_t[::1] ids,
                       int64_t[::1] counts, int64_t cap, bint track,
                       const int32_t* tokens) except -1:
        """Find and validate every sequence, decide its copies, count each pool's
        pages and hash the pages the step fills, into ``plan``."""
        cdef Py_ssize_t B = ids.shape[0], b
        cdef PkvSequence* seq
        cdef int64_t new_len, ps = self.page_size
        plan.batch.reserve(B)
        plan.copy_full.resize(B)
        plan.copy_window.resize(B)
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
            self.plan_pages(plan, b, seq, counts[b])
            if track and <int64_t>seq.tokens.size() == seq.length:
                self.new_page_hashes(seq, counts[b], tokens + plan.total_new if counts[b] else NULL,
                                     plan.hashes[b])
            plan.total_new += counts[b]
            plan.nnz += pages_for(new_len, ps)
            plan.max_pages = max(plan.max_pages, pages_for(new_len, ps))
            plan.batch.push_back(seq)
        if self.windowed:
            self.count_freed_window_pages(plan)
        return 0

    cdef void plan_pages(self, PkvStepPlan& plan, Py_ssize_t b, PkvSequence* seq,
                         int64_t count) noexcept nogil:
        """Sequence ``b``'s copies and new pages in each pool, and the window pages
        its step gives back."""
        cdef int64_t ps = self.page_size, num_pages = pages_for(seq.length + count, ps)
        plan.copy_full[b] = must_copy(self.allocator, seq.pages, seq.length, ps, count,
                                      plan.copies_of)
        if plan.copy_full[b]:
            plan.copies_of[seq.pages.back()] += 1
            plan.num_copies += 1
        plan.needed += plan.copy_full[b] + num_pages - <int64_t>seq.pages.size()
        if not self.windowed:
            return
        plan.copy_window[b] = must_copy(self.window_allocator, seq.window_pages, seq.length,
                                        ps, count, plan.window_copies_of)
        if plan.copy_window[b]:
            plan.window_copies_of[seq.window_pages.back()] += 1
            plan.num_window_copies += 1
        plan.window_new += num_pages - <int64_t>seq.window_pages.size()
        if count:        # (a sequence without new tokens gives nothing back)
            self.count_window_releases(seq, seq.length + count, plan.window_releases)

    cdef void count_freed_window_pages(self, PkvStepPlan& plan) noexcept nogil:
        """The window pages the step frees: those every holder gives back."""
        for kv in plan.window_releases:
            plan.window_freed += self.window_allocator.refcount_of(kv.first) == kv.second

    cdef int check_room(self, PkvStepPlan& plan) except -1:
        """OutOfPagesError unless each pool can give what the plan takes."""
        if plan.needed > self.allocator.num_free_pages:
            raise OutOfPagesError(
                f"append: this step needs {plan.needed} new pages, "
                f"{self.allocator.num_free_pages} of {self.allocator.num_pages} free"
                + (" in the full-attention pool" if self.windowed else ""))
        if self.windowed and (plan.num_window_copies > self.window_allocator.num_free_pages or
                              plan.num_window_copies + plan.window_new - plan.window_freed
                              > self.window_allocator.num_free_pages):
            raise OutOfPagesError(
                f"append: this step needs {plan.num_window_copies + plan.window_new} new window "
                f"pages ({plan.num_window_copies} of them copies of shared pages, taken before "
                f"the {plan.window_freed} it gives back are free), "
                f"{self.window_allocator.num_free_pages} of {self.window_allocator.num_pages} "
                f"free in the window pool (the sliding-window layers; num_window_pages)")
        return 0

    cdef AppendTables new_tables(self, PkvStepPlan& plan, PkvStepOut& out):
        """The step's tables, allocated (``out``: where the commit writes them)."""
        cdef Py_ssize_t B = plan.batch.size()
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
        tables.full = new_pool_tables(out.full, B, plan.total_new, plan.nnz, plan.max_pages,
                                      plan.num_copies)
        tables.window = new_pool_tables(out.window, B, plan.total_new, plan.nnz,
                                        plan.max_pages, plan.num_window_copies) \
            if self.windowed else None
        return tables

    # (the commit: cannot fail)
    cdef void commit_step(self, PkvStepPlan& plan, int64_t[::1] ids,
                          int64_t[::1] counts, bint track, const int32_t* tokens,
                          PkvStepOut& out) noexcept nogil:
        cdef Py_ssize_t b, B = plan.batch.size()
        cdef int64_t row = 0
        self.record_undo(plan, ids)
        if self.windowed:
            self.take_window_copies(plan, out.window)
            self.give_back_window_pages(plan, counts)
        out.query_start[0] = 0
        out.page_indptr[0] = 0
        for b in range(B):
            self.extend_sequence(plan, b, ids[b], counts[b], track, tokens, row, out)
            row += counts[b]
        self.drop_copy_sources(out)

    cdef void record_undo(self, PkvStepPlan& plan, int64_t[::1] ids) noexcept nogil:
        """What each sequence is before the step, for ``undo_append``."""
        cdef Py_ssize_t b
        cdef PkvSequence* seq
        cdef PkvUndoSeq* u
        for b in range(<Py_ssize_t>plan.batch.size()):
            seq = plan.batch[b]
            u = &self.undo_seqs[b]
            u.seq_id = ids[b]
            u.length = seq.length
            u.num_pages = seq.pages.size()
            u.num_window_pages = seq.window_pages.size()
            u.window_released = seq.window_released
            u.num_tokens = seq.tokens.size()
            u.num_hashes = seq.hashes.size()
            u.copy_source = -1
            u.window_copy_source = -1

    cdef void take_window_copies(self, PkvStepPlan& plan, PkvPoolOut& window) noexcept nogil:
        """Private copies of the shared last window pages, before anything is given back."""
        cdef Py_ssize_t b
        for b in range(<Py_ssize_t>plan.batch.size()):
            if plan.copy_window[b]:
                self.undo_seqs[b].window_copy_source = take_copy(
                    self.window_allocator, plan.batch[b].window_pages, window)

    cdef void give_back_window_pages(self, PkvStepPlan& plan,
                                     int64_t[::1] counts) noexcept nogil:
        """The window pages no query of the step (or after a rollback) can see."""
        cdef Py_ssize_t b
        cdef PkvSequence* seq
        for b in range(<Py_ssize_t>plan.batch.size()):
            if counts[b]:
                seq = plan.batch[b]
                self.release_window_recorded(seq, self.keep_from(seq.length,
                                                                 seq.length + counts[b]), b)

    cdef void extend_sequence(self, PkvStepPlan& plan, Py_ssize_t b, int64_t seq_id,
                              int64_t count, bint track, const int32_t* tokens, int64_t row,
                              PkvStepOut& out) noexcept nogil:
        """Sequence ``b`` of the step: its full-pool copy, new pages in each pool, new
        token ids (and pending full pages), and its rows of the tables (its new
        tokens are rows ``row:row + count``)."""
        cdef PkvSequence* seq = plan.batch[b]
        cdef int64_t ps = self.page_size, old_len = seq.length, new_len = seq.length + count
        cdef size_t n_pages
        if plan.copy_full[b]:
            self.undo_seqs[b].copy_source = take_copy(self.allocator, seq.pages, out.full)
        grow(self.allocator, seq.pages, pages_for(new_len, ps))
        if self.windowed:
            grow(self.window_allocator, seq.window_pages, pages_for(new_len, ps))
        if track and <int64_t>seq.tokens.size() == seq.length:
            self.open_seqs.push_back(pair[int64_t, int64_t](seq_id, seq.length))
            if count > 0:   # (tokens + row may be one past the end of tokens otherwise)
                seq.tokens.insert(seq.tokens.end(), tokens + row, tokens + row + count)
            self.record_full_pages(seq_id, seq, plan.hashes[b])
        n_pages = seq.pages.size()
        write_tables(seq.pages, old_len, new_len, ps, row, out.full, out.page_indptr[b],
                     b * out.max_pages)
        if self.windowed:
            write_tables(seq.window_pages, old_len, new_len, ps, row, out.window,
                         out.page_indptr[b], b * out.max_pages)
        seq.length = new_len
        out.page_indptr[b + 1] = out.page_indptr[b] + <int32_t>n_pages
        out.query_start[b + 1] = <int32_t>(row + count)
        out.seq_lens[b] = <int32_t>new_len
        out.last_page_len[b] = <int32_t>(new_len - (<int64_t>n_pages - 1) * ps) if n_pages else 0

    cdef void drop_copy_sources(self, PkvStepOut& out) noexcept nogil:
        """Let go of the shared pages the step copied, now that its pages are all taken."""
        cdef int64_t i
        for i in range(out.full.num_copied):
            self.allocator.decref_page(out.full.copy_src[i])
        for i in range(out.window.num_copied):
            self.window_allocator.decref_page(out.window.copy_src[i])

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
        cdef Py_ssize_t b, i, B = self.undo_seqs.size()
        cdef PkvSequence* seq
        cdef PkvUndoSeq* u
        # the commit's steps in reverse: the copies' sources held again, new
        # pages and full-pool copies dropped, window pages given back taken
        # back, window-pool copies dropped; then the previous open step
        for b in range(B - 1, -1, -1):
            u = &self.undo_seqs[b]
            if u.window_copy_source >= 0:
                self.window_allocator.hold(u.window_copy_source)
            if u.copy_source >= 0:
                self.allocator.hold(u.copy_source)
        for b in range(B - 1, -1, -1):
            u = &self.undo_seqs[b]
            seq = &deref(self.seqs.find(u.seq_id)).second
            if self.windowed:
                release_pages(self.window_allocator, seq.window_pages, u.num_window_pages)
            release_pages(self.allocator, seq.pages, u.num_pages)
            if u.copy_source >= 0:
                self.allocator.decref_page(seq.pages.back())
                seq.pages[seq.pages.size() - 1] = u.copy_source
            seq.length = u.length
            seq.tokens.resize(u.num_tokens)
            seq.hashes.resize(u.num_hashes)
        for i in range(<Py_ssize_t>self.undo_released.size() - 1, -1, -1):
            seq = &deref(self.seqs.find(self.undo_seqs[self.undo_released[i].b].seq_id)).second
            self.window_allocator.hold(self.undo_released[i].page)
            seq.window_pages[self.undo_released[i].index] = self.undo_released[i].page
        for b in range(B - 1, -1, -1):
            u = &self.undo_seqs[b]
            seq = &deref(self.seqs.find(u.seq_id)).second
            seq.window_released = u.window_released
            if u.window_copy_source >= 0:
                self.window_allocator.decref_page(seq.window_pages.back())
                seq.window_pages[seq.window_pages.size() - 1] = u.window_copy_source
        for i in range(<Py_ssize_t>self.undo_forgotten.size()):
            it = self.seqs.find(self.undo_forgotten[i].seq_id)
            if it != self.seqs.end():
                pkv_remember(self.undo_forgotten[i], deref(it).second)
        self.pending.swap(self.undo_pending)
        self.open_seqs.swap(self.undo_open_seqs)
        self.undo_pending.clear()
        self.undo_open_seqs.clear()
        self.undo_forgotten.clear()
        self.undo_released.clear()

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
        later prompt is matched against.  The window page at the same place
        joins the window pool's index under the full page's entry.  Returns
        how many full pages joined.
        """
        cdef size_t i
        cdef int64_t parent_entry, j
        cdef int joined = 0
        cdef PkvSequence* seq
        for i in range(self.pending.size()):
            it = self.seqs.find(self.pending[i].seq_id)
            if it == self.seqs.end():
                continue
            seq = &deref(it).second
            j = self.pending[i].index
            if j >= <int64_t>seq.pages.size() or j >= <int64_t>seq.hashes.size() or \
                    seq.hashes[j] != self.pending[i].hash or \
                    (j + 1) * self.page_size > <int64_t>seq.tokens.size():
                continue
            parent_entry = ROOT_ENTRY if j == 0 else self.allocator.entry_of(seq.pages[j - 1])
            if parent_entry == 0 or not self.allocator.cache_page(
                    seq.pages[j], self.pending[i].hash, parent_entry,
                    &seq.tokens[j * self.page_size]):
                continue
            joined += 1
            if self.windowed and seq.window_pages[j] != RELEASED:
                self.window_allocator.cache_page(
                    seq.window_pages[j], <uint64_t>self.allocator.entry_of(seq.pages[j]),
                    ROOT_ENTRY, &seq.tokens[j * self.page_size])
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
        """The sequence's leading token ids that the cache knows (prefix caching:
        all of them while ``len == seq_len``); ndarray, shape [known], int32 (a copy)."""
        entry = self.swapped_entry(seq_id)
        if entry is not None:
            return entry[1].copy()
        cdef PkvSequence* seq = self.find(seq_id)
        out = np.empty(seq.tokens.size(), dtype=np.int32)
        cdef int32_t[::1] view = out
        if seq.tokens.size():
            memcpy(&view[0], seq.tokens.data(), seq.tokens.size() * sizeof(int32_t))
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

    def adopt(self, int64_t length, token_ids=None, int64_t window_from=0, write=None):
        """A new sequence of ``length`` tokens on new pages, for K/V that come from
        elsewhere (import, load); returns its id.

        All or nothing over both pools.  Its window pages before page
        ``window_from`` are given back from the start.  ``token_ids`` (int32,
        at most ``length``: the leading tokens the cache will know, with
        prefix caching) extend into its hash chain.  ``write(seq_id)`` then
        fills its K/V; once it returns, the full pages of known tokens join
        the prefix cache, as a stored step's pages would.  If ``write``
        raises, the sequence is dropped and the error propagates.

        Raises
        ------
        OutOfPagesError
            Too few free pages in either pool; nothing changed.
        """
        seq_id = self.next_id
        self.place(seq_id, length, token_ids, window_from, write, "import")
        self.next_id += 1
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

    def swap_in(self, seq_id, int64_t window_from=0, write=None):
        """Give a swapped-out sequence new pages (as ``adopt`` does, its window pages
        before ``window_from`` given back) and its id, length and token ids again;
        ``write(seq_id)`` fills its K/V.  All or nothing: it stays swapped out
        when this raises (``OutOfPagesError``, or ``write``'s error)."""
        entry = self.swapped_entry(seq_id)
        if entry is None:
            self.find(seq_id)
            raise ValueError(f"seq_id: sequence {seq_id} is not swapped out")
        self.place(int(seq_id), entry[0], entry[1], window_from, write, "swap_in")
        del self.swapped[int(seq_id)]

    cdef place(self, int64_t seq_id, int64_t length, token_ids, int64_t window_from, write,
               str caller):
        """``adopt`` and ``swap_in``: sequence ``seq_id`` of ``length`` tokens on new pages."""
        cdef int64_t ps = self.page_size, j, num_pages = pages_for(length, ps)
        cdef int64_t window_needed = num_pages - window_from if self.windowed else 0
        cdef const int32_t[::1] tokens
        cdef uint64_t h = ROOT_HASH
        cdef PkvSequence seq
        if not 0 <= window_from <= num_pages:
            raise ValueError(f"window_from: expected 0 <= window_from <= {num_pages} pages, "
                             f"got {window_from}")
        if num_pages > self.allocator.num_free_pages:
            raise OutOfPagesError(
                f"{caller}: this sequence of {length} tokens needs {num_pages} pages, "
                f"{self.allocator.num_free_pages} of {self.allocator.num_pages} free"
                + (" in the full-attention pool" if self.windowed else ""))
        if window_needed > 0 and window_needed > self.window_allocator.num_free_pages:
            raise OutOfPagesError(
                f"{caller}: this sequence of {length} tokens needs {window_needed} window pages, "
                f"{self.window_allocator.num_free_pages} of {self.window_allocator.num_pages} "
                f"free in the window pool (the sliding-window layers; num_window_pages)")
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
        for j in range(num_pages):
            seq.pages.push_back(self.allocator.take_page())
        if self.windowed:
            seq.window_pages.assign(window_from, RELEASED)
            seq.window_released = window_from
            for j in range(window_from, num_pages):
                seq.window_pages.push_back(self.window_allocator.take_page())
        seq.length = length
        self.seqs[seq_id] = seq
        try:
            if write is not None:
                write(seq_id)
        except BaseException:
            self.drop(self.find_id(seq_id))
            self.seqs.erase(seq_id)
            raise
        self.cache_known_pages(self.find_id(seq_id))

    cdef void cache_known_pages(self, PkvSequence* seq) noexcept nogil:
        """Enter a written sequence's full pages of known tokens in the prefix index,
        in chain order, with their window pages (as ``close_step`` does)."""
        cdef int64_t j, parent_entry, ps = self.page_size
        for j in range(<int64_t>seq.hashes.size()):
            parent_entry = ROOT_ENTRY if j == 0 else self.allocator.entry_of(seq.pages[j - 1])
            if parent_entry == 0 or not self.allocator.cache_page(
                    seq.pages[j], seq.hashes[j], parent_entry, &seq.tokens[j * ps]):
                continue
            if self.windowed and seq.window_pages[j] != RELEASED:
                self.window_allocator.cache_page(
                    seq.window_pages[j], <uint64_t>self.allocator.entry_of(seq.pages[j]),
                    ROOT_ENTRY, &seq.tokens[j * ps])

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
        cdef int32_t p
        cdef int64_t entry, parent
        cdef list found = []
        if self.caching:
            for p in range(a.num_pages):
                if a._entry[p]:
                    found.append((a._entry[p], p))
        found.sort()          # entries grow with each insertion: parents come first
        index_of = {}
        pages, parents, windows = [], [], []
        for entry, p in found:
            parent = a._parent_entry[p]
            if parent != ROOT_ENTRY and parent not in index_of:
                continue      # its parent was evicted: no prompt reaches it
            index_of[entry] = len(pages)
            pages.append(p)
            parents.append(-1 if parent == ROOT_ENTRY else index_of[parent])
            windows.append(self.window_allocator.lookup(<uint64_t>entry, ROOT_ENTRY,
                                                        &a._tokens[p, 0])
                           if self.windowed else -1)
        page_ids = np.asarray(pages, dtype=np.int32)
        return {"pages": page_ids, "parents": np.asarray(parents, dtype=np.int64),
                "tokens": np.asarray(a._tokens)[page_ids].reshape(len(pages), self.page_size),
                "window_pages": np.asarray(windows, dtype=np.int32)}

    def add_cached_chains(self, token_ids, parents, has_window, write, int64_t reserve=0,
                          int64_t reserve_window=0):
        """Enter page chains from elsewhere (a file) in the prefix cache, as free,
        evictable pages that prompts starting with their tokens hit.

        A page already cached here (same tokens after the same parent) is
        kept and not written again.  All or nothing.

        Parameters
        ----------
        token_ids : ndarray, shape [N, page_size], int32
        parents : ndarray, shape [N], int64
            Each page's parent: an earlier index, or -1 for a prompt's first page.
        has_window : ndarray, shape [N], bool
            Whether the windowed layers' K/V of the page come too.
        write : callable
            ``write(pages, window_pages)``, two int32 arrays of shape [N]:
            fill the K/V of page ``i`` into ``pages[i]`` and ``window_pages[i]``
            where they are >= 0 (the pages not cached here yet).  If it raises,
            nothing stays taken or cached, and the error propagates.
        reserve, reserve_window : int
            Pages of each pool that must stay free besides (for sequences the
            caller places next); the pages entered here are evicted after any
            other free page.

        Returns
        -------
        int
            Pages of the chains that are now cached here (new or already there).

        Raises
        ------
        OutOfPagesError
            Too few free pages; nothing changed.
        """
        cdef const int32_t[:, ::1] tokens = token_ids
        cdef const int64_t[::1] parent = parents
        cdef const cnp.uint8_t[::1] window = has_window.view(np.uint8)
        cdef Py_ssize_t N = tokens.shape[0], i
        cdef int64_t entry, needed = 0, window_needed = 0, busy = 0, window_busy = 0
        if tokens.shape[1] != self.page_size or parent.shape[0] != N or window.shape[0] != N:
            raise ValueError(f"token_ids, parents, has_window: expected shapes [N, "
                             f"{self.page_size}], [N], [N], got {list(token_ids.shape)}, "
                             f"{list(parents.shape)}, {list(has_window.shape)}")
        hashes = np.zeros(N, dtype=np.uint64)
        cdef uint64_t[::1] h = hashes
        pages_out = np.full(N, -1, dtype=np.int32)
        window_out = np.full(N, -1, dtype=np.int32)
        write_pages = np.full(N, -1, dtype=np.int32)
        write_window = np.full(N, -1, dtype=np.int32)
        cdef int32_t[::1] page = pages_out, wpage = window_out
        cdef int32_t[::1] new_page = write_pages, new_wpage = write_window
        # Plan: hash every page, find those cached here already; nothing changes yet.
        for i in range(N):
            if not -1 <= parent[i] < i:
                raise ValueError(f"parents: page {i} names parent {parent[i]}; expected -1 or "
                                 f"an earlier page")
            h[i] = self.page_hash(ROOT_HASH if parent[i] < 0 else h[parent[i]], &tokens[i, 0])
            entry = ROOT_ENTRY if parent[i] < 0 else \
                (self.allocator.entry_of(page[parent[i]]) if page[parent[i]] >= 0 else 0)
            if entry != 0:
                page[i] = self.allocator.lookup(h[i], entry, &tokens[i, 0])
            if page[i] >= 0:
                busy += self.allocator.refcount_of(page[i]) == 0
                if self.windowed and window[i]:
                    wpage[i] = self.window_allocator.lookup(
                        <uint64_t>self.allocator.entry_of(page[i]), ROOT_ENTRY, &tokens[i, 0])
                    if wpage[i] >= 0:
                        window_busy += self.window_allocator.refcount_of(wpage[i]) == 0
                    else:
                        window_needed += 1
            else:
                needed += 1
                window_needed += self.windowed and window[i]
        if needed + reserve + busy > self.allocator.num_free_pages:
            raise OutOfPagesError(
                f"load: the prefix cache's chains need {needed} pages besides the "
                f"sequences' {reserve}, {self.allocator.num_free_pages - busy} of "
                f"{self.allocator.num_pages} free"
                + (" in the full-attention pool" if self.windowed else ""))
        if self.windowed and window_needed + reserve_window + window_busy > \
                self.window_allocator.num_free_pages:
            raise OutOfPagesError(
                f"load: the prefix cache's chains need {window_needed} window pages besides "
                f"the sequences' {reserve_window}, "
                f"{self.window_allocator.num_free_pages - window_busy} of "
                f"{self.window_allocator.num_pages} free in the window pool")
        # Commit: hold the pages found (before any take could evict one), take the
        # new ones, write, cache, let go.
        for i in range(N):
            if page[i] >= 0:
                self.allocator.acquire(page[i])
            if wpage[i] >= 0:
                self.window_allocator.acquire(wpage[i])
        for i in range(N):
            if page[i] < 0:
                page[i] = new_page[i] = self.allocator.take_page()
            if self.windowed and window[i] and wpage[i] < 0:
                wpage[i] = new_wpage[i] = self.window_allocator.take_page()
        try:
            write(write_pages, write_window)
        except BaseException:
            self.release_chains(page, wpage)
            raise
        cdef int64_t joined = 0
        for i in range(N):
            entry = ROOT_ENTRY if parent[i] < 0 else self.allocator.entry_of(page[parent[i]])
            if new_page[i] >= 0 and entry != 0:
                self.allocator.cache_page(page[i], h[i], entry, &tokens[i, 0])
            if self.allocator.entry_of(page[i]) == 0:
                continue
            joined += 1
            if new_wpage[i] >= 0:
                self.window_allocator.cache_page(
                    wpage[i], <uint64_t>self.allocator.entry_of(page[i]), ROOT_ENTRY,
                    &tokens[i, 0])
        self.release_chains(page, wpage)
        return joined

    cdef void release_chains(self, int32_t[::1] page, int32_t[::1] wpage) noexcept nogil:
        """Drop the references ``add_cached_chains`` took, last page first (so that
        a chain's tail is evicted before its head)."""
        cdef Py_ssize_t i
        for i in range(page.shape[0] - 1, -1, -1):
            if page[i] >= 0:
                self.allocator.decref_page(page[i])
            if wpage[i] >= 0:
                self.window_allocator.decref_page(wpage[i])
