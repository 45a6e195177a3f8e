"""Prefix caching: model-checked page accounting plus focused behaviour tests, on every backend.

K/V in these tests are a function of the token prefix, as in a real model:
the K/V at position i depend on tokens[0..i].  So a reused prefix page is
right exactly when it holds what the sequence would have computed itself.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import pagedkv
from prefix_model import PrefixCacheModel

H, D = 1, 4


def prefix_kv(tokens, layer):
    """K and V [len(tokens), H, D] float32 that depend on every token up to each position."""
    digest = np.zeros(len(tokens), dtype=np.int64)
    acc = 17
    for i, t in enumerate(tokens):
        acc = (acc * 31 + int(t) + 7) % 100003
        digest[i] = acc
    base = (digest % 1024).astype(np.float32)[:, None, None] + layer * 1024
    k = base + np.arange(H * D, dtype=np.float32).reshape(1, H, D) / 8
    return k, k + 0.5


def store_step(cache, batch, seq_ids, full_tokens, counts):
    """Store every layer of a step: the K/V of each sequence's new positions."""
    for layer in range(cache.num_layers):
        ks, vs = [], []
        for s, n in zip(seq_ids, counts):
            k, v = prefix_kv(full_tokens[s], layer)
            ks.append(k[len(k) - n:])
            vs.append(v[len(v) - n:])
        cache.store(layer, batch, np.concatenate(ks) if ks else np.zeros((0, H, D)),
                    np.concatenate(vs) if vs else np.zeros((0, H, D)))


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random add/fork/append/truncate/restore/free/reset against PrefixCacheModel."""

    backend = None
    num_pages, page_size = 10, 2

    @initialize()
    def start(self):
        self.cache = pagedkv.PagedKVCache(2, H, D, num_pages=self.num_pages,
                                          page_size=self.page_size, backend=self.backend,
                                          enable_prefix_caching=True)
        self.model = PrefixCacheModel(self.num_pages, self.page_size)
        self.checkpoints = []

    def live(self):
        return sorted(self.model.seqs)

    def tokens_of(self, s):
        return self.model.seqs[s]["tokens"]

    def _append(self, seq_ids, counts, new_tokens, with_tokens):
        """Append through both; store K/V.  Returns False if the pool was full."""
        if self.model.pages_needed(seq_ids, counts) is None:
            with pytest.raises(pagedkv.OutOfPagesError):
                self.cache.append(seq_ids, counts, token_ids=new_tokens if with_tokens else None)
            return False
        batch = self.cache.append(seq_ids, counts, token_ids=new_tokens if with_tokens else None)
        self.model.append(seq_ids, counts, new_tokens, with_tokens)
        store_step(self.cache, batch, seq_ids, {s: self.tokens_of(s) for s in seq_ids}, counts)
        return True

    @rule(prompt=st.lists(st.integers(0, 2), max_size=9), with_tokens=st.booleans())
    def add(self, prompt, with_tokens):
        s = self.cache.add_sequence(token_ids=prompt if with_tokens else None)
        self.model.add(s, prompt if with_tokens else None)
        reused = len(self.tokens_of(s))
        assert self.cache.seq_len(s) == reused
        assert reused % self.page_size == 0 and (reused < len(prompt) or reused == 0)
        rest = prompt[reused:]
        self._append([s], [len(rest)], rest, True)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live()))
        child = self.cache.fork(parent)
        self.model.fork(parent, child)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), with_tokens=st.booleans())
    def append(self, data, with_tokens):
        seqs = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3,
                                  unique=True))
        counts = [data.draw(st.integers(0, 4)) for _ in seqs]
        new_tokens = data.draw(st.lists(st.integers(0, 2), min_size=sum(counts),
                                        max_size=sum(counts)))
        self._append(seqs, counts, new_tokens, with_tokens)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(self.live()))
        self.checkpoints.append([self.cache.checkpoint(s), True])
        new_len = data.draw(st.integers(0, len(self.tokens_of(s))))
        self.cache.truncate(s, new_len)
        self.model.truncate(s, new_len)
        self._void_checkpoints_beyond(s, new_len)

    def _void_checkpoints_beyond(self, s, new_len):
        """A cut below a checkpoint voids it for good (even if the sequence regrows)."""
        for entry in self.checkpoints:
            if entry[0].seq_id == s and entry[0].seq_len > new_len:
                entry[1] = False

    @precondition(lambda self: self.checkpoints)
    @rule(data=st.data())
    def restore(self, data):
        ck, valid = self.checkpoints.pop(data.draw(st.integers(0, len(self.checkpoints) - 1)))
        if ck.seq_id not in self.model.seqs:
            with pytest.raises(pagedkv.UnknownSequenceError):
                self.cache.restore(ck)
        elif not valid:
            with pytest.raises(ValueError, match="truncated below"):
                self.cache.restore(ck)
        else:
            self.cache.restore(ck)
            self._void_checkpoints_beyond(ck.seq_id, ck.seq_len)
            self.model.truncate(ck.seq_id, ck.seq_len)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.live()))
        self.cache.free(s)
        self.model.free(s)

    @rule()
    def reset(self):
        self.cache.reset_prefix_cache()
        self.model.reset()

    @invariant()
    def pages_agree_with_model(self):
        assert self.cache.seq_ids() == self.live()
        for s in self.live():
            assert list(self.cache.page_ids(s)) == self.model.seqs[s]["pages"]
        assert list(self.cache._allocator.free_queue()) == self.model.queue
        assert self.cache.stats() == pytest.approx(self.model.stats())

    @invariant()
    def each_page_in_exactly_one_state(self):
        alloc = self.cache._allocator
        queue = list(alloc.free_queue())
        assert len(queue) == len(set(queue))
        referenced = np.zeros(self.num_pages, dtype=int)
        for s in self.live():
            np.add.at(referenced, self.cache.page_ids(s), 1)
        for page in range(self.num_pages):
            free = page in queue and not alloc.is_cached(page)
            evictable = page in queue and alloc.is_cached(page)
            in_use = self.cache.refcount(page) > 0
            assert free + evictable + in_use == 1, page
            assert self.cache.refcount(page) == referenced[page]

    @invariant()
    def data_is_what_was_written(self):
        for s in self.live():
            for layer in range(2):
                k, v = self.cache.gather(layer, s)
                k_ref, v_ref = prefix_kv(self.tokens_of(s), layer)
                np.testing.assert_array_equal(k, k_ref)
                np.testing.assert_array_equal(v, v_ref)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for s in self.live():
            self.cache.free(s)
        self.cache.reset_prefix_cache()
        assert self.cache.num_free_pages == self.num_pages
        assert self.cache.stats()["num_used_pages"] == 0
        assert self.cache.stats()["num_cached_pages"] == 0


@pytest.mark.one_opencl_device
@pytest.mark.slow
def test_model_checked_prefix_cache(backend):
    """~4,000 random steps per backend against the pure-Python model."""
    PrefixCacheMachine.backend = backend
    machine_test = PrefixCacheMachine.TestCase
    machine_test.settings = settings(max_examples=130, stateful_step_count=30, deadline=None,
                                     derandomize=True,
                                     suppress_health_check=list(HealthCheck))
    machine_test().runTest()


# -- focused tests -----------------------------------------------------------------

def make(backend, num_pages=64, page_size=4, **kwargs):
    return pagedkv.PagedKVCache(2, H, D, num_pages=num_pages, page_size=page_size,
                                backend=backend, enable_prefix_caching=True, **kwargs)


def serve_prompt(cache, prompt):
    """Add a request like an engine: reuse the cached prefix, compute the rest."""
    s = cache.add_sequence(token_ids=prompt)
    done = cache.seq_len(s)
    batch = cache.append([s], len(prompt) - done, token_ids=prompt[done:])
    store_step(cache, batch, [s], {s: prompt}, [len(prompt) - done])
    return s


def test_shared_system_prompt_is_stored_once(backend):
    cache = make(backend, num_pages=64, page_size=4)
    system = list(range(100, 132))                      # 8 full pages
    prompts = [system + [i, i + 1, i + 2] for i in range(8)]
    seqs = [serve_prompt(cache, prompt) for prompt in prompts]
    for s in seqs[1:]:
        assert list(cache.page_ids(s)[:8]) == list(cache.page_ids(seqs[0])[:8])
    assert all(cache.refcount(p) == 8 for p in cache.page_ids(seqs[0])[:8])
    stats = cache.stats()
    assert stats["num_used_pages"] == 8 + 8 * 1          # shared prefix once + one tail each
    assert stats["prefix_hit_rate"] == pytest.approx(7 * 32 / (8 * 35))
    for s, prompt in zip(seqs, prompts):
        np.testing.assert_array_equal(cache.gather(1, s)[0], prefix_kv(prompt, 1)[0])


def test_prompt_last_token_is_never_reused(backend):
    cache = make(backend, page_size=4)
    serve_prompt(cache, list(range(8)))
    s = cache.add_sequence(token_ids=list(range(8)))     # identical prompt: 2 full pages cached
    assert cache.seq_len(s) == 4                         # the last token must be computed
    t = cache.add_sequence(token_ids=list(range(9)))
    assert cache.seq_len(t) == 8


def test_eviction_order_is_lru_tail_first(backend):
    cache = make(backend, num_pages=6, page_size=2)
    a = serve_prompt(cache, [1, 2, 3, 4, 5])             # pages: [1,2] [3,4] [5]
    b = serve_prompt(cache, [7, 8, 9])                    # pages: [7,8] [9]
    pa, pb = list(cache.page_ids(a)), list(cache.page_ids(b))
    cache.free(a)     # a's full pages become evictable, tail first: [3,4] before [1,2]
    cache.free(b)
    queue = list(cache._allocator.free_queue())
    # uncached pages first (reused first), then the LRU: a's tail, a's head, then b's page
    assert queue[-3:] == [pa[1], pa[0], pb[0]]
    assert cache.stats()["num_cached_pages"] == 3
    c = cache.add_sequence()
    cache.append([c], 8)                                  # 4 pages: 1 free + 3 more
    assert cache.stats()["num_evictions"] == 1 and cache.stats()["num_cached_pages"] == 2
    assert cache.add_sequence(token_ids=[1, 2, 3, 4, 5]) is not None
    assert cache.seq_len(cache.seq_ids()[-1]) == 2      # [1,2] survived, [3,4] was evicted


def test_hash_collisions_never_return_wrong_kv(backend):
    cache = make(backend, page_size=2, prefix_hash=lambda parent, tokens: 42)
    a = serve_prompt(cache, [1, 2, 3, 4, 5])
    b = serve_prompt(cache, [1, 2, 9, 9, 5])     # same hash for every page
    c = serve_prompt(cache, [9, 9, 3, 4, 5])
    for s, prompt in ((a, [1, 2, 3, 4, 5]), (b, [1, 2, 9, 9, 5]), (c, [9, 9, 3, 4, 5])):
        for layer in range(2):
            np.testing.assert_array_equal(cache.gather(layer, s)[0], prefix_kv(prompt, layer)[0])
    assert cache.page_ids(b)[0] == cache.page_ids(a)[0]      # a true hit still hits
    assert cache.page_ids(c)[0] != cache.page_ids(a)[0]


def test_reuse_after_free(backend):
    cache = make(backend, page_size=4)
    prompt = list(range(20, 33))
    s = serve_prompt(cache, prompt)
    cache.free(s)
    assert cache.stats()["num_used_pages"] == 0
    t = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(t) == 12
    np.testing.assert_array_equal(cache.gather(0, t)[0], prefix_kv(prompt[:12], 0)[0])
    cache.reset_prefix_cache()                           # only unused pages are dropped
    u = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(u) == 12


def test_truncate_into_cached_page_copies_before_write(backend):
    cache = make(backend, page_size=4)
    prompt = list(range(8))
    s = serve_prompt(cache, prompt)                      # two full, cached pages
    cached = list(cache.page_ids(s))
    cache.truncate(s, 6)
    batch = cache.append([s], 2, token_ids=[50, 51])
    store_step(cache, batch, [s], {s: prompt[:6] + [50, 51]}, [2])
    assert cache.page_ids(s)[1] != cached[1]             # wrote into a private copy
    t = cache.add_sequence(token_ids=prompt + [99])
    assert list(cache.page_ids(t)) == cached             # the cached copy is intact
    np.testing.assert_array_equal(cache.gather(0, t)[0], prefix_kv(prompt, 0)[0])


def test_attention_same_with_caching_on_and_off(backend):
    rng = np.random.default_rng(3)
    system = list(rng.integers(0, 50, 24))
    outs = {}
    for caching in (False, True):
        cache = pagedkv.PagedKVCache(1, 2, 16, num_pages=32, page_size=8, backend=backend,
                                     enable_prefix_caching=caching)
        results = []
        for i in range(3):
            prompt = system + [100 + i] * (3 + i)
            s = cache.add_sequence(token_ids=prompt)
            done = cache.seq_len(s)
            batch = cache.append([s], len(prompt) - done, token_ids=prompt[done:])
            k, v = prefix_kv(prompt, 0)
            k = np.repeat(k, 4, axis=2).reshape(len(prompt), 1, 16).repeat(2, axis=1)
            q = np.random.default_rng(i).standard_normal((len(prompt), 4, 16)).astype(np.float32)
            cache.store(0, batch, k[done:], k[done:] / 3)
            results.append(cache.attention(0, batch, q[done:])[-1])   # the last token's output
        outs[caching] = np.stack(results)
    np.testing.assert_allclose(outs[True], outs[False], rtol=2e-5, atol=2e-5)


def test_pages_join_the_cache_only_once_every_layer_is_stored(backend):
    cache = make(backend, page_size=2)
    s = cache.add_sequence(token_ids=[1, 2, 3])
    batch = cache.append([s], 3, token_ids=[1, 2, 3])   # fills a page
    cache.store(0, batch, *prefix_kv([1, 2, 3], 0))
    early = cache.add_sequence(token_ids=[1, 2, 7])     # layer 1 not stored yet: no hit
    assert cache.seq_len(early) == 0
    cache.store(1, batch, *prefix_kv([1, 2, 3], 1))
    assert cache.seq_len(cache.add_sequence(token_ids=[1, 2, 7])) == 2


@pytest.mark.parametrize("abandon", ["truncate", "free", "append again", "restore"])
def test_an_abandoned_step_leaves_nothing_reusable(backend, abandon):
    """The engine's forward pass fails after some layers, and it rolls back or moves on:
    the pages the step filled never hold K/V of every layer, so no prompt may hit them."""
    cache = make(backend, page_size=2)
    other = cache.add_sequence()
    s = cache.add_sequence(token_ids=[1, 2, 3, 4, 5])
    checkpoint = cache.checkpoint(s)
    batch = cache.append([s], 5, token_ids=[1, 2, 3, 4, 5])
    cache.store(0, batch, *prefix_kv([1, 2, 3, 4, 5], 0))        # layer 1 never stored
    if abandon == "truncate":
        cache.truncate(s, 0)
    elif abandon == "free":
        cache.free(s)
    elif abandon == "restore":
        cache.restore(checkpoint)
    else:
        cache.append([other], 1)
    assert cache.stats()["num_cached_pages"] == 0
    probe = cache.add_sequence(token_ids=[1, 2, 3, 4, 5, 6])
    assert cache.seq_len(probe) == 0


def test_token_ids_validation(backend):
    cache = make(backend)
    s = cache.add_sequence()
    with pytest.raises(ValueError, match="expected 3 token ids"):
        cache.append([s], 3, token_ids=[1, 2])
    with pytest.raises(ValueError, match="int32"):
        cache.add_sequence(token_ids=[2**40])
    with pytest.raises(TypeError):
        cache.add_sequence(token_ids=[0.5])
    assert cache.seq_len(s) == 0 and cache.seq_ids() == [s]


def test_token_ids_ignored_without_caching(backend):
    cache = pagedkv.PagedKVCache(1, H, D, num_pages=8, page_size=2, backend=backend)
    s = cache.add_sequence(token_ids=[1, 2, 3])
    assert cache.seq_len(s) == 0
    cache.append([s], 3, token_ids=[1, 2, 3])
    t = cache.add_sequence(token_ids=[1, 2, 3])
    assert cache.seq_len(t) == 0
    assert cache.stats()["prefix_hit_rate"] == 0.0


def test_failing_hash_function_changes_nothing(backend):
    def broken_hash(parent, tokens):
        if 9 in tokens:
            raise RuntimeError("hash service down")
        return hash(tokens) & 0xFFFF

    cache = make(backend, page_size=2, prefix_hash=broken_hash)
    s = serve_prompt(cache, [1, 2, 3])
    before = (cache.seq_len(s), list(cache.page_ids(s)), cache.num_free_pages, cache.stats())
    with pytest.raises(RuntimeError, match="hash service down"):
        cache.append([s], 2, token_ids=[9, 5])       # fills the page [3, 9]: its hash fails
    assert (cache.seq_len(s), list(cache.page_ids(s)), cache.num_free_pages,
            cache.stats()) == before
