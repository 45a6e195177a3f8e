"""Paged attention and storage against the dense NumPy reference, on every backend."""
import numpy as np
import pytest

import pagedkv
from reference import Harness, dense_attention, round_to_storage


def make(backend, *, num_layers=2, num_kv_heads=2, head_dim=32, page_size=16, num_pages=256,
         dtype="float32", group=1, seed=0):
    cache = pagedkv.PagedKVCache(num_layers, num_kv_heads, head_dim, num_pages=num_pages,
                                 page_size=page_size, dtype=dtype, backend=backend)
    return Harness(cache, num_heads=num_kv_heads * group, seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_store_and_attention_in_any_order(backend, dtype):
    # Every layer stored before any attention, attention in reverse order, a
    # layer stored twice (the second write wins), gather between a store and
    # its attention: each call sees every store made before it.
    if dtype == "int8":
        from test_int8 import Int8Harness
        h = Int8Harness(pagedkv.PagedKVCache(3, 2, 32, num_pages=64, dtype=dtype,
                                             backend=backend), num_heads=4)
    else:
        h = make(backend, num_layers=3, dtype=dtype, group=2)
    c = h.cache
    seqs = [h.add() for _ in range(2)]

    def store(batch, layer, counts, record=True):
        k, v = (h.random(sum(counts), 2, 32) for _ in range(2))
        c.store(layer, batch, k, v)
        if record:
            h.record(layer, seqs, counts, k, v)

    def attend(batch, layer, counts):
        q = h.random(sum(counts), 4, 32)
        h.compare(layer, seqs, counts, q, c.attention(layer, batch, q), {})

    counts = [5, 18]
    batch = c.append(seqs, counts)
    store(batch, 0, counts)
    store(batch, 1, counts, record=False)
    store(batch, 1, counts)
    store(batch, 2, counts)
    for layer in (2, 1, 0):
        attend(batch, layer, counts)
    counts = [1, 1]
    batch = c.append(seqs, counts)
    store(batch, 0, counts)
    for s in seqs:                                   # gather before the layer's attention
        k, v = c.gather(0, s)
        np.testing.assert_array_equal(k, h.ref.k[s][0])
        np.testing.assert_array_equal(v, h.ref.v[s][0])
    store(batch, 1, counts)
    attend(batch, 0, counts)                         # with layer 1's store not yet run
    store(batch, 2, counts)
    attend(batch, 2, counts)
    attend(batch, 1, counts)
    h.check_contents()


@pytest.mark.parametrize("page_size", [1, 7, 16, 32])
def test_ragged_prefill_then_decode_then_chunk(backend, page_size):
    h = make(backend, page_size=page_size, group=2)
    seqs = [h.add() for _ in range(4)]
    # ragged prefill: lengths straddle page boundaries for every page size
    h.step(seqs, [page_size - 1, page_size + 1, 2 * page_size + 3, 1])
    for _ in range(3):                      # decode steps
        h.step(seqs, 1)
    h.step(seqs, [5, 0, page_size, 2])      # chunked prefill next to a decode
    h.check_contents()


# 20 and 40 are not multiples of the host kernels' vector width (their tails
# take the scalar paths); 64, 80, 96, 128 and 256 have specialised kernels
@pytest.mark.parametrize("head_dim", [20, 32, 40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_head_dims_and_gqa(backend, head_dim, group):
    h = make(backend, head_dim=head_dim, group=group, num_layers=1, page_size=16)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [17, 33, 5])
    h.step(seqs, 1)
    h.check_contents()


def test_mqa_single_kv_head(backend):
    h = make(backend, num_kv_heads=1, group=8, num_layers=1)
    s = h.add()
    h.step([s], 40)
    h.step([s], 1)


def test_long_context_5000_tokens(backend):
    # one long sequence: decode runs split over key-range partitions and merged
    h = make(backend, num_kv_heads=1, group=4, head_dim=64, num_layers=1, page_size=16,
             num_pages=400)
    s = h.add()
    h.step([s], 4999, check=False)
    h.step([s], 1)
    h.step([s], 3)                          # a short chunk at the end of a long context
    assert h.cache.seq_len(s) == 5003


@pytest.mark.parametrize("page_size", [3, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_over_spans_of_small_pages(backend, page_size, dtype):
    # The host page path takes one softmax step per span of consecutive pages
    # (128 keys): split-K ranges (over 2,048 keys), window starts and partial
    # last pages cut spans anywhere, and a query's max may move within one.
    cache = pagedkv.PagedKVCache(1, 2, 64, num_pages=2600 // page_size * 3 + 12,
                                 page_size=page_size, dtype=dtype, backend=backend)
    h = Harness(cache, num_heads=8, dtype=dtype)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [2500, 131, 7 * page_size + 1], check=False)
    for variant in ({}, {"sliding_window": 200}, {"sliding_window": 61},
                    {"logits_soft_cap": 5.0}):
        h.step(seqs, 1, **variant)
    h.step(seqs, [2, 1, 3], sliding_window=61)


@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (40, 7)])
def test_float16_storage_rounds(backend, head_dim, page_size):
    h = make(backend, dtype="float16", group=4, head_dim=head_dim, page_size=page_size)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [20, 3, 16])
    h.step(seqs, 1)
    h.check_contents()   # exact: gather returns the float16-rounded values as float32
    assert h.cache.memory_bytes == 2 * 2 * 256 * 2 * page_size * head_dim * 2


