"""Shared-prefix (cascade) attention: ``cascade="auto"`` against ``cascade="off"`` (within
float32 rounding) and against the dense NumPy reference, on every backend, for forks,
prefix-cache hits, several groups, long prefixes, every variant, dtype and pool."""
import numpy as np
import pytest

import pagedkv
from pagedkv.cascade import CascadePolicy
from test_chunk_alibi import geometric_slopes, make, sinks_for

NUM_HEADS = 8       # make()'s default: 2 KV heads, GQA group 4
# auto and off differ only by float32 rounding: the same sums, merged in another order
# (ALiBi's bias in the shared part is shifted by up to slope x context, then shifted back)
ROUNDING = dict(rtol=2e-5, atol=5e-6)
# Every group of two or more with a shared key reads it once: the small caches here save
# too few bytes for the backends' own policies (tested below on their own)
FORCED = CascadePolicy(min_run_bytes=0, min_shared_keys=1)


class Twin:
    """A Harness over a ``cascade="auto"`` cache (checked against the dense reference),
    driving a ``cascade="off"`` cache with the same data beside it."""

    def __init__(self, backend, *, dtype="float32", policy=FORCED, **kwargs):
        self.h = make(backend, dtype=dtype, **kwargs)
        self.off = make(backend, dtype=dtype, cascade="off", **kwargs).cache
        self.cache = self.h.cache
        if policy is not None:
            self.cache._backend.cascade_policy = policy
        self.used = []           # per step: whether each layer read a shared run once

    def add(self, token_ids=None):
        s = self.h.add() if token_ids is None else self._add_cached(token_ids)
        assert self.off.add_sequence(token_ids) == s
        return s

    def _add_cached(self, token_ids):
        s = self.cache.add_sequence(token_ids)
        self.h.ref.add(s)
        return s

    def fork(self, parent):
        child = self.h.fork(parent)
        assert self.off.fork(parent) == child
        return child

    def step(self, seq_ids, counts, check=True, token_ids=None, **variant):
        h, c = self.h, self.cache
        counts = [int(n) for n in np.broadcast_to(counts, (len(seq_ids),))]
        batch = c.append(seq_ids, counts, token_ids=token_ids)
        other = self.off.append(seq_ids, counts, token_ids=token_ids)
        assert other.sharing == pagedkv.cascade.Sharing()
        total, used = sum(counts), []
        for layer in range(c.num_layers):
            k = h.random(total, c.num_kv_heads, c.head_dim)
            v = h.random(total, c.num_kv_heads, c.head_dim)
            q = h.random(total, h.num_heads, c.head_dim)
            c.store(layer, batch, k, v)
            self.off.store(layer, other, k, v)
            h.record(layer, seq_ids, counts, k, v)
            if not check:
                continue
            out = c.attention(layer, batch, q, **variant)
            np.testing.assert_allclose(out, self.off.attention(layer, other, q, **variant),
                                       **ROUNDING)
            h.compare(layer, seq_ids, counts, q, out, h.layer_variant(layer, variant))
            tables = c._layer_pool[layer].step_tables(batch)
            used.append(any(plan is not None for key, plan in tables.plans.items()
                            if key[0] == "cascade"))
        self.used.append(tuple(used) if len(used) > 1 else any(used))
        return batch


def forked_family(t, prefix=300, suffixes=(0, 3, 17, 40)):
    """A root with ``prefix`` tokens (its last page partly filled), forked once per
    suffix length; each fork then writes its own suffix (copy-on-write of that page)."""
    root = t.add()
    t.step([root], prefix, check=False)
    kids = [t.fork(root) for _ in suffixes]
    for kid, n in zip(kids, suffixes):
        if n:
            t.step([kid], n, check=False)
    return root, kids


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_forks_with_own_suffixes(backend, dtype):
    t = Twin(backend, dtype=dtype)
    root, kids = forked_family(t)
    alone = t.add()
    t.step([alone], 280, check=False)
    batch = t.step(kids + [alone, root], [1, 2, 1, 1, 3, 1])
    t.step(kids + [root], 1)
    assert t.used == [False] * 5 + [True, True]
    sharing = batch.sharing
    # 18 whole pages (288 tokens) shared by the root and its 4 forks; the 19th was copied
    assert (sharing.num_groups, sharing.num_sequences, sharing.shared_tokens,
            sharing.saved_token_reads) == (1, 5, 288, 288 * 4)


