# The page tables (see _page_table.pyx), for the modules that work on them:
# _placement (sequences placed with K/V from elsewhere) and _prefix_chains.
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.pair cimport pair
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map

from pagedkv._allocator cimport PageAllocator
from pagedkv.pkv_page_table cimport (PkvPages, PkvSequence, PkvPendingPage, PkvUndoSeq,
                                     PkvForgotten, PkvStepPlan, PkvStepOut)


cdef class PageTables:
    cdef readonly tuple pools
    # ``pools``, borrowed (the tuple holds them), for the loops that run without the GIL
    cdef vector[PyObject*] pool_refs
    cdef PageAllocator allocator          # pools[0]'s: the prefix chain's
    cdef readonly int page_size
    cdef readonly bint caching
    cdef object hash_fn
    cdef unordered_map[int64_t, PkvSequence] seqs
    # the open step: pages it filled (cached once it is stored in every layer)
    # and its sequences' lengths before it (forgotten tokens if abandoned)
    cdef vector[PkvPendingPage] pending
    cdef vector[pair[int64_t, int64_t]] open_seqs
    cdef public int64_t next_id          # the id the next new sequence gets
    cdef int64_t num_steps
    cdef readonly int64_t num_prompt_tokens    # passed to add(token_ids=...)
    cdef readonly int64_t num_reused_tokens    # of those, found in the prefix cache
    cdef readonly dict swapped                # swapped-out id -> (length, known token ids)
    # how to undo the last append (``undo_append``), while ``undo_armed``; each
    # pool keeps its own part
    cdef bint undo_armed
    cdef vector[PkvSequence*] undo_batch
    cdef vector[PkvUndoSeq] undo_seqs
    cdef vector[PkvForgotten] undo_forgotten
    cdef vector[PkvPendingPage] undo_pending
    cdef vector[pair[int64_t, int64_t]] undo_open_seqs

    cdef uint64_t page_hash(self, uint64_t parent_hash, const int32_t* tokens) except? 0
    cdef PkvSequence* find(self, seq_id) except NULL
    cdef PkvSequence* find_id(self, int64_t seq_id) except NULL
    cdef PkvPages* pool_list(self, seq_id, int pool) except NULL
    cdef bint find_cached(self, vector[vector[int32_t]]& found, const int32_t* prompt,
                          int64_t hit) noexcept nogil
    cdef void drop(self, PkvSequence* seq) noexcept nogil
    cdef int new_page_hashes(self, PkvSequence* seq, int64_t num_new, const int32_t* new_tokens,
                             vector[uint64_t]& out) except -1
    cdef int plan_step(self, PkvStepPlan& plan, int64_t[::1] ids,
                       int64_t[::1] counts, int64_t cap, bint track,
                       const int32_t* tokens) except -1
    cdef object new_tables(self, PkvStepPlan& plan, PkvStepOut& out)
    cdef void commit_step(self, PkvStepPlan& plan, int64_t[::1] ids,
                          int64_t[::1] counts, bint track, const int32_t* tokens,
                          PkvStepOut& out) noexcept nogil
    cdef void extend_sequence(self, PkvStepPlan& plan, Py_ssize_t b, int64_t seq_id,
                              int64_t count, bint track, const int32_t* tokens, int64_t row,
                              PkvStepOut& out) noexcept nogil
    cdef void undo_last_append(self) noexcept nogil
    cdef void record_full_pages(self, int64_t seq_id, PkvSequence* seq,
                                vector[uint64_t]& new_hashes) noexcept nogil
    cdef void abandon_step(self, bint record=*) noexcept nogil
    cdef object swapped_entry(self, seq_id)
    cdef void cache_known_pages(self, PkvSequence* seq) noexcept nogil
    cdef int64_t chain_entry(self, PkvSequence* seq, int64_t j) noexcept nogil
    cdef void cache_in_other_pools(self, PkvSequence* seq, int64_t j) noexcept nogil
