"""Files, transfer and swap keep every promise (reliability, third round).

Each test is one hole an adversarial run found, on every backend: a file
``save`` just wrote that ``load`` refused, a small crafted file that cost
seconds and hundreds of MB before it was refused, sequences whose later pages
never joined the prefix cache after a transfer, an export of a swapped-out
sequence that was the cache's own object, a ``SequenceKV`` whose arrays lie
about their shape, deeply nested JSON in a file, and ALiBi slopes whose bias
overflows float32.
"""
import json
import time
import tracemalloc
import zlib

import numpy as np
import pytest

import pagedkv
from pagedkv import kv_file
from reference import TOLERANCE, dense_attention
from test_transfer import D, H, HQ, L, assert_same_bits, make, step

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def snapshot(cache):
    return (cache.num_free_pages, cache.num_free_window_pages, cache.stats(),
            {s: (cache.seq_len(s), list(cache.page_ids(s))) for s in cache.seq_ids()})


def write_file(path, tensors, metadata):
    """A pagedkv file of these tensors and metadata, its checksum made to match."""
    metadata = dict(metadata)
    metadata["checksum"] = kv_file.checksum(metadata, tensors)
    safetensors_numpy.save_file(tensors, str(path), metadata=metadata)
    return path


def read_file(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        metadata = json.loads(f.read(n))["__metadata__"]
    return metadata, safetensors_numpy.load_file(str(path))


# -- 1. a file save just wrote loads --------------------------------------------------

def no_cached_page_yet(backend, rng):
    """Caches with prefix caching whose prefix cache is empty, and their sequences."""
    fresh = make(backend, enable_prefix_caching=True)
    short = make(backend, enable_prefix_caching=True)
    s = short.add_sequence(token_ids=[1, 2])
    step(short, [s], [3], rng, token_ids=[1, 2, 3])      # shorter than a page
    untracked = make(backend, enable_prefix_caching=True)
    t = untracked.add_sequence()
    step(untracked, [t], [9], rng)                       # appended without token ids
    return {"fresh": (fresh, []), "shorter than a page": (short, [s]),
            "without token ids": (untracked, [t])}


def test_a_file_with_no_cached_page_loads(backend, tmp_path):
    rng = np.random.default_rng(300)
    for name, (cache, seqs) in no_cached_page_yet(backend, rng).items():
        path = tmp_path / name
        cache.save(path)
        other = make(backend, enable_prefix_caching=True)
        ids = other.load(path)
        assert len(ids) == len(seqs), name
        for s, t in zip(seqs, ids):
            assert_same_bits(cache, s, other, t)


def test_a_file_whose_empty_prefix_cache_has_tensors_still_loads(backend, tmp_path):
    """Earlier saves wrote an empty prefix cache as tensors of zero pages."""
    rng = np.random.default_rng(301)
    cache = make(backend, enable_prefix_caching=True)
    s = cache.add_sequence()
    step(cache, [s], [6], rng)
    path = tmp_path / "kv"
    cache.save(path)
    metadata, tensors = read_file(path)
    assert not any(name.startswith("prefix_cache.") for name in tensors)
    tensors.update({"prefix_cache.token_ids": np.zeros((0, 4), np.int32),
                    "prefix_cache.parents": np.zeros(0, np.int64),
                    "prefix_cache.has_window": np.zeros(0, np.uint8)})
    for layer in range(L):
        tensors[f"prefix_cache.k.{layer}"] = np.zeros((0, H, D), np.float32)
        tensors[f"prefix_cache.v.{layer}"] = np.zeros((0, H, D), np.float32)
    write_file(path, tensors, metadata)
    other = make(backend, enable_prefix_caching=True)
    assert_same_bits(cache, s, other, other.load(path)[0])
    tensors["prefix_cache.stray"] = np.zeros(3, np.int32)        # not empty: refused
    write_file(path, tensors, metadata)
    with pytest.raises(ValueError, match="unexpected tensors"):
        other.load(path)


# -- 2. a crafted file costs what its size says -------------------------------------------

def crafted_chains(path, trunk, leaves, head_dim=8):
    """A file of page size 1 whose prefix cache is a trunk of ``trunk`` pages with
    ``leaves`` one-page continuations: cut into pages of the trunk's length plus
    one, every leaf completes a page of its own."""
    n = trunk + leaves
    parents = np.concatenate([np.arange(-1, trunk - 1), np.full(leaves, trunk - 1)])
    tokens = np.concatenate([np.zeros(trunk), np.arange(1, leaves + 1)])
    rows = np.zeros((n, 1, head_dim), np.float32)
    tensors = {"prefix_cache.token_ids": tokens.astype(np.int32)[:, None],
               "prefix_cache.parents": parents.astype(np.int64),
               "prefix_cache.has_window": np.zeros(n, np.uint8),
               "prefix_cache.k.0": rows, "prefix_cache.v.0": rows.copy()}
    config = dict(num_layers=1, num_kv_heads=1, head_dim=head_dim, num_pages=n, page_size=1,
                  dtype="float32", max_seq_len=None, enable_prefix_caching=True,
                  layer_windows=[None], num_window_pages=None, window_rollback_tokens=1,
                  kv_rotation=False)
    metadata = {key: json.dumps(value) for key, value in config.items()}
    metadata.update(pagedkv_format_version="1", rotation_block="0", sequences="[]",
                    prefix_cache=json.dumps({"num_pages": n, "num_window_pages": 0}))
    return write_file(path, tensors, metadata)


def test_chains_that_cannot_fit_are_refused_before_the_work(backend, tmp_path):
    """10,000 leaves on a 2,047-page trunk fill 10,000 pages of 2,048 tokens: 20M
    positions from a file of under 1 MB.  A 4-page cache refuses it at once."""
    path = crafted_chains(tmp_path / "crafted", trunk=2047, leaves=10000)
    size = path.stat().st_size
    cache = pagedkv.PagedKVCache(1, 1, 8, num_pages=4, page_size=2048, backend=backend,
                                 enable_prefix_caching=True)
    before = snapshot(cache)
    tracemalloc.start()
    began = time.perf_counter()
    try:
        with pytest.raises(pagedkv.OutOfPagesError, match="chains fill 10000 pages of 2048"):
            cache.load(path)
        seconds = time.perf_counter() - began
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert snapshot(cache) == before
    assert peak < 8 * size, (peak, size)       # the file, its tables: no per-position work
    assert seconds < 5, seconds                # was 17 s


def kv_of_prefix(tokens):
    """K and V of the last of ``tokens`` in every layer, [L, 2, H, D]: a function of the
    token prefix, as a model's are (so branches that share a prefix share them)."""
    seed = zlib.crc32(np.asarray(tokens, np.int64).tobytes())
    return np.random.default_rng(seed).standard_normal((L, 2, H, D)).astype(np.float32)


def test_chains_recut_into_other_page_sizes_hit_as_their_tokens_say(backend, tmp_path):
    """A forest of cached prompts (shared prefixes, branches inside pages), saved at
    one page size and loaded at others: each prompt hits every full page of the
    new size that lies inside its cached tokens, with the saved K/V."""
    rng = np.random.default_rng(302)
    base = rng.integers(0, 50, 11).tolist()
    prompts = [base + rng.integers(0, 50, n).tolist() for n in (9, 2, 13)]
    prompts += [base[:5] + rng.integers(0, 50, 10).tolist(), rng.integers(0, 50, 7).tolist(),
                prompts[2][:17] + [99, 98, 97]]
    for source_page in (1, 3):
        source = make(backend, page_size=source_page, enable_prefix_caching=True,
                      num_pages=128)
        for prompt in prompts:
            s = source.add_sequence(token_ids=prompt)
            done = source.seq_len(s)
            batch = source.append([s], len(prompt) - done, token_ids=prompt[done:])
            rows = np.stack([kv_of_prefix(prompt[:p + 1]) for p in range(done, len(prompt))])
            for layer in range(L):
                source.store(layer, batch, rows[:, layer, 0], rows[:, layer, 1])
            source.free(s)
        path = tmp_path / f"forest{source_page}"
        source.save(path)
        for page_size in (1, 2, 4, 5, 8):
            target = make(backend, page_size=page_size, enable_prefix_caching=True,
                          num_pages=128)
            target.load(path)
            for prompt in prompts:
                cached = len(prompt) // source_page * source_page    # what the source holds
                t = target.add_sequence(token_ids=prompt)
                expected = min(cached, len(prompt) - 1) // page_size * page_size
                assert target.seq_len(t) == expected, (source_page, page_size, prompt)
                rows = np.array([kv_of_prefix(prompt[:p + 1]) for p in range(expected)],
                                np.float32).reshape(expected, L, 2, H, D)
                for layer in range(L):
                    k, v = target.gather(layer, t)
                    np.testing.assert_array_equal(k, rows[:, layer, 0])
                    np.testing.assert_array_equal(v, rows[:, layer, 1])
                target.free(t)


# -- 3. pages filled after a transfer join the prefix cache ------------------------------

def transfer(backend, cache, s, how, tmp_path):
    """``s`` out of ``cache`` and back by ``how``; returns (cache, its id there)."""
    if how == "swap":
        cache.swap_out(s)
        cache.swap_in(s)
        return cache, s
    if how == "export":
        kv = cache.export_sequence(s)
        cache.free(s)
        return cache, cache.import_sequence(kv)
    path = tmp_path / "transfer"
    cache.save(path, seq_ids=[s])
    other = make(backend, enable_prefix_caching=True)
    return other, other.load(path)[0]


@pytest.mark.parametrize("how", ["swap", "export", "save"])
@pytest.mark.parametrize("first", [6, 8])        # inside a page, on a page boundary
def test_pages_filled_after_a_transfer_join_the_prefix_cache(backend, how, first, tmp_path):
    rng = np.random.default_rng(303)
    prompt = rng.integers(0, 500, 20).tolist()
    cache = make(backend, enable_prefix_caching=True)
    s = cache.add_sequence(token_ids=[])
    step(cache, [s], [first], rng, token_ids=prompt[:first])
    cache, s = transfer(backend, cache, s, how, tmp_path)
    for token in prompt[first:]:                           # decode the rest
        step(cache, [s], [1], rng, token_ids=[token])
    t = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(t) == 16
    for layer in range(L):
        for x, y in zip(cache.gather(layer, t), cache.gather(layer, s)):
            np.testing.assert_array_equal(x, y[:16])


def test_two_sequences_that_computed_one_prompt_both_cache_what_follows(backend):
    """The second's pages of the prompt are not cached (the first's are); its own
    continuation is, after the first's pages."""
    rng = np.random.default_rng(304)
    prompt = rng.integers(0, 500, 8).tolist()
    cache = make(backend, enable_prefix_caching=True)
    a, b = cache.add_sequence(token_ids=prompt), cache.add_sequence(token_ids=prompt)
    step(cache, [a, b], [8, 8], rng, token_ids=prompt + prompt)
    tails = {a: [1, 2, 3, 4, 5], b: [6, 7, 8, 9, 10]}
    step(cache, [a, b], [5, 5], rng, token_ids=tails[a] + tails[b])
    for s in (a, b):
        t = cache.add_sequence(token_ids=prompt + tails[s])
        assert cache.seq_len(t) == 12
        for layer in range(L):
            for x, y, z in zip(cache.gather(layer, t), cache.gather(layer, a),
                               cache.gather(layer, s)):
                np.testing.assert_array_equal(x[:8], y[:8])
                np.testing.assert_array_equal(x[8:], z[8:12])


def test_a_step_not_yet_stored_does_not_travel_into_a_prefix_cache(backend, tmp_path):
    """Export, save or swap-out between a step's append and its last store: the
    step's tokens are not known yet, so no page of them joins a prefix cache."""
    rng = np.random.default_rng(311)
    tokens = list(range(1, 9))
    for how in ("import", "load", "swap"):
        cache = make(backend, enable_prefix_caching=True)
        s = cache.add_sequence(token_ids=[])
        step(cache, [s], [2], rng, token_ids=tokens[:2])
        cache.append([s], 6, token_ids=tokens[2:])            # stored in no layer yet
        assert cache.export_sequence(s).token_ids is None
        target = make(backend, enable_prefix_caching=True)
        if how == "import":
            target.import_sequence(cache.export_sequence(s))
        elif how == "load":
            cache.save(tmp_path / "open")
            target.load(tmp_path / "open")
        else:
            cache.swap_out(s)
            cache.swap_in(s)
            target = cache
        assert target.seq_len(target.add_sequence(token_ids=tokens + [0])) == 0, how


# -- 4. an export is a copy, swapped or not ----------------------------------------------

def test_exporting_a_swapped_sequence_hands_out_a_copy(backend, tmp_path):
    rng = np.random.default_rng(305)
    cache = make(backend, enable_prefix_caching=True)
    tokens = list(range(10))
    s = cache.add_sequence(token_ids=tokens)
    step(cache, [s], [10], rng, token_ids=tokens)
    cache.swap_out(s)
    first, second = cache.export_sequence(s), cache.export_sequence(s)
    assert first is not second
    for kv in (first, second):
        assert kv.token_ids.flags.writeable and kv.keys[0].flags.writeable
    assert not np.shares_memory(first.keys[0], second.keys[0])
    first.token_ids[:] = 7                       # the caller's to change
    first.keys[0][:] = 0
    np.testing.assert_array_equal(cache.export_sequence(s).token_ids, tokens)
    cache.save(tmp_path / "kv")
    other = make(backend, enable_prefix_caching=True)
    t = other.load(tmp_path / "kv")[0]
    np.testing.assert_array_equal(other.export_sequence(t).token_ids, tokens)
    assert other.seq_len(other.add_sequence(token_ids=[7] * 10)) == 0
    cache.swap_in(s)
    assert_same_bits(cache, s, other, t)


# -- 5. a SequenceKV is checked by its real buffers ------------------------------------

class LyingArray(np.ndarray):
    """An ndarray that says it has more rows than its buffer holds."""
    claimed = None

    @property
    def shape(self):
        return self.claimed


def lying(array, claimed):
    liar = array.view(LyingArray)
    liar.claimed = claimed
    return liar


def test_arrays_that_lie_about_their_shape_are_refused(backend):
    rng = np.random.default_rng(306)
    source = make(backend)
    s = source.add_sequence()
    step(source, [s], [40], rng)
    kv = source.export_sequence(s)
    target = make(backend, num_pages=4096)
    before = snapshot(target)
    short = kv.keys[1][:2]                            # 2 rows, claiming 40
    liar = kv.__class__(**{**kv.__dict__, "keys": kv.keys[:1] + (lying(short, kv.keys[1].shape),)
                           + kv.keys[2:]})
    with pytest.raises(ValueError, match=r"kv\.keys\[1\]: expected a float32 array of shape "
                                         r"\[40, 2, 8\], got float32 \[2, 2, 8\]"):
        target.import_sequence(liar)
    assert snapshot(target) == before
    ids = lying(kv.token_ids if kv.token_ids is not None else np.zeros(2, np.int32), (40,))
    with pytest.raises(ValueError, match=r"kv\.token_ids: expected None or an int32 array"):
        target.import_sequence(kv.__class__(**{**kv.__dict__, "token_ids": ids}))
    assert snapshot(target) == before


def test_arrays_in_any_layout_import_as_their_values(backend):
    """A strided view and an ndarray subclass that tells the truth import like the
    plain arrays."""
    rng = np.random.default_rng(307)
    source = make(backend)
    s = source.add_sequence()
    step(source, [s], [11], rng)
    kv = source.export_sequence(s)
    strided = tuple(np.stack([k, -k], axis=-1)[..., 0] for k in kv.keys)
    assert not strided[0].flags.c_contiguous
    honest = tuple(lying(v, v.shape) for v in kv.values)
    target = make(backend, page_size=3)
    t = target.import_sequence(kv.__class__(**{**kv.__dict__, "keys": strided,
                                               "values": honest}))
    assert_same_bits(source, s, target, t)


# -- 6. deeply nested JSON in a file -------------------------------------------------

@pytest.mark.parametrize("entry", ["sequences", "layer_windows", "prefix_cache"])
def test_deeply_nested_json_is_a_value_error_naming_the_path_and_entry(backend, tmp_path,
                                                                        entry):
    rng = np.random.default_rng(308)
    cache = make(backend)
    s = cache.add_sequence()
    step(cache, [s], [5], rng)
    good = tmp_path / "good"
    cache.save(good)
    metadata, tensors = read_file(good)
    target = make(backend)
    before = snapshot(target)
    for depth in (100_000, 900, 50):
        metadata[entry] = "[" * depth + "]" * depth
        path = write_file(tmp_path / f"nested{depth}", tensors, metadata)
        with pytest.raises(ValueError) as info:
            target.load(path)
        assert str(path) in str(info.value), depth
        if depth > 50:
            assert entry in str(info.value), (depth, str(info.value)[:300])
        assert len(str(info.value)) < 1000
        assert snapshot(target) == before


# -- 7. ALiBi slopes that would overflow float32 -------------------------------------

def test_alibi_slopes_too_steep_for_max_seq_len_are_refused(backend):
    rng = np.random.default_rng(309)
    limit = float(np.finfo(np.float32).max) / 4
    for max_seq_len in (None, 16):
        cache = make(backend, max_seq_len=max_seq_len)
        s = cache.add_sequence()
        batch = step(cache, [s], [3], rng)
        q = rng.standard_normal((3, HQ, D)).astype(np.float32)
        distance = (max_seq_len or 2**31 - 1) - 1
        for slope in (3e38, -3e38, 1.01 * limit / distance):
            slopes = np.full(HQ, 0.5)
            slopes[2] = slope
            with pytest.raises(ValueError, match="alibi_slopes: a slope of magnitude"):
                cache.attention(0, batch, q, alibi_slopes=slopes)
        assert cache.seq_len(s) == 3


def test_alibi_slopes_at_the_limit_give_finite_attention(backend):
    """A quarter of float32's range over the longest distance: every bias, logit
    and difference stays finite, and attention equals the float64 reference."""
    rng = np.random.default_rng(310)
    max_seq_len = 16
    steepest = float(np.finfo(np.float32).max) / 4 / (max_seq_len - 1)
    cache = make(backend, max_seq_len=max_seq_len)
    s = cache.add_sequence()
    step(cache, [s], [12], rng)
    batch = cache.append([s], 4)
    slopes = np.array([steepest, -steepest, 0.99 * steepest, -0.5 * steepest])
    q = rng.standard_normal((4, HQ, D)).astype(np.float32)
    for layer in range(L):
        k = rng.standard_normal((4, H, D)).astype(np.float32)
        cache.store(layer, batch, k, rng.standard_normal(k.shape).astype(np.float32))
        out = cache.attention(layer, batch, q, alibi_slopes=slopes)
        assert np.isfinite(out).all()
        expected = dense_attention(q, *cache.gather(layer, s), np.arange(12, 16),
                                   alibi_slopes=slopes)
        np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])
