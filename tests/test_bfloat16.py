"""bfloat16 storage (``dtype="bfloat16"``): round to nearest even on store, bit for bit
against the NumPy reference's rounding; attention over exactly the stored values; every
feature combined with it, on every backend."""
import pickle

import numpy as np
import pytest

import pagedkv
from reference import (TOLERANCE, Harness, dense_attention, fork_divergence_steps,
                       rollback_steps, round_to_bfloat16)

TIGHT = TOLERANCE["float32"]   # attention against the reference over the stored values


def make(backend, *, num_kv_heads=2, head_dim=32, page_size=7, num_pages=128, group=2,
         num_layers=1, seed=0, **kwargs):
    cache = pagedkv.PagedKVCache(num_layers, num_kv_heads, head_dim, num_pages=num_pages,
                                 page_size=page_size, dtype="bfloat16", backend=backend,
                                 **kwargs)
    return Harness(cache, num_heads=num_kv_heads * group, seed=seed, dtype="bfloat16")


def bits(array):
    return np.ascontiguousarray(array, np.float32).view(np.uint32)


def from_bits(words):
    return np.asarray(words, dtype=np.uint32).view(np.float32)


# float32 bit patterns and the bfloat16 (as float32 bits) each must round to
ROUNDING_CASES = [
    (0x3F800000, 0x3F800000),      # 1.0: exact
    (0x3F808000, 0x3F800000),      # tie between 1.0 and the next: to the even one (1.0)
    (0x3F818000, 0x3F820000),      # tie, odd below: up to the even one
    (0x3F808001, 0x3F810000),      # just above the tie: up
    (0x3F807FFF, 0x3F800000),      # just below the tie: down
    (0xBF808000, 0xBF800000),      # negative tie: to even
    (0xBF818000, 0xBF820000),
    (0x7F800000, 0x7F800000),      # inf
    (0xFF800000, 0xFF800000),      # -inf
    (0x7F7FFFFF, 0x7F800000),      # float32 max: above bfloat16's max, to inf
    (0x7F7F8000, 0x7F800000),      # tie between bfloat16 max (odd) and inf: to inf
    (0x7F7F7FFF, 0x7F7F0000),      # below the tie: bfloat16 max
    (0xFF7FFFFF, 0xFF800000),      # to -inf
    (0x00000000, 0x00000000),      # +0
    (0x80000000, 0x80000000),      # -0
    (0x00000001, 0x00000000),      # smallest denormal: to zero
    (0x00008000, 0x00000000),      # denormal tie: to even (zero)
    (0x00018000, 0x00020000),      # denormal tie, odd below: up
    (0x00010000, 0x00010000),      # a bfloat16 denormal: exact
    (0x00012345, 0x00010000),
    (0x007FFFFF, 0x00800000),      # largest denormal: up to the smallest normal
    (0x807FFFFF, 0x80800000),
]
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F80FFFF, 0xFF800001, 0x7FFFFFFF,
            0xFFFFFFFF]


def test_reference_rounding_on_known_cases():
    """The oracle itself, on hand-worked cases (no backend involved)."""
    got = round_to_bfloat16(from_bits([a for a, _ in ROUNDING_CASES]))
    assert got.dtype == np.float32
    assert [hex(b) for b in bits(got)] == [hex(b) for _, b in ROUNDING_CASES]
    assert np.isnan(round_to_bfloat16(from_bits(NAN_BITS))).all()


def test_reference_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    words = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64)
    x = np.concatenate([from_bits(words.astype(np.uint32)),
                        from_bits([a for a, _ in ROUNDING_CASES] + NAN_BITS)])
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    got = round_to_bfloat16(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(bits(got)[~nan], bits(want)[~nan])


def rounding_inputs(head_dim=16, num_kv_heads=2):
    """float32 rows holding every rounding case and NaN pattern, then values of
    every magnitude: shape [n, num_kv_heads, head_dim]."""
    rng = np.random.default_rng(1)
    special = from_bits([a for a, _ in ROUNDING_CASES] + NAN_BITS)
    # random bit patterns over the whole float32 range, plus Gaussian values
    words = rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32)
    values = np.concatenate([special, from_bits(words),
                             rng.standard_normal(1000, dtype=np.float32),
                             (rng.standard_normal(500) * 1e-38).astype(np.float32),
                             (rng.standard_normal(500) * 1e38).astype(np.float32)])
    row = head_dim * num_kv_heads
    values = np.concatenate([values, np.zeros(-len(values) % row, np.float32)])
    return values.reshape(-1, num_kv_heads, head_dim)