def test_fork_at_a_page_boundary_and_no_suffix(backend):
    t = Twin(backend)
    root, kids = forked_family(t, prefix=320, suffixes=(0, 0, 0))
    t.step(kids + [root], 1)
    assert t.used[-1]


def test_several_groups_and_a_long_prefix(backend):
    # a prefix longer than a split-K part, so that the shared call splits and merges too
    t = Twin(backend, num_pages=700)
    a, a_kids = forked_family(t, prefix=2600, suffixes=(5, 0, 9))
    b, b_kids = forked_family(t, prefix=400, suffixes=(1, 30))
    solo = t.add()
    t.step([solo], 20, check=False)
    batch = t.step(a_kids + [solo] + b_kids + [a, b], 1)
    assert t.used[-1] and batch.sharing.num_groups == 2


def test_many_small_groups(backend):
    # pairs (beams) of prefixes of different lengths, interleaved in the batch
    t = Twin(backend, num_pages=600)
    pairs = [forked_family(t, prefix=p, suffixes=(s,)) for p, s in
             ((300, 0), (512, 5), (700, 16), (260, 2), (999, 0))]
    order = [s for root, kids in pairs for s in (kids[0], root)]
    order = order[1::2] + order[::2]
    batch = t.step(order, 1)
    assert t.used[-1] and batch.sharing.num_groups == 5


def test_prefix_cache_hits(backend):
    t = Twin(backend, enable_prefix_caching=True)
    prompt = list(range(1000, 1000 + 400))
    first = t.add(prompt)
    t.step([first], len(prompt), check=False, token_ids=prompt)
    hits = []
    for _ in range(3):
        s = t.add(prompt)
        done = t.cache.seq_len(s)
        assert done == 384            # 24 full pages cached; the prompt's last token is not
        t.h.ref.k[s] = [k[:done] for k in t.h.ref.k[first]]
        t.h.ref.v[s] = [v[:done] for v in t.h.ref.v[first]]
        t.step([s], len(prompt) - done, token_ids=prompt[done:])
        hits.append(s)
    t.step(hits + [first], 1)
    assert t.used[-1]


VARIANTS = {
    "window": dict(sliding_window=500),           # members see different first keys
    "chunk_from_0": dict(attention_chunk_size=2048),
    "cap_sinks_alibi": dict(logits_soft_cap=2.0, sinks=sinks_for(NUM_HEADS),
                            alibi_slopes=geometric_slopes(NUM_HEADS)),
    "alibi_negative": dict(alibi_slopes=-np.linspace(0.0, 0.05, NUM_HEADS)),
    "window_cap_sinks": dict(sliding_window=550, logits_soft_cap=5.0,
                             sinks=sinks_for(NUM_HEADS, seed=3)),
}


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_variants(backend, variant, dtype):
    t = Twin(backend, dtype=dtype)
    root, kids = forked_family(t, prefix=600, suffixes=(0, 7, 33))
    t.step(kids + [root], [1, 1, 2, 1], **VARIANTS[variant])
    assert t.used[-1]


def test_chunk_that_starts_inside_the_shared_run(backend):
    t = Twin(backend, num_pages=400)
    root, kids = forked_family(t, prefix=2600, suffixes=(0, 4, 20))
    # positions 2600..2624 sit in chunk 2048..4095: the shared keys 2048..2591 are read once
    t.step(kids + [root], 1, attention_chunk_size=2048)
    assert t.used[-1]


def test_both_pools(backend):
    t = Twin(backend, num_layers=2, layer_windows=[None, 400])
    root, kids = forked_family(t, prefix=600, suffixes=(0, 3, 12))
    batch = t.step(kids + [root], 1)
    assert t.used[-1] == (True, True)        # the window pool's shared pages too
    assert batch.sharing.num_groups == 1     # the full pool's sharing


