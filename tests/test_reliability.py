"""What a busy or hostile engine does: threads, forks, callbacks that misbehave,
tables edited in place, sizes that cannot work.  On every backend."""
import copy
import os
import pickle
import sys
import textwrap
import threading

import numpy as np
import pytest

import pagedkv
from python_child import run_python
from reference import TOLERANCE, Harness, dense_attention


def small_cache(backend, **kwargs):
    args = dict(num_pages=64, page_size=4, backend=backend)
    args.update(kwargs)
    return pagedkv.PagedKVCache(2, 2, 16, **args)


def kv(n, rng):
    return rng.standard_normal((2, n, 2, 16), dtype=np.float32)


# -- threads ---------------------------------------------------------------------------

def thread_workload(cache, seed, steps=60):
    """Own sequences: add, append, store, attention, truncate, free.  Returns the
    attention outputs and the final gathered K/V of the surviving sequence."""
    rng = np.random.default_rng(seed)
    outputs = []
    keep = cache.add_sequence()
    for _ in range(steps):
        s = cache.add_sequence()
        for seqs, n in (([keep, s], 3), ([keep, s], 1)):
            batch = cache.append(seqs, n)
            for layer in range(2):
                k, v = kv(batch.num_tokens, rng)
                cache.store(layer, batch, k, v)
                q = rng.standard_normal((batch.num_tokens, 4, 16), dtype=np.float32)
                outputs.append(cache.attention(layer, batch, q))
        cache.truncate(keep, cache.seq_len(keep) - 2)
        cache.free(s)
    return outputs, [cache.gather(layer, keep) for layer in range(2)]


def run_in_threads(target, args_list):
    results, errors = [None] * len(args_list), []

    def run(i):
        try:
            results[i] = target(*args_list[i])
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def test_threads_with_caches_of_their_own_equal_a_serial_run(backend):
    """Kernels run without the GIL, and on opencl the caches of one device share
    their kernel objects: threads must not mix each other's arguments."""
    seeds = [1, 2, 3, 4]
    serial = [thread_workload(small_cache(backend, num_pages=256), seed) for seed in seeds]
    caches = [small_cache(backend, num_pages=256) for _ in seeds]
    parallel = run_in_threads(thread_workload, [(c, s) for c, s in zip(caches, seeds)])
    for (out_s, kv_s), (out_p, kv_p) in zip(serial, parallel):
        for a, b in zip(out_s, out_p):
            np.testing.assert_array_equal(a, b)
        for (ka, va), (kb, vb) in zip(kv_s, kv_p):
            np.testing.assert_array_equal(ka, kb)
            np.testing.assert_array_equal(va, vb)