def assert_rounded(got, original):
    """``got`` (from gather) is the bfloat16 rounding of ``original``, bit for bit;
    NaN stays NaN."""
    assert got.dtype == np.float32 and got.shape == original.shape
    want = round_to_bfloat16(original)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(bits(got)[~nan], bits(want)[~nan])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_store_and_gather_round_to_nearest_even(backend, page_size):
    k = rounding_inputs()
    v = np.ascontiguousarray(k[::-1])
    n = len(k)
    cache = pagedkv.PagedKVCache(1, 2, 16, num_pages=n // page_size + 2, page_size=page_size,
                                 dtype="bfloat16", backend=backend)
    s = cache.add_sequence()
    cache.store(0, cache.append([s], n), k, v)
    got_k, got_v = cache.gather(0, s)
    assert_rounded(got_k, k)
    assert_rounded(got_v, v)
    start = n - 37
    got_k, got_v = cache.gather(0, s, start)
    assert_rounded(got_k, k[start:])
    assert_rounded(got_v, v[start:])
    for pos in (0, 5, n - 1):
        row_k, row_v = cache.read_token(0, s, pos)
        assert_rounded(row_k, k[pos])
        assert_rounded(row_v, v[pos])


def test_stored_values_come_back_exactly(backend):
    """Values bfloat16 holds exactly come back unchanged; storing gather's rows again
    changes nothing."""
    rng = np.random.default_rng(2)
    k = round_to_bfloat16(rng.standard_normal((30, 2, 16), dtype=np.float32))
    cache = pagedkv.PagedKVCache(1, 2, 16, num_pages=16, page_size=4, dtype="bfloat16",
                                 backend=backend)
    s = cache.add_sequence()
    cache.store(0, cache.append([s], 30), k, -k)
    got_k, got_v = cache.gather(0, s)
    np.testing.assert_array_equal(bits(got_k), bits(k))
    np.testing.assert_array_equal(bits(got_v), bits(-k))


def test_memory_is_half_of_float32(backend):
    def memory(dtype, **kwargs):
        return pagedkv.PagedKVCache(2, 4, 64, num_pages=32, page_size=16, dtype=dtype,
                                    backend=backend, **kwargs).memory_bytes
    assert 2 * memory("bfloat16") == memory("float32")
    assert memory("bfloat16") == memory("float16") == 2 * 2 * 32 * 4 * 16 * 64 * 2
    windowed = dict(layer_windows=[None, 8], num_window_pages=12)
    assert 2 * memory("bfloat16", **windowed) == memory("float32", **windowed)


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_attention_over_the_stored_values(backend, page_size):
    h = make(backend, page_size=page_size)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [2 * page_size + 3, page_size + 1, 5])       # ragged prefill
    for _ in range(2):
        h.step(seqs, 1)                                       # decode
    h.step(seqs, [page_size + 2, 1, 0])                       # a chunk next to a decode
    h.check_contents()                                        # bit for bit


@pytest.mark.parametrize("head_dim,group", [(64, 1), (80, 3), (128, 4), (20, 8)])
def test_head_dims_and_gqa(backend, head_dim, group):
    h = make(backend, head_dim=head_dim, group=group, page_size=16)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [17, 33, 5])
    h.step(seqs, 1)
    h.check_contents()


