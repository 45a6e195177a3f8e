"""A stateful fuzzer: random valid and invalid calls on one cache, on every backend.

K/V of every position are a deterministic function of the sequence's tokens
up to it (``kv_of``), so the model of what the cache must hold is each
sequence's tokens, and which positions of each layer were stored (a step may
be abandoned part way), whatever mix of prefix hits, forks, rollbacks and
abandoned steps produced them.  After every call nothing crashed; after a failed call
the observable state is exactly what it was; at the end, freeing everything
returns every page.

Sequences also leave the cache and come back (swap, export/import, save/load):
they keep their tokens and K/V, and with their tokens known, the pages they
fill afterwards join the prefix cache like any other's (a prompt of their
tokens hits every full page, unless an eviction intervened).
"""
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import pagedkv
from reference import TOLERANCE, dense_attention

LAYERS, H, D, PAGE = 2, 2, 8, 3
NUM_PAGES = 24
GROUP = 2


def kv_of(tokens, layer):
    """K and V [len(tokens), H, D] float32, each row a function of tokens[:i+1]."""
    acc, rows = 11 + layer, []
    for t in tokens:
        acc = (acc * 1000003 + int(t) * 7919 + 1) % 2**31
        rows.append(acc)
    base = (np.array(rows, dtype=np.int64) % 997).astype(np.float32)[:, None, None] / 97
    k = np.sin(base + np.arange(H * D, dtype=np.float32).reshape(1, H, D))
    return k, np.cos(k * 3)


class Flaky:
    """A prefix hash that raises when armed."""

    def __init__(self):
        self.armed = False

    def __call__(self, parent, tokens):
        if self.armed:
            raise RuntimeError("hash failed")
        return hash((parent, tokens)) & (2**63 - 1)