def pool_churn(cache, seed, steps=300):
    """Adds, appends, truncates and frees on a shared cache, each thread on its own
    sequences (pages only: a step's stores belong to the step's one caller).
    Returns this thread's surviving sequences, in the order it made them."""
    rng = np.random.default_rng(seed)
    mine = []
    for _ in range(steps):
        if len(mine) < 3 or rng.random() < 0.5:
            mine.append(cache.add_sequence())
        cache.append([mine[int(rng.integers(len(mine)))]], int(rng.integers(1, 9)))
        if rng.random() < 0.4:
            s = mine.pop(int(rng.integers(len(mine))))
            if rng.random() < 0.5:
                cache.truncate(s, cache.seq_len(s) // 2)
                mine.insert(0, s)
            else:
                cache.free(s)
    return mine


def test_threads_sharing_one_pool_keep_it_consistent(backend):
    seeds = range(4)
    serial_cache = small_cache(backend, num_pages=4000)
    serial = [[serial_cache.seq_len(s) for s in pool_churn(serial_cache, seed)]
              for seed in seeds]
    cache = small_cache(backend, num_pages=4000)
    survivors = run_in_threads(pool_churn, [(cache, seed) for seed in seeds])
    assert [[cache.seq_len(s) for s in group] for group in survivors] == serial
    live = [s for group in survivors for s in group]
    assert sorted(live) == cache.seq_ids()
    counts = np.zeros(cache.num_pages, dtype=int)
    for s in live:
        np.add.at(counts, cache.page_ids(s), 1)
        assert cache.page_count(s) == -(-cache.seq_len(s) // cache.page_size)
    assert list(cache._allocator.refcount(np.arange(cache.num_pages))) == list(counts)
    assert cache.num_free_pages == int((counts == 0).sum()) == serial_cache.num_free_pages
    cache.clear()
    assert cache.num_free_pages == cache.num_pages


def test_one_batch_read_from_several_threads(backend):
    rng = np.random.default_rng(5)
    cache = small_cache(backend)
    seqs = [cache.add_sequence() for _ in range(3)]
    batch = cache.append(seqs, [9, 4, 13])
    for layer in range(2):
        cache.store(layer, batch, *kv(batch.num_tokens, rng))
    queries = [rng.standard_normal((26, 4, 16), dtype=np.float32) for _ in range(6)]
    expected = [cache.attention(i % 2, batch, q) for i, q in enumerate(queries)]

    def read(i):
        return [cache.attention(i % 2, batch, queries[i]) for _ in range(25)]

    results = run_in_threads(read, [(i,) for i in range(6)])
    for i, outs in enumerate(results):
        for out in outs:
            np.testing.assert_array_equal(out, expected[i])


# -- forked processes ----------------------------------------------------------------------

FORK_SCRIPT = textwrap.dedent("""
    import os, sys, numpy as np, pagedkv
    backend, mode = sys.argv[1], sys.argv[2]

    def run(cache):
        s = cache.add_sequence()
        batch = cache.append([s], 300)
        k = np.linspace(-1, 1, 300 * 2 * 64, dtype=np.float32).reshape(300, 2, 64)
        cache.store(0, batch, k, k)
        return float(cache.attention(0, batch, np.ones((300, 8, 64), np.float32)).sum())

    parent = pagedkv.PagedKVCache(1, 2, 64, num_pages=64, backend=backend)
    expected = run(parent)
    pid = os.fork()
    if pid == 0:
        try:
            cache = parent if mode == "inherited" else \\
                pagedkv.PagedKVCache(1, 2, 64, num_pages=64, backend=backend)
            got = run(cache)
            print("child ok" if abs(got - expected) < 1e-3 * abs(expected) else "child WRONG")
        except (RuntimeError, pagedkv.BackendUnavailableError) as exc:
            print("child refused:", exc)
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
@pytest.mark.parametrize("mode", ["inherited", "new"])
def test_a_forked_child_works_or_fails_clearly(backend, mode):
    """After the parent ran kernels, a fork()ed child never hangs: it computes the
    right result, or refuses with an error that says how to do it instead."""
    result = run_python(FORK_SCRIPT, backend, mode)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line == "child ok" or (line.startswith("child refused:") and "spawn" in line), line


# -- callbacks and re-entrancy -------------------------------------------------------------

def prefix_cache(backend, prefix_hash):
    return small_cache(backend, enable_prefix_caching=True, prefix_hash=prefix_hash)


def serve(cache, prompt, rng):
    s = cache.add_sequence(token_ids=prompt)
    done = cache.seq_len(s)
    batch = cache.append([s], len(prompt) - done, token_ids=prompt[done:])
    for layer in range(2):
        cache.store(layer, batch, *kv(batch.num_tokens, rng))
    return s


def test_a_raising_prefix_hash_leaks_nothing(backend):
    calls = {"n": 0, "fail_after": 10**9}

    def flaky(parent, tokens):
        calls["n"] += 1
        if calls["n"] > calls["fail_after"]:
            raise RuntimeError("hash service down")
        return hash((parent, tokens))

    rng = np.random.default_rng(0)
    cache = prefix_cache(backend, flaky)
    prompt = list(range(40))
    serve(cache, prompt, rng)
    before = (cache.num_free_pages, cache.seq_ids())
    calls["fail_after"] = calls["n"] + 3             # fails part way through the chain
    with pytest.raises(RuntimeError, match="hash service down"):
        cache.add_sequence(token_ids=prompt + [99])
    assert (cache.num_free_pages, cache.seq_ids()) == before
    cache.clear()
    cache.reset_prefix_cache()
    assert cache.num_free_pages == cache.num_pages


def test_a_prefix_hash_returning_none_is_a_clear_error(backend):
    cache = prefix_cache(backend, lambda parent, tokens: None)
    with pytest.raises(TypeError, match="prefix_hash: expected it to return an int"):
        cache.add_sequence(token_ids=list(range(10)))
    assert cache.seq_ids() == [] and cache.num_free_pages == cache.num_pages


def test_a_prefix_hash_that_touches_the_cache_is_refused(backend):
    victims = []

    def meddling(parent, tokens):
        if victims:
            cache.free(victims[0])      # would free the sequence being appended
        return hash((parent, tokens))

    cache = prefix_cache(backend, meddling)
    s = cache.add_sequence()
    victims.append(s)
    with pytest.raises(RuntimeError, match="inside another call on this cache"):
        cache.append([s], 8, token_ids=list(range(8)))
    assert cache.seq_ids() == [s] and cache.seq_len(s) == 0
    assert cache.num_free_pages == cache.num_pages
    victims.clear()
    cache.append([s], 8, token_ids=list(range(8)))    # still works
    assert cache.seq_len(s) == 8


def test_arrays_changed_by_a_callback_after_validation_change_nothing(backend):
    counts = np.array([8, 4])

    def mutating(parent, tokens):
        counts[:] = 10**6               # after append validated them
        return hash((parent, tokens))

    cache = prefix_cache(backend, mutating)
    a, b = cache.add_sequence(), cache.add_sequence()
    batch = cache.append(np.array([a, b]), counts, token_ids=list(range(12)))
    assert batch.num_tokens == 12 and cache.seq_len(a) == 8 and cache.seq_len(b) == 4


# -- tables the kernels trust ----------------------------------------------------------------

def test_step_tables_are_read_only_copies(backend):
    rng = np.random.default_rng(1)
    cache = small_cache(backend)
    s = cache.add_sequence()
    batch = cache.append([s], 5)
    for name in ("slot_mapping", "query_start", "seq_lens", "page_indptr", "page_indices",
                 "last_page_len", "block_table", "seq_ids"):
        array = getattr(batch, name)
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 10**6
        array.setflags(write=True)      # an engine that insists edits only its copy
        array[...] = 10**6
    k, v = kv(5, rng)
    for layer in range(2):
        cache.store(layer, batch, k, v)
    q = rng.standard_normal((5, 4, 16), dtype=np.float32)
    np.testing.assert_allclose(cache.attention(0, batch, q),
                               dense_attention(q, k, v, np.arange(5)), **TOLERANCE["float32"])
    got_k, _ = cache.gather(0, s)
    np.testing.assert_array_equal(got_k, k)


class LyingShape(np.ndarray):
    """An array whose ``shape`` attribute claims more than its buffer holds."""

    @property
    def shape(self):
        return (64, 2, 16)


def test_an_array_whose_shape_lies_is_checked_by_its_buffer(backend):
    cache = small_cache(backend)
    s = cache.add_sequence()
    batch = cache.append([s], 64)
    liar = np.zeros((1, 2, 16), np.float32).view(LyingShape)
    with pytest.raises(ValueError, match=r"k: expected shape \[64, 2, 16\], got \[1, 2, 16\]"):
        cache.store(0, batch, liar, liar)


# -- sizes and memory ------------------------------------------------------------------------

def test_a_cache_larger_than_the_machine_is_refused(backend):
    from pagedkv._memory import memory_limit
    limit, what = memory_limit()
    if limit is None:
        pytest.skip("this platform does not say how much memory it has")
    pages = limit // (2 * 4 * 1024 * 16) + 1       # float32, 1 layer, 4 heads x 256 dims x 16
    with pytest.raises(MemoryError, match="num_pages: .* more than this machine's"):
        pagedkv.PagedKVCache(1, 4, 256, num_pages=pages, page_size=16, backend=backend)


def test_bookkeeping_of_a_huge_page_count_is_refused_before_allocating(backend):
    with pytest.raises(MemoryError, match="num_pages"):
        pagedkv.PagedKVCache(1, 1, 1, num_pages=2**31 - 1, page_size=1, backend=backend)


LIMITED_SCRIPT = textwrap.dedent("""
    import resource, sys, pagedkv
    backend = sys.argv[1]
    pagedkv.PagedKVCache(1, 1, 8, num_pages=4, backend=backend)    # the driver is up
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.RLIM_INFINITY))
    try:
        pagedkv.PagedKVCache(4, 8, 128, num_pages=16384, page_size=16, backend=backend)  # 8 GiB
    except MemoryError as exc:
        print("MemoryError:", exc)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux's")
def test_an_address_space_limit_gives_memory_error_not_a_crash(backend):
    result = run_python(LIMITED_SCRIPT, backend)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("MemoryError: num_pages"), result.stdout


# -- smaller contract points -----------------------------------------------------------------

def test_read_only_and_numpy_id_arrays_work(backend):
    cache = small_cache(backend)
    ids = np.array([cache.add_sequence(), cache.add_sequence()])
    ids.setflags(write=False)
    counts = np.array([3, 2])
    counts.setflags(write=False)
    batch = cache.append(ids, counts)
    assert batch.num_tokens == 5
    cache.checkpoint(np.int64(ids[0]))


@pytest.mark.parametrize("call,exc,fragment", [
    (lambda c, s: c.checkpoint(np.array([s])), KeyError, "seq_id"),
    (lambda c, s: c.checkpoint("0"), KeyError, "seq_id"),
    (lambda c, s: c.append([True, s], 1), TypeError, "seq_ids: expected ints, got a bool"),
    (lambda c, s: c.append([s, [s]], 1), ValueError, "seq_ids"),
    (lambda c, s: c.append([s], [[1, 2], [3]]), ValueError, "num_new_tokens"),
    (lambda c, s: c.append([s], 1, token_ids=[[1]]), ValueError, "token_ids"),
])
def test_malformed_ids_name_the_argument(backend, call, exc, fragment):
    cache = small_cache(backend)
    s = cache.add_sequence()
    with pytest.raises(exc, match=fragment):
        call(cache, s)
    assert cache.seq_ids() == [s] and cache.seq_len(s) == 0


def test_a_checkpoint_restores_only_on_its_own_cache(backend):
    a, b = small_cache(backend), small_cache(backend)
    sa, sb = a.add_sequence(), b.add_sequence()
    a.append([sa], 5)
    b.append([sb], 9)
    ck = a.checkpoint(sa)
    with pytest.raises(ValueError, match="another cache"):
        b.restore(ck)
    assert b.seq_len(sb) == 9


def test_a_checkpoint_cannot_lie_after_truncation_and_regrowth(backend):
    h = Harness(small_cache(backend), num_heads=4)
    s = h.add()
    h.step([s], 10)
    ck = h.cache.checkpoint(s)
    later = h.cache.checkpoint(s)
    h.step([s], 3)
    h.truncate(s, 8)                     # below the checkpoint ...
    h.step([s], 6)                       # ... and past it again: other tokens at 8, 9
    with pytest.raises(ValueError, match="truncated below"):
        h.cache.restore(ck)
    with pytest.raises(ValueError, match="truncated below"):
        h.cache.restore(later)
    assert h.cache.seq_len(s) == 14
    fresh = h.cache.checkpoint(s)
    h.step([s], 2)
    h.restore(fresh)                     # a rollback that is still true works
    h.check_contents()


def test_copies_of_a_checkpoint_are_voided_with_it(backend):
    # (issue 22, item 5: a deep copy still restored after truncation and regrowth)
    h = Harness(small_cache(backend), num_heads=4)
    s = h.add()
    h.step([s], 10)
    ck = h.cache.checkpoint(s)
    copies = [copy.copy(ck), copy.deepcopy(ck), copy.deepcopy([ck])[0]]
    assert all(c == ck for c in copies)
    with pytest.raises(TypeError, match="Checkpoint cannot be pickled"):
        pickle.dumps(ck)
    h.step([s], 3)
    h.truncate(s, 8)
    h.step([s], 6)
    for c in [ck] + copies:
        with pytest.raises(ValueError, match="truncated below"):
            h.cache.restore(c)
    assert h.cache.seq_len(s) == 14
    fresh = copy.deepcopy(h.cache.checkpoint(s))
    h.step([s], 2)
    h.restore(fresh)
    h.check_contents()


def test_a_cache_cannot_be_copied_or_pickled(backend):
    cache = small_cache(backend)
    for make_copy in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be"):
            make_copy(cache)
