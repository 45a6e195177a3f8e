from libc.stdint cimport int32_t

cdef class PageAllocator:
    cdef readonly int num_pages
    cdef int num_free_pages
    cdef int32_t[::1] _refcount
    # The free queue: an intrusive doubly linked list over page ids, so that
    # taking or returning any page is O(1).  -1 ends the list.
    cdef int32_t[::1] _next
    cdef int32_t[::1] _prev
    cdef int32_t _head
    cdef int32_t _tail

    cdef int32_t take_page(self) noexcept nogil
    cdef void incref_page(self, int32_t page) noexcept nogil
    cdef bint decref_page(self, int32_t page) noexcept nogil
    cdef int32_t refcount_of(self, int32_t page) noexcept nogil
    cdef void _push_tail(self, int32_t page) noexcept nogil
    cdef void _unlink(self, int32_t page) noexcept nogil
