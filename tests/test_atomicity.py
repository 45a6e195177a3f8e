"""A failed call changes nothing, whatever raises inside it, on every backend.

Each public call that changes state runs on a cache in a prepared state
while an exception is injected at the N-th Python function call inside
pagedkv (a ``sys.settrace`` hook on "call" events of frames in the package),
for N = 1, 2, ... until the call completes.  That is where the interpreter
raises ``RecursionError``, ``MemoryError`` of a Python-level allocation, or a
``KeyboardInterrupt`` from a signal handler.  After each failure the
observable state (every sequence's length, pages in both pools, K/V of every
held position of every layer, free counts, stats, checkpoints) must equal
what it was; once the call completes, the state must equal that of a twin
cache that ran the call without injection, and a further step must give the
twin's attention output.  A sweep of low recursion limits does the same with
the interpreter's own ``RecursionError``.
"""
import os
import sys

import numpy as np
import pytest

import pagedkv

PACKAGE = os.path.dirname(pagedkv.__file__) + os.sep
LAYERS, H, D, PS = 2, 2, 8, 4
GROUP = 2


class Injected(Exception):
    """What the hook raises (a plain Exception: the library must not swallow it)."""


def make(backend, caching=False):
    return pagedkv.PagedKVCache(LAYERS, H, D, num_pages=40, page_size=PS,
                                layer_windows=[None, 5], num_window_pages=14,
                                window_rollback_tokens=2, backend=backend,
                                enable_prefix_caching=caching)


def kv(seq_id, start, n, layer):
    """Deterministic K and V [n, H, D] of positions start:start+n written by seq_id."""
    pos = np.arange(start, start + n, dtype=np.float32)[:, None, None]
    base = pos * 0.37 + seq_id * 1.9 + layer * 0.61 + np.arange(H * D).reshape(1, H, D) * 0.05
    return np.sin(base).astype(np.float32), np.cos(base * 1.3).astype(np.float32)


def append(cache, seqs, counts, tokens=None):
    return cache.append(seqs, counts, token_ids=tokens)


def store(cache, batch, seqs, counts, layers=range(LAYERS)):
    for layer in layers:
        parts = [kv(s, int(n_after) - n, n, layer)
                 for s, n, n_after in zip(seqs, counts, batch.seq_lens)]
        k = np.concatenate([p[0] for p in parts]) if parts else np.zeros((0, H, D), np.float32)
        v = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, H, D), np.float32)
        cache.store(layer, batch, k, v)


def step(cache, seqs, counts, tokens=None):
    batch = append(cache, seqs, counts, tokens)
    store(cache, batch, seqs, counts)
    return batch


def queries(batch, seed=0):
    return np.random.default_rng(seed).standard_normal(
        (batch.num_tokens, H * GROUP, D), dtype=np.float32)


def snapshot(cache, ctx):
    """Everything a caller can observe of the cache (reading it changes nothing)."""
    seqs = {}
    for s in cache.seq_ids():
        entry = [cache.seq_len(s), cache.is_swapped(s)]
        if not cache.is_swapped(s):
            entry += [cache.page_ids(s).tolist(), cache.window_page_ids(s).tolist()]
            held = np.flatnonzero(cache.window_page_ids(s) >= 0)
            start = int(held[0]) * PS if len(held) else cache.seq_len(s)
            for layer in range(LAYERS):
                k, v = cache.gather(layer, s, 0 if layer == 0 else start)
                entry += [k.tobytes(), v.tobytes()]
        seqs[s] = entry
    stats = cache.stats()
    checkpoints = [(c.seq_id, c.seq_len, c._stamp.valid) for c in ctx.get("checkpoints", ())]
    return seqs, stats, checkpoints


# -- the prepared state and the calls --------------------------------------------------
def base_state(cache, tmp_path):
    """a: 10 tokens; b: a fork of a (a shared, partly filled last page in both
    pools); c: 21 tokens decoded one by one (window pages given back); e:
    swapped out; checkpoints of a; a saved file and an exported sequence."""
    ctx = {}
    a, c, e = cache.add_sequence(), cache.add_sequence(), cache.add_sequence()
    step(cache, [a, c, e], [10, 13, 6])
    for _ in range(8):
        step(cache, [c], [1])
    b = cache.fork(a)
    ctx.update(a=a, b=b, c=c, e=e)
    ctx["checkpoints"] = [cache.checkpoint(a)]
    step(cache, [a], [3])
    ctx["checkpoints"].append(cache.checkpoint(a))
    ctx["exported"] = cache.export_sequence(c)
    path = tmp_path / f"kv-{cache.backend}.safetensors"
    if not path.exists():
        cache.save(path, [a, c])
    ctx["path"] = path
    cache.swap_out(e)
    return ctx


