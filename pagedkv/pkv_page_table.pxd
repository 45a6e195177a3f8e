# Cython's view of pkv_page_table.h: the page tables' records (written there once).
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map


cdef extern from "pkv_page_table.h" nogil:
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
                    size_t num_tokens, size_t num_hashes)
    void pkv_remember(PkvForgotten& f, PkvSequence& seq)
    uint64_t pkv_hash_page(uint64_t parent_hash, const int32_t* tokens, int n)
