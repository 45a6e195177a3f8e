"""Sequence lifecycle: fork and copy-on-write, truncate and restore, running out of
pages, and a random mix of operations; on every backend."""
import numpy as np
import pytest

import pagedkv
from reference import Harness


def make(backend, *, num_pages=64, page_size=4, group=2):
    cache = pagedkv.PagedKVCache(2, 2, 16, num_pages=num_pages, page_size=page_size,
                                 backend=backend)
    return Harness(cache, num_heads=2 * group)


def test_fork_then_divergent_writes(backend):
    h = make(backend)
    parent = h.add()
    h.step([parent], 6)                      # 1.5 pages: the last page is shared after fork
    free_before = h.cache.num_free_pages
    child = h.fork(parent)
    assert h.cache.num_free_pages == free_before          # fork copies nothing
    assert list(h.cache.page_ids(child)) == list(h.cache.page_ids(parent))
    assert all(h.cache.refcount(p) == 2 for p in h.cache.page_ids(parent))
    h.step([child], 3)                       # copy-on-write of the shared last page
    assert h.cache.page_ids(child)[0] == h.cache.page_ids(parent)[0]
    assert h.cache.page_ids(child)[1] != h.cache.page_ids(parent)[1]
    h.step([parent], 5)                      # the parent writes its own copy
    h.step([parent, child], [1, 2])
    h.check_contents()                       # neither sees the other's writes
    h.free(parent)
    h.check_contents()
    h.free(child)
    assert h.cache.num_free_pages == h.cache.num_pages


def test_fork_on_page_boundary_copies_nothing(backend):
    h = make(backend)
    parent = h.add()
    h.step([parent], 8)                      # exactly two full pages
    child = h.fork(parent)
    free_before = h.cache.num_free_pages
    h.step([child], 1)
    assert h.cache.num_free_pages == free_before - 1      # one new page, no copy
    h.check_contents()


def test_truncate_and_restore_then_continue(backend):
    h = make(backend)
    s = h.add()
    h.step([s], 10)
    ck = h.cache.checkpoint(s)
    assert ck.seq_len == 10
    for _ in range(7):                      # speculative tokens, crossing pages
        h.step([s], 1)
    h.restore(ck)
    assert h.cache.seq_len(s) == 10 and h.cache.page_count(s) == 3
    assert h.cache.token_capacity(s) == 12
    h.step([s], 3)                          # continue decoding over the rolled-back tail
    h.truncate(s, 4)
    assert h.cache.page_count(s) == 1
    h.step([s], 2)
    h.check_contents()
    with pytest.raises(ValueError, match="truncated below"):
        h.cache.restore(ck)                 # the sequence is now shorter than the checkpoint


def test_truncate_into_shared_page_copies_before_write(backend):
    h = make(backend)
    parent = h.add()
    h.step([parent], 8)
    child = h.fork(parent)
    h.truncate(child, 5)                    # child's last page is still the parent's
    h.step([child], 2)
    h.check_contents()


def test_restore_freed_sequence_is_unknown(backend):
    h = make(backend)
    s = h.add()
    h.step([s], 3)
    ck = h.cache.checkpoint(s)
    h.free(s)
    with pytest.raises(pagedkv.UnknownSequenceError):
        h.cache.restore(ck)


def test_out_of_pages_changes_nothing(backend):
    h = make(backend, num_pages=6, page_size=4)
    a, b = h.add(), h.add()
    h.step([a, b], [6, 6])                  # 4 pages used, 2 free
    child = h.fork(a)
    before = {s: (h.cache.seq_len(s), list(h.cache.page_ids(s))) for s in (a, b, child)}
    free_before = h.cache.num_free_pages
    with pytest.raises(pagedkv.OutOfPagesError) as info:
        h.cache.append([a, child, b], [1, 1, 7])   # a CoW + b's 2 pages: 3 > 2
    assert isinstance(info.value, MemoryError)
    assert "needs 3 new pages, 2 of 6 free" in str(info.value)
    assert h.cache.num_free_pages == free_before
    assert {s: (h.cache.seq_len(s), list(h.cache.page_ids(s))) for s in (a, b, child)} == before
    h.step([a, child], [1, 1])              # what fits still works afterwards
    h.check_contents()


def test_clear_returns_every_page(backend):
    h = make(backend)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [5, 9, 1])
    h.fork(seqs[1])
    h.cache.clear()
    assert h.cache.num_free_pages == h.cache.num_pages
    assert h.cache.seq_ids() == []


def test_max_seq_len(backend):
    cache = pagedkv.PagedKVCache(1, 1, 8, num_pages=16, page_size=4, max_seq_len=10,
                                 backend=backend)
    s = cache.add_sequence()
    cache.append([s], 10)
    with pytest.raises(ValueError, match="would reach 11 tokens, over max_seq_len=10"):
        cache.append([s], 1)
    assert cache.seq_len(s) == 10


def test_random_operations_keep_data_and_pages(backend):
    """A seeded random mix of add/fork/append/truncate/restore/free: data read back
    equals what was written, and every page is back in the pool at the end."""
    rng = np.random.default_rng(7)
    h = make(backend, num_pages=48, page_size=3)
    checkpoints = []
    for _ in range(120):
        live = list(h.ref.k)
        op = rng.choice(["add", "fork", "append", "append", "truncate", "restore", "free"])
        if op == "add" or not live:
            h.add()
        elif op == "fork":
            h.fork(int(rng.choice(live)))
        elif op == "append":
            seqs = list(rng.choice(live, size=min(len(live), rng.integers(1, 4)), replace=False))
            counts = [int(c) for c in rng.integers(0, 6, size=len(seqs))]
            try:
                h.step([int(s) for s in seqs], counts)
            except pagedkv.OutOfPagesError:
                pass
        elif op == "truncate":
            s = int(rng.choice(live))
            checkpoints.append([h.cache.checkpoint(s), True])
            new_len = int(rng.integers(0, h.ref.seq_len(s) + 1))
            h.truncate(s, new_len)
            for entry in checkpoints:     # a cut below a checkpoint voids it for good
                if entry[0].seq_id == s and entry[0].seq_len > new_len:
                    entry[1] = False
        elif op == "restore" and checkpoints:
            ck, valid = checkpoints.pop(int(rng.integers(len(checkpoints))))
            if ck.seq_id in h.ref.k:
                if valid:
                    h.restore(ck)
                    for entry in checkpoints:
                        if entry[0].seq_id == ck.seq_id and entry[0].seq_len > ck.seq_len:
                            entry[1] = False
                else:
                    with pytest.raises(ValueError, match="truncated below"):
                        h.restore(ck)
        elif op == "free":
            h.free(int(rng.choice(live)))
        if len(h.ref.k) > 8:
            h.free(int(rng.choice(list(h.ref.k))))
        h.check_contents()
        # ref counts equal the number of page-table entries pointing at each page
        counts = np.zeros(h.cache.num_pages, dtype=int)
        for s in h.ref.k:
            np.add.at(counts, h.cache.page_ids(s), 1)
        assert [h.cache.refcount(p) for p in range(h.cache.num_pages)] == list(counts)
        assert h.cache.num_free_pages == int((counts == 0).sum())
    for s in list(h.ref.k):
        h.free(s)
    assert h.cache.num_free_pages == h.cache.num_pages
