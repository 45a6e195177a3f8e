"""Sliding windows, logit soft-capping and attention sinks, against the dense NumPy
reference, on every backend."""
import numpy as np
import pytest

import pagedkv
from reference import TOLERANCE, Harness, dense_attention


def make(backend, *, num_kv_heads=2, head_dim=64, page_size=16, num_pages=256,
         dtype="float32", group=4, num_layers=1, seed=0):
    cache = pagedkv.PagedKVCache(num_layers, num_kv_heads, head_dim, num_pages=num_pages,
                                 page_size=page_size, dtype=dtype, backend=backend)
    return Harness(cache, num_heads=num_kv_heads * group, seed=seed)


def sinks_for(num_heads, seed=0):
    # around the logits' own scale, so that the sink takes a real share
    return np.random.default_rng(seed).uniform(-1.0, 3.0, num_heads)


def variants(num_heads, page_size):
    """Each variant alone, and all three combined, for a cache of ``page_size``."""
    return {
        "window_1": dict(sliding_window=1),
        "window_page": dict(sliding_window=page_size),
        "window_odd": dict(sliding_window=page_size + 3),
        "window_huge": dict(sliding_window=10**6),
        "soft_cap": dict(logits_soft_cap=0.7),
        "sinks": dict(sinks=sinks_for(num_heads)),
        "combined": dict(sliding_window=2 * page_size + 1, logits_soft_cap=1.5,
                         sinks=sinks_for(num_heads, 1), scale=0.2),
    }


VARIANT_NAMES = sorted(variants(1, 1))


def prefill_decode_chunk(h, **variant):
    """Ragged prefill across page boundaries, decode steps, then a chunk next to a decode."""
    ps = h.cache.page_size
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [2 * ps + 3, ps + 1, 5], **variant)
    for _ in range(2):
        h.step(seqs, 1, **variant)
    h.step(seqs, [ps + 2, 1, 0], **variant)
    h.check_contents()


@pytest.mark.parametrize("name", VARIANT_NAMES)
@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_variants_over_page_sizes(backend, name, page_size):
    h = make(backend, page_size=page_size)
    prefill_decode_chunk(h, **variants(8, page_size)[name])


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_combined_variant_over_head_dims_and_gqa(backend, head_dim, group):
    h = make(backend, head_dim=head_dim, group=group, page_size=7)
    prefill_decode_chunk(h, **variants(2 * group, 7)["combined"])


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_variants_with_float16_storage(backend, name):
    h = make(backend, dtype="float16", page_size=7)
    prefill_decode_chunk(h, **variants(8, 7)[name])


@pytest.mark.parametrize("window", [64, 300, 1000, 2000])
def test_split_k_long_context_with_windows(backend, window):
    # one sequence of 5,000 tokens: decode and a chunk take the split-K path
    # (on the host, a decode step over 2,000 keys is work enough for threads)
    h = make(backend, num_kv_heads=1, group=4, page_size=16, num_pages=400)
    s = h.add()
    h.step([s], 4999, check=False)
    variant = dict(sliding_window=window, logits_soft_cap=2.0, sinks=sinks_for(4))
    h.step([s], 1, sliding_window=window)
    h.step([s], 1, **variant)
    h.step([s], 64, sliding_window=window)
    h.step([s], 64, **variant)