def open_step(cache, ctx):
    """An appended step of a, b and c, stored in layer 0 only (on opencl that
    store may wait, fused, for layer 0's attention)."""
    seqs, counts = [ctx["a"], ctx["b"], ctx["c"]], [2, 1, 3]
    ctx["batch"] = append(cache, seqs, counts)
    ctx["step"] = (seqs, counts)
    store(cache, ctx["batch"], seqs, counts, layers=[0])


def open_step_with_tokens(cache, ctx):
    """With prefix caching: a step of a and c with token ids that fills pages,
    stored in layer 0 only (still open: its pages wait for layer 1)."""
    seqs, counts = [ctx["a"], ctx["c"]], [7, 4]
    ctx["batch"] = append(cache, seqs, counts, tokens=list(range(11)))
    ctx["step"] = (seqs, counts)
    store(cache, ctx["batch"], seqs, counts, layers=[0])


def chains_file(cache, ctx):
    """With prefix caching: a file from another cache holding a sequence of 13
    tokens and its 3 cached pages (none cached here), so that load enters chains."""
    path = ctx["path"].with_name(f"chains-{cache.backend}.safetensors")
    if not path.exists():
        source = make(cache.backend, caching=True)
        s = source.add_sequence()
        step(source, [s], [13], tokens=list(range(200, 213)))
        source.save(path)
    ctx["chains_path"] = path


CACHING = {"append_abandoning_an_open_step_with_tokens", "store_closing_a_step_with_tokens",
           "load_with_prefix_cache"}

CALLS = {
    "append_abandoning_an_open_step_with_tokens": (
        open_step_with_tokens, lambda c, x: append(c, [x["a"], x["b"]], [6, 2],
                                                   tokens=list(range(100, 108)))),
    "store_closing_a_step_with_tokens": (
        open_step_with_tokens, lambda c, x: store(c, x["batch"], *x["step"], layers=[1])),
    "append": (None, lambda c, x: append(c, [x["a"], x["b"], x["c"]], [2, 3, 1])),
    "append_after_open_step": (open_step, lambda c, x: append(c, [x["b"], x["c"]], [5, 1])),
    "store": (open_step, lambda c, x: store(c, x["batch"], *x["step"], layers=[1])),
    "attention": (open_step, lambda c, x: c.attention(0, x["batch"], queries(x["batch"]))),
    "fork": (None, lambda c, x: c.fork(x["b"])),
    "free": (None, lambda c, x: c.free(x["a"])),
    "free_swapped": (None, lambda c, x: c.free(x["e"])),
    "truncate": (None, lambda c, x: c.truncate(x["a"], 9)),
    "restore": (None, lambda c, x: c.restore(x["checkpoints"][0])),
    "clear": (None, lambda c, x: c.clear()),
    "swap_out": (None, lambda c, x: c.swap_out(x["c"])),
    "swap_in": (None, lambda c, x: c.swap_in(x["e"])),
    "import_sequence": (None, lambda c, x: c.import_sequence(x["exported"])),
    "load": (None, lambda c, x: c.load(x["path"])),
    "load_with_prefix_cache": (chains_file, lambda c, x: c.load(x["chains_path"])),
}


def prepare(backend, name, tmp_path):
    cache = make(backend, caching=name in CACHING)
    ctx = base_state(cache, tmp_path)
    setup = CALLS[name][0]
    if setup is not None:
        setup(cache, ctx)
    return cache, ctx


def next_step_output(cache):
    """A step over every live sequence that is not swapped out; its attention, per layer."""
    seqs = [s for s in cache.seq_ids() if not cache.is_swapped(s)]
    batch = step(cache, seqs, [1] * len(seqs))
    return [cache.attention(layer, batch, queries(batch, 1)) for layer in range(LAYERS)]


class Hook:
    """A trace function that raises ``error`` at the n-th call of a function in pagedkv."""

    def __init__(self, n, error):
        self.n, self.error, self.count, self.fired = n, error, 0, False

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            self.count += 1
            if self.count == self.n:
                self.fired = True
                raise self.error(f"injected at call {self.n}")
        return None


def run_injected(call, cache, ctx, hook):
    old = sys.gettrace()
    sys.settrace(hook)
    try:
        return call(cache, ctx)
    finally:
        sys.settrace(old)


