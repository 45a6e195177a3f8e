# distutils: language = c++
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.unordered_map cimport unordered_map

cdef class PageAllocator:
    cdef readonly int num_pages
    cdef readonly int page_size
    cdef readonly bint prefix_caching
    cdef int num_free_pages          # free + evictable: what an allocation can take
    cdef int num_evictable           # free pages that still hold a cached prefix
    cdef readonly int64_t num_evictions
    # pages with two references or more: 0 means no two holders (sequences) share
    # a page, which lets a step skip the shared-prefix (cascade) search
    cdef readonly int64_t num_shared_pages
    cdef int32_t[::1] _refcount
    # The free queue: an intrusive doubly linked list over page ids (-1 ends
    # it), so that taking, returning or reviving any page is O(1).  Allocation
    # takes the head.  Pages without a cached prefix return to the head (reused
    # first); cached ones to the tail, so the head end is least recently used.
    cdef int32_t[::1] _next
    cdef int32_t[::1] _prev
    cdef int32_t _head
    cdef int32_t _tail
    # The prefix index: cached full pages by hash.  `_entry[p]` is a unique id
    # of p's current cached content (0 = not cached); a child page records its
    # parent's entry, so a chain never matches through an evicted-and-reused
    # parent.  `_tokens[p]` confirms a hit exactly.
    cdef unordered_map[uint64_t, int32_t] _index
    cdef uint64_t[::1] _hash
    cdef int64_t[::1] _entry
    cdef int64_t[::1] _parent_entry
    cdef int32_t[:, ::1] _tokens
    cdef readonly int64_t num_cache_insertions   # also the id of the newest cache entry

    cdef int32_t take_page(self) noexcept nogil
    cdef void incref_page(self, int32_t page) noexcept nogil
    cdef bint decref_page(self, int32_t page) noexcept nogil
    cdef int32_t refcount_of(self, int32_t page) noexcept nogil
    cdef int64_t entry_of(self, int32_t page) noexcept nogil
    cdef int32_t lookup(self, uint64_t page_hash, int64_t parent_entry,
                        const int32_t* tokens) noexcept nogil
    cdef void acquire(self, int32_t page) noexcept nogil
    cdef void hold(self, int32_t page) noexcept nogil
    cdef bint cache_page(self, int32_t page, uint64_t page_hash, int64_t parent_entry,
                         const int32_t* tokens) noexcept nogil
    cdef void _uncache(self, int32_t page) noexcept nogil
    cdef void _push_head(self, int32_t page) noexcept nogil
    cdef void _push_tail(self, int32_t page) noexcept nogil
    cdef void _unlink(self, int32_t page) noexcept nogil