def test_pages_outside_every_window_are_never_read(backend):
    """NaN in the pages no window of the step reaches: results stay finite and right."""
    ps, window = 16, 40
    cache = pagedkv.PagedKVCache(1, 2, 32, num_pages=64, page_size=ps, backend=backend)
    rng = np.random.default_rng(3)
    a, b = cache.add_sequence(), cache.add_sequence()
    lengths = [200, 77]
    k = [rng.standard_normal((n + 3, 2, 32), dtype=np.float32) for n in lengths]
    v = [rng.standard_normal((n + 3, 2, 32), dtype=np.float32) for n in lengths]
    for kk, vv, n in zip(k, v, lengths):
        # every page wholly before the oldest position the step's windows see
        first_seen = n + 1 - window
        kk[:first_seen // ps * ps] = np.nan
        vv[:first_seen // ps * ps] = np.nan
    batch = cache.append([a, b], lengths)
    cache.store(0, batch, np.concatenate([kk[:n] for kk, n in zip(k, lengths)]),
                np.concatenate([vv[:n] for vv, n in zip(v, lengths)]))
    batch = cache.append([a, b], 3)                    # a chunk of 3 rows per sequence
    cache.store(0, batch, np.concatenate([kk[n:] for kk, n in zip(k, lengths)]),
                np.concatenate([vv[n:] for vv, n in zip(v, lengths)]))
    q = rng.standard_normal((6, 4, 32), dtype=np.float32)
    sinks = sinks_for(4)
    out = cache.attention(0, batch, q, sliding_window=window, sinks=sinks)
    assert np.isfinite(out).all()
    for i, n in enumerate(lengths):
        expected = dense_attention(q[3 * i:3 * i + 3], k[i], v[i], np.arange(n, n + 3),
                                   sliding_window=window, sinks=sinks)
        np.testing.assert_allclose(out[3 * i:3 * i + 3], expected, **TOLERANCE["float32"])


def test_defaults_change_nothing(backend):
    h = make(backend, page_size=7)
    seqs = [h.add() for _ in range(2)]
    batch = h.step(seqs, [12, 20])
    q = h.random(32, 8, 64)
    plain = h.cache.attention(0, batch, q)
    explicit = h.cache.attention(0, batch, q, scale=None, sliding_window=None,
                                 logits_soft_cap=None, sinks=None)
    np.testing.assert_array_equal(plain, explicit)


def test_window_covering_everything_equals_full_attention(backend):
    h = make(backend, page_size=7)
    s = h.add()
    batch = h.step([s], 30)
    q = h.random(30, 8, 64)
    np.testing.assert_allclose(h.cache.attention(0, batch, q, sliding_window=30),
                               h.cache.attention(0, batch, q), rtol=1e-6, atol=1e-6)


def test_very_negative_sinks_change_nothing_and_large_sinks_dominate(backend):
    h = make(backend, page_size=7)
    s = h.add()
    batch = h.step([s], 20)
    q = h.random(20, 8, 64)
    plain = h.cache.attention(0, batch, q)
    np.testing.assert_allclose(h.cache.attention(0, batch, q, sinks=np.full(8, -80.0)),
                               plain, rtol=1e-6, atol=1e-6)
    # a sink far above every logit takes almost all the weight, without overflow
    quiet = h.cache.attention(0, batch, q, sinks=np.full(8, 200.0))
    assert np.isfinite(quiet).all() and np.abs(quiet).max() < 1e-30


BAD_VARIANTS = [
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(sliding_window=-3), ValueError, "sliding_window"),
    (dict(sliding_window=2.0), ValueError, "sliding_window"),
    (dict(sliding_window=True), ValueError, "sliding_window"),
    (dict(sliding_window="8"), ValueError, "sliding_window"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=1e39), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="2"), ValueError, "logits_soft_cap"),
    (dict(sinks=np.zeros(7)), ValueError, "sinks"),
    (dict(sinks=np.zeros((8, 1))), ValueError, "sinks"),
    (dict(sinks=np.array([np.nan] + [0.0] * 7)), ValueError, "sinks"),
    (dict(sinks=np.array([np.inf] + [0.0] * 7)), ValueError, "sinks"),
    (dict(sinks=np.full(8, 1e39)), ValueError, "sinks"),
    (dict(sinks=np.array(["a"] * 8)), ValueError, "sinks"),
    (dict(sinks=3.0), ValueError, "sinks"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=10**400), ValueError, "scale"),
    (dict(scale=1e308), ValueError, "scale"),
    (dict(scale=1e-50), ValueError, "scale"),
]


@pytest.mark.parametrize("kwargs,error,name", BAD_VARIANTS,
                         ids=[f"{k}={v!r}"[:40] for kw, _, _ in BAD_VARIANTS
                              for k, v in kw.items()])
def test_bad_variant_arguments(backend, kwargs, error, name):
    h = make(backend, page_size=7)
    s = h.add()
    batch = h.step([s], 10)
    q = h.random(10, 8, 64)
    before = h.cache.attention(0, batch, q)
    with pytest.raises(error, match=name):
        h.cache.attention(0, batch, q, **kwargs)
    # nothing changed: the same batch still gives the same result, the cache still works
    np.testing.assert_array_equal(h.cache.attention(0, batch, q), before)
    h.step([s], 1, sliding_window=3)


