"""int8 KV storage: rounding, attention over exactly the stored values, and every feature
combined with it, on every backend."""
import numpy as np
import pytest

import pagedkv
from reference import (TOLERANCE, Harness, ReferenceCache, fork_divergence_steps,
                       rollback_steps)

# Attention over gather's rows (the values int8 keeps): float32 rounding only.
TIGHT = TOLERANCE["float32"]


class Int8Harness(Harness):
    """A Harness whose reference holds what the cache's gather returns: after each
    store the new rows are read back, so attention is compared with exactly the
    values int8 kept, while ``original`` keeps the float32 rows for the loose check."""

    def __init__(self, cache, num_heads=None, seed=0):
        super().__init__(cache, num_heads, seed)
        self.tol = TIGHT
        # both references hold float32 rows: the kept ones, and the original ones
        self.ref = ReferenceCache(cache.num_layers, cache.num_kv_heads, cache.head_dim)
        self.original = ReferenceCache(cache.num_layers, cache.num_kv_heads, cache.head_dim)

    def add(self):
        s = super().add()
        self.original.add(s)
        return s

    def fork(self, parent):
        child = super().fork(parent)
        self.original.add(child, like=parent)
        return child

    def truncate(self, s, new_len):
        super().truncate(s, new_len)
        self.original.truncate(s, new_len)

    def restore(self, checkpoint):
        super().restore(checkpoint)
        self.original.truncate(checkpoint.seq_id, checkpoint.seq_len)

    def record(self, layer, seq_ids, counts, k, v):
        # the reference gets the rows the cache kept; the original rows are kept too
        self.original.store(layer, seq_ids, counts, k, v)
        kept = [self.cache.gather(layer, s, self.cache.seq_len(s) - n)
                for s, n in zip(seq_ids, counts)]
        self.ref.store(layer, seq_ids, counts, np.concatenate([k for k, _ in kept]),
                       np.concatenate([v for _, v in kept]))

    def compare(self, layer, seq_ids, counts, q, out, variant):
        super().compare(layer, seq_ids, counts, q, out, variant)      # tight, over kept rows
        # and close to attention over the original float32 rows
        loose = self.original.attention(layer, seq_ids, counts, q, **variant)
        assert np.abs(out - loose).max() < 0.05 * max(np.abs(loose).max(), 1.0)


def make(backend, *, num_kv_heads=2, head_dim=64, page_size=7, group=3, num_pages=128,
         **kwargs):
    cache = pagedkv.PagedKVCache(1, num_kv_heads, head_dim, num_pages=num_pages,
                                 page_size=page_size, dtype="int8", backend=backend, **kwargs)
    return Int8Harness(cache, num_heads=num_kv_heads * group)


