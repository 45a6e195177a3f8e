"""Windowed layers (``layer_windows``): a second pool that gives pages back, against the
dense NumPy reference, on every backend."""
import numpy as np
import pytest

import pagedkv
from reference import TOLERANCE, Harness, dense_attention

PS = 4


def make(backend, *, windows=(None, 6, 3), num_pages=64, num_window_pages=None,
         rollback=1, caching=False, group=2, **kwargs):
    cache = pagedkv.PagedKVCache(len(windows), 2, 16, num_pages=num_pages, page_size=PS,
                                 layer_windows=list(windows), num_window_pages=num_window_pages,
                                 window_rollback_tokens=rollback, backend=backend,
                                 enable_prefix_caching=caching, **kwargs)
    return Harness(cache, num_heads=2 * group)


def held_pages_bound(window, new_tokens, rollback=1):
    """What a windowed layer may hold per sequence: the DESIGN's (W + new) / ps + 2."""
    return (window + new_tokens + rollback - 1) // PS + 2


def test_windowed_layers_match_the_reference_as_sequences_grow(backend):
    h = make(backend)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [9, 2, 14])                         # ragged prefill over page boundaries
    for _ in range(25):                              # decode far past every window
        h.step(seqs, 1)
        for s in seqs:
            assert h.cache.window_page_count(s) <= held_pages_bound(6, 1)
    h.step(seqs, [5, 0, 7])                          # a chunk next to a decode
    h.step(seqs, 1, sliding_window=2)                # a smaller window than the layers'
    h.check_contents()
    assert h.cache.page_count(seqs[0]) == -(-h.cache.seq_len(seqs[0]) // PS)


def test_pages_go_back_as_sequences_grow(backend):
    h = make(backend, windows=(None, 8), num_window_pages=40)
    s = h.add()
    h.step([s], 3)
    free_at_start = h.cache.num_free_window_pages
    for _ in range(60):
        h.step([s], 1)
        assert h.cache.window_page_count(s) <= held_pages_bound(8, 1)
    assert h.cache.num_free_window_pages >= free_at_start - held_pages_bound(8, 1)
    ids = h.cache.window_page_ids(s)
    released = np.flatnonzero(ids < 0)
    assert len(ids) == h.cache.page_count(s) and len(released) > 0
    assert (released == np.arange(len(released))).all()          # a leading run
    h.check_contents()


def test_a_long_sequence_fits_a_window_pool_far_smaller_than_it(backend):
    # 1,200 tokens = 300 pages in the full pool; the windowed layers hold 8
    h = make(backend, windows=(None, 10, 10), num_pages=320, num_window_pages=8)
    s = h.add()
    h.step([s], 11)
    for _ in range(140):                             # chunked prefill, 8 tokens a step
        h.step([s], 8, check=False)
    # a step adding n tokens holds about (W + n) / page_size + 2 window pages
    with pytest.raises(pagedkv.OutOfPagesError, match="window pool"):
        h.cache.append([s], 40)
    for _ in range(20):
        h.step([s], 1)
    h.step([s], 8)
    assert h.cache.seq_len(s) == 1159 and h.cache.window_page_count(s) <= 8
    h.check_contents()


def test_exhaustion_of_either_pool_changes_nothing(backend):
    h = make(backend, windows=(None, 6), num_pages=12, num_window_pages=5)
    a, b = h.add(), h.add()
    h.step([a, b], [7, 6])
    before = (h.cache.num_free_pages, h.cache.num_free_window_pages,
              [list(h.cache.page_ids(s)) for s in (a, b)],
              [list(h.cache.window_page_ids(s)) for s in (a, b)])
    with pytest.raises(pagedkv.OutOfPagesError, match="window pool") as window_error:
        h.cache.append([a, b], [9, 9])               # 6 window pages needed, 1 free
    assert isinstance(window_error.value, MemoryError)
    with pytest.raises(pagedkv.OutOfPagesError, match="full-attention pool"):
        h.cache.append([a], 40)
    after = (h.cache.num_free_pages, h.cache.num_free_window_pages,
             [list(h.cache.page_ids(s)) for s in (a, b)],
             [list(h.cache.window_page_ids(s)) for s in (a, b)])
    assert after == before
    h.step([a, b], 1)
    h.check_contents()


def pool_state(cache, seqs):
    return (cache.num_free_pages, cache.num_free_window_pages,
            [cache.seq_len(s) for s in seqs], [list(cache.page_ids(s)) for s in seqs],
            [list(cache.window_page_ids(s)) for s in seqs])


def full_window_pool(backend):
    """A window pool of 6 pages, all held: ``a`` (16 tokens) holds 4, ``p`` 2."""
    h = make(backend, windows=(None, 4), num_window_pages=6)
    a, p = h.add(), h.add()
    h.step([a], 16)
    h.step([p], 5)
    assert h.cache.num_free_window_pages == 0 and h.cache.window_page_count(a) == 4
    return h, a, p


def test_a_sequence_without_new_tokens_gives_no_window_pages_back(backend):
    # (issue 22, item 1: ``a`` with 0 new tokens counted as giving 3 pages back,
    # and ``s`` was handed page -1)
    h, a, p = full_window_pool(backend)
    s = h.add()
    before = pool_state(h.cache, [a, p, s])
    with pytest.raises(pagedkv.OutOfPagesError, match="window pool"):
        h.cache.append([a, s], [0, 8])
    assert pool_state(h.cache, [a, p, s]) == before
    h.step([a, s], [1, 4])               # a's token gives back 3 pages, s takes 1 + a 1
    assert (h.cache.window_page_ids(s) >= 0).all()
    h.check_contents()


def test_pages_a_later_sequence_gives_back_serve_an_earlier_one(backend):
    # (issue 22, item 1: ``s`` took its pages before ``a`` gave its back, and got -1)
    h, a, p = full_window_pool(backend)
    s = h.add()
    h.step([s, a], [8, 1])               # a gives back 3 pages; s takes 2, a 1
    assert (h.cache.window_page_ids(s) >= 0).all()
    assert h.cache.num_free_window_pages == 0
    h.step([s, a, p], 1)
    h.check_contents()


def test_a_window_pool_that_really_is_too_small_is_refused(backend):
    h, a, p = full_window_pool(backend)
    s = h.add()
    before = pool_state(h.cache, [a, p, s])
    with pytest.raises(pagedkv.OutOfPagesError, match="window pool"):
        h.cache.append([s, a], [12, 1])  # 4 new pages, 3 given back, none free
    assert pool_state(h.cache, [a, p, s]) == before
    h.check_contents()


def test_the_large_example_of_issue_22(backend):
    cache = pagedkv.PagedKVCache(2, 8, 128, num_pages=64, page_size=64,
                                 layer_windows=[None, 64], num_window_pages=6, backend=backend)
    h = Harness(cache)
    a, p = h.add(), h.add()
    h.step([a], 256)
    h.step([p], 67)
    s = h.add()
    with pytest.raises(pagedkv.OutOfPagesError, match="window pool"):
        cache.append([a, s], [0, 192])
    h.step([s, a], [128, 1])
    assert (cache.window_page_ids(s) >= 0).all()
    h.check_contents()


def test_fork_shares_window_pages_with_copy_on_write(backend):
    h = make(backend)
    a = h.add()
    h.step([a], 10)                                  # the last page is partly filled
    b = h.fork(a)
    shared = h.cache.window_page_ids(a)
    assert list(h.cache.window_page_ids(b)) == list(shared)
    h.step([a, b], [1, 2])                           # both write: one copies the last page
    assert h.cache.window_page_ids(a)[-1] != h.cache.window_page_ids(b)[-1]
    assert shared[-1] in (h.cache.window_page_ids(a)[-1], h.cache.window_page_ids(b)[-1])
    for _ in range(12):                              # and both give pages back, alone
        h.step([a, b], 1)
    h.check_contents()
    h.free(a)
    h.step([b], 2)
    h.check_contents()


def test_rollback_by_one_token_always_works(backend):
    h = make(backend)
    s = h.add()
    h.step([s], 7)
    for _ in range(20):
        h.step([s], 1)
        h.truncate(s, h.cache.seq_len(s) - 1)        # reject the token ...
        h.step([s], 1)                               # ... and decode it again
    h.check_contents()


def test_rollback_past_what_the_window_kept_is_refused(backend):
    h = make(backend, windows=(None, 6))
    s = h.add()
    h.step([s], 10)
    for _ in range(20):
        h.step([s], 1)
    length = h.cache.seq_len(s)
    checkpoint_far = None
    before = (list(h.cache.page_ids(s)), list(h.cache.window_page_ids(s)),
              h.cache.num_free_pages, h.cache.num_free_window_pages)
    with pytest.raises(ValueError, match="new_len: the windowed layers gave back .* position"):
        h.cache.truncate(s, length - 8)
    assert h.cache.seq_len(s) == length
    assert (list(h.cache.page_ids(s)), list(h.cache.window_page_ids(s)),
            h.cache.num_free_pages, h.cache.num_free_window_pages) == before
    h.truncate(s, 0)                                 # always works
    assert h.cache.window_page_count(s) == 0 and h.cache.page_count(s) == 0
    h.step([s], 9)
    h.check_contents()
    del checkpoint_far


def test_restore_past_what_the_window_kept_is_refused(backend):
    h = make(backend, windows=(None, 5))
    s = h.add()
    h.step([s], 6)
    checkpoint = h.cache.checkpoint(s)
    for _ in range(12):
        h.step([s], 1)
    with pytest.raises(ValueError, match="gave back"):
        h.cache.restore(checkpoint)
    assert h.cache.seq_len(s) == 18
    recent = h.cache.checkpoint(s)
    h.step([s], 1)
    h.restore(recent)                                # one token back: fine
    h.check_contents()


def test_a_sequence_shorter_than_the_window_rolls_back_anywhere(backend):
    # (issue 22, item 2: a sequence of 100 tokens under a window of 512 could not
    # be truncated to 99: nothing was given back, yet the check said so)
    h = make(backend, windows=(512, None), num_pages=64)
    s = h.add()
    h.step([s], 100)
    h.truncate(s, 99)
    checkpoint = h.cache.checkpoint(s)
    h.step([s], 3)
    h.restore(checkpoint)
    h.truncate(s, 37)
    h.step([s], 5)
    h.check_contents()


def test_a_window_beyond_any_length_acts_as_full_attention(backend):
    # (issue 22, item 8: a window of 2**31 - 1 refused every truncate)
    h = make(backend, windows=(None, 2**31 - 1))
    s = h.add()
    h.step([s], 30)
    for _ in range(5):
        h.step([s], 1)
    assert h.cache.window_page_count(s) == h.cache.page_count(s)   # nothing given back
    h.truncate(s, 3)
    h.step([s], 2)
    h.check_contents()


@pytest.mark.parametrize("draft", [1, 3, 5])
def test_a_rollback_margin_keeps_room_for_speculative_decoding(backend, draft):
    """With window_rollback_tokens = k + 1, a step of k draft tokens plus one can be
    rolled back to the last accepted token."""
    h = make(backend, windows=(None, 6), rollback=draft + 1)
    s = h.add()
    h.step([s], 8)
    for _ in range(15):
        accepted = h.cache.seq_len(s)
        h.step([s], draft + 1)                       # verify k drafts in one step
        h.truncate(s, accepted + 1)                  # keep one, reject the rest
        for _ in range(draft):
            h.step([s], 1)
    h.check_contents()
    assert h.cache.window_page_count(s) <= held_pages_bound(6, draft + 1, draft + 1)


def test_gather_and_read_token_of_released_positions_say_where_k_v_starts(backend):
    h = make(backend, windows=(None, 5))
    s = h.add()
    h.step([s], 30)
    h.step([s], 1)
    held_from = h.held_from(1, s)
    assert held_from > 0
    with pytest.raises(ValueError, match=f"only from position {held_from}"):
        h.cache.gather(1, s)
    with pytest.raises(ValueError, match=f"only from position {held_from}"):
        h.cache.read_token(1, s, held_from - 1)
    k, _ = h.cache.gather(1, s, held_from)
    np.testing.assert_array_equal(k, h.ref.k[s][1][held_from:])
    np.testing.assert_array_equal(h.cache.read_token(1, s, 30)[0], h.ref.k[s][1][30])
    np.testing.assert_array_equal(h.cache.gather(0, s)[0], h.ref.k[s][0])    # a full layer


def test_a_windowed_layer_applies_its_window_and_refuses_a_larger_one(backend):
    h = make(backend, windows=(None, 6))
    s = h.add()
    batch = h.step([s], 13)
    q = h.random(13, 4, 16)
    k, v = h.ref.k[s][1], h.ref.v[s][1]
    np.testing.assert_allclose(h.cache.attention(1, batch, q),
                               dense_attention(q, k, v, np.arange(13), sliding_window=6),
                               **TOLERANCE["float32"])
    np.testing.assert_allclose(h.cache.attention(1, batch, q, sliding_window=2),
                               dense_attention(q, k, v, np.arange(13), sliding_window=2),
                               **TOLERANCE["float32"])
    with pytest.raises(ValueError, match="sliding_window: layer 1 keeps only a window of 6"):
        h.cache.attention(1, batch, q, sliding_window=7)


def test_window_tables_describe_the_window_pool(backend):
    h = make(backend, windows=(None, 6))
    a, b = h.add(), h.add()
    h.step([a, b], [15, 3])
    batch = h.cache.append([a, b], [1, 2])
    wt = batch.window_tables
    assert wt is not None
    np.testing.assert_array_equal(wt.page_indptr, batch.page_indptr)
    np.testing.assert_array_equal(wt.last_page_len, batch.last_page_len)
    for i, s in enumerate((a, b)):
        ids = h.cache.window_page_ids(s)
        row = wt.page_indices[wt.page_indptr[i]:wt.page_indptr[i + 1]]
        np.testing.assert_array_equal(row, ids)
        np.testing.assert_array_equal(wt.block_table[i, :len(ids)], ids)
    positions = [15, 3, 4]
    pages = [h.cache.window_page_ids(s) for s in (a, b, b)]
    expected = [int(p[pos // PS]) * PS + pos % PS for p, pos in zip(pages, positions)]
    np.testing.assert_array_equal(wt.slot_mapping, expected)
    with pytest.raises(ValueError, match="read-only"):
        wt.slot_mapping[0] = 0
    assert pagedkv.PagedKVCache(1, 1, 8, num_pages=4, backend=backend).append(
        [], []).window_tables is None


def test_memory_and_pool_figures_count_both_pools(backend):
    windows = (None, 8, 8, None, 8)
    cache = pagedkv.PagedKVCache(5, 2, 16, num_pages=40, num_window_pages=10, page_size=PS,
                                 layer_windows=windows, dtype="float16", backend=backend)
    page_bytes = 2 * PS * 16 * 2
    assert cache.memory_bytes == 2 * page_bytes * (2 * 40 + 3 * 10)
    assert cache.num_pages == 40 and cache.num_window_pages == 10
    assert cache.num_free_window_pages == 10
    s = cache.add_sequence()
    cache.append([s], 9)
    assert cache.window_page_count(s) == 3 and cache.page_count(s) == 3
    stats = cache.stats()
    assert stats["num_used_pages"] == 3 and stats["num_used_window_pages"] == 3
    assert stats["num_free_window_pages"] == 7
    plain = pagedkv.PagedKVCache(2, 2, 16, num_pages=40, page_size=PS, backend=backend)
    assert plain.num_window_pages == 0 and plain.num_free_window_pages == 0
    assert "num_free_window_pages" not in plain.stats()
    assert plain.window_page_count(plain.add_sequence()) == 0


def test_default_window_pool_has_num_pages_pages(backend):
    cache = pagedkv.PagedKVCache(2, 1, 8, num_pages=12, page_size=PS, layer_windows=[4, None],
                                 backend=backend)
    assert cache.num_window_pages == 12


# -- prefix caching ----------------------------------------------------------------

def kv_for(tokens, layer):
    """K/V [n, 2, 16] that depend on every token up to each position (and the layer)."""
    acc, rows = 5 + layer, []
    for t in tokens:
        acc = (acc * 31 + int(t) + 3) % 10007
        rows.append(acc)
    base = np.array(rows, dtype=np.float32)[:, None, None] / 997
    k = np.sin(base + np.arange(32, dtype=np.float32).reshape(1, 2, 16))
    return k, np.cos(3 * k)


def serve(cache, prompt):
    """Like an engine: start on the cached prefix, compute and store the rest."""
    s = cache.add_sequence(token_ids=prompt)
    done = cache.seq_len(s)
    batch = cache.append([s], len(prompt) - done, token_ids=prompt[done:])
    for layer in range(cache.num_layers):
        k, v = kv_for(prompt, layer)
        cache.store(layer, batch, k[done:], v[done:])
    return s, done, batch


def check_attention(cache, batch, s, prompt, done):
    rng = np.random.default_rng(len(prompt))
    q = rng.standard_normal((len(prompt) - done, 4, 16), dtype=np.float32)
    for layer, window in enumerate(cache.layer_windows):
        k, v = kv_for(prompt, layer)
        np.testing.assert_allclose(
            cache.attention(layer, batch, q),
            dense_attention(q, k, v, np.arange(done, len(prompt)), sliding_window=window),
            **TOLERANCE["float32"])


def test_a_prefix_hit_reuses_window_pages_that_are_still_cached(backend):
    cache = pagedkv.PagedKVCache(2, 2, 16, num_pages=64, page_size=PS, layer_windows=[None, 6],
                                 backend=backend, enable_prefix_caching=True)
    prompt = list(range(50, 90))
    first, done, batch = serve(cache, prompt)
    assert done == 0
    batch = cache.append([first], 1, token_ids=[3])                   # one decode step ...
    for layer in range(2):
        cache.store(layer, batch, *(x[-1:] for x in kv_for(prompt + [3], layer)))
    assert cache.window_page_count(first) < cache.page_count(first)   # ... gives pages back
    cache.free(first)
    again = prompt[:37] + [7]
    s, done, batch = serve(cache, again)
    assert done == 36                     # every full page but the one holding the last token
    check_attention(cache, batch, s, again, done)
    assert cache.window_page_count(s) <= held_pages_bound(6, len(again) - done)


def test_a_hit_is_cut_where_the_window_pool_lost_the_pages(backend):
    """The windowed layers gave back (and then lost) the pages a window at the full
    hit's end would see: the hit shortens to where both pools hold the K/V."""
    cache = pagedkv.PagedKVCache(2, 2, 16, num_pages=64, page_size=PS, layer_windows=[None, 6],
                                 num_window_pages=16, backend=backend,
                                 enable_prefix_caching=True)
    prompt = list(range(100, 140))                   # 10 pages
    first, _, _ = serve(cache, prompt[:20])          # its pages 0-4 are cached in both pools
    for _ in range(5):                               # decode on: window pages go back
        batch = cache.append([first], 4, token_ids=[0] * 4)
        for layer in range(2):
            cache.store(layer, batch, *kv_for([0] * 4, layer))
    cache.free(first)
    # another sequence churns the window pool: the given-back pages get evicted
    other, _, _ = serve(cache, list(range(500, 560)))
    cache.free(other)
    s, done, batch = serve(cache, prompt[:20] + [1, 2, 3])
    assert done < 20 and done % PS == 0
    check_attention(cache, batch, s, prompt[:20] + [1, 2, 3], done)


def test_prefix_hits_never_return_wrong_k_v_with_windows(backend):
    """Many prompts sharing prefixes, through tight pools with a colliding hash:
    every hit is verified against the dense reference in both pools."""
    cache = pagedkv.PagedKVCache(3, 2, 16, num_pages=64, page_size=PS,
                                 layer_windows=[5, None, 9], num_window_pages=32,
                                 backend=backend, enable_prefix_caching=True,
                                 prefix_hash=lambda parent, tokens: 7)
    rng = np.random.default_rng(11)
    base = list(rng.integers(0, 3, 40))
    for i in range(12):
        prompt = base[:int(rng.integers(5, 40))] + list(rng.integers(0, 3, 3))
        s, done, batch = serve(cache, prompt)
        check_attention(cache, batch, s, prompt, done)
        if i % 3:
            cache.free(s)
        else:               # keep it, decoding a token: its window pages go back
            batch = cache.append([s], 1, token_ids=[0])
            for layer in range(3):
                cache.store(layer, batch, *(x[-1:] for x in kv_for(prompt + [0], layer)))
    cache.clear()
    cache.reset_prefix_cache()
    assert cache.num_free_pages == 64 and cache.num_free_window_pages == 32


# -- bad input ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,fragment", [
    (dict(layer_windows=[4]), ValueError, "layer_windows: expected 2 entries"),
    (dict(layer_windows=[4, 4, 4]), ValueError, "layer_windows: expected 2 entries"),
    (dict(layer_windows=[0, None]), ValueError, r"layer_windows\[0\]"),
    (dict(layer_windows=[None, -2]), ValueError, r"layer_windows\[1\]"),
    (dict(layer_windows=[None, 2.5]), TypeError, r"layer_windows\[1\]"),
    (dict(layer_windows=[True, None]), TypeError, r"layer_windows\[0\]"),
    (dict(layer_windows="44"), TypeError, "layer_windows"),
    (dict(layer_windows=4), TypeError, "layer_windows"),
    (dict(layer_windows={0: None, 1: 4}), ValueError, "layer_windows: expected a list"),
    (dict(layer_windows={5: None, 6: 4}), ValueError, "layer_windows: expected a list"),
    (dict(layer_windows={None, 4}), ValueError, "layer_windows: expected a list"),
    (dict(layer_windows=np.array([[4, 4]])), ValueError, "layer_windows: expected a list"),
    (dict(layer_windows=[4, None], num_window_pages=0), ValueError, "num_window_pages"),
    (dict(layer_windows=[4, None], num_window_pages=1.5), TypeError, "num_window_pages"),
    (dict(layer_windows=[4, None], window_rollback_tokens=0), ValueError,
     "window_rollback_tokens"),
])
def test_bad_window_arguments(backend, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        pagedkv.PagedKVCache(2, 1, 8, num_pages=8, page_size=PS, backend=backend, **kwargs)


@pytest.mark.parametrize("windows", [[None, 4], (None, 4), np.array([None, 4], dtype=object),
                                     np.array([3, 4])])
def test_layer_windows_as_a_list_tuple_or_array(backend, windows):
    cache = pagedkv.PagedKVCache(2, 1, 8, num_pages=8, page_size=PS, backend=backend,
                                 layer_windows=windows)
    assert cache.layer_windows[1] == 4 and type(cache.layer_windows[1]) is int
