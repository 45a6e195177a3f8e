"""The page allocator: a fixed pool of page ids, a free queue and ref counts.

Python-facing methods validate every id before they change anything, so a
failed call leaves the pool as it was.  The ``cdef`` methods are the unchecked
O(1) primitives the page tables use from ``nogil`` code.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t

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

    Every operation is O(1) per page.  A page is free exactly when its ref
    count is 0; ``allocate`` hands pages out with a ref count of 1.
    """

    def __cinit__(self, int num_pages):
        if num_pages <= 0:
            raise ValueError(f"num_pages: expected a positive int, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = np.zeros(num_pages, dtype=np.int32)
        self._next = np.empty(num_pages, dtype=np.int32)
        self._prev = np.empty(num_pages, dtype=np.int32)
        self._head = -1
        self._tail = -1
        self.num_free_pages = 0
        cdef int32_t p
        for p in range(num_pages):
            self._push_tail(p)

    # -- unchecked primitives (callers guarantee validity) -----------------
    cdef void _push_tail(self, int32_t page) noexcept nogil:
        self._prev[page] = self._tail
        self._next[page] = -1
        if self._tail >= 0:
            self._next[self._tail] = page
        else:
            self._head = page
        self._tail = page
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

    cdef int32_t take_page(self) noexcept nogil:
        """Pop the head of the free queue with ref count 1; -1 if none is free."""
        cdef int32_t page = self._head
        if page < 0:
            return -1
        self._unlink(page)
        self._refcount[page] = 1
        return page

    cdef void incref_page(self, int32_t page) noexcept nogil:
        self._refcount[page] += 1

    cdef bint decref_page(self, int32_t page) noexcept nogil:
        """Drop one reference; return True if the page went back to the free queue."""
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._push_tail(page)
            return True
        return False

    cdef int32_t refcount_of(self, int32_t page) noexcept nogil:
        return self._refcount[page]

    # -- Python API -----------------------------------------------------------
    @property
    def num_free(self):
        """Pages an allocation can take now."""
        return self.num_free_pages

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
        if arr.size and (np.asarray(self._refcount)[arr] == 0).any():
            bad = arr[np.asarray(self._refcount)[arr] == 0][0]
            raise ValueError(f"pages: page {int(bad)} is free; only pages in use can be shared")
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
