"""Chunked local attention (``attention_chunk_size``) and ALiBi (``alibi_slopes``), alone and
combined with each other and with the other variants, against the dense NumPy reference,
on every backend and storage dtype."""
import numpy as np
import pytest

import pagedkv
from reference import TOLERANCE, Harness, dense_attention, round_to_storage, visible_keys
from test_attention_variants import prefill_decode_chunk
from test_int8 import Int8Harness

NUM_HEADS = 8            # query heads of the default cache: 2 KV heads, GQA group 4


def make(backend, *, dtype="float32", num_kv_heads=2, head_dim=32, page_size=16,
         num_pages=256, group=4, num_layers=1, seed=0, **kwargs):
    """A Harness over a new cache; int8's compares with the rows gather returns."""
    cache = pagedkv.PagedKVCache(num_layers, num_kv_heads, head_dim, num_pages=num_pages,
                                 page_size=page_size, dtype=dtype, backend=backend, **kwargs)
    if dtype == "int8":
        return Int8Harness(cache, num_heads=num_kv_heads * group, seed=seed)
    return Harness(cache, num_heads=num_kv_heads * group, seed=seed, dtype=dtype)


def geometric_slopes(num_heads):
    """BLOOM's slopes for a power-of-two head count: ``2 ** (-8 i / n)``, i = 1 .. n."""
    return 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)


def random_slopes(num_heads, seed=0):
    return np.random.default_rng(seed).uniform(0.0, 1.0, num_heads)


def sinks_for(num_heads, seed=0):
    # around the logits' own scale, so that the sink takes a real share
    return np.random.default_rng(seed).uniform(-1.0, 3.0, num_heads)


def variants(num_heads):
    """Chunks and ALiBi alone and with the other variants, for a cache of page size 7
    (the steps of :func:`prefill_decode_chunk` cross chunk and page boundaries)."""
    return {
        "chunk_below_window": dict(attention_chunk_size=10, sliding_window=25),
        "window_below_chunk": dict(attention_chunk_size=25, sliding_window=10),
        "chunk_soft_cap": dict(attention_chunk_size=12, logits_soft_cap=0.8),
        "chunk_sinks": dict(attention_chunk_size=12, sinks=sinks_for(num_heads)),
        "alibi_random": dict(alibi_slopes=random_slopes(num_heads)),
        "alibi_zero": dict(alibi_slopes=np.zeros(num_heads)),
        "alibi_negative": dict(alibi_slopes=-geometric_slopes(num_heads)),
        "alibi_mixed_signs": dict(alibi_slopes=random_slopes(num_heads, 1) - 0.5),
        "alibi_geometric": dict(alibi_slopes=geometric_slopes(num_heads)),
        "alibi_soft_cap": dict(alibi_slopes=geometric_slopes(num_heads), logits_soft_cap=1.2),
        "alibi_sinks": dict(alibi_slopes=random_slopes(num_heads, 2), sinks=sinks_for(num_heads)),
        "alibi_chunk_window": dict(alibi_slopes=geometric_slopes(num_heads),
                                   attention_chunk_size=11, sliding_window=8),
        "everything": dict(attention_chunk_size=20, sliding_window=13, logits_soft_cap=1.5,
                           sinks=sinks_for(num_heads, 1), scale=0.2,
                           alibi_slopes=random_slopes(num_heads, 3)),
    }


VARIANT_NAMES = sorted(variants(1))


def chunk_steps(h, chunk, **variant):
    """Steps whose queries sit at, just before, just after and across chunk boundaries
    (multiples of ``chunk``), on a ragged batch: prefill, decode, chunked prefill."""
    ps = h.cache.page_size
    variant = dict(variant, attention_chunk_size=chunk)
    seqs = [h.add() for _ in range(4)]
    h.step(seqs, [chunk - 1, chunk, 2 * chunk + 3, ps + 1], **variant)
    # decode: sequence 0 at chunk - 1 (its chunk's last) then chunk (sees only itself)
    for _ in range(2):
        h.step(seqs, 1, **variant)
    # chunked prefill across the next boundary, next to a decode and an idle sequence
    h.step(seqs, [chunk + 2, 1, chunk, 0], **variant)
    h.step(seqs, 1, **variant)
    h.check_contents()


@pytest.mark.parametrize("page_size,chunk", [
    (16, 1), (16, 3), (16, 16), (16, 21), (16, 33), (16, 48), (7, 16), (1, 5)])
def test_chunks_at_and_across_page_and_chunk_boundaries(backend, page_size, chunk):
    h = make(backend, page_size=page_size)
    chunk_steps(h, chunk)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_chunks_and_alibi_with_gqa(backend, group):
    h = make(backend, page_size=7, group=group, head_dim=64)
    chunk_steps(h, 10, alibi_slopes=geometric_slopes(2 * group))


