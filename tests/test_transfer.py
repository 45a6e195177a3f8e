"""Sequences that leave the cache: export_sequence / import_sequence and swap_out / swap_in.

Round trips must give back the same bits (``gather`` equal bit for bit), into
caches of other page sizes and backends; other dtypes convert as ``store``
would; an imported or swapped-in sequence decodes on like the original
(attention against the dense reference over the original's K/V).
"""
import dataclasses
import pickle

import numpy as np
import pytest

import pagedkv
from reference import TOLERANCE, dense_attention

L, H, D = 3, 2, 8          # layers, KV heads, head_dim
HQ = 4                     # query heads (GQA)
DTYPES = ("float32", "float16", "int8")


def make(backend, **kwargs):
    options = dict(num_pages=64, page_size=4, backend=backend)
    options.update(kwargs)
    return pagedkv.PagedKVCache(L, H, D, **options)


def step(cache, seq_ids, counts, rng, token_ids=None):
    """Append one step of random K/V in every layer; returns the batch."""
    batch = cache.append(seq_ids, counts, token_ids=token_ids)
    for layer in range(cache.num_layers):
        k = rng.standard_normal((batch.num_tokens, H, D)).astype(np.float32)
        cache.store(layer, batch, k, rng.standard_normal(k.shape).astype(np.float32))
    return batch


def bits(array):
    return np.asarray(array, np.float32).view(np.uint32)


def held_from(cache, seq_id, layer):
    return cache.export_sequence(seq_id).layer_start[layer]


def assert_same_bits(a, sa, b, sb):
    """Every layer of sequence ``sa`` of cache ``a`` equals ``sb`` of ``b`` bit for bit,
    over the positions both hold."""
    assert a.seq_len(sa) == b.seq_len(sb)
    for layer in range(L):
        start = max(held_from(a, sa, layer), held_from(b, sb, layer))
        for x, y in zip(a.gather(layer, sa, start), b.gather(layer, sb, start)):
            np.testing.assert_array_equal(bits(x), bits(y))


def targets():
    """A backend name per available backend (the opencl one on the test's device)."""
    return pagedkv.available_backends()


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact_across_page_sizes_and_backends(backend, dtype):
    rng = np.random.default_rng(1)
    source = make(backend, dtype=dtype)
    a, b = source.add_sequence(), source.add_sequence()
    step(source, [a, b], [9, 1], rng)           # ragged, across page boundaries
    c = source.fork(a)
    step(source, [a, b, c], [1, 7, 3], rng)      # the fork diverges inside a shared page
    exported = {s: pickle.loads(pickle.dumps(source.export_sequence(s))) for s in (a, b, c)}
    for kv in exported.values():     # as Ray's zero-copy arrays are
        for array in kv.keys + kv.values + (kv.key_scales or ()) + (kv.value_scales or ()):
            array.setflags(write=False)
    assert exported[a].num_tokens == 10 and exported[c].num_tokens == 12
    assert exported[a].dtype == dtype and exported[a].num_layers == L
    assert exported[a].layer_start == (0,) * L and exported[a].token_ids is None
    for target in targets():
        for page_size in (1, 4, 5, 16):
            other = make(target, dtype=dtype, page_size=page_size)
            for s, kv in exported.items():
                assert_same_bits(source, s, other, other.import_sequence(kv))


@pytest.mark.parametrize("source_dtype,target_dtype", [
    ("float32", "float16"), ("float32", "int8"), ("int8", "float32"), ("float16", "int8"),
    ("int8", "float16")])
def test_another_dtype_converts_as_store_would(backend, source_dtype, target_dtype):
    rng = np.random.default_rng(2)
    source = make(backend, dtype=source_dtype)
    s = source.add_sequence()
    step(source, [s], [11], rng)
    for target in targets():
        imported = make(target, dtype=target_dtype, page_size=3)
        t = imported.import_sequence(source.export_sequence(s))
        stored = make(target, dtype=target_dtype, page_size=3)
        u = stored.add_sequence()
        batch = stored.append([u], 11)
        for layer in range(L):
            stored.store(layer, batch, *source.gather(layer, s))
        assert_same_bits(imported, t, stored, u)