def test_read_token_matches_gather(backend):
    h = make(backend, page_size=7)
    s = h.add()
    h.step([s], 20)
    k_all, v_all = h.cache.gather(1, s)
    for pos in (0, 6, 7, 19):
        k, v = h.cache.read_token(1, s, pos)
        np.testing.assert_array_equal(k, k_all[pos])
        np.testing.assert_array_equal(v, v_all[pos])


def test_scale_and_input_dtypes(backend):
    cache = pagedkv.PagedKVCache(1, 2, 16, num_pages=8, page_size=4, backend=backend)
    s = cache.add_sequence()
    rng = np.random.default_rng(1)
    k = rng.standard_normal((6, 2, 16))           # float64 input is accepted and rounded
    v = rng.standard_normal((6, 2, 16)).astype(np.float16)
    q = rng.standard_normal((6, 4, 16))
    batch = cache.append([s], 6)
    cache.store(0, batch, k, v)
    out = cache.attention(0, batch, q, scale=0.3)
    expected = dense_attention(q.astype(np.float32), round_to_storage(k, np.float32),
                               v.astype(np.float32), np.arange(6), scale=0.3)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scale_applies_before_the_dot_product(backend, dtype):
    # q.k of these rows (every product positive, 32 of about 0.56e38) is past
    # float32's maximum, scale * q.k is not: the scale must reach the queries
    # before the sum, on every backend, prefill (block path) and decode.
    cache = pagedkv.PagedKVCache(1, 2, 32, num_pages=16, page_size=4, dtype=dtype,
                                 backend=backend)
    s = cache.add_sequence()
    rng = np.random.default_rng(2)
    k, v = (rng.uniform(0.5, 1.0, (21, 2, 32)) for _ in "kv")
    k *= 1e19
    q = rng.uniform(0.5, 1.0, (21, 8, 32)) * 1e19
    batch = cache.append([s], 20)
    cache.store(0, batch, k[:20], v[:20])
    prefill = cache.attention(0, batch, q[:20], scale=1e-38)
    batch = cache.append([s], 1)
    cache.store(0, batch, k[20:], v[20:])
    decode = cache.attention(0, batch, q[20:], scale=1e-38)
    kr, vr = (round_to_storage(x, dtype) for x in (k, v))
    expected = dense_attention(q.astype(np.float32), kr, vr, np.arange(21), scale=1e-38)
    out = np.concatenate([prefill, decode])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_empty_step_and_zero_new_tokens(backend):
    h = make(backend)
    a, b = h.add(), h.add()
    h.step([a], 3)
    batch = h.step([a, b], [0, 0])
    assert batch.num_tokens == 0
    batch = h.cache.append([], [])
    assert batch.num_seqs == 0 and batch.block_table.shape == (0, 0)
    h.check_contents()


def test_decode_batch_of_many_sequences(backend):
    # enough sequences that a host work item covers several KV heads at once
    h = make(backend, num_kv_heads=4, group=2, head_dim=64, num_layers=1, page_size=8,
             num_pages=300)
    seqs = [h.add() for _ in range(24)]
    h.step(seqs, [5 + 3 * i for i in range(24)])
    for _ in range(2):
        h.step(seqs, 1)
    h.check_contents()
