# distutils: language = c++
"""Per-sequence page tables and the per-step tables kernels read.

Each sequence owns an ordered list of page ids and a length.  ``append``
reserves the slots for one step, all or nothing, copying a shared or cached
last page first (copy-on-write), and builds every table format an engine may
want: the slot mapping (vLLM), the CSR page table (FlashInfer, TVM) and the
padded block table.

With prefix caching, a sequence also keeps its token ids and the hash chain
of its full pages (``hash(parent page's hash, page's token ids)``).  A page
that a step fills is entered in the allocator's prefix index only once that
step's K/V is stored in every layer (``commit_pending``): a step abandoned
before that (another append, a truncate, a free) leaves nothing reusable.
``add(token_ids)`` starts a sequence on the longest cached chain of its prompt.
"""
import numbers

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy
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
    struct PkvSequence {
        std::vector<int32_t> pages;
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
    """
    cdef cppclass PkvSequence:
        PkvSequence() except +
        vector[int32_t] pages
        int64_t length
        int64_t last_step
        vector[int32_t] tokens
        vector[uint64_t] hashes
    cdef cppclass PkvPendingPage:
        int64_t seq_id
        int64_t index
        uint64_t hash

cdef extern from "pkv_hash.h" nogil:
    uint64_t pkv_hash_page(uint64_t parent_hash, const int32_t* tokens, int n)

# The chain's root: the "parent hash" of every sequence's first page, and the
# parent entry that marks a first page in the prefix index.
cdef uint64_t ROOT_HASH = 0
cdef int64_t ROOT_ENTRY = -1


cdef inline int64_t pages_for(int64_t num_tokens, int64_t page_size) noexcept nogil:
    return (num_tokens + page_size - 1) // page_size


cdef void release_pages(PageAllocator allocator, PkvSequence* seq, int64_t keep) noexcept nogil:
    """Drop the sequence's pages past the first ``keep``, last page first, so
    that a freed chain enters the LRU end-first and loses its tail first."""
    while <int64_t>seq.pages.size() > keep:
        allocator.decref_page(seq.pages.back())
        seq.pages.pop_back()


cdef class PageTables:
    """The page tables of every live sequence, over one :class:`PageAllocator`.

    Parameters
    ----------
    allocator : PageAllocator
        Pool the pages come from; its ``page_size`` and ``prefix_caching`` apply.
    hash_fn : callable, optional
        ``hash_fn(parent_hash: int, token_ids: tuple) -> int`` replaces the
        default page hash (e.g. to force collisions in tests).
    """
    cdef PageAllocator allocator
    cdef readonly int page_size
    cdef bint caching
    cdef object hash_fn
    cdef unordered_map[int64_t, PkvSequence] seqs
    cdef vector[PkvPendingPage] pending     # pages the last step filled, not yet cached
    cdef int64_t next_id
    cdef int64_t num_steps
    cdef readonly int64_t num_prompt_tokens    # passed to add(token_ids=...)
    cdef readonly int64_t num_reused_tokens    # of those, found in the prefix cache

    def __cinit__(self, PageAllocator allocator, hash_fn=None):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.caching = allocator.prefix_caching
        self.hash_fn = hash_fn
        self.next_id = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_reused_tokens = 0

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
            raise UnknownSequenceError(f"seq_id: no live sequence {seq_id} (never added, or freed)")
        return &deref(it).second

    # -- sequences ---------------------------------------------------------------
    def add(self, token_ids=None):
        """Create a sequence; return its id (ids are never reused).

        With prefix caching and ``token_ids`` (the prompt, int32 [n]), the
        sequence starts on the longest cached chain of full pages of the
        prompt, short of its last token; ``seq_len`` tells how many tokens
        that covers.  Nothing is reserved for the rest.
        """
        cdef PkvSequence seq
        cdef int32_t[::1] prompt
        cdef int64_t j, num_full, ps = self.page_size
        cdef int64_t parent_entry = ROOT_ENTRY
        cdef uint64_t h = ROOT_HASH
        cdef vector[uint64_t] chain
        cdef int32_t page
        if self.caching and token_ids is not None:
            prompt = token_ids
            num_full = (prompt.shape[0] - 1) // ps if prompt.shape[0] else 0
            # hash first: a user hash function may raise, and nothing is held yet
            for j in range(num_full):
                h = self.page_hash(h, &prompt[j * ps])
                chain.push_back(h)
            for j in range(num_full):
                h = chain[j]
                page = self.allocator.lookup(h, parent_entry, &prompt[j * ps])
                if page < 0:
                    break
                self.allocator.acquire(page)
                parent_entry = self.allocator.entry_of(page)
                seq.pages.push_back(page)
                seq.hashes.push_back(h)
            seq.length = <int64_t>seq.pages.size() * ps
            seq.tokens.assign(&prompt[0], &prompt[0] + seq.length) if seq.length else None
            self.num_prompt_tokens += prompt.shape[0]
            self.num_reused_tokens += seq.length
        cdef int64_t seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = seq
        return seq_id

    def fork(self, parent_id):
        """A new sequence sharing every page of ``parent_id`` (ref counts only)."""
        cdef PkvSequence* parent = self.find(parent_id)
        cdef int64_t child_id = self.next_id
        cdef size_t i
        for i in range(parent.pages.size()):
            self.allocator.incref_page(parent.pages[i])
        self.next_id += 1
        self.seqs[child_id] = deref(parent)   # copies the page list, not the pages
        return child_id

    def free(self, seq_id):
        """Drop the sequence; its pages go back to the pool once no one shares them."""
        cdef PkvSequence* seq = self.find(seq_id)
        self.pending.clear()
        release_pages(self.allocator, seq, 0)
        self.seqs.erase(<int64_t>seq_id)

    def clear(self):
        """Free every sequence."""
        self.pending.clear()
        for kv in self.seqs:
            release_pages(self.allocator, &kv.second, 0)
        self.seqs.clear()

    def __contains__(self, seq_id):
        try:
            self.find(seq_id)
        except UnknownSequenceError:
            return False
        return True

    def __len__(self):
        return self.seqs.size()

    def ids(self):
        """Ids of the live sequences, ascending."""
        return sorted(kv.first for kv in self.seqs)

    def seq_len(self, seq_id):
        """Tokens stored in the sequence."""
        return self.find(seq_id).length

    def pages(self, seq_id):
        """The sequence's page ids in order; ndarray, shape [num_pages], int32 (a copy)."""
        cdef PkvSequence* seq = self.find(seq_id)
        out = np.empty(seq.pages.size(), dtype=np.int32)
        cdef int32_t[::1] view = out
        cdef size_t i
        for i in range(seq.pages.size()):
            view[i] = seq.pages[i]
        return out

    def slots(self, seq_id, int64_t start, int64_t stop):
        """Slots (``page * page_size + offset``) of positions ``start:stop``.

        Returns
        -------
        slots : ndarray, shape [stop - start], int64
        """
        cdef PkvSequence* seq = self.find(seq_id)
        if not 0 <= start <= stop <= seq.length:
            raise ValueError(f"positions {start}:{stop}: expected 0 <= start <= stop <= "
                             f"seq_len={seq.length}")
        out = np.empty(stop - start, dtype=np.int64)
        cdef int64_t[::1] view = out
        cdef int64_t pos, ps = self.page_size
        for pos in range(start, stop):
            view[pos - start] = <int64_t>seq.pages[pos // ps] * ps + pos % ps
        return out

    def truncate(self, seq_id, int64_t new_len):
        """Shorten the sequence to ``new_len`` tokens; pages past it are released."""
        cdef PkvSequence* seq = self.find(seq_id)
        if not 0 <= new_len <= seq.length:
            raise ValueError(f"new_len: expected 0 <= new_len <= seq_len={seq.length}, got {new_len}")
        self.pending.clear()
        release_pages(self.allocator, seq, pages_for(new_len, self.page_size))
        seq.length = new_len
        if <int64_t>seq.tokens.size() > new_len:
            seq.tokens.resize(new_len)
        if <int64_t>seq.hashes.size() > new_len // self.page_size:
            seq.hashes.resize(new_len // self.page_size)

    # -- one step ----------------------------------------------------------------
    cdef bint must_copy(self, PkvSequence* seq, int64_t num_new,
                        unordered_map[int32_t, int32_t]& copies_of) noexcept nogil:
        """Does writing ``num_new`` tokens need a private copy of the last page first?

        Yes when that page is partly filled and either cached (its content is
        promised to later prefix hits) or held by a sequence other than the
        writers of this step that already copied it.
        """
        if num_new == 0 or seq.length % self.page_size == 0:
            return False
        cdef int32_t last = seq.pages.back()
        if self.allocator.entry_of(last) != 0:
            return True
        cdef int32_t holders = self.allocator.refcount_of(last)
        if holders == 1:
            return False
        it = copies_of.find(last)
        return holders - (deref(it).second if it != copies_of.end() else 0) > 1

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

        All or nothing: on any error no sequence or page changes.  A sequence
        whose last page is partly filled and shared (or cached) gets a private
        copy of it first; the (source, destination) pairs are returned so that
        the backend copies the data before anything is stored.

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
            the prefix index; a sequence appended without them stops caching
            until truncated back to its known tokens.

        Returns
        -------
        dict of ndarray
            ``query_start`` [B+1] int32, ``seq_lens`` [B] int32,
            ``slot_mapping`` [total_new] int64, ``page_indptr`` [B+1] int32,
            ``page_indices`` [nnz] int32, ``last_page_len`` [B] int32,
            ``block_table`` [B, max_pages] int32 (-1 padded),
            ``copy_src`` / ``copy_dst`` [num_copies] int32.
        """
        cdef int64_t[::1] ids = seq_ids
        cdef int64_t[::1] counts = num_new_tokens
        cdef int32_t[::1] tokens
        cdef bint track = self.caching and token_ids is not None
        cdef Py_ssize_t B = ids.shape[0], b
        cdef int64_t ps = self.page_size
        cdef int64_t cap = -1 if max_seq_len is None else max_seq_len
        cdef vector[PkvSequence*] batch
        # copies this step will make per shared page: the last writer of a
        # page shared only within the step keeps it instead of copying
        cdef unordered_map[int32_t, int32_t] copies_of
        cdef vector[vector[uint64_t]] hashes
        cdef PkvSequence* seq
        cdef int64_t needed = 0, new_len, total_new = 0, nnz = 0, num_copies = 0, max_pages = 0
        cdef int64_t row = 0, pos, j, c = 0

        # Pass 1: validate everything, count pages and hash the pages this step
        # fills (a user hash function may raise); nothing changes yet.
        batch.reserve(B)
        self.num_steps += 1
        if track:
            tokens = token_ids
            hashes.resize(B)
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
            if self.must_copy(seq, counts[b], copies_of):
                copies_of[seq.pages.back()] += 1
                needed += 1
                num_copies += 1
            needed += pages_for(new_len, ps) - <int64_t>seq.pages.size()
            if track and <int64_t>seq.tokens.size() == seq.length:
                self.new_page_hashes(seq, counts[b], &tokens[total_new] if counts[b] else NULL,
                                     hashes[b])
            total_new += counts[b]
            nnz += pages_for(new_len, ps)
            max_pages = max(max_pages, pages_for(new_len, ps))
            batch.push_back(seq)
        if needed > self.allocator.num_free_pages:
            raise OutOfPagesError(f"append: this step needs {needed} new pages, "
                                  f"{self.allocator.num_free_pages} of {self.allocator.num_pages} free")

        out = {
            "query_start": np.empty(B + 1, dtype=np.int32),
            "seq_lens": np.empty(B, dtype=np.int32),
            "slot_mapping": np.empty(total_new, dtype=np.int64),
            "page_indptr": np.empty(B + 1, dtype=np.int32),
            "page_indices": np.empty(nnz, dtype=np.int32),
            "last_page_len": np.empty(B, dtype=np.int32),
            "block_table": np.full((B, max_pages), -1, dtype=np.int32),
            "copy_src": np.empty(num_copies, dtype=np.int32),
            "copy_dst": np.empty(num_copies, dtype=np.int32),
        }
        cdef int32_t[::1] query_start = out["query_start"], seq_lens = out["seq_lens"]
        cdef int64_t[::1] slot_mapping = out["slot_mapping"]
        cdef int32_t[::1] page_indptr = out["page_indptr"], page_indices = out["page_indices"]
        cdef int32_t[::1] last_page_len = out["last_page_len"]
        cdef int32_t[:, ::1] block_table = out["block_table"]
        cdef int32_t[::1] copy_src = out["copy_src"], copy_dst = out["copy_dst"]
        cdef int32_t page
        cdef size_t n_pages
        copies_of.clear()
        self.pending.clear()     # the previous step's pages, if still pending, are abandoned

        # Pass 2: commit (cannot fail) and fill the tables.
        with nogil:
            query_start[0] = 0
            page_indptr[0] = 0
            for b in range(B):
                seq = batch[b]
                # copies_of stays empty here: the decrefs below are real now
                if self.must_copy(seq, counts[b], copies_of):
                    page = self.allocator.take_page()
                    copy_src[c] = seq.pages.back()
                    copy_dst[c] = page
                    c += 1
                    self.allocator.decref_page(seq.pages.back())
                    seq.pages[seq.pages.size() - 1] = page
                new_len = seq.length + counts[b]
                while <int64_t>seq.pages.size() < pages_for(new_len, ps):
                    seq.pages.push_back(self.allocator.take_page())
                if track and <int64_t>seq.tokens.size() == seq.length:
                    if counts[b] > 0:   # (row may be one past the end of tokens otherwise)
                        seq.tokens.insert(seq.tokens.end(), &tokens[row],
                                          &tokens[row] + counts[b])
                    self.record_full_pages(ids[b], seq, hashes[b])
                for pos in range(seq.length, new_len):
                    slot_mapping[row] = <int64_t>seq.pages[pos // ps] * ps + pos % ps
                    row += 1
                seq.length = new_len
                n_pages = seq.pages.size()
                if n_pages:
                    memcpy(&page_indices[page_indptr[b]], seq.pages.data(), n_pages * sizeof(int32_t))
                    memcpy(&block_table[b, 0], seq.pages.data(), n_pages * sizeof(int32_t))
                page_indptr[b + 1] = page_indptr[b] + <int32_t>n_pages
                query_start[b + 1] = <int32_t>row
                seq_lens[b] = <int32_t>new_len
                last_page_len[b] = <int32_t>(new_len - (<int64_t>n_pages - 1) * ps) if n_pages else 0
        return out

    cdef void record_full_pages(self, int64_t seq_id, PkvSequence* seq,
                                vector[uint64_t]& new_hashes) noexcept nogil:
        """Extend the sequence's hash chain by the pages this step fills, and hold
        them as pending until ``commit_pending``."""
        cdef size_t i
        cdef PkvPendingPage entry
        for i in range(new_hashes.size()):
            entry.seq_id = seq_id
            entry.index = seq.hashes.size()
            entry.hash = new_hashes[i]
            seq.hashes.push_back(new_hashes[i])
            self.pending.push_back(entry)

    def commit_pending(self):
        """Enter the last step's filled pages in the prefix index, in chain order.

        Call once the step's K/V is stored in every layer.  A page joins only
        if its parent page is cached: the chain is what a later prompt is
        matched against.  Returns how many pages joined.
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
            if parent_entry != 0 and self.allocator.cache_page(
                    seq.pages[j], self.pending[i].hash, parent_entry,
                    &seq.tokens[j * self.page_size]):
                joined += 1
        self.pending.clear()
        return joined

    @property
    def num_pending(self):
        """Pages the last step filled that wait for ``commit_pending``."""
        return self.pending.size()
