"""The page allocator on its own: batched, all-or-nothing, ref-counted."""
import numpy as np
import pytest

import pagedkv
from pagedkv._allocator import PageAllocator


def test_allocate_is_batched_and_distinct():
    a = PageAllocator(8)
    pages = a.allocate(5)
    assert pages.dtype == np.int32 and len(set(pages.tolist())) == 5
    assert a.num_free == 3
    assert list(a.refcount(pages)) == [1] * 5
    assert a.allocate(0).shape == (0,)


def test_allocate_all_or_nothing():
    a = PageAllocator(4)
    a.allocate(3)
    with pytest.raises(pagedkv.OutOfPagesError, match="2 pages requested, 1 of 4 free"):
        a.allocate(2)
    assert a.num_free == 1
    assert len(a.allocate(1)) == 1


def test_refcounts_and_free():
    a = PageAllocator(4)
    p = a.allocate(2)
    a.incref(p[:1])
    assert a.refcount(int(p[0])) == 2
    a.decref(p)                                   # p[0]: 2 -> 1, p[1]: 1 -> 0 (freed)
    assert a.num_free == 3 and a.refcount(int(p[1])) == 0
    a.free([p[0]])
    assert a.num_free == 4


def test_shared_pages_are_counted():
    a = PageAllocator(4)
    p = a.allocate(3)
    assert a.num_shared_pages == 0
    a.incref([p[0], p[0], p[1]])                  # p[0]: 3 holders, p[1]: 2, p[2]: 1
    assert a.num_shared_pages == 2
    a.decref([p[0]])
    assert a.num_shared_pages == 2
    a.decref([p[0], p[1]])                        # each down to one holder
    assert a.num_shared_pages == 0
    with pytest.raises(ValueError, match="double free"):
        a.decref([p[2], p[2]])
    assert a.num_shared_pages == 0 and list(a.refcount(p)) == [1, 1, 1]
    a.decref(p)
    assert a.num_shared_pages == 0 and a.num_free == 4


def test_double_free_and_bad_ids_change_nothing():
    a = PageAllocator(4)
    p = a.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        a.decref([p[0], p[0]])                    # one reference, dropped twice
    assert list(a.refcount(p)) == [1, 1] and a.num_free == 2
    with pytest.raises(ValueError, match=r"page id 4 is outside the pool \[0, 4\)"):
        a.decref([p[1], 4])
    with pytest.raises(ValueError, match="outside the pool"):
        a.incref([-1])
    with pytest.raises(ValueError, match="is free"):
        a.incref([int(np.setdiff1d(np.arange(4), p)[0])])
    with pytest.raises(ValueError, match="integer page ids"):
        a.decref([0.5])
    with pytest.raises(ValueError, match="non-negative int"):
        a.allocate(-1)
    assert list(a.refcount(p)) == [1, 1] and a.num_free == 2


def test_freed_pages_are_reused_most_recent_first():
    a = PageAllocator(3)
    first = a.allocate(3)
    a.decref(first[[2, 0]])               # uncached pages return to the head of the queue
    assert list(a.allocate(2)) == [first[0], first[2]]


def test_bad_pool_size():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