def check_call(backend, name, tmp_path, errors, fresh_each_time):
    """Inject at call 1, 2, ... of ``name`` until it completes; see the module notes."""
    call = CALLS[name][1]
    twin, twin_ctx = prepare(backend, name, tmp_path)
    want_before = snapshot(twin, twin_ctx)
    twin_result = call(twin, twin_ctx)
    want_after = snapshot(twin, twin_ctx)
    cache, ctx = prepare(backend, name, tmp_path)
    failures = 0
    for n in range(1, 400):
        error = errors[n % len(errors)]
        if fresh_each_time and n > 1:
            cache, ctx = prepare(backend, name, tmp_path)
        hook = Hook(n, error)
        try:
            result = run_injected(call, cache, ctx, hook)
        except error:
            assert hook.fired
            failures += 1
            assert snapshot(cache, ctx) == want_before, f"{name}: call {n} ({error.__name__})"
            continue
        assert not hook.fired, f"{name}: the error injected at call {n} was swallowed"
        break
    else:
        pytest.fail(f"{name} never completed")
    assert failures > 0
    if isinstance(twin_result, np.ndarray):
        np.testing.assert_array_equal(result, twin_result)
    assert snapshot(cache, ctx) == want_after
    for got, want in zip(next_step_output(cache), next_step_output(twin)):
        np.testing.assert_array_equal(got, want)
    assert snapshot(cache, ctx) == snapshot(twin, twin_ctx)


@pytest.mark.parametrize("name", sorted(set(CALLS) - {"attention", "store",
                                                      "store_closing_a_step_with_tokens",
                                                      "load_with_prefix_cache"}))
def test_an_exception_at_any_call_inside_changes_nothing(backend, name, tmp_path):
    check_call(backend, name, tmp_path, (Injected, KeyboardInterrupt, MemoryError), False)


def test_a_failed_load_with_chains_changes_nothing(backend, tmp_path):
    # load reserves and writes the file's chains, places its sequences, then
    # enters the chains in the prefix cache: a failure anywhere leaves nothing
    check_call(backend, "load_with_prefix_cache", tmp_path,
               (Injected, KeyboardInterrupt, MemoryError), False)


@pytest.mark.parametrize("name", ["attention", "store", "store_closing_a_step_with_tokens"])
def test_an_exception_inside_store_or_attention_loses_no_k_v(backend, name, tmp_path):
    # a fresh cache each time: on opencl a store waits for its layer's attention,
    # and the snapshot's reads would launch it
    check_call(backend, name, tmp_path, (Injected, KeyboardInterrupt, MemoryError), True)


def frame_depth():
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return depth


@pytest.mark.parametrize("name", ["append", "append_after_open_step", "free", "truncate",
                                  "clear", "swap_out", "swap_in", "import_sequence"])
def test_a_recursion_error_at_any_depth_changes_nothing(backend, name, tmp_path):
    call = CALLS[name][1]
    twin, twin_ctx = prepare(backend, name, tmp_path)
    want_before = snapshot(twin, twin_ctx)
    call(twin, twin_ctx)
    want_after = snapshot(twin, twin_ctx)
    cache, ctx = prepare(backend, name, tmp_path)
    limit, failures = sys.getrecursionlimit(), 0
    for extra in range(2, 200):
        depth = frame_depth()
        try:
            sys.setrecursionlimit(depth + extra)
            try:
                call(cache, ctx)
            finally:
                sys.setrecursionlimit(limit)
        except RecursionError:
            failures += 1
            assert snapshot(cache, ctx) == want_before, f"{name}: limit depth + {extra}"
            continue
        break
    assert failures > 0
    assert snapshot(cache, ctx) == want_after
    for got, want in zip(next_step_output(cache), next_step_output(twin)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["append_after_open_step",
                                  "append_abandoning_an_open_step_with_tokens"])
def test_a_failed_append_keeps_the_previous_batch_valid(backend, name, tmp_path):
    # the open step goes on after an append that failed, late (after its tables
    # committed: while preparing the step or copying pages) or early
    call = CALLS[name][1]
    cache, ctx = prepare(backend, name, tmp_path)
    counter = Hook(0, Injected)               # (n = 0: counts calls, never raises)
    run_injected(call, cache, ctx, counter)
    for n in sorted({counter.count, counter.count - 1, counter.count - 3, counter.count // 2}):
        cache, ctx = prepare(backend, name, tmp_path)
        batch, (seqs, counts) = ctx["batch"], ctx["step"]
        with pytest.raises(Injected):
            run_injected(call, cache, ctx, Hook(n, Injected))
        store(cache, batch, seqs, counts, layers=[1])
        twin, twin_ctx = prepare(backend, name, tmp_path)
        store(twin, twin_ctx["batch"], seqs, counts, layers=[1])
        for layer in range(LAYERS):
            np.testing.assert_array_equal(cache.attention(layer, batch, queries(batch)),
                                          twin.attention(layer, twin_ctx["batch"],
                                                         queries(twin_ctx["batch"])))
        assert snapshot(cache, ctx) == snapshot(twin, twin_ctx)