def variants(num_heads):
    rng = np.random.default_rng(4)
    sinks = rng.uniform(-1.0, 3.0, num_heads)
    slopes = 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)
    return {
        "window": dict(sliding_window=5),
        "soft_cap": dict(logits_soft_cap=0.7),
        "sinks": dict(sinks=sinks),
        "chunk": dict(attention_chunk_size=10),
        "alibi": dict(alibi_slopes=slopes),
        "everything": dict(sliding_window=13, logits_soft_cap=1.5, sinks=sinks, scale=0.2,
                           attention_chunk_size=11, alibi_slopes=rng.uniform(0, 1, num_heads)),
    }


@pytest.mark.parametrize("name", sorted(variants(1)))
def test_variants(backend, name):
    h = make(backend, group=4)
    variant = variants(8)[name]
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [17, 8, 5], **variant)
    for _ in range(2):
        h.step(seqs, 1, **variant)
    h.step(seqs, [9, 1, 0], **variant)
    h.check_contents()


def test_split_k_long_context(backend):
    h = make(backend, num_kv_heads=1, group=4, page_size=16, num_pages=400)
    s = h.add()
    h.step([s], 4999, check=False)
    h.step([s], 1)
    h.step([s], 1, sliding_window=3000, logits_soft_cap=2.0,
           sinks=np.array([0.5, 1.0, -1.0, 2.0]))
    h.step([s], 3, attention_chunk_size=4096, alibi_slopes=np.array([2.0 ** -10] * 4))


def test_fork_copy_on_write(backend):
    fork_divergence_steps(make(backend))


def test_truncate_and_restore(backend):
    rollback_steps(make(backend))


def test_prefix_caching(backend):
    cache = pagedkv.PagedKVCache(1, 2, 32, num_pages=32, page_size=4, dtype="bfloat16",
                                 backend=backend, enable_prefix_caching=True)
    rng = np.random.default_rng(5)
    prompt = list(range(20))
    k, v = rng.standard_normal((2, 20, 2, 32), dtype=np.float32)
    first = cache.add_sequence(token_ids=prompt)
    cache.store(0, cache.append([first], 20, token_ids=prompt), k, v)
    second = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(second) == 16
    got_k, got_v = cache.gather(0, second)
    np.testing.assert_array_equal(bits(got_k), bits(round_to_bfloat16(k[:16])))
    np.testing.assert_array_equal(bits(got_v), bits(round_to_bfloat16(v[:16])))
    # the hit's sequence goes on: its last prompt tokens, then a decode step
    for rows, tokens in ((4, prompt[16:]), (1, [99])):
        batch = cache.append([second], rows, token_ids=tokens)
        nk, nv = rng.standard_normal((2, rows, 2, 32), dtype=np.float32)
        cache.store(0, batch, nk, nv)
        q = rng.standard_normal((rows, 4, 32), dtype=np.float32)
        all_k, all_v = cache.gather(0, second)
        n = cache.seq_len(second)
        np.testing.assert_array_equal(bits(all_k[n - rows:]), bits(round_to_bfloat16(nk)))
        np.testing.assert_allclose(cache.attention(0, batch, q),
                                   dense_attention(q, all_k, all_v, np.arange(n - rows, n)),
                                   **TIGHT)


def test_window_pool(backend):
    h = make(backend, num_layers=2, page_size=4, layer_windows=[None, 6])
    s = h.add()
    h.step([s], 9)
    for _ in range(12):
        h.step([s], 1)
    h.step([s], 3, alibi_slopes=np.linspace(0.1, 0.5, 4), attention_chunk_size=8)
    assert h.cache.window_page_count(s) < h.cache.page_count(s)
    h.check_contents()


# -- sequences that leave the cache -------------------------------------------------
L, H, D = 2, 2, 8


def transfer_cache(backend, dtype, page_size=4):
    return pagedkv.PagedKVCache(L, H, D, num_pages=64, page_size=page_size, dtype=dtype,
                                backend=backend)