@pytest.mark.parametrize("dtype", DTYPES)
def test_imported_sequence_decodes_like_the_original(backend, dtype):
    """The imported sequence and the original take the same new K/V; the imported
    one's attention matches the dense reference over the original's K/V."""
    rng = np.random.default_rng(3)
    source = make(backend, dtype=dtype)
    s = source.add_sequence()
    step(source, [s], [13], rng)
    target = make(backend, dtype=dtype, page_size=8)
    other = target.add_sequence()
    step(target, [other], [5], rng)
    t = target.import_sequence(source.export_sequence(s))
    for n in (1, 3, 1):                                   # decode, a chunk, decode
        batch = target.append([other, t], [1, n])
        source_batch = source.append([s], n)
        q = rng.standard_normal((batch.num_tokens, HQ, D)).astype(np.float32)
        length = target.seq_len(t)
        for layer in range(L):
            k = rng.standard_normal((batch.num_tokens, H, D)).astype(np.float32)
            v = rng.standard_normal(k.shape).astype(np.float32)
            target.store(layer, batch, k, v)
            source.store(layer, source_batch, k[1:], v[1:])
            expected = dense_attention(q[1:], *source.gather(layer, s),
                                       np.arange(length - n, length))
            np.testing.assert_allclose(target.attention(layer, batch, q)[1:], expected,
                                       **TOLERANCE[dtype])
    assert_same_bits(source, s, target, t)


def test_windowed_layers_keep_only_what_their_window_needs(backend):
    """A long sequence of a full-attention cache goes into a cache whose windowed
    layers have a pool far too small for it: they take pages for the window only."""
    rng = np.random.default_rng(4)
    source = make(backend, num_pages=128, page_size=4)
    s = source.add_sequence()
    step(source, [s], [200], rng)
    windows = [None, 6, 3]
    target = make(backend, num_pages=64, page_size=4, layer_windows=windows, num_window_pages=4)
    t = target.import_sequence(source.export_sequence(s))
    assert target.window_page_count(t) <= 3 and target.page_count(t) == 50
    kv = target.export_sequence(t)
    assert kv.layer_start[0] == 0 and 200 - 6 >= kv.layer_start[1] == kv.layer_start[2] >= 192
    for layer in range(L):
        start = kv.layer_start[layer]
        for x, y in zip(source.gather(layer, s, start), target.gather(layer, t, start)):
            np.testing.assert_array_equal(bits(x), bits(y))
    for _ in range(3):                       # decoding goes on, window pages come and go
        batch = target.append([t], 1)
        q = rng.standard_normal((1, HQ, D)).astype(np.float32)
        for layer in range(L):
            k = rng.standard_normal((1, H, D)).astype(np.float32)
            target.store(layer, batch, k, -k)
            length = target.seq_len(t)
            k_all = np.concatenate([source.gather(layer, s)[0], target.gather(layer, t, 200)[0]])
            v_all = np.concatenate([source.gather(layer, s)[1], target.gather(layer, t, 200)[1]])
            expected = dense_attention(q, k_all, v_all, [length - 1],
                                       sliding_window=windows[layer])
            np.testing.assert_allclose(target.attention(layer, batch, q), expected,
                                       **TOLERANCE["float32"])
    assert target.window_page_count(t) <= 4