@pytest.mark.parametrize("name", VARIANT_NAMES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_variants_over_storage_dtypes(backend, dtype, name):
    h = make(backend, dtype=dtype, page_size=7)
    prefill_decode_chunk(h, **variants(NUM_HEADS)[name])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_chunk_with_alibi_at_chunk_boundaries_over_storage_dtypes(backend, dtype):
    h = make(backend, dtype=dtype, page_size=16)
    chunk_steps(h, 21, alibi_slopes=random_slopes(NUM_HEADS), sliding_window=30,
                logits_soft_cap=2.0, sinks=sinks_for(NUM_HEADS))


@pytest.mark.parametrize("prefill,chunk", [(2300, 1000), (2300, 1170), (2300, 4096),
                                           (5200, 3000)])
def test_split_k_long_context_with_chunks(backend, prefill, chunk):
    # decode over more than 2,048 keys takes the split-K path; 1170 puts a chunk
    # boundary (2340) inside the last 64-token step; with 4096 every key is in the
    # first chunk; 5200 with 3000 leaves 2,200 keys in the decode's chunk
    h = make(backend, num_kv_heads=1, group=4, page_size=16, num_pages=420)
    s = h.add()
    h.step([s], prefill, check=False)
    h.step([s], 1, attention_chunk_size=chunk)
    h.step([s], 1, attention_chunk_size=chunk, alibi_slopes=geometric_slopes(4),
           logits_soft_cap=2.0, sinks=sinks_for(4))
    h.step([s], 64, attention_chunk_size=chunk)
    h.step([s], 1, attention_chunk_size=chunk, sliding_window=1500,
           alibi_slopes=random_slopes(4) * 0.01)


def test_split_k_long_context_with_alibi(backend):
    h = make(backend, num_kv_heads=1, group=4, page_size=16, num_pages=420)
    s = h.add()
    h.step([s], 4999, check=False)
    # slopes small enough that keys thousands of positions back still count
    slopes = np.array([2.0 ** -12, 2.0 ** -10, 0.0, -2.0 ** -12])
    h.step([s], 1, alibi_slopes=slopes)
    h.step([s], 3, alibi_slopes=slopes, logits_soft_cap=3.0)


@pytest.mark.parametrize("granularity", ["page", "position"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_positions_outside_every_chunk_are_never_read(backend, dtype, granularity):
    """NaN K/V in the earlier positions no chunk of the step reaches: whole pages,
    or every such position (also those sharing a page with visible ones)."""
    ps, chunk, heads = 16, 50, 4
    cache = pagedkv.PagedKVCache(1, 2, 32, num_pages=64, page_size=ps, dtype=dtype,
                                 backend=backend)
    rng = np.random.default_rng(3)
    seqs = [cache.add_sequence() for _ in range(3)]
    lengths = [200, 77, 150]           # chunks of the later steps start at 200, 50, 150
    new = 1 + 3                        # a decode step, then a step of 3 rows
    k = [rng.standard_normal((n + new, 2, 32), dtype=np.float32) for n in lengths]
    v = [rng.standard_normal((n + new, 2, 32), dtype=np.float32) for n in lengths]
    for kk, vv, n in zip(k, v, lengths):
        first_seen = n // chunk * chunk
        hidden = first_seen // ps * ps if granularity == "page" else first_seen
        kk[:hidden] = np.nan
        vv[:hidden] = np.nan
    batch = cache.append(seqs, lengths)
    cache.store(0, batch, np.concatenate([kk[:n] for kk, n in zip(k, lengths)]),
                np.concatenate([vv[:n] for vv, n in zip(v, lengths)]))
    slopes = geometric_slopes(heads)
    done = list(lengths)
    for rows in (1, 3):
        batch = cache.append(seqs, rows)
        cache.store(0, batch, np.concatenate([kk[n:n + rows] for kk, n in zip(k, done)]),
                    np.concatenate([vv[n:n + rows] for vv, n in zip(v, done)]))
        q = rng.standard_normal((3 * rows, heads, 32), dtype=np.float32)
        for variant in (dict(attention_chunk_size=chunk),
                        dict(attention_chunk_size=chunk, alibi_slopes=slopes,
                             sliding_window=30, sinks=sinks_for(heads))):
            out = cache.attention(0, batch, q, **variant)
            assert np.isfinite(out).all()
            for i, n in enumerate(done):
                kept_k = round_to_storage(k[i][:n + rows], dtype)
                kept_v = round_to_storage(v[i][:n + rows], dtype)
                expected = dense_attention(q[rows * i:rows * (i + 1)], kept_k, kept_v,
                                           np.arange(n, n + rows), **variant)
                np.testing.assert_allclose(out[rows * i:rows * (i + 1)], expected,
                                           **TOLERANCE[dtype])
        done = [n + rows for n in done]


def test_chunk_on_a_windowed_layer(backend):
    # layer 1 keeps a window of 9 in the window pool: it sees what chunk and window allow
    h = make(backend, num_layers=2, page_size=4, layer_windows=[None, 9])
    s, t = h.add(), h.add()
    h.step([s, t], [23, 6], attention_chunk_size=12, alibi_slopes=geometric_slopes(8))
    for _ in range(6):
        h.step([s, t], 1, attention_chunk_size=12, alibi_slopes=geometric_slopes(8))
    h.step([s, t], [7, 2], attention_chunk_size=5)
    h.check_contents()


def test_forks_sharing_pages(backend):
    """Sequences sharing their pages (one shared run read for all, where the planner
    takes it) give each query its own chunk and ALiBi distances."""
    variant = dict(attention_chunk_size=13, alibi_slopes=random_slopes(NUM_HEADS),
                   sinks=sinks_for(NUM_HEADS))
    h = make(backend, page_size=4)
    a = h.add()
    h.step([a], 30, **variant)
    kids = [h.fork(a) for _ in range(3)]
    h.step([a] + kids, 1, **variant)
    h.step([a] + kids, [2, 1, 5, 1], **variant)
    h.step([a] + kids, 1, **variant)
    h.check_contents()


def test_alibi_is_added_after_the_soft_cap(backend):
    """Large logits and a small cap, where the order matters: the cache must match the
    reference that adds the bias after the cap, and the other order is far from it."""
    heads, head_dim, n = 2, 16, 24
    cache = pagedkv.PagedKVCache(1, 1, head_dim, num_pages=16, page_size=4, backend=backend)
    rng = np.random.default_rng(7)
    k = 4 * rng.standard_normal((n, 1, head_dim), dtype=np.float32)
    v = rng.standard_normal((n, 1, head_dim), dtype=np.float32)
    q = 4 * rng.standard_normal((n, heads, head_dim), dtype=np.float32)
    s = cache.add_sequence()
    batch = cache.append([s], n)
    cache.store(0, batch, k, v)
    slopes = np.array([0.3, 1.5])
    variant = dict(alibi_slopes=slopes, logits_soft_cap=1.0)
    after = dense_attention(q, k, v, np.arange(n), **variant)
    before = dense_attention(q, k, v, np.arange(n), alibi_before_soft_cap=True, **variant)
    assert np.abs(after - before).max() > 0.1
    out = cache.attention(0, batch, q, **variant)
    np.testing.assert_allclose(out, after, **TOLERANCE["float32"])


def test_alibi_keeps_its_precision_100k_positions_in(backend):
    # the distance j - p is an integer: near keys of a query at position ~100k get
    # their small bias to float32 precision (slope * j - slope * p in float32 would
    # be off by up to ~4e-3 at slope 0.3, whose products with positions round)
    n = 100_000
    h = make(backend, num_kv_heads=1, group=4, head_dim=16, page_size=16,
             num_pages=n // 16 + 8)
    s = h.add()
    h.step([s], n, check=False)
    slopes = np.array([0.3, 0.7, 0.13, 0.0101])
    h.step([s], 1, alibi_slopes=slopes)
    h.step([s], 3, alibi_slopes=slopes, attention_chunk_size=4096, logits_soft_cap=4.0)
    h.step([s], 1, alibi_slopes=slopes, sliding_window=64, sinks=sinks_for(4))


def test_alibi_precision_with_positions_far_apart(backend):
    """A quicker cousin of the 100k test: queries near position 20,000, slopes whose
    products with positions round, so that a float32 ``slope * j - slope * p`` would
    be off by ~4e-4 in the output."""
    n = 20_000
    h = make(backend, num_kv_heads=1, group=4, head_dim=16, page_size=16,
             num_pages=n // 16 + 8)
    s = h.add()
    h.step([s], n, check=False)
    slopes = np.array([1.3, 0.7, 0.3, 2.7])
    h.step([s], 1, alibi_slopes=slopes)
    h.step([s], 2, alibi_slopes=slopes, attention_chunk_size=3000)


def test_defaults_change_nothing(backend):
    h = make(backend, page_size=7)
    seqs = [h.add() for _ in range(2)]
    batch = h.step(seqs, [12, 20])
    q = h.random(32, NUM_HEADS, 32)
    plain = h.cache.attention(0, batch, q)
    explicit = h.cache.attention(0, batch, q, attention_chunk_size=None, alibi_slopes=None)
    np.testing.assert_array_equal(plain, explicit)


def test_zero_slopes_and_a_chunk_covering_everything_change_nothing(backend):
    h = make(backend, page_size=7)
    s = h.add()
    batch = h.step([s], 30)
    q = h.random(30, NUM_HEADS, 32)
    plain = h.cache.attention(0, batch, q)
    for variant in (dict(alibi_slopes=np.zeros(NUM_HEADS)), dict(attention_chunk_size=30),
                    dict(attention_chunk_size=10**9)):
        np.testing.assert_allclose(h.cache.attention(0, batch, q, **variant), plain,
                                   rtol=1e-6, atol=1e-6)


def test_chunk_of_one_returns_each_tokens_own_value(backend):
    h = make(backend, page_size=7)
    s = h.add()
    batch = h.step([s], 15)
    q = h.random(15, NUM_HEADS, 32)
    out = h.cache.attention(0, batch, q, attention_chunk_size=1,
                            alibi_slopes=geometric_slopes(NUM_HEADS))
    _, v = h.cache.gather(0, s)
    np.testing.assert_allclose(out, np.repeat(v, 4, axis=1), rtol=1e-6, atol=1e-6)


def test_numpy_and_list_arguments_are_accepted(backend):
    h = make(backend, page_size=7)
    s = h.add()
    h.step([s], 12)
    h.step([s], 2, attention_chunk_size=np.int64(5), alibi_slopes=list(geometric_slopes(8)))
    h.step([s], 1, attention_chunk_size=np.int32(4),
           alibi_slopes=tuple(random_slopes(8).astype(np.float32)))


def test_torch_tensor_slopes_are_accepted(backend):
    torch = pytest.importorskip("torch")
    h = make(backend, page_size=7)
    s = h.add()
    batch = h.step([s], 20)
    q = h.random(20, NUM_HEADS, 32)
    slopes = geometric_slopes(NUM_HEADS)
    want = h.cache.attention(0, batch, q, alibi_slopes=slopes)
    h.compare(0, [s], [20], q, want, dict(alibi_slopes=slopes))
    for tensor in (torch.tensor(slopes), torch.tensor(slopes, dtype=torch.float32)):
        got = h.cache.attention(0, batch, q, alibi_slopes=tensor)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


BAD_ARGUMENTS = [
    (dict(attention_chunk_size=0), "attention_chunk_size"),
    (dict(attention_chunk_size=-1), "attention_chunk_size"),
    (dict(attention_chunk_size=2.5), "attention_chunk_size"),
    (dict(attention_chunk_size=True), "attention_chunk_size"),
    (dict(attention_chunk_size="4"), "attention_chunk_size"),
    (dict(alibi_slopes=np.zeros(NUM_HEADS - 1)), "alibi_slopes"),
    (dict(alibi_slopes=np.zeros(NUM_HEADS + 1)), "alibi_slopes"),
    (dict(alibi_slopes=np.zeros((NUM_HEADS, 1))), "alibi_slopes"),
    (dict(alibi_slopes=0.5), "alibi_slopes"),
    (dict(alibi_slopes=np.array([np.nan] + [0.1] * (NUM_HEADS - 1))), "alibi_slopes"),
    (dict(alibi_slopes=np.array([0.1] * (NUM_HEADS - 1) + [np.inf])), "alibi_slopes"),
    (dict(alibi_slopes=np.full(NUM_HEADS, -np.inf)), "alibi_slopes"),
]


@pytest.mark.parametrize("kwargs,name", BAD_ARGUMENTS,
                         ids=[f"{k}={v!r}"[:40] for kw, _ in BAD_ARGUMENTS
                              for k, v in kw.items()])
def test_bad_arguments_are_refused_and_change_nothing(backend, kwargs, name):
    h = make(backend, page_size=7)
    s = h.add()
    batch = h.step([s], 10)
    q = h.random(10, NUM_HEADS, 32)
    before = h.cache.attention(0, batch, q)
    k_before, v_before = h.cache.gather(0, s)
    with pytest.raises(ValueError, match=name):
        h.cache.attention(0, batch, q, **kwargs)
    # nothing changed: length, contents and results; the cache still works
    assert h.cache.seq_len(s) == 10
    k_after, v_after = h.cache.gather(0, s)
    np.testing.assert_array_equal(k_after, k_before)
    np.testing.assert_array_equal(v_after, v_before)
    np.testing.assert_array_equal(h.cache.attention(0, batch, q), before)
    h.step([s], 1, attention_chunk_size=4, alibi_slopes=geometric_slopes(NUM_HEADS))


@pytest.mark.parametrize("window,chunk", [(None, None), (5, None), (None, 4), (3, 8), (9, 4),
                                          (1, 1)])
def test_a_band_s_first_visible_key_is_the_first_the_reference_shows(window, chunk):
    """``Band.first_visible``, which the planner and cascade both use, against the
    reference's visibility mask."""
    from pagedkv.attention_spec import Band
    positions = np.arange(40, dtype=np.int64)
    visible = visible_keys(positions, 40, sliding_window=window, attention_chunk_size=chunk)
    np.testing.assert_array_equal(Band(window, chunk).first_visible(positions),
                                  visible.argmax(axis=1))