def relative_row_errors(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_round_trip_error_is_about_one_percent_at_any_magnitude(backend, magnitude, head_dim):
    cache = pagedkv.PagedKVCache(1, 4, head_dim, num_pages=16, page_size=16, dtype="int8",
                                 backend=backend)
    rng = np.random.default_rng(head_dim)
    k = (rng.standard_normal((50, 4, head_dim)) * magnitude).astype(np.float32)
    v = (rng.standard_normal((50, 4, head_dim)) * magnitude).astype(np.float32)
    s = cache.add_sequence()
    cache.store(0, cache.append([s], 50), k, v)
    got_k, got_v = cache.gather(0, s)
    assert relative_row_errors(got_k, k).max() < 0.012
    assert relative_row_errors(got_v, v).max() < 0.012
    assert relative_row_errors(got_k, k).mean() < 0.01


def test_zero_rows_stay_zero_and_extreme_rows_keep_their_scale(backend):
    cache = pagedkv.PagedKVCache(1, 1, 32, num_pages=4, page_size=4, dtype="int8",
                                 backend=backend)
    rows = np.zeros((4, 1, 32), np.float32)
    rows[1] = 1e30                         # very large: no overflow
    rows[2] = 1e-30                        # very small: the scale does not flush to zero
    rows[3, 0, ::2], rows[3, 0, 1::2] = 3.0, -5.0
    s = cache.add_sequence()
    cache.store(0, cache.append([s], 4), rows, rows)
    got, _ = cache.gather(0, s)
    np.testing.assert_array_equal(got[0], 0.0)
    for i in (1, 2, 3):
        assert relative_row_errors(got[i], rows[i]).max() < 0.01
    assert np.isfinite(got).all()


def test_memory_is_at_most_0_27_of_float32(backend):
    def memory(dtype):
        return pagedkv.PagedKVCache(2, 8, 128, num_pages=32, page_size=16, dtype=dtype,
                                    backend=backend).memory_bytes
    assert memory("int8") <= 0.27 * memory("float32")
    assert memory("int8") == 2 * 2 * 32 * 8 * 16 * (128 + 4)        # values and scales


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_attention_over_the_kept_values_page_sizes(backend, page_size):
    h = make(backend, page_size=page_size)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [2 * page_size + 3, page_size + 1, 5])       # ragged prefill
    for _ in range(2):
        h.step(seqs, 1)
    h.step(seqs, [page_size + 2, 1, 0])                       # a chunk next to a decode


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_attention_over_the_kept_values_head_dims_and_gqa(backend, head_dim, group):
    h = make(backend, head_dim=head_dim, group=group)
    seqs = [h.add() for _ in range(2)]
    h.step(seqs, [17, 9])
    h.step(seqs, 1)


def test_split_k_long_context(backend):
    h = make(backend, num_kv_heads=1, group=4, page_size=16, num_pages=400)
    s = h.add()
    h.step([s], 4999, check=False)
    h.step([s], 1)
    h.step([s], 3)


def test_variants_with_int8(backend):
    h = make(backend)
    seqs = [h.add() for _ in range(2)]
    variant = dict(sliding_window=9, logits_soft_cap=1.5,
                   sinks=np.random.default_rng(2).uniform(-1, 2, 6))
    h.step(seqs, [20, 11], **variant)
    h.step(seqs, 1, **variant)
    h.step(seqs, [4, 1], sliding_window=3)


def test_fork_copy_on_write_carries_the_scales(backend):
    fork_divergence_steps(make(backend))


def test_truncate_restore_and_prefix_hits(backend):
    rollback_steps(make(backend))
    cache = pagedkv.PagedKVCache(1, 2, 32, num_pages=32, page_size=4, dtype="int8",
                                 backend=backend, enable_prefix_caching=True)
    rng = np.random.default_rng(4)
    prompt = list(range(20))
    k, v = rng.standard_normal((2, 20, 2, 32), dtype=np.float32)
    first = cache.add_sequence(token_ids=prompt)
    cache.store(0, cache.append([first], 20, token_ids=prompt), k, v)
    kept = cache.gather(0, first)
    second = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(second) == 16
    got = cache.gather(0, second)
    np.testing.assert_array_equal(got[0], kept[0][:16])
    np.testing.assert_array_equal(got[1], kept[1][:16])


def test_window_pool_with_int8(backend):
    cache = pagedkv.PagedKVCache(2, 2, 64, num_pages=64, page_size=4, dtype="int8",
                                 layer_windows=[None, 6], backend=backend)
    h = Int8Harness(cache, num_heads=4)
    s = h.add()
    h.step([s], 9)
    for _ in range(12):
        h.step([s], 1)
    assert cache.window_page_count(s) < cache.page_count(s)
    h.check_contents()


def test_without_rotation(backend):
    h = make(backend, kv_rotation=False)
    assert h.cache.storage.rotation_block == 0
    seqs = [h.add() for _ in range(2)]
    h.step(seqs, [15, 4])
    h.step(seqs, 1)