def test_a_layer_needing_positions_the_export_lacks_is_refused(backend):
    rng = np.random.default_rng(5)
    source = make(backend, layer_windows=[None, 4, 4], page_size=2)
    s = source.add_sequence()
    step(source, [s], [20], rng)
    step(source, [s], [1], rng)             # a decode step gives old window pages back
    kv = source.export_sequence(s)
    assert kv.layer_start[1] > 0
    full = make(backend)
    before = full.num_free_pages
    with pytest.raises(ValueError, match="layer 1 is a full-attention layer"):
        full.import_sequence(kv)
    wider = make(backend, layer_windows=[None, 16, 4], page_size=2)
    with pytest.raises(ValueError, match=r"layer 1 \(sliding window 16\) needs K/V from position 6"):
        wider.import_sequence(kv)
    assert full.num_free_pages == before and full.seq_ids() == [] and wider.seq_ids() == []
    same = make(backend, layer_windows=[None, 4, 2], page_size=8)      # smaller windows fit
    t = same.import_sequence(kv)
    for layer in range(L):
        start = max(kv.layer_start[layer], same.export_sequence(t).layer_start[layer])
        np.testing.assert_array_equal(bits(source.gather(layer, s, start)[0]),
                                      bits(same.gather(layer, t, start)[0]))


def test_a_window_that_starts_inside_a_page_is_held_from_there(backend):
    """K/V whose windowed layers start inside a page of the importing cache (an
    export from pages of 2 into pages of 8) are held from that row on: imported,
    exported, swapped and forked without the rows before it, which no rollback
    may reach, and decoding goes on as over the full K/V."""
    rng = np.random.default_rng(15)
    windows = [None, 4, 4]
    source = make(backend, layer_windows=windows, page_size=2)
    twin = make(backend)                      # the same K/V, every position kept
    s, w = source.add_sequence(), twin.add_sequence()
    for count in (21, 1):
        batch, twin_batch = source.append([s], count), twin.append([w], count)
        for layer in range(L):
            k, v = (rng.standard_normal((count, H, D)).astype(np.float32) for _ in "kv")
            source.store(layer, batch, k, v)
            twin.store(layer, twin_batch, k, v)
    kv = source.export_sequence(s)
    assert kv.layer_start[1] == kv.layer_start[2] == 18     # inside page 2 of pages of 8
    cache = make(backend, layer_windows=windows, page_size=8)
    t = cache.import_sequence(kv)
    assert held_from(cache, t, 1) == 18 and cache.window_page_count(t) == 1
    for layer in range(L):
        start = 18 if windows[layer] else 0
        for x, y in zip(twin.gather(layer, w, start), cache.gather(layer, t, start)):
            np.testing.assert_array_equal(bits(x), bits(y))
    with pytest.raises(ValueError, match="only from position 18"):
        cache.gather(1, t, 16)
    # a query at 21 (after a rollback by one) sees from 18: held; one at 20 would not be
    with pytest.raises(ValueError, match="new_len: .* before position 18"):
        cache.truncate(t, 20)
    cache.swap_out(t)
    cache.swap_in(t)
    child = cache.fork(t)
    for seq in (t, child):
        assert held_from(cache, seq, 1) == 18
        with pytest.raises(ValueError, match="before position 18"):
            cache.truncate(seq, 20)
    cache.truncate(child, 21)
    cache.free(child)
    for _ in range(3):                       # decode on: window pages come and go
        batch, twin_batch = cache.append([t], 1), twin.append([w], 1)
        q = rng.standard_normal((1, HQ, D)).astype(np.float32)
        for layer in range(L):
            k, v = (rng.standard_normal((1, H, D)).astype(np.float32) for _ in "kv")
            cache.store(layer, batch, k, v)
            twin.store(layer, twin_batch, k, v)
            expected = twin.attention(layer, twin_batch, q, sliding_window=windows[layer])
            np.testing.assert_allclose(cache.attention(layer, batch, q), expected,
                                       **TOLERANCE["float32"])