class CacheMachine(RuleBasedStateMachine):
    backend = None

    @initialize()
    def make(self):
        self.hash = Flaky()
        self.cache = pagedkv.PagedKVCache(LAYERS, H, D, num_pages=NUM_PAGES, page_size=PAGE,
                                          backend=self.backend, enable_prefix_caching=True,
                                          prefix_hash=self.hash)
        self.tokens = {}          # seq id -> token ids (the model)
        self.stored = {}          # seq id -> per layer, a bool per position: K/V stored
        self.batch = None         # the last step: (StepBatch, seq ids, counts, layers stored)
        self.checkpoints = []     # [checkpoint, tokens at the time, still valid]
        self.swapped = set()      # seq ids swapped out
        self.folder = tempfile.mkdtemp(prefix="pagedkv-fuzz-")
        self.rng = np.random.default_rng(0)

    # -- helpers ---------------------------------------------------------------
    def live(self):
        return sorted(self.tokens)

    def active(self):
        """Live sequences that are not swapped out."""
        return [s for s in self.live() if s not in self.swapped]

    def snapshot(self):
        c = self.cache
        return (c.num_free_pages, c.seq_ids(), sorted(self.swapped),
                {s: (c.seq_len(s), c.export_sequence(s).keys[0].tobytes())
                 for s in c.seq_ids()})

    def expect_failure(self, call, *errors):
        before = self.snapshot()
        with pytest.raises(errors or (ValueError, KeyError, TypeError, MemoryError,
                                      RuntimeError)):
            call()
        assert self.snapshot() == before

    def invalidate_step(self):
        self.batch = None

    def cut(self, s, new_len):
        del self.tokens[s][new_len:]
        for flags in self.stored[s]:
            del flags[new_len:]

    def void_checkpoints(self, s, new_len):
        for entry in self.checkpoints:
            if entry[0].seq_id == s and entry[0].seq_len > new_len:
                entry[2] = False

    # -- sequences -------------------------------------------------------------
    @rule(prompt=st.lists(st.integers(0, 1), max_size=10))
    def add(self, prompt):
        s = self.cache.add_sequence(token_ids=prompt if prompt else None)
        hit = self.cache.seq_len(s)
        assert hit % PAGE == 0 and hit <= max(len(prompt) - 1, 0)
        self.tokens[s] = list(prompt[:hit])
        self.stored[s] = [[True] * hit for _ in range(LAYERS)]
        for layer in range(LAYERS):        # a hit serves only K/V stored in every layer
            k, v = self.cache.gather(layer, s)
            want_k, want_v = kv_of(prompt[:hit], layer)
            np.testing.assert_array_equal(k, want_k.reshape(-1, H, D))
            np.testing.assert_array_equal(v, want_v.reshape(-1, H, D))

    @rule(prompt=st.lists(st.integers(0, 1), min_size=4, max_size=10))
    def add_with_a_failing_hash(self, prompt):
        self.hash.armed = True
        try:
            self.expect_failure(lambda: self.cache.add_sequence(token_ids=prompt), RuntimeError)
        finally:
            self.hash.armed = False

    @precondition(lambda self: self.active())
    @rule(data=st.data())
    def fork(self, data):
        s = data.draw(st.sampled_from(self.active()))
        child = self.cache.fork(s)
        self.tokens[child] = list(self.tokens[s])
        self.stored[child] = [list(flags) for flags in self.stored[s]]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.live()))
        self.cache.free(s)
        del self.tokens[s], self.stored[s]
        self.swapped.discard(s)
        self.invalidate_step()

    @rule()
    def clear(self):
        self.cache.clear()
        self.tokens.clear()
        self.stored.clear()
        self.swapped.clear()
        self.invalidate_step()

    @precondition(lambda self: self.active())
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(self.active()))
        new_len = data.draw(st.integers(0, len(self.tokens[s])))
        self.checkpoints.append([self.cache.checkpoint(s), list(self.tokens[s]), True])
        self.cache.truncate(s, new_len)
        self.cut(s, new_len)
        self.void_checkpoints(s, new_len)
        self.invalidate_step()

    @precondition(lambda self: self.checkpoints)
    @rule(data=st.data())
    def restore(self, data):
        i = data.draw(st.integers(0, len(self.checkpoints) - 1))
        checkpoint, tokens, valid = self.checkpoints.pop(i)
        if checkpoint.seq_id not in self.tokens:
            self.expect_failure(lambda: self.cache.restore(checkpoint), KeyError)
        elif not valid or checkpoint.seq_id in self.swapped:
            self.expect_failure(lambda: self.cache.restore(checkpoint), ValueError)
        else:
            self.cache.restore(checkpoint)
            self.cut(checkpoint.seq_id, checkpoint.seq_len)
            self.void_checkpoints(checkpoint.seq_id, checkpoint.seq_len)
            self.invalidate_step()

    # -- steps -----------------------------------------------------------------
    @precondition(lambda self: self.active())
    @rule(data=st.data(), with_tokens=st.booleans())
    def append(self, data, with_tokens):
        seqs = data.draw(st.lists(st.sampled_from(self.active()), min_size=1, max_size=3,
                                  unique=True))
        counts = data.draw(st.lists(st.integers(0, 5), min_size=len(seqs), max_size=len(seqs)))
        new = [data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) for n in counts]
        flat = [t for part in new for t in part]
        try:
            batch = self.cache.append(seqs, counts, token_ids=flat if with_tokens else None)
        except pagedkv.OutOfPagesError:
            return      # (atomicity of this failure: test_lifecycle and test_errors)
        for s, part in zip(seqs, new):
            self.tokens[s] += part
            for flags in self.stored[s]:
                flags += [False] * len(part)
        self.batch = (batch, seqs, counts, set())

    @precondition(lambda self: self.batch is not None)
    @rule(data=st.data())
    def store(self, data):
        batch, seqs, counts, stored = self.batch
        layer = data.draw(st.sampled_from(range(LAYERS)))
        k, v = self.step_kv(seqs, counts, layer)
        self.cache.store(layer, batch, k, v)
        stored.add(layer)
        for s, n in zip(seqs, counts):
            flags = self.stored[s][layer]
            flags[len(flags) - n:] = [True] * n

    def step_kv(self, seqs, counts, layer):
        parts = [kv_of(self.tokens[s], layer) for s in seqs]
        k = np.concatenate([p[0][len(p[0]) - n:] for p, n in zip(parts, counts)])
        v = np.concatenate([p[1][len(p[1]) - n:] for p, n in zip(parts, counts)])
        return k.reshape(-1, H, D), v.reshape(-1, H, D)

    @precondition(lambda self: self.batch is not None and self.batch[3])
    @rule(data=st.data())
    def attention(self, data):
        batch, seqs, counts, stored = self.batch
        layer = data.draw(st.sampled_from(sorted(stored)))
        window = data.draw(st.one_of(st.none(), st.integers(1, 8)))
        q = self.rng.standard_normal((batch.num_tokens, H * GROUP, D), dtype=np.float32)
        out = self.cache.attention(layer, batch, q, sliding_window=window)
        row = 0
        for s, n in zip(seqs, counts):
            k, v = kv_of(self.tokens[s], layer)
            positions = np.arange(len(k) - n, len(k))
            lo = 0 if window is None else max(0, len(k) - n - window + 1)
            if not all(self.stored[s][layer][lo:]):   # an abandoned step's K/V is in view
                row += n
                continue
            np.testing.assert_allclose(
                out[row:row + n],
                dense_attention(q[row:row + n], k, v, positions, sliding_window=window),
                **TOLERANCE["float32"])
            row += n

    # -- sequences that leave the cache ----------------------------------------
    @precondition(lambda self: self.active())
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(self.active()))
        self.cache.swap_out(s)
        self.swapped.add(s)
        self.invalidate_step()
        self.expect_failure(lambda: self.cache.append([s], 1), ValueError)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        s = data.draw(st.sampled_from(sorted(self.swapped)))
        before = self.snapshot()
        try:
            self.cache.swap_in(s)
        except pagedkv.OutOfPagesError:
            assert self.snapshot() == before
            return
        self.swapped.discard(s)

    def place_copy(self, s, through_a_file):
        """A copy of sequence ``s`` placed by export/import or save/load: its id, or
        None when there was no room (and nothing changed)."""
        before = self.snapshot()
        try:
            if through_a_file:
                path = os.path.join(self.folder, "kv.safetensors")
                self.cache.save(path, seq_ids=[s])
                (t,) = self.cache.load(path)
            else:
                t = self.cache.import_sequence(self.cache.export_sequence(s))
        except pagedkv.OutOfPagesError:
            assert self.snapshot() == before
            return None
        self.tokens[t] = list(self.tokens[s])
        self.stored[t] = [list(flags) for flags in self.stored[s]]
        self.invalidate_step()
        return t

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), through_a_file=st.booleans())
    def export_and_import(self, data, through_a_file):
        """A sequence, swapped out or not, placed again beside itself."""
        self.place_copy(data.draw(st.sampled_from(self.live())), through_a_file)

    @precondition(lambda self: self.active() and (self.batch is None or
                                                  len(self.batch[3]) == LAYERS))
    @rule(data=st.data(), how=st.sampled_from(["swap", "import", "load"]),
          new=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def transfer_and_decode(self, data, how, new):
        """A sequence whose tokens the cache knows, stored in every layer, leaves and
        comes back, then decodes: the pages it fills join the prefix cache."""
        ready = [s for s in self.active() if all(all(flags) for flags in self.stored[s])
                 and self.cache.export_sequence(s).token_ids is not None]
        if not ready:
            return
        s = data.draw(st.sampled_from(ready))
        evictions = self.cache.stats()["num_evictions"]
        reached = self.hit(self.tokens[s]) == len(self.tokens[s]) // PAGE * PAGE
        self.invalidate_step()
        if how == "swap":
            self.cache.swap_out(s)
            self.swapped.add(s)
            try:
                self.cache.swap_in(s)
            except pagedkv.OutOfPagesError:
                return
            self.swapped.discard(s)
            t = s
        else:
            t = self.place_copy(s, how == "load")
            if t is None:
                return
            self.cache.free(s)
            del self.tokens[s], self.stored[s]
        try:
            batch = self.cache.append([t], [len(new)], token_ids=new)
        except pagedkv.OutOfPagesError:
            return
        self.tokens[t] += new
        for layer in range(LAYERS):
            self.stored[t][layer] += [True] * len(new)
            self.cache.store(layer, batch, *self.step_kv([t], [len(new)], layer))
        if reached and self.cache.stats()["num_evictions"] == evictions:
            tokens = self.tokens[t]
            assert self.hit(tokens) == len(tokens) // PAGE * PAGE, (how, tokens)

    def hit(self, tokens):
        """How many of ``tokens`` a prompt of them and one more token reuses."""
        probe = self.cache.add_sequence(token_ids=list(tokens) + [0])
        hit = self.cache.seq_len(probe)
        self.cache.free(probe)
        return hit

    # -- invalid calls ---------------------------------------------------------
    @rule(data=st.data())
    def invalid_call(self, data):
        c = self.cache
        live = self.live()
        s = live[0] if live else 0
        calls = [
            lambda: c.seq_len(10**6),
            lambda: c.truncate(s, 10**6),
            lambda: c.append([s, s], 1),
            lambda: c.append([10**6], 1),
            lambda: c.append([s], -1),
            lambda: c.append([True], 1),
            lambda: c.append([s], NUM_PAGES * PAGE + 1),
            lambda: c.gather(LAYERS, s),
            lambda: c.read_token(0, s, 10**6),
            lambda: c.checkpoint([s]),
            lambda: c.restore("checkpoint"),
            lambda: c.refcount(NUM_PAGES),
        ]
        if self.batch is not None:
            batch = self.batch[0]
            n = batch.num_tokens
            calls += [
                lambda: c.store(0, batch, np.zeros((n + 1, H, D)), np.zeros((n + 1, H, D))),
                lambda: c.attention(0, batch, np.zeros((n, H * GROUP, D)), sliding_window=0),
                lambda: c.attention(0, batch, np.zeros((n, H * GROUP, D)), sinks=[1.0]),
                lambda: c.attention(0, batch, np.zeros((n, 3, D))),
            ]
        self.expect_failure(data.draw(st.sampled_from(calls)))

    @precondition(lambda self: self.batch is not None)
    @rule()
    def store_a_stale_batch(self):
        batch, seqs, counts, _ = self.batch
        self.cache.append([], [])            # any append moves the cache on
        self.batch = None
        k, v = np.zeros((2, batch.num_tokens, H, D), np.float32)
        if batch.num_tokens:
            self.expect_failure(lambda: self.cache.store(0, batch, k, v), ValueError)

    # -- what must always hold --------------------------------------------------
    @invariant()
    def contents_match_the_model(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.seq_ids() == self.live()
        for s in self.live():
            assert self.cache.seq_len(s) == len(self.tokens[s])
        # pages several sequences hold, as the allocator counts them for cascade's fast path
        held = np.concatenate([self.cache.page_ids(s) for s in self.active()] + [[]])
        _, holders = np.unique(held, return_counts=True)
        assert self.cache._allocator.num_shared_pages == int((holders > 1).sum())

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)
        # what every stored layer holds: only the steps stored in full are known
        # to match; freeing everything returns every page
        self.cache.clear()
        self.cache.reset_prefix_cache()
        assert self.cache.num_free_pages == NUM_PAGES


@pytest.mark.slow
def test_random_calls_keep_the_cache_consistent(backend):
    machine = type(f"Machine_{backend}", (CacheMachine,), {"backend": backend})
    machine.TestCase.settings = settings(
        max_examples=300, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()