def test_numpy_scalar_variant_arguments_are_accepted(backend):
    h = make(backend, page_size=7)
    s = h.add()
    h.step([s], 12)
    h.step([s], 2, scale=np.float32(0.3), sliding_window=np.int64(5),
           logits_soft_cap=np.float64(1.2), sinks=list(sinks_for(8)))
    h.step([s], 1, scale=2, logits_soft_cap=3)


# -- attention_chunk_size (chunked local attention) ------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("chunk,window", [(1, None), (7, None), (16, None), (23, None),
                                          (9, 5), (5, 9)])
def test_chunks_alone_and_with_windows(backend, dtype, chunk, window):
    # prefill (block path: many queries per KV head), decode (page path) and a
    # chunked prefill next to a decode, with queries on both sides of chunk ends
    h = make(backend, page_size=7, dtype=dtype)
    prefill_decode_chunk(h, attention_chunk_size=chunk, sliding_window=window,
                         logits_soft_cap=1.5 if chunk == 7 else None)


def test_chunked_prefill_many_rows_per_item_crosses_a_chunk(backend):
    # one item's query rows span a chunk boundary: its rows see different starts
    h = make(backend, page_size=16, group=8)
    s = h.add()
    h.step([s], 150, attention_chunk_size=64, sinks=sinks_for(16))
    h.step([s], 1, attention_chunk_size=64)


def test_chunked_decode_reads_only_its_chunk(backend):
    # split-K over a long context: the plan's key ranges start at the chunk
    from pagedkv.attention_spec import AttentionSpec
    from pagedkv.backends.schedule import ITEM
    h = make(backend, page_size=16, num_pages=400, group=1)
    s = h.add()
    h.step([s], 3000, check=False)
    batch = h.step([s], 1, attention_chunk_size=1024)   # position 3000: sees 2048 .. 3000
    spec = AttentionSpec.from_arguments(
        head_dim=64, num_heads=2, attention_chunk_size=1024)
    plan = h.cache._backend.plan(batch._tables, 2, spec.band)
    items = plan.host_items if hasattr(plan, "host_items") else plan.items
    assert items[:, ITEM.KEY0].min() == 2048 and items[:, ITEM.KEY1].max() == 3001


@pytest.mark.parametrize("hide", ["pages", "positions"])
def test_positions_before_every_chunk_are_never_read(backend, hide):
    """NaN K/V before the chunk of every query of the step (whole pages, or every
    position before the chunk's start): results stay finite and right."""
    ps, chunk = 16, 48
    cache = pagedkv.PagedKVCache(1, 2, 32, num_pages=64, page_size=ps, backend=backend)
    rng = np.random.default_rng(5)
    a, b = cache.add_sequence(), cache.add_sequence()
    lengths = [200, 100]               # the step's rows: 200..202 and 100..102
    k = [rng.standard_normal((n + 3, 2, 32), dtype=np.float32) for n in lengths]
    v = [rng.standard_normal((n + 3, 2, 32), dtype=np.float32) for n in lengths]
    for kk, vv, n in zip(k, v, lengths):
        first_seen = n // chunk * chunk
        hidden = first_seen // ps * ps if hide == "pages" else first_seen
        kk[:hidden] = np.nan
        vv[:hidden] = np.nan
    batch = cache.append([a, b], lengths)
    cache.store(0, batch, np.concatenate([kk[:n] for kk, n in zip(k, lengths)]),
                np.concatenate([vv[:n] for vv, n in zip(v, lengths)]))
    batch = cache.append([a, b], 3)
    cache.store(0, batch, np.concatenate([kk[n:] for kk, n in zip(k, lengths)]),
                np.concatenate([vv[n:] for vv, n in zip(v, lengths)]))
    q = rng.standard_normal((6, 4, 32), dtype=np.float32)
    for variant in (dict(attention_chunk_size=chunk),
                    dict(attention_chunk_size=chunk, sliding_window=30, sinks=sinks_for(4))):
        out = cache.attention(0, batch, q, **variant)
        assert np.isfinite(out).all()
        for i, n in enumerate(lengths):
            expected = dense_attention(q[3 * i:3 * i + 3], k[i], v[i], np.arange(n, n + 3),
                                       **variant)
            np.testing.assert_allclose(out[3 * i:3 * i + 3], expected, **TOLERANCE["float32"])