@pytest.mark.parametrize("first_page,first_row,match", [
    (1, 3, "first_row: expected a position of page 1 \\(4 to 7\\), got 3"),
    (1, 8, "first_row: expected a position of page 1 \\(4 to 7\\), got 8"),
    (1, 7, "first_row: .* from position 6; expected first_row <= 6, got 7"),
])
def test_a_first_row_the_window_cannot_hold_from_is_refused(backend, first_page, first_row,
                                                             match):
    """``adopt``'s ``first_row`` must lie in page ``first_page`` and not after what
    the next query sees; otherwise ValueError and nothing changes."""
    cache = make(backend, num_pages=16, layer_windows=[None, 4, 4], num_window_pages=16)
    before = (cache.num_free_pages, cache.num_free_window_pages, cache.seq_ids(),
              cache._tables.next_id)
    with pytest.raises(ValueError, match=match):
        cache._holdings.placement.adopt(9, None, first_page, first_row=first_row)
    assert (cache.num_free_pages, cache.num_free_window_pages, cache.seq_ids(),
            cache._tables.next_id) == before
    seq = cache._holdings.placement.adopt(9, None, 1, first_row=6)   # the next query sees from 6
    cache._holdings.placement.commit()
    assert cache._tables.held_from(seq, 1) == 6


def test_a_window_page_without_its_first_rows_is_not_cached(backend):
    """With prefix caching, the full page an imported window starts inside joins
    the prefix cache in the full pool only: a prompt hit must not hand its
    missing rows to a new sequence (whose rollbacks could then see them)."""
    rng = np.random.default_rng(16)
    windows = [None, 4, 4]
    tokens = np.arange(100, 130, dtype=np.int32)
    source = make(backend, layer_windows=windows, page_size=2, enable_prefix_caching=True)
    s = source.add_sequence()
    step(source, [s], [29], rng, token_ids=tokens[:29])
    step(source, [s], [1], rng, token_ids=tokens[29:])
    kv = source.export_sequence(s)
    assert kv.layer_start[1] == 26 and kv.token_ids is not None
    cache = make(backend, layer_windows=windows, page_size=4, enable_prefix_caching=True)
    t = cache.import_sequence(kv)           # window page 6 (positions 24-27) from row 26
    assert held_from(cache, t, 1) == 26
    hit = cache.add_sequence(token_ids=tokens[:29])
    assert cache.seq_len(hit) <= 24         # page 6 of the window pool is not reused


def test_mismatched_or_inconsistent_exports_are_refused(backend):
    rng = np.random.default_rng(6)
    source = make(backend, dtype="int8")
    s = source.add_sequence()
    step(source, [s], [5], rng)
    kv = source.export_sequence(s)
    for kwargs, field in ((dict(num_layers=2), "num_layers"), (dict(num_kv_heads=1), "num_kv_heads"),
                          (dict(head_dim=16), "head_dim")):
        shape = dict(num_layers=L, num_kv_heads=H, head_dim=D)
        shape.update(kwargs)
        other = pagedkv.PagedKVCache(shape.pop("num_layers"), shape.pop("num_kv_heads"),
                                     shape.pop("head_dim"), num_pages=8, backend=backend)
        with pytest.raises(ValueError, match=f"kv.{field}: this cache has {field}="):
            other.import_sequence(kv)
    target = make(backend, max_seq_len=4)
    with pytest.raises(ValueError, match="max_seq_len=4"):
        target.import_sequence(kv)
    bad = [(dataclasses.replace(kv, num_tokens=6), r"kv.keys\[0\]: expected a int8 array of "
                                                  r"shape \[6, 2, 8\]"),
           (dataclasses.replace(kv, key_scales=None), "kv.key_scales: expected a tuple"),
           (dataclasses.replace(kv, dtype="int4"), "kv.dtype"),
           (dataclasses.replace(kv, rotation_block=3), "kv.rotation_block"),
           (dataclasses.replace(kv, layer_start=(0, 9, 0)), "kv.layer_start"),
           (dataclasses.replace(kv, token_ids=np.zeros(5, np.int64)), "kv.token_ids"),
           (dataclasses.replace(kv, values=kv.values[:2]), "kv.values: expected a tuple of 3")]
    target = make(backend, dtype="int8")
    for wrong, message in bad:
        with pytest.raises(ValueError, match=message):
            target.import_sequence(wrong)
    with pytest.raises(TypeError, match="kv: expected a pagedkv.SequenceKV"):
        target.import_sequence({"keys": kv.keys})
    assert target.seq_ids() == [] and target.num_free_pages == target.num_pages


