"""Per-process state (``pagedkv._process``): the OpenCL contexts and programs a
process shares between its caches, clearing them, and what a ``fork()``ed child
starts with."""
import gc
import os
import textwrap
import weakref

import numpy as np
import pytest

import pagedkv
from pagedkv import _process
from opencl_devices import TEST_DEVICES
from python_child import run_python
from reference import TOLERANCE, dense_attention

HAS_OPENCL = "opencl" in pagedkv.available_backends()
needs_opencl = pytest.mark.skipif(not HAS_OPENCL, reason="no usable OpenCL device")


def run_step(cache, rng):
    """One 20-token prefill on layer 0 of ``cache``; (output, NumPy reference)."""
    s = cache.add_sequence()
    batch = cache.append([s], 20)
    k = rng.standard_normal((20, 2, 32), dtype=np.float32)
    v = rng.standard_normal((20, 2, 32), dtype=np.float32)
    q = rng.standard_normal((20, 4, 32), dtype=np.float32)
    cache.store(0, batch, k, v)
    return cache.attention(0, batch, q), dense_attention(q, k, v, np.arange(20))


def opencl_cache(device=None):
    """A small opencl cache on ``device`` (default: the primary OpenCL test device)."""
    return pagedkv.PagedKVCache(1, 2, 32, num_pages=8, page_size=16, backend="opencl",
                                device=TEST_DEVICES[0].device if device is None else device)


@needs_opencl
def test_programs_of_an_unreferenced_context_are_released():
    """The program cache keys contexts weakly: a caller's context, once its caches and
    the caller let go of it, is released together with its programs."""
    import pyopencl as cl
    context = cl.Context([TEST_DEVICES[0].device])
    cache = opencl_cache(context)
    out, expected = run_step(cache, np.random.default_rng(0))
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])
    assert _process.opencl.programs[context]            # built for this context
    gone = weakref.ref(context)
    del cache, context
    gc.collect()
    assert gone() is None
    assert all(c() is not None for c in _process.opencl.programs.keyrefs())


@needs_opencl
def test_clear_caches_empties_them_and_the_next_cache_rebuilds():
    first = opencl_cache()
    first_context = first._backend.context
    _process.clear_caches()
    assert not _process.opencl.contexts and not _process.opencl.programs
    rng = np.random.default_rng(1)
    out, expected = run_step(first, rng)                 # a live cache keeps its kernels
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])
    second = opencl_cache()
    assert second._backend.context is not first_context
    assert list(_process.opencl.contexts.values()) == [second._backend.context]
    assert _process.opencl.programs[second._backend.context]
    out, expected = run_step(second, rng)
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])


FORK_SCRIPT = textwrap.dedent("""
    import os, sys, threading, numpy as np, pagedkv
    from pagedkv import _process
    backend = sys.argv[1]

    def attention(cache):
        s = cache.add_sequence()
        batch = cache.append([s], 40)
        k = np.linspace(-1, 1, 40 * 2 * 64, dtype=np.float32).reshape(40, 2, 64)
        cache.store(0, batch, k, k)
        return cache.attention(0, batch, np.ones((40, 8, 64), np.float32))

    def reference():
        k = np.linspace(-1, 1, 40 * 2 * 64).reshape(40, 2, 64).repeat(4, axis=1)
        scores = np.einsum("qhd,khd->hqk", np.ones((40, 8, 64)), k) / 8.0
        scores[:, np.triu(np.ones((40, 40), bool), 1)] = -np.inf
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", weights, k)

    inside, release = threading.Event(), threading.Event()

    def blocking_hash(parent, tokens):
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            release.wait()
        return hash((parent, tokens))

    # the parent runs parallel host kernels, and a thread holds the host cache's lock
    host = pagedkv.PagedKVCache(1, 2, 64, num_pages=64, backend="host",
                                enable_prefix_caching=True, prefix_hash=blocking_hash)
    attention(host)
    holder = threading.Thread(target=host.add_sequence, kwargs={"token_ids": [7] * 20})
    holder.start()
    inside.wait()
    assert not _process.opencl.driver_started
    pid = os.fork()
    if pid == 0:
        try:
            ok = _process.in_forked_child() and not _process.opencl.contexts
            ok = ok and np.allclose(attention(host), reference(), atol=1e-3)   # lock is free
            fresh = pagedkv.PagedKVCache(1, 2, 64, num_pages=64, backend=backend)
            ok = ok and np.allclose(attention(fresh), reference(), atol=1e-3)
            print("child ok" if ok else "child WRONG")
        except BaseException as exc:
            print("child failed:", repr(exc))
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    release.set()
    holder.join()
    print("parent ok" if not _process.in_forked_child() else "parent WRONG")
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_starts_with_fresh_process_state(backend):
    """A child forked while another thread held a cache's lock, after parallel host
    kernels and before any OpenCL use: the inherited cache's lock is free, and a new
    cache works on either backend."""
    result = run_python(FORK_SCRIPT, backend)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["child ok", "parent ok"], result.stdout