def test_the_rotation_helps_rows_with_an_outlier_channel(backend):
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((64, 1, 128)).astype(np.float32)
    rows[:, 0, 7] = 40.0                   # one outlier channel, as small models' keys have
    errors = {}
    for rotate in (True, False):
        cache = pagedkv.PagedKVCache(1, 1, 128, num_pages=8, page_size=16, dtype="int8",
                                     backend=backend, kv_rotation=rotate)
        s = cache.add_sequence()
        cache.store(0, cache.append([s], 64), rows, rows)
        errors[rotate] = relative_row_errors(cache.gather(0, s)[0], rows).mean()
    assert errors[True] < 0.5 * errors[False]


def test_unknown_dtype_names_the_accepted_ones(backend):
    with pytest.raises(ValueError, match="'float32', 'float16', 'bfloat16', 'int8'"):
        pagedkv.PagedKVCache(1, 1, 8, num_pages=4, dtype="int4", backend=backend)
    with pytest.raises(TypeError, match="kv_rotation"):
        pagedkv.PagedKVCache(1, 1, 8, num_pages=4, dtype="int8", kv_rotation="yes",
                             backend=backend)


def extreme_rows(head_dim, rng):
    """Rows [n, 1, head_dim] at the ends of float32's range: whole rows of up to
    +-3e38 (their rotation exceeds float32), rows with one such element, tiny
    and denormal rows, and all-zero rows."""
    signs = rng.choice([-1.0, 1.0], (head_dim,))
    rows = [signs * 3e38, np.full(head_dim, 3e38), np.full(head_dim, -1e38),
            rng.uniform(-3e38, 3e38, head_dim), rng.standard_normal(head_dim) * 1e37,
            rng.standard_normal(head_dim) * 2**64, rng.standard_normal(head_dim) * 2**57]
    one = rng.standard_normal(head_dim)
    one[3] = -3e38
    rows += [one, rng.standard_normal(head_dim) * 1e-30, rng.standard_normal(head_dim) * 1e-38,
             rng.standard_normal(head_dim) * 1e-40, np.zeros(head_dim)]
    return np.asarray(rows, np.float32)[:, None, :]


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rows_at_the_ends_of_float32_read_back_finite(backend, head_dim):
    rows = extreme_rows(head_dim, np.random.default_rng(head_dim))
    cache = pagedkv.PagedKVCache(1, 1, head_dim, num_pages=4, page_size=16, dtype="int8",
                                 backend=backend)
    s = cache.add_sequence()
    cache.store(0, cache.append([s], len(rows)), rows, rows[::-1].copy())
    got_k, got_v = cache.gather(0, s)
    for got, want in ((got_k, rows), (got_v, rows[::-1])):
        assert np.isfinite(got).all()
        zero = ~want.any(axis=-1)
        np.testing.assert_array_equal(got[zero], 0.0)
        # denormal rows hold fewer bits than int8 levels: their error is absolute
        err = np.linalg.norm(np.float64(got) - want, axis=-1)
        bound = 0.012 * np.linalg.norm(np.float64(want), axis=-1) + head_dim * 2.0**-149
        assert (err[~zero] <= bound[~zero]).all(), (err / np.maximum(bound, 1e-300)).max()


def test_attention_over_rows_near_the_top_of_float32(backend):
    # rows of one value repeated: the rotation adds them all up (past float32's
    # range midway, as the butterflies run), the rotated rows keep their norm
    h = make(backend, num_kv_heads=1, head_dim=64, group=2, page_size=4)
    rng = np.random.default_rng(3)
    s = h.add()
    batch = h.cache.append([s], 10)
    k = rng.standard_normal((10, 1, 64)).astype(np.float32)
    v = rng.standard_normal((10, 1, 64)).astype(np.float32)
    k[[1, 4, 7]] = np.float32([1e37, -1e37, 1e37])[:, None, None]   # logits of about 1e37
    v[[2, 5, 8]] = np.float32([2e37, -2e37, 2e37])[:, None, None]
    q = rng.standard_normal((10, 2, 64)).astype(np.float32)
    h.cache.store(0, batch, k, v)
    h.record(0, [s], [10], k, v)
    out = h.cache.attention(0, batch, q)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, h.ref.attention(0, [s], [10], q), rtol=2e-5,
                               atol=2e-5 * 2e37)