def test_out_of_pages_on_import_changes_nothing(backend):
    rng = np.random.default_rng(7)
    source = make(backend)
    s = source.add_sequence()
    step(source, [s], [40], rng)                       # 10 pages
    target = make(backend, num_pages=9, enable_prefix_caching=True)
    prompt = list(range(8))
    u = target.add_sequence(token_ids=prompt)
    step(target, [u], [8], rng, token_ids=prompt)
    target.free(u)                                     # 2 cached pages, evictable
    before = (target.num_free_pages, target.stats(), target.seq_ids())
    with pytest.raises(pagedkv.OutOfPagesError, match="needs 10 pages, 9 of 9 free"):
        target.import_sequence(source.export_sequence(s))
    assert (target.num_free_pages, target.stats(), target.seq_ids()) == before
    assert target.seq_len(target.add_sequence(token_ids=prompt + [1])) == 8   # still cached


def test_import_with_token_ids_warms_the_prefix_cache(backend):
    rng = np.random.default_rng(8)
    source = make(backend, enable_prefix_caching=True)
    prompt = rng.integers(0, 1000, 18).tolist()
    s = source.add_sequence(token_ids=prompt)
    step(source, [s], [18], rng, token_ids=prompt)
    kv = source.export_sequence(s)
    np.testing.assert_array_equal(kv.token_ids, prompt)
    target = make(backend, enable_prefix_caching=True, page_size=8, dtype="float16")
    t = target.import_sequence(kv)
    target.free(t)                    # its full pages stay cached, as if stored here
    hit = target.add_sequence(token_ids=prompt + [7])
    assert target.seq_len(hit) == 16
    stored = make(backend, page_size=8, dtype="float16")
    u = stored.add_sequence()
    batch = stored.append([u], 18)
    for layer in range(L):
        stored.store(layer, batch, *source.gather(layer, s))
    for layer in range(L):
        np.testing.assert_array_equal(bits(target.gather(layer, hit)[0]),
                                      bits(stored.gather(layer, u)[0][:16]))


# -- swap ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_out_and_in_gives_back_the_same_bits(backend, dtype):
    rng = np.random.default_rng(9)
    cache = make(backend, dtype=dtype, num_pages=8, layer_windows=[None, 5, None],
                 num_window_pages=8)
    s, other = cache.add_sequence(), cache.add_sequence()
    step(cache, [s, other], [14, 3], rng)
    step(cache, [s], [1], rng)             # its window pages before position 8 go back
    starts = [held_from(cache, s, layer) for layer in range(L)]
    assert starts == [0, 8, 0]
    before = [cache.gather(layer, s, start) for layer, start in enumerate(starts)]
    free = cache.num_free_pages
    cache.swap_out(s)
    assert cache.is_swapped(s) and not cache.is_swapped(other)
    assert cache.num_free_pages == free + 4 and cache.seq_len(s) == 15
    stats = cache.stats()
    assert stats["num_swapped_sequences"] == 1
    assert stats["swapped_bytes"] == cache.export_sequence(s).nbytes > 0
    filler = cache.add_sequence()
    step(cache, [filler], [8], rng)        # the freed pages serve others meanwhile
    cache.free(filler)
    cache.swap_in(s)
    assert not cache.is_swapped(s) and cache.stats()["num_swapped_sequences"] == 0
    assert [held_from(cache, s, layer) for layer in range(L)] == starts
    for layer, start in enumerate(starts):
        for x, y in zip(before[layer], cache.gather(layer, s, start)):
            np.testing.assert_array_equal(bits(x), bits(y))
    step(cache, [s, other], [1, 1], rng)   # and it decodes on


