# distutils: language = c++
"""Per-sequence page tables and the per-step tables kernels read.

Each sequence owns an ordered list of page ids and a length.  ``append``
reserves the slots for one step, all or nothing, copying a shared last page
first (copy-on-write), and builds every table format an engine may want:
the slot mapping (vLLM), the CSR page table (FlashInfer, TVM) and the padded
block table.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
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
    };
    """
    cdef cppclass PkvSequence:
        PkvSequence() except +
        vector[int32_t] pages
        int64_t length


cdef inline int64_t pages_for(int64_t num_tokens, int64_t page_size) noexcept nogil:
    return (num_tokens + page_size - 1) // page_size


cdef class PageTables:
    """The page tables of every live sequence, over one :class:`PageAllocator`.

    Parameters
    ----------
    allocator : PageAllocator
        Pool the pages come from.
    page_size : int
        Tokens per page.
    """
    cdef PageAllocator allocator
    cdef readonly int page_size
    cdef unordered_map[int64_t, PkvSequence] seqs
    cdef int64_t next_id

    def __cinit__(self, PageAllocator allocator, int page_size):
        if page_size <= 0:
            raise ValueError(f"page_size: expected a positive int, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.next_id = 0

    cdef PkvSequence* find(self, seq_id) except NULL:
        if not isinstance(seq_id, (int, np.integer)) or isinstance(seq_id, bool):
            raise UnknownSequenceError(f"seq_id: expected an int sequence id, got {seq_id!r}")
        it = self.seqs.find(<int64_t>seq_id) if -2**63 <= seq_id < 2**63 else self.seqs.end()
        if it == self.seqs.end():
            raise UnknownSequenceError(f"seq_id: no live sequence {seq_id!r} (never added, or freed)")
        return &deref(it).second

    # -- sequences ---------------------------------------------------------------
    def add(self):
        """Create an empty sequence; return its id (ids are never reused)."""
        cdef int64_t seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = PkvSequence()
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
        cdef size_t i
        for i in range(seq.pages.size()):
            self.allocator.decref_page(seq.pages[i])
        self.seqs.erase(<int64_t>seq_id)

    def clear(self):
        """Free every sequence."""
        cdef size_t i
        for kv in self.seqs:
            for i in range(kv.second.pages.size()):
                self.allocator.decref_page(kv.second.pages[i])
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
        cdef int64_t keep = pages_for(new_len, self.page_size)
        while <int64_t>seq.pages.size() > keep:
            self.allocator.decref_page(seq.pages.back())
            seq.pages.pop_back()
        seq.length = new_len

    # -- one step ----------------------------------------------------------------
    def append(self, seq_ids, num_new_tokens, max_seq_len=None):
        """Reserve slots for ``num_new_tokens[b]`` new tokens of each ``seq_ids[b]``.

        All or nothing: on any error no sequence or page changes.  A sequence
        whose last page is shared and partly filled gets a private copy of it
        first; the (source, destination) pairs are returned so that the backend
        copies the data before anything is stored.

        Parameters
        ----------
        seq_ids : ndarray, shape [B], int64
            Distinct live sequence ids.
        num_new_tokens : ndarray, shape [B], int64
            New tokens per sequence, each >= 0.
        max_seq_len : int or None
            Cap on any sequence's length.

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
        cdef Py_ssize_t B = ids.shape[0], b
        cdef int64_t ps = self.page_size
        cdef int64_t cap = -1 if max_seq_len is None else max_seq_len
        cdef vector[PkvSequence*] batch
        cdef unordered_set[int64_t] seen
        # copies this step will make per shared page: the last writer of a
        # page shared only within the step keeps it instead of copying
        cdef unordered_map[int32_t, int32_t] copies_of
        cdef PkvSequence* seq
        cdef int64_t needed = 0, new_len, total_new = 0, nnz = 0, num_copies = 0, max_pages = 0
        cdef bint cow

        # Pass 1: validate everything and count pages; nothing changes yet.
        batch.reserve(B)
        for b in range(B):
            seq = self.find(ids[b])
            if not seen.insert(ids[b]).second:
                raise ValueError(f"seq_ids: sequence {ids[b]} appears more than once in one step")
            new_len = seq.length + counts[b]
            if cap >= 0 and new_len > cap:
                raise ValueError(f"num_new_tokens: sequence {ids[b]} would reach {new_len} tokens, "
                                 f"over max_seq_len={cap}")
            if new_len >= 2**31:
                raise ValueError(f"num_new_tokens: sequence {ids[b]} would reach {new_len} tokens, "
                                 f"over the int32 limit of the tables")
            cow = counts[b] > 0 and seq.length % ps != 0 and \
                self.allocator.refcount_of(seq.pages.back()) - copies_of[seq.pages.back()] > 1
            if cow:
                copies_of[seq.pages.back()] += 1
            needed += pages_for(new_len, ps) - <int64_t>seq.pages.size() + cow
            num_copies += cow
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
        cdef int64_t row = 0, pos, j, c = 0
        cdef int32_t page
        cdef size_t n_pages

        # Pass 2: commit (cannot fail) and fill the tables.
        with nogil:
            query_start[0] = 0
            page_indptr[0] = 0
            for b in range(B):
                seq = batch[b]
                if counts[b] > 0 and seq.length % ps != 0 and \
                        self.allocator.refcount_of(seq.pages.back()) > 1:
                    page = self.allocator.take_page()
                    copy_src[c] = seq.pages.back()
                    copy_dst[c] = page
                    c += 1
                    self.allocator.decref_page(seq.pages.back())
                    seq.pages[seq.pages.size() - 1] = page
                new_len = seq.length + counts[b]
                while <int64_t>seq.pages.size() < pages_for(new_len, ps):
                    seq.pages.push_back(self.allocator.take_page())
                for pos in range(seq.length, new_len):
                    slot_mapping[row] = <int64_t>seq.pages[pos // ps] * ps + pos % ps
                    row += 1
                seq.length = new_len
                n_pages = seq.pages.size()
                for j in range(<int64_t>n_pages):
                    page_indices[page_indptr[b] + j] = seq.pages[j]
                    block_table[b, j] = seq.pages[j]
                page_indptr[b + 1] = page_indptr[b] + <int32_t>n_pages
                query_start[b + 1] = <int32_t>row
                seq_lens[b] = <int32_t>new_len
                last_page_len[b] = <int32_t>(new_len - (<int64_t>n_pages - 1) * ps) if n_pages else 0
        return out