def test_default_policy_reads_a_long_shared_prefix_once(backend):
    t = Twin(backend, policy=None, num_kv_heads=8, head_dim=64, group=2, num_pages=200)
    root, kids = forked_family(t, prefix=1100, suffixes=(0, 1, 2, 3, 4, 5, 6))
    batch = t.step(kids + [root], 1)     # 8 x 1,088 keys x 4 KiB of reads: 35.7 MB
    assert t.used[-1] and batch.sharing.saved_token_reads == 7 * 1088


def test_default_policy_reads_short_runs_once_per_sequence(backend):
    t = Twin(backend, policy=None)
    root, kids = forked_family(t, prefix=100, suffixes=(0, 1))   # too short to pay
    others = [t.add() for _ in range(3)]
    for s in others:
        t.step([s], 300, check=False)
    batch = t.step(kids + [root] + others, 1)
    assert t.used[-1] is False and batch.sharing == pagedkv.cascade.Sharing()


def test_prefill_after_a_fork_reads_once_per_sequence(backend):
    # many rows each: the block path already reads the keys once per block of rows
    t = Twin(backend)
    root, kids = forked_family(t, prefix=400, suffixes=(0, 0))
    t.step(kids + [root], 40)
    assert t.used[-1] is False


@pytest.mark.parametrize("bad", ["on", "AUTO", "", None, 1, True])
def test_bad_cascade_value(bad):
    with pytest.raises(ValueError, match="cascade"):
        pagedkv.PagedKVCache(1, 1, 8, num_pages=4, backend="host", cascade=bad)


def test_nothing_shared_skips_the_search_and_a_later_fork_is_found(backend, monkeypatch):
    """With no page held twice in a pool, the step's tables say so and the search is
    skipped (results still equal "off" and the reference); a fork made afterwards
    is found, and freeing it brings the fast path back.  Each pool's step searches
    once, whatever the layers and ``StepBatch.sharing`` ask."""
    calls = []
    find_groups = pagedkv.cascade.find_groups

    def counting(tables, *args):
        calls.append(tables.may_share)
        return find_groups(tables, *args)

    monkeypatch.setattr(pagedkv.cascade, "find_groups", counting)
    t = Twin(backend, num_layers=2, layer_windows=[None, 400])
    seqs = [t.add() for _ in range(3)]
    for s, n in zip(seqs, (600, 350, 17)):
        t.step([s], n, check=False)

    def pools(batch):
        return [t.cache._layer_pool[layer].step_tables(batch) for layer in range(2)]

    batch = t.step(seqs, 1)
    assert [tables.may_share for tables in pools(batch)] == [False, False]
    assert t.used[-1] == (False, False) and batch.sharing == pagedkv.cascade.Sharing()
    kid = t.fork(seqs[0])
    t.step([kid], 5, check=False)           # its own suffix, after copy-on-write
    calls.clear()
    batch = t.step(seqs + [kid], 1)
    assert [tables.may_share for tables in pools(batch)] == [True, True]
    assert t.used[-1] == (True, True) and batch.sharing.num_groups == 1
    assert batch.sharing.num_sequences == 2
    assert calls == [True, True]             # one search per pool, none for sharing
    batch = t.step(seqs[1:] + [kid], 1)      # the fork's parent sits this step out
    assert t.used[-1] == (False, False) and batch.sharing == pagedkv.cascade.Sharing()
    t.h.free(kid)
    t.off.free(kid)
    batch = t.step(seqs, 1)
    assert [tables.may_share for tables in pools(batch)] == [False, False]
    assert t.used[-1] == (False, False) and batch.sharing == pagedkv.cascade.Sharing()


def test_a_prefix_hit_is_sharing(backend):
    """Pages a prefix-cache hit takes have two holders: the step is searched."""
    t = Twin(backend, enable_prefix_caching=True)
    prompt = list(range(500, 500 + 300))
    first = t.add(prompt)
    t.step([first], len(prompt), check=False, token_ids=prompt)
    second = t.add(prompt)
    done = t.cache.seq_len(second)
    t.h.ref.k[second] = [k[:done] for k in t.h.ref.k[first]]
    t.h.ref.v[second] = [v[:done] for v in t.h.ref.v[first]]
    t.step([second], len(prompt) - done, token_ids=prompt[done:], check=False)
    batch = t.step([first, second], 1)
    assert batch._tables.may_share and t.used[-1]
    assert batch.sharing.num_groups == 1 and batch.sharing.shared_tokens == done