def fill(cache, counts, rng):
    """Sequences of ``counts`` tokens of random K/V in every layer; returns their ids."""
    seqs = [cache.add_sequence() for _ in counts]
    batch = cache.append(seqs, counts)
    for layer in range(L):
        k = rng.standard_normal((batch.num_tokens, H, D)).astype(np.float32)
        cache.store(layer, batch, k, rng.standard_normal(k.shape).astype(np.float32))
    return seqs


def assert_same_bits(a, sa, b, sb):
    assert a.seq_len(sa) == b.seq_len(sb)
    for layer in range(L):
        for x, y in zip(a.gather(layer, sa), b.gather(layer, sb)):
            np.testing.assert_array_equal(bits(x), bits(y))


def test_export_import_bfloat16_is_bit_exact(backend):
    rng = np.random.default_rng(6)
    source = transfer_cache(backend, "bfloat16")
    a, b = fill(source, [9, 1], rng)
    c = source.fork(a)
    kv = {s: pickle.loads(pickle.dumps(source.export_sequence(s))) for s in (a, b, c)}
    assert kv[a].dtype == "bfloat16" and kv[a].num_tokens == 9
    for target in pagedkv.available_backends():
        for page_size in (1, 5):
            other = transfer_cache(target, "bfloat16", page_size)
            for s, exported in kv.items():
                assert_same_bits(source, s, other, other.import_sequence(exported))


@pytest.mark.parametrize("source_dtype,target_dtype", [
    ("float32", "bfloat16"), ("bfloat16", "float32"), ("bfloat16", "float16"),
    ("float16", "bfloat16"), ("bfloat16", "int8"), ("int8", "bfloat16")])
def test_another_dtype_converts_as_store_would(backend, source_dtype, target_dtype):
    rng = np.random.default_rng(7)
    source = transfer_cache(backend, source_dtype)
    (s,) = fill(source, [11], rng)
    for target in pagedkv.available_backends():
        imported = transfer_cache(target, target_dtype, page_size=3)
        t = imported.import_sequence(source.export_sequence(s))
        stored = transfer_cache(target, target_dtype, page_size=3)
        u = stored.add_sequence()
        batch = stored.append([u], 11)
        for layer in range(L):
            stored.store(layer, batch, *source.gather(layer, s))
        assert_same_bits(imported, t, stored, u)


def test_float32_into_bfloat16_rounds_and_bfloat16_into_float32_is_exact(backend):
    rng = np.random.default_rng(8)
    wide = transfer_cache(backend, "float32")
    (s,) = fill(wide, [13], rng)
    narrow = transfer_cache(backend, "bfloat16")
    t = narrow.import_sequence(wide.export_sequence(s))
    for layer in range(L):
        for x, y in zip(wide.gather(layer, s), narrow.gather(layer, t)):
            np.testing.assert_array_equal(bits(y), bits(round_to_bfloat16(x)))
    back = transfer_cache(backend, "float32")
    u = back.import_sequence(narrow.export_sequence(t))
    assert_same_bits(narrow, t, back, u)


def test_swap_and_save_load_keep_the_bits(backend, tmp_path):
    rng = np.random.default_rng(9)
    cache = transfer_cache(backend, "bfloat16")
    s, t = fill(cache, [10, 3], rng)
    before = [cache.gather(layer, s) for layer in range(L)]
    cache.swap_out(s)
    cache.swap_in(s)
    for layer in range(L):
        for x, y in zip(before[layer], cache.gather(layer, s)):
            np.testing.assert_array_equal(bits(x), bits(y))
    path = tmp_path / "kv.safetensors"
    cache.save(path)
    other = transfer_cache(backend, "bfloat16", page_size=5)
    s2, t2 = other.load(path)
    assert_same_bits(cache, s, other, s2)
    assert_same_bits(cache, t, other, t2)


@pytest.mark.parametrize("dtype", ["bfloat17", "bf16x", "int4", ""])
def test_bad_dtype_is_refused(backend, dtype):
    with pytest.raises(ValueError, match="dtype") as info:
        pagedkv.PagedKVCache(1, 1, 8, num_pages=4, dtype=dtype, backend=backend)
    assert "bfloat16" in str(info.value)        # the accepted names include it