def test_swap_with_a_fork_sharing_pages(backend):
    rng = np.random.default_rng(10)
    cache = make(backend, num_pages=10)
    parent = cache.add_sequence()
    step(cache, [parent], [10], rng)                   # 3 pages
    child = cache.fork(parent)
    step(cache, [child], [4], rng)                     # copies the shared last page
    parent_kv = [cache.gather(layer, parent) for layer in range(L)]
    child_kv = [cache.gather(layer, child) for layer in range(L)]
    free = cache.num_free_pages
    cache.swap_out(parent)
    assert cache.num_free_pages == free + 1            # the 2 shared pages stay with the child
    assert all(cache.refcount(p) == 1 for p in cache.page_ids(child))
    for layer in range(L):
        for x, y in zip(child_kv[layer], cache.gather(layer, child)):
            np.testing.assert_array_equal(bits(x), bits(y))
    step(cache, [child], [1], rng)
    cache.swap_in(parent)
    assert cache.page_count(parent) == 3
    for layer in range(L):
        for x, y in zip(parent_kv[layer], cache.gather(layer, parent)):
            np.testing.assert_array_equal(bits(x), bits(y))


def test_a_swapped_sequence_refuses_what_needs_its_pages(backend):
    rng = np.random.default_rng(11)
    cache = make(backend)
    s, other = cache.add_sequence(), cache.add_sequence()
    batch = step(cache, [s, other], [5, 2], rng)
    checkpoint = cache.checkpoint(s)
    cache.swap_out(s)
    kv = np.zeros((7, H, D), np.float32)
    calls = {
        "append": lambda: cache.append([other, s], 1),
        "fork": lambda: cache.fork(s),
        "gather": lambda: cache.gather(0, s),
        "read_token": lambda: cache.read_token(0, s, 0),
        "truncate": lambda: cache.truncate(s, 2),
        "restore": lambda: cache.restore(checkpoint),
        "page_count": lambda: cache.page_count(s),
        "swap_out": lambda: cache.swap_out(s),
        "store": lambda: cache.store(0, batch, kv, kv),
        "attention": lambda: cache.attention(0, batch, np.zeros((7, HQ, D), np.float32)),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="swapped out") as info:
            call()
        assert "sequence 0" in str(info.value), name
    assert cache.seq_len(s) == 5 and cache.export_sequence(s).num_tokens == 5
    assert cache.checkpoint(s).seq_len == 5 and s in cache.seq_ids()
    with pytest.raises(ValueError, match="sequence 1 is not swapped out"):
        cache.swap_in(other)
    step(cache, [other], [1], rng)           # the others go on
    cache.swap_in(s)
    cache.restore(checkpoint)                # checkpoints outlive the swap
    step(cache, [s, other], [1, 1], rng)


def test_free_of_a_swapped_sequence(backend):
    rng = np.random.default_rng(12)
    cache = make(backend)
    s = cache.add_sequence()
    step(cache, [s], [6], rng)
    cache.swap_out(s)
    cache.free(s)
    assert cache.stats()["num_swapped_sequences"] == 0 and cache.stats()["swapped_bytes"] == 0
    assert cache.num_free_pages == cache.num_pages and cache.seq_ids() == []
    for call in (lambda: cache.seq_len(s), lambda: cache.swap_in(s), lambda: cache.is_swapped(s)):
        with pytest.raises(pagedkv.UnknownSequenceError):
            call()
    t = cache.add_sequence()
    step(cache, [t], [2], rng)
    cache.swap_out(t)
    cache.clear()
    assert cache.stats()["num_swapped_sequences"] == 0 and cache.seq_ids() == []


