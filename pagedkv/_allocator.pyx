# distutils: language = c++
"""The page allocator: a fixed pool of page ids, a free queue, ref counts, and the
prefix index of cached pages.

Python-facing methods validate every id before they change anything, so a
failed call leaves the pool as it was.  The ``cdef`` methods are the unchecked
O(1) primitives the page tables use from ``nogil`` code.

With prefix caching, a page whose last reference goes away but that holds a
cached prefix is not forgotten: it stays in the free queue as *evictable*,
reusable by a prefix hit until an allocation takes it (an eviction).
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcmp, memcpy
from cython.operator cimport dereference as deref

from pagedkv.errors import OutOfPagesError

cnp.import_array()


def _as_page_ids(pages, int num_pages, str name="pages"):
    """Validate ``pages`` as ids in ``[0, num_pages)``; return an int32 array."""
    arr = np.asarray(pages)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of page ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integer page ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_pages):
        bad = arr[(arr < 0) | (arr >= num_pages)][0]
        raise ValueError(f"{name}: page id {int(bad)} is outside the pool [0, {num_pages})")
    return np.ascontiguousarray(arr, dtype=np.int32)


cdef class PageAllocator:
    """A pool of ``num_pages`` page ids with a free queue and a ref count per page.

    Parameters
    ----------
    num_pages : int
        Size of the pool; page ids are ``0 .. num_pages-1``.
    page_size : int, default 1
        Tokens per page (the prefix index keeps each cached page's token ids).
    prefix_caching : bool, default False
        Keep freed pages that hold a cached prefix reusable until evicted.

    Every operation is O(1) per page.  ``allocate`` hands pages out with a
    ref count of 1; a page is in the free queue exactly when its count is 0.

    Attributes
    ----------
    num_shared_pages : int
        Pages with a ref count of 2 or more (held by several sequences: forks,
        prefix-cache hits); kept as counts change, so reading it is O(1).
    """

    def __cinit__(self, int num_pages, int page_size=1, bint prefix_caching=False):
        if num_pages <= 0:
            raise ValueError(f"num_pages: expected a positive int, got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size: expected a positive int, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._refcount = np.zeros(num_pages, dtype=np.int32)
        self._next = np.empty(num_pages, dtype=np.int32)
        self._prev = np.empty(num_pages, dtype=np.int32)
        self._hash = np.zeros(num_pages, dtype=np.uint64)
        self._entry = np.zeros(num_pages, dtype=np.int64)
        self._parent_entry = np.zeros(num_pages, dtype=np.int64)
        # token ids of cached pages (a placeholder when caching is off)
        self._tokens = np.zeros((num_pages if prefix_caching else 1,
                                 page_size if prefix_caching else 1), dtype=np.int32)
        self._head = -1
        self._tail = -1
        self.num_free_pages = 0
        self.num_evictable = 0
        self.num_evictions = 0
        self.num_cache_insertions = 0
        self.num_shared_pages = 0
        cdef int32_t p
        for p in range(num_pages):
            self._push_tail(p)

    # -- the free queue --------------------------------------------------------
    cdef void _push_tail(self, int32_t page) noexcept nogil:
        self._prev[page] = self._tail
        self._next[page] = -1
        if self._tail >= 0:
            self._next[self._tail] = page
        else:
            self._head = page
        self._tail = page
        self.num_free_pages += 1

    cdef void _push_head(self, int32_t page) noexcept nogil:
        self._next[page] = self._head
        self._prev[page] = -1
        if self._head >= 0:
            self._prev[self._head] = page
        else:
            self._tail = page
        self._head = page
        self.num_free_pages += 1

    cdef void _unlink(self, int32_t page) noexcept nogil:
        cdef int32_t p = self._prev[page], n = self._next[page]
        if p >= 0:
            self._next[p] = n
        else:
            self._head = n
        if n >= 0:
            self._prev[n] = p
        else:
            self._tail = p
        self.num_free_pages -= 1

    # -- unchecked primitives (callers guarantee validity) -----------------------
    cdef int32_t take_page(self) noexcept nogil:
        """Pop the least recently used free page with ref count 1 (evicting its
        cached prefix, if any); -1 if none is free."""
        cdef int32_t page = self._head
        if page < 0:
            return -1
        self._unlink(page)
        if self._entry[page]:
            self._uncache(page)
            self.num_evictable -= 1
            self.num_evictions += 1
        self._refcount[page] = 1
        return page

    cdef void incref_page(self, int32_t page) noexcept nogil:
        self._refcount[page] += 1
        if self._refcount[page] == 2:
            self.num_shared_pages += 1

    cdef bint decref_page(self, int32_t page) noexcept nogil:
        """Drop one reference; return True if the page went back to the free queue."""
        self._refcount[page] -= 1
        if self._refcount[page] > 0:
            if self._refcount[page] == 1:
                self.num_shared_pages -= 1
            return False
        if self._entry[page]:
            self._push_tail(page)       # most recently used end: evicted last
            self.num_evictable += 1
        else:
            self._push_head(page)       # holds nothing worth keeping: reused first
        return True

    cdef int32_t refcount_of(self, int32_t page) noexcept nogil:
        return self._refcount[page]

    cdef int64_t entry_of(self, int32_t page) noexcept nogil:
        return self._entry[page]

    cdef int32_t lookup(self, uint64_t page_hash, int64_t parent_entry,
                        const int32_t* tokens) noexcept nogil:
        """The cached page holding ``tokens`` after the parent entry, or -1.

        The hash only finds a candidate; its parent entry and token ids must
        match exactly, so a collision is a miss, never wrong KV.
        """
        it = self._index.find(page_hash)
        if it == self._index.end():
            return -1
        cdef int32_t page = deref(it).second
        if self._parent_entry[page] != parent_entry or \
                memcmp(&self._tokens[page, 0], tokens, self.page_size * sizeof(int32_t)) != 0:
            return -1
        return page

    cdef void acquire(self, int32_t page) noexcept nogil:
        """Take a reference to a cached page found by ``lookup`` (reviving it if evictable)."""
        if self._refcount[page] == 0:
            self._unlink(page)
            self.num_evictable -= 1
        self._refcount[page] += 1
        if self._refcount[page] == 2:
            self.num_shared_pages += 1

    cdef void hold(self, int32_t page) noexcept nogil:
        """Take a reference to any page, cached or not, taking it off the free
        queue if it is there (undoing a ``decref_page``)."""
        if self._refcount[page] == 0:
            self._unlink(page)
            if self._entry[page]:
                self.num_evictable -= 1
        self._refcount[page] += 1
        if self._refcount[page] == 2:
            self.num_shared_pages += 1

    cdef bint cache_page(self, int32_t page, uint64_t page_hash, int64_t parent_entry,
                         const int32_t* tokens) noexcept nogil:
        """Remember a full, in-use page under ``page_hash``; False if the hash
        is already taken (the page then stays uncached)."""
        if self._entry[page] or self._index.count(page_hash):
            return False
        self.num_cache_insertions += 1
        self._entry[page] = self.num_cache_insertions
        self._hash[page] = page_hash
        self._parent_entry[page] = parent_entry
        memcpy(&self._tokens[page, 0], tokens, self.page_size * sizeof(int32_t))
        self._index[page_hash] = page
        return True

    cdef void _uncache(self, int32_t page) noexcept nogil:
        self._index.erase(self._hash[page])
        self._entry[page] = 0

    # -- Python API -----------------------------------------------------------
    @property
    def num_free(self):
        """Pages an allocation can take now (evictable cached pages included)."""
        return self.num_free_pages

    @property
    def num_cached_free(self):
        """Free pages that still hold a cached prefix (evictable)."""
        return self.num_evictable

    def is_cached(self, int page):
        """True if page ``page`` holds a cached prefix."""
        _as_page_ids(page, self.num_pages, "page")
        return self._entry[page] != 0

    def free_queue(self):
        """The free queue from the next page to take to the last; ndarray, int32."""
        out = np.empty(self.num_free_pages, dtype=np.int32)
        cdef int32_t page = self._head
        cdef Py_ssize_t i = 0
        while page >= 0:
            out[i] = page
            page = self._next[page]
            i += 1
        return out

    def reset_prefix_cache(self):
        """Forget every cached page that no sequence uses; return how many."""
        cdef int32_t page = self._head, nxt
        cdef int dropped = 0
        while page >= 0:
            nxt = self._next[page]
            if self._entry[page]:
                self._uncache(page)
                self._unlink(page)
                self._push_head(page)
                dropped += 1
            page = nxt
        self.num_evictable -= dropped
        return dropped

    def allocate(self, n):
        """Take ``n`` free pages, all or nothing.

        Returns
        -------
        pages : ndarray, shape [n], int32
            Page ids, each with a ref count of 1.

        Raises
        ------
        OutOfPagesError
            Fewer than ``n`` pages are free; the pool is unchanged.
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n: expected a non-negative int, got {n!r}")
        if n > self.num_free_pages:
            raise OutOfPagesError(
                f"allocate: {n} pages requested, {self.num_free_pages} of {self.num_pages} free")
        out = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] view = out
        cdef Py_ssize_t i
        for i in range(n):
            view[i] = self.take_page()
        return out

    def incref(self, pages):
        """Add one reference to each page in use (ids may repeat)."""
        arr = _as_page_ids(pages, self.num_pages)
        counts = np.asarray(self._refcount)[arr]
        if (counts == 0).any():
            raise ValueError(f"pages: page {int(arr[counts == 0][0])} is free; "
                             f"only pages in use can be shared")
        cdef int32_t[::1] view = arr
        cdef Py_ssize_t i
        for i in range(view.shape[0]):
            self.incref_page(view[i])

    def decref(self, pages):
        """Drop one reference from each page (ids may repeat); pages reaching 0 are freed.

        Raises
        ------
        ValueError
            A page would drop below 0 references (double free); nothing changed.
        """
        arr = _as_page_ids(pages, self.num_pages)
        if arr.size:
            ids, counts = np.unique(arr, return_counts=True)
            over = counts > np.asarray(self._refcount)[ids]
            if over.any():
                bad = ids[over][0]
                raise ValueError(
                    f"pages: page {int(bad)} has {self._refcount[bad]} reference(s), "
                    f"cannot drop {int(counts[over][0])} (double free)")
        cdef int32_t[::1] view = arr
        cdef Py_ssize_t i
        for i in range(view.shape[0]):
            self.decref_page(view[i])

    free = decref

    def refcount(self, pages):
        """Reference counts, shape like ``pages`` (0 = free)."""
        arr = _as_page_ids(pages, self.num_pages)
        counts = np.asarray(self._refcount)[arr]
        return int(counts[0]) if np.ndim(pages) == 0 else counts
