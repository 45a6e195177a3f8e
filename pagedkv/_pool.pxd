# The pool of the page tables (see _pool.pyx), for the modules that cimport it.
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map

from pagedkv._allocator cimport PageAllocator
from pagedkv.pkv_page_table cimport (PkvPages, PkvSequence, PkvUndoPages, PkvReleased,
                                     PkvPoolPlan, PkvPoolOut)

cdef enum:
    # a page list's entry for a page given back
    RELEASED = -1
    # the prefix chain's root: the "parent hash" of every sequence's first page,
    # and the parent entry that marks a first page in the prefix index
    ROOT_HASH = 0
    ROOT_ENTRY = -1


cdef inline int64_t rows_from(const PkvPages& own, int64_t page_size) noexcept nogil:
    """The first position whose rows the list ``own`` holds."""
    return max(own.released * page_size, own.first_row)


cdef inline int64_t pages_for(int64_t num_tokens, int64_t page_size) noexcept nogil:
    return (num_tokens + page_size - 1) // page_size


cdef class PoolTables:
    cdef readonly cnp.ndarray slot_mapping, page_indices, block_table, copy_src, copy_dst


cdef PoolTables new_pool_tables(PkvPoolOut& out, Py_ssize_t B, int64_t total_new, int64_t nnz,
                                int64_t max_pages, int64_t num_copies)


cdef class Pool:
    cdef readonly PageAllocator allocator
    cdef readonly int index
    cdef readonly int64_t span
    cdef readonly int64_t rollback
    cdef readonly bint gives_back
    cdef readonly object names
    cdef int64_t page_size
    cdef vector[PkvUndoPages] undo
    cdef vector[PkvReleased] undo_released

    cpdef int64_t keep_from(self, int64_t old_len, int64_t new_len) noexcept nogil
    cdef int64_t first_held(self, int64_t first_page) noexcept nogil
    cdef int check_first_held(self, int64_t length, int64_t first_page,
                              int64_t first_row) except -1
    cpdef str free_text(self, int64_t busy=*, bint hint=*)
    cdef int start(self, PkvPages& own, int64_t first, int64_t num_pages,
                   int64_t first_row) except -1
    cdef int start_on(self, PkvPages& own, int64_t first, vector[int32_t]& found) except -1
    cdef void share(self, PkvPages& own) noexcept nogil
    cdef void drop(self, PkvPages& own) noexcept nogil
    cdef void truncate(self, PkvPages& own, int64_t num_pages) noexcept nogil
    cdef int check_rollback(self, PkvPages& own, int64_t length, int64_t new_len) except -1
    cdef int check_held(self, PkvPages& own, int64_t start, int64_t stop) except -1
    cdef bint find_cached(self, PageAllocator chain, vector[int32_t]& found,
                          const int32_t* prompt, int64_t hit,
                          vector[int32_t]& out) noexcept nogil
    cdef void cache_under(self, PkvPages& own, int64_t j, int64_t entry,
                          const int32_t* tokens) noexcept nogil
    cdef void plan(self, PkvPoolPlan& plan, vector[PkvSequence*]& batch,
                   int64_t[::1] counts) noexcept nogil
    cdef void count_releases(self, PkvPages& own, int64_t old_len, int64_t new_len,
                             unordered_map[int32_t, int32_t]& releases) noexcept nogil
    cdef int check_room(self, PkvPoolPlan& plan) except -1
    cdef void commit(self, PkvPoolPlan& plan, vector[PkvSequence*]& batch, int64_t[::1] counts,
                     PkvPoolOut& out, int64_t max_pages) noexcept nogil
    cdef void give_back(self, PkvPages& own, int64_t keep_from, int64_t b) noexcept nogil
    cdef void undo_commit(self, vector[PkvSequence*]& batch) noexcept nogil
    cdef void undo_copy(self, vector[int32_t]& pages, int32_t source) noexcept nogil
