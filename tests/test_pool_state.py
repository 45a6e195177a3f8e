"""A seeded random walk over both pools of a windowed cache with a tight window pool.

Random ``append`` (ragged batches, 0-token entries, some too large to fit),
``fork``, ``free``, ``truncate``, ``checkpoint`` and ``restore`` against a
model of what each sequence holds: its K/V rows per layer, each a
deterministic function of the sequence that wrote it and the position.
After every call: no sequence lacks a window page that a query may still
see (given back pages are a leading run, before what the next query sees),
every page id is in its pool, the free and used counts of both pools add up
and match the pages the sequences hold (and so do the pages with several
holders), every held position reads back
what the model says, and a failed call changed nothing.
"""
import numpy as np
import pytest

import pagedkv

H, D, PS = 2, 4, 4


def rows(writer, start, n, layer):
    pos = np.arange(start, start + n, dtype=np.float32)[:, None, None]
    base = pos * 0.29 + writer * 1.7 + layer * 0.53 + np.arange(H * D).reshape(1, H, D) * 0.11
    return np.sin(base).astype(np.float32), np.cos(base).astype(np.float32)


class Walk:
    def __init__(self, backend, windows, num_pages, num_window_pages, rollback, seed):
        self.cache = pagedkv.PagedKVCache(
            len(windows), H, D, num_pages=num_pages, page_size=PS, layer_windows=list(windows),
            num_window_pages=num_window_pages, window_rollback_tokens=rollback,
            backend=backend)
        self.windows = windows
        self.window = max(w for w in windows if w is not None)
        self.rng = np.random.default_rng(seed)
        self.model = {}           # seq id -> per layer (k, v) of every position
        self.checkpoints = []     # (checkpoint, model entry then)
        self.failures = self.appends = 0

    # -- what the caller can see -------------------------------------------------
    def held_from(self, s):
        ids = self.cache.window_page_ids(s)
        held = np.flatnonzero(ids >= 0)
        return int(held[0]) * PS if len(held) else self.cache.seq_len(s)

    def snapshot(self):
        c = self.cache
        seqs = {}
        for s in c.seq_ids():
            entry = [c.seq_len(s), c.page_ids(s).tolist(), c.window_page_ids(s).tolist()]
            for layer, w in enumerate(self.windows):
                k, v = c.gather(layer, s, 0 if w is None else self.held_from(s))
                entry += [k.tobytes(), v.tobytes()]
            seqs[s] = entry
        return seqs, c.stats()

    def check(self):
        c = self.cache
        assert c.seq_ids() == sorted(self.model)
        full_refs, window_refs = {}, {}
        for s, layers in self.model.items():
            length = len(layers[0][0])
            assert c.seq_len(s) == length
            pages, window_pages = c.page_ids(s), c.window_page_ids(s)
            assert len(pages) == len(window_pages) == -(-length // PS)
            assert ((pages >= 0) & (pages < c.num_pages)).all()
            given_back = np.flatnonzero(window_pages < 0)
            assert (given_back == np.arange(len(given_back))).all()     # a leading run
            assert (window_pages[len(given_back):] < c.num_window_pages).all()
            held_from = self.held_from(s)
            # what the next query (at position length) sees is held
            assert held_from <= max(0, length - self.window + 1) or held_from == length == 0
            for p in pages.tolist():
                full_refs[p] = full_refs.get(p, 0) + 1
            for p in window_pages[window_pages >= 0].tolist():
                window_refs[p] = window_refs.get(p, 0) + 1
            for layer, w in enumerate(self.windows):
                start = 0 if w is None else held_from
                k, v = c.gather(layer, s, start)
                np.testing.assert_array_equal(k, layers[layer][0][start:])
                np.testing.assert_array_equal(v, layers[layer][1][start:])
        stats = c.stats()
        assert stats["num_free_pages"] + stats["num_used_pages"] == c.num_pages
        assert stats["num_free_window_pages"] + stats["num_used_window_pages"] == \
            c.num_window_pages
        assert stats["num_used_pages"] == len(full_refs)
        assert stats["num_used_window_pages"] == len(window_refs)
        for p, n in full_refs.items():
            assert c.refcount(p) == n
        # the allocators' count of pages with several holders (cascade's fast path)
        assert c._pools[0].allocator.num_shared_pages == sum(n > 1 for n in full_refs.values())
        assert c._pools[1].allocator.num_shared_pages == sum(n > 1 for n in window_refs.values())

    def expect_unchanged(self, call, *errors):
        before = self.snapshot()
        with pytest.raises(errors):
            call()
        assert self.snapshot() == before
        self.failures += 1

    # -- the calls ---------------------------------------------------------------
    def add(self):
        s = self.cache.add_sequence()
        self.model[s] = [(np.zeros((0, H, D), np.float32),) * 2 for _ in self.windows]

    def append(self):
        live = sorted(self.model)
        seqs = list(self.rng.choice(live, size=self.rng.integers(1, len(live) + 1),
                                    replace=False))
        counts = [int(self.rng.choice([0, 0, 1, 1, 1, 2, 3, 5, 9, 14])) for _ in seqs]
        c = self.cache
        try:
            batch = c.append(seqs, counts)
        except pagedkv.OutOfPagesError as error:
            assert "pool" in str(error) or "free" in str(error)
            # (what it changed: nothing, as a snapshot taken again shows)
            self.expect_unchanged(lambda: c.append(seqs, counts), pagedkv.OutOfPagesError)
            self.free()          # (room for the walk to go on)
            return
        self.appends += 1
        for layer in range(len(self.windows)):
            new = [rows(s, len(self.model[s][layer][0]), n, layer) for s, n in zip(seqs, counts)]
            c.store(layer, batch, np.concatenate([r[0] for r in new]),
                    np.concatenate([r[1] for r in new]))
            for s, (k, v) in zip(seqs, new):
                old_k, old_v = self.model[s][layer]
                self.model[s][layer] = (np.concatenate([old_k, k]), np.concatenate([old_v, v]))

    def fork(self):
        s = int(self.rng.choice(sorted(self.model)))
        child = self.cache.fork(s)
        self.model[child] = list(self.model[s])

    def free(self):
        s = int(self.rng.choice(sorted(self.model)))
        self.cache.free(s)
        del self.model[s]

    def cut(self, s, new_len):
        self.model[s] = [(k[:new_len], v[:new_len]) for k, v in self.model[s]]

    def truncate(self):
        s = int(self.rng.choice(sorted(self.model)))
        length = self.cache.seq_len(s)
        new_len = int(self.rng.integers(max(0, length - 6), length + 1))
        if 0 < new_len < length and max(new_len - self.window + 1, 0) < self.held_from(s):
            self.expect_unchanged(lambda: self.cache.truncate(s, new_len), ValueError)
            return
        self.cache.truncate(s, new_len)
        self.cut(s, new_len)

    def checkpoint(self):
        s = int(self.rng.choice(sorted(self.model)))
        self.checkpoints.append((self.cache.checkpoint(s), list(self.model[s])))

    def restore(self):
        checkpoint, then = self.checkpoints.pop(int(self.rng.integers(len(self.checkpoints))))
        s, n = checkpoint.seq_id, checkpoint.seq_len
        if s not in self.model:
            self.expect_unchanged(lambda: self.cache.restore(checkpoint), KeyError)
            return
        now = self.model[s]
        true = len(now[0][0]) >= n and all(
            np.array_equal(a[0][:n], b[0][:n]) for a, b in zip(now, then))
        try:
            self.cache.restore(checkpoint)
        except ValueError:
            self.failures += 1
            assert self.cache.seq_len(s) == len(now[0][0])
            return
        assert true, "a restore to K/V that are no longer the checkpoint's"
        self.cut(s, n)

    def run(self, steps):
        for _ in range(3):
            self.add()
        for _ in range(steps):
            if len(self.model) < 2:
                self.add()
            ops = [self.append] * 6 + [self.add, self.fork, self.free, self.truncate,
                                       self.truncate, self.checkpoint]
            if self.checkpoints:
                ops.append(self.restore)
            ops[int(self.rng.integers(len(ops)))]()
            self.check()
        assert self.appends > steps // 5 and self.failures > 0
        self.cache.clear()
        assert self.cache.num_free_pages == self.cache.num_pages
        assert self.cache.num_free_window_pages == self.cache.num_window_pages


@pytest.mark.parametrize("windows,num_pages,num_window_pages,rollback,seed", [
    ((None, 5), 48, 7, 1, 1),
    ((6, None, 3), 48, 9, 2, 2),
    ((4,), 40, 6, 3, 3),
])
def test_random_walk_keeps_both_pools_consistent(backend, windows, num_pages,
                                                 num_window_pages, rollback, seed):
    Walk(backend, windows, num_pages, num_window_pages, rollback, seed).run(150)