def test_swap_in_out_of_pages_changes_nothing(backend):
    rng = np.random.default_rng(13)
    cache = make(backend, num_pages=4)
    s = cache.add_sequence()
    step(cache, [s], [12], rng)                      # 3 pages
    cache.swap_out(s)
    hog = cache.add_sequence()
    step(cache, [hog], [8], rng)                     # 2 pages: 2 left, 3 needed
    before = (cache.num_free_pages, cache.stats(), cache.seq_ids())
    with pytest.raises(pagedkv.OutOfPagesError, match="swap_in: this sequence of 12 tokens "
                                                      "needs 3 pages, 2 of 4 free"):
        cache.swap_in(s)
    assert (cache.num_free_pages, cache.stats(), cache.seq_ids()) == before
    assert cache.is_swapped(s)
    cache.free(hog)
    cache.swap_in(s)


# -- where window pages start (PageTables.adopt / swap_in, transfer.import_sequence) ----

def decode_matches_the_source(target, t, source, s, windows, rng, steps=3):
    """Decode ``steps`` tokens on ``t`` and check every layer's attention against the
    dense reference over ``source``'s K/V of ``s`` (full attention there) and the new ones."""
    start = source.seq_len(s)
    for _ in range(steps):
        batch = target.append([t], 1)
        q = rng.standard_normal((1, HQ, D)).astype(np.float32)
        for layer in range(L):
            k = rng.standard_normal((1, H, D)).astype(np.float32)
            target.store(layer, batch, k, -k)
            new_k, new_v = target.gather(layer, t, start)
            k_all = np.concatenate([source.gather(layer, s)[0], new_k])
            v_all = np.concatenate([source.gather(layer, s)[1], new_v])
            expected = dense_attention(q, k_all, v_all, [target.seq_len(t) - 1],
                                       sliding_window=windows[layer])
            np.testing.assert_allclose(target.attention(layer, batch, q), expected,
                                       **TOLERANCE["float32"])


@pytest.mark.parametrize("windows,length,edge", [
    ([None, 3, 2], 10, 2),     # the next query sees from position 8: page 2 of 3, partly full
    ([None, 1, 1], 9, 2),      # it sees only itself; page 2 of 3 holds the last token
    ([None, 1, 1], 8, 2),      # the same, the last page full: every window page can go
])
def test_window_pages_start_no_later_than_the_next_query_sees(backend, windows, length, edge):
    """A sequence placed with its window pages before ``first_page`` given back must
    still hold the page of what its next query sees (the last token's page when it
    is partly full): later ones are refused with nothing changed; the latest
    allowed one decodes on like the source."""
    rng = np.random.default_rng(14)
    source = make(backend, num_pages=16)
    s = source.add_sequence()
    step(source, [s], [length], rng)
    kv = source.export_sequence(s)
    cache = make(backend, num_pages=16, layer_windows=windows, num_window_pages=16)
    num_pages = -(-length // 4)
    swapped = cache.add_sequence()
    step(cache, [swapped], [length], rng)
    cache.swap_out(swapped)

    def state():
        return (cache.num_free_pages, cache.num_free_window_pages, cache.seq_ids(),
                cache.stats(), cache._tables.next_id, cache.is_swapped(swapped))

    before = state()
    for first_page in range(edge + 1, num_pages + 1):
        with pytest.raises(ValueError, match=f"first_page: .* expected first_page <= {edge}, "
                                             f"got {first_page}"):
            pagedkv.transfer.import_sequence(cache._holdings, kv, first_page * 4)
        with pytest.raises(ValueError, match="first_page"):
            cache._holdings.placement.swap_in(swapped, first_page)
        assert state() == before
    t = pagedkv.transfer.import_sequence(cache._holdings, kv, edge * 4)
    assert cache.window_page_count(t) == num_pages - edge
    for layer in range(L):
        start = 0 if windows[layer] is None else edge * 4
        for x, y in zip(source.gather(layer, s, start), cache.gather(layer, t, start)):
            np.testing.assert_array_equal(bits(x), bits(y))
    decode_matches_the_source(cache, t, source, s, windows, rng)
    cache.swap_in(swapped)          # the public paths place from a page that works
    assert not cache.is_swapped(swapped)
