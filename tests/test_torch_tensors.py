"""torch CPU tensors and other CPU ``__dlpack__`` arrays in ``store`` and ``attention``.

On every backend: float16, bfloat16, float32 and float64 tensors, contiguous
or strided views, give what the same values give as numpy arrays and what
the dense NumPy reference computes; ``attention`` answers a torch ``q`` with
a float32 torch tensor; a float32 contiguous tensor is read in place and the
output tensor is the buffer the kernels fill; ``sinks`` may be a tensor;
tensors the cache cannot read are errors that say what to do.

torch is optional: without it these tests skip.  CI (``$CI`` set) installs
torch's CPU build, and there ``test_ci_has_torch`` fails without it, as a
missing OpenCL device fails CI.  ``import pagedkv`` must never import torch.
"""
import os
import textwrap

import numpy as np
import pytest

import pagedkv
from pagedkv._arrays import to_numpy
from python_child import run_python
from reference import TOLERANCE, ReferenceCache

TORCH_DTYPES = ["float16", "bfloat16", "float32", "float64"]
LAYOUTS = ["contiguous", "transposed", "sliced"]
NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 2, 2, 16, 4
NUM_HEADS = NUM_KV_HEADS * GROUP


def _import_torch():
    try:
        import torch
    except ImportError as exc:
        return None, str(exc)
    return torch, None


@pytest.fixture
def torch():
    """The torch module, or a skip without it (``test_ci_has_torch`` fails in CI then)."""
    module, reason = _import_torch()
    if module is None:
        pytest.skip(f"torch is not installed ({reason}); CI installs its CPU build")
    return module


@pytest.mark.skipif(not os.environ.get("CI"),
                    reason="torch is optional here; only CI must have it (CI is not set)")
def test_ci_has_torch():
    module, reason = _import_torch()
    assert module is not None, (f"CI must have torch: the README's test command installs its "
                                f"CPU build (torch==2.13.0); {reason}")


def make_cache(backend, num_layers=1):
    return pagedkv.PagedKVCache(num_layers, NUM_KV_HEADS, HEAD_DIM, num_pages=32,
                                page_size=PAGE_SIZE, backend=backend)


def tensor(torch, values, dtype, layout):
    """A torch tensor of ``dtype`` holding ``values`` (float32 ndarray [N, H, D]) rounded
    to ``dtype``, laid out as ``layout``: "contiguous", "transposed" (a view of an
    [H, N, D] buffer) or "sliced" (every other element of a larger buffer, at an offset)."""
    dt = getattr(torch, dtype)
    if layout == "contiguous":
        t = torch.from_numpy(values).to(dt)
    elif layout == "transposed":
        t = torch.from_numpy(np.ascontiguousarray(values.transpose(1, 0, 2))).to(dt).transpose(0, 1)
    else:
        n, h, d = values.shape
        big = torch.zeros((n + 1, h, 2 * d + 1), dtype=dt)
        big[1:, :, 1::2] = torch.from_numpy(values).to(dt)
        t = big[1:, :, 1::2]
    assert t.shape == values.shape and t.dtype == dt
    assert t.is_contiguous() == (layout == "contiguous")
    return t


def values_of(t):
    """The float32 values the kernels read from tensor ``t`` (exact for every float dtype
    here but float64, which the cache rounds to float32 as numpy's astype does)."""
    return t.double().numpy().astype(np.float32)


class CpuArray:
    """Not numpy, not torch: a CPU array that only speaks DLPack (as JAX's CPU arrays
    or an engine's own buffer type may); ``device`` is what it reports as its
    DLPack device, ``(1, 0)`` the CPU; ``capsule(**kwargs)``, if given, is what
    its ``__dlpack__`` does instead of exporting the array."""

    def __init__(self, array, device=(1, 0), capsule=None):
        self._array, self._device, self._capsule = array, device, capsule

    def __dlpack__(self, **kwargs):
        if self._capsule is not None:
            return self._capsule(**kwargs)
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device


def steps(rng, counts_per_step):
    """Random K/V/Q float32 arrays for each step of ``counts_per_step``."""
    out = []
    for counts in counts_per_step:
        n = sum(counts)
        out.append(tuple(rng.standard_normal((n, h, HEAD_DIM), dtype=np.float32)
                         for h in (NUM_KV_HEADS, NUM_KV_HEADS, NUM_HEADS)))
    return out


# ragged prefill across page boundaries, then a decode step and a short chunk
COUNTS = [[5, 9, 1], [1, 1, 1], [3, 0, 2]]


def twin_caches(backend):
    """Two fresh caches and a ReferenceCache, each with the same len(COUNTS[0]) sequences."""
    first, second = make_cache(backend), make_cache(backend)
    ref = ReferenceCache(1, NUM_KV_HEADS, HEAD_DIM)
    seqs = [first.add_sequence() for _ in COUNTS[0]]
    assert [second.add_sequence() for _ in COUNTS[0]] == seqs
    for s in seqs:
        ref.add(s)
    return first, second, ref, seqs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_tensors_give_what_numpy_and_the_reference_give(backend, torch, dtype, layout):
    rng = np.random.default_rng(1)
    with_torch, with_numpy, ref, seqs = twin_caches(backend)
    for counts, (k, v, q) in zip(COUNTS, steps(rng, COUNTS)):
        kt, vt, qt = (tensor(torch, a, dtype, layout) for a in (k, v, q))
        k32, v32, q32 = (values_of(t) for t in (kt, vt, qt))
        bt, bn = with_torch.append(seqs, counts), with_numpy.append(seqs, counts)
        with_torch.store(0, bt, kt, vt)
        # the numpy path: the same values as numpy arrays of the same dtype
        # (float32 for bfloat16, which numpy lacks)
        as_np = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
        with_numpy.store(0, bn, *(t.double().numpy().astype(as_np) for t in (kt, vt)))
        ref.store(0, seqs, counts, k32, v32)

        out = with_torch.attention(0, bt, qt)
        assert isinstance(out, torch.Tensor)
        assert out.dtype == torch.float32 and out.device.type == "cpu"
        assert tuple(out.shape) == tuple(qt.shape)
        expected = with_numpy.attention(0, bn, qt.double().numpy().astype(as_np))
        assert isinstance(expected, np.ndarray)
        np.testing.assert_array_equal(out.numpy(), expected)
        np.testing.assert_allclose(out.numpy(), ref.attention(0, seqs, counts, q32),
                                   **TOLERANCE["float32"])
    for s in seqs:        # store wrote exactly the tensors' values
        k, v = with_torch.gather(0, s)
        np.testing.assert_array_equal(k, ref.k[s][0])
        np.testing.assert_array_equal(v, ref.v[s][0])


def test_returned_types_and_mixed_inputs(backend, torch):
    rng = np.random.default_rng(2)
    cache = make_cache(backend)
    s = cache.add_sequence()
    batch = cache.append([s], 6)
    k, v, q = steps(rng, [[6]])[0]
    cache.store(0, batch, torch.from_numpy(k), v)          # torch k beside numpy v
    from_numpy = cache.attention(0, batch, q)
    assert type(from_numpy) is np.ndarray and from_numpy.dtype == np.float32
    from_torch = cache.attention(0, batch, torch.from_numpy(q).half())
    assert type(from_torch) is torch.Tensor and from_torch.dtype == torch.float32
    np.testing.assert_array_equal(from_torch.numpy(), cache.attention(0, batch, q.astype(np.float16)))
    np.testing.assert_array_equal(from_numpy, cache.attention(0, batch, torch.from_numpy(q)))

    empty = cache.append([s], 0)                          # a step with no new tokens
    cache.store(0, empty, torch.zeros(0, NUM_KV_HEADS, HEAD_DIM),
                torch.zeros(0, NUM_KV_HEADS, HEAD_DIM))
    out = cache.attention(0, empty, torch.zeros(0, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16))
    assert type(out) is torch.Tensor and out.dtype == torch.float32
    assert tuple(out.shape) == (0, NUM_HEADS, HEAD_DIM)


def _pointer(array):
    return array.__array_interface__["data"][0]


def test_float32_tensor_is_read_in_place_and_output_filled_in_place(backend, torch, monkeypatch):
    rng = np.random.default_rng(3)
    k, v, q = (torch.from_numpy(a) for a in steps(rng, [[7]])[0])
    view = to_numpy("k", k)                    # shares the tensor's memory: no copy
    assert isinstance(view, np.ndarray) and _pointer(view) == k.data_ptr()
    k[0, 0, 0] = 42.0
    assert view[0, 0, 0] == 42.0
    strided = k.transpose(0, 1)                # a strided view stays a view too
    assert _pointer(to_numpy("k", strided)) == strided.data_ptr()

    cache = make_cache(backend)
    seen = {}
    real_store, real_attention = cache._backend.store, cache._backend.attention

    def store(layer, tables, k_arg, v_arg):
        seen["k"], seen["v"] = _pointer(k_arg), _pointer(v_arg)
        return real_store(layer, tables, k_arg, v_arg)

    def attention(layer, tables, q_arg, spec, out=None):
        seen["q"], seen["out"] = _pointer(q_arg), out
        return real_attention(layer, tables, q_arg, spec, out=out)

    monkeypatch.setattr(cache._backend, "store", store)
    monkeypatch.setattr(cache._backend, "attention", attention)
    s = cache.add_sequence()
    batch = cache.append([s], 7)
    cache.store(0, batch, k, v)
    out = cache.attention(0, batch, q)
    # the backend got the tensors' own memory ...
    assert (seen["k"], seen["v"], seen["q"]) == (k.data_ptr(), v.data_ptr(), q.data_ptr())
    # ... and wrote the result into the returned tensor's memory, not into a copy
    assert seen["out"] is not None and _pointer(seen["out"]) == out.data_ptr()
    assert out.is_contiguous() and out.numpy().any()
    kg, _ = cache.gather(0, s)
    np.testing.assert_array_equal(kg, k.numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_sinks_as_a_tensor(backend, torch, dtype):
    rng = np.random.default_rng(4)
    cache = make_cache(backend)
    ref = ReferenceCache(1, NUM_KV_HEADS, HEAD_DIM)
    s = cache.add_sequence()
    ref.add(s)
    batch = cache.append([s], 9)
    k, v, q = steps(rng, [[9]])[0]
    cache.store(0, batch, k, v)
    ref.store(0, [s], [9], k, v)
    # every other entry of a longer tensor: strided, and not float32 for two dtypes
    sinks = torch.from_numpy(rng.standard_normal(2 * NUM_HEADS).astype(np.float32) * 2)
    sinks = sinks.to(getattr(torch, dtype))[::2]
    sinks32 = values_of(sinks)
    out = cache.attention(0, batch, q, sinks=sinks)
    np.testing.assert_array_equal(out, cache.attention(0, batch, q, sinks=sinks32))
    np.testing.assert_array_equal(out, cache.attention(0, batch, q, sinks=CpuArray(sinks32)))
    np.testing.assert_allclose(out, ref.attention(0, [s], [9], q, sinks=sinks32),
                               **TOLERANCE["float32"])
    assert not np.allclose(out, cache.attention(0, batch, q))   # the sinks did something


def test_other_cpu_dlpack_arrays_work_like_numpy(backend):
    rng = np.random.default_rng(5)
    cache, plain, ref, seqs = twin_caches(backend)
    for counts, (k, v, q) in zip(COUNTS, steps(rng, COUNTS)):
        strided_v = np.repeat(v, 2, axis=2)[:, :, ::2]          # a strided float32 view
        half_q = q.astype(np.float16)
        b, bp = cache.append(seqs, counts), plain.append(seqs, counts)
        cache.store(0, b, CpuArray(k), CpuArray(strided_v))
        plain.store(0, bp, k, v)
        ref.store(0, seqs, counts, k, v)
        out = cache.attention(0, b, CpuArray(half_q))
        assert type(out) is np.ndarray and out.dtype == np.float32 and out.shape == q.shape
        np.testing.assert_array_equal(out, plain.attention(0, bp, half_q))
        np.testing.assert_allclose(out, ref.attention(0, seqs, counts, half_q),
                                   **TOLERANCE["float32"])
    assert _pointer(to_numpy("k", CpuArray(k))) == _pointer(k)    # read in place


def _ready(backend):
    """A cache with one stored step of 3 tokens, and that step's batch."""
    cache = make_cache(backend)
    s = cache.add_sequence()
    batch = cache.append([s], 3)
    kv = np.ones((3, NUM_KV_HEADS, HEAD_DIM), np.float32)
    cache.store(0, batch, kv, kv)
    return cache, s, batch


def _raises(exc):
    """A ``__dlpack__`` that raises ``exc``."""
    def dlpack(**kwargs):
        raise exc
    return dlpack


# case -> (make(torch, shape) -> bad value, exception, fragment of its message)
BAD = {
    "requires grad": (lambda torch, shape: torch.zeros(shape, requires_grad=True),
                      ValueError, ".detach()"),
    "meta device": (lambda torch, shape: torch.zeros(shape, device="meta"), ValueError, ".cpu()"),
    "GPU DLPack": (lambda torch, shape: CpuArray(np.zeros(shape, np.float32), device=(2, 0)),
                   ValueError, "not the CPU"),
    # a lying __dlpack_device__, a bad capsule, a raising __dlpack__
    "DLPack device not ints": (lambda torch, shape: CpuArray(np.zeros(shape), device=("cpu", 0)),
                               TypeError, "__dlpack_device__() gave no (device_type, device_id)"),
    "DLPack device None": (lambda torch, shape: CpuArray(np.zeros(shape), device=None),
                           TypeError, "__dlpack_device__() gave no (device_type, device_id)"),
    "DLPack bad capsule": (lambda torch, shape: CpuArray(np.zeros(shape),
                                                         capsule=lambda **kw: object()),
                           TypeError, "numpy cannot read this CpuArray through DLPack"),
    "DLPack raises KeyError": (lambda torch, shape: CpuArray(np.zeros(shape),
                                                             capsule=_raises(KeyError("stream"))),
                               TypeError, "through DLPack (KeyError: 'stream')"),
    "DLPack raises IndexError": (lambda torch, shape: CpuArray(np.zeros(shape),
                                                               capsule=_raises(IndexError("0"))),
                                 TypeError, "through DLPack (IndexError: 0)"),
    "wrong shape": (lambda torch, shape: torch.zeros(shape[:-1] + (shape[-1] + 1,)),
                    ValueError, "expected shape"),
    "sparse": (lambda torch, shape: torch.zeros(shape).to_sparse(), TypeError, ".to_dense()"),
    "float8": (lambda torch, shape: torch.zeros(shape, dtype=torch.float8_e4m3fn),
               TypeError, "float8_e4m3fn"),
    "complex": (lambda torch, shape: torch.zeros(shape, dtype=torch.complex64),
                TypeError, "float"),
}
SHAPES = {"k": (3, NUM_KV_HEADS, HEAD_DIM), "v": (3, NUM_KV_HEADS, HEAD_DIM),
          "q": (3, NUM_HEADS, HEAD_DIM), "sinks": (NUM_HEADS,)}


@pytest.mark.parametrize("argument", ["k", "v", "q", "sinks"])
@pytest.mark.parametrize("case", list(BAD))
def test_unreadable_tensors_are_clear_errors(backend, torch, case, argument):
    make, exc, fragment = BAD[case]
    cache, s, batch = _ready(backend)
    before = [a.copy() for a in cache.gather(0, s)]
    good_kv = np.zeros((3, NUM_KV_HEADS, HEAD_DIM), np.float32)
    good_q = np.zeros((3, NUM_HEADS, HEAD_DIM), np.float32)
    bad = make(torch, SHAPES[argument])
    with pytest.raises(exc) as info:
        if argument in ("k", "v"):
            cache.store(0, batch, *(bad if n == argument else good_kv for n in ("k", "v")))
        elif argument == "q":
            cache.attention(0, batch, bad)
        else:
            cache.attention(0, batch, good_q, sinks=bad)
    message = str(info.value)
    assert message.startswith(f"{argument}:"), message
    assert fragment in message, message
    for got, want in zip(cache.gather(0, s), before):        # nothing changed
        np.testing.assert_array_equal(got, want)


def test_integer_tensor_is_a_type_error(backend, torch):
    cache, _, batch = _ready(backend)
    ints = torch.zeros((3, NUM_KV_HEADS, HEAD_DIM), dtype=torch.int32)
    with pytest.raises(pagedkv.ArgumentTypeError, match=r"^k: expected a float dtype .*int32"):
        cache.store(0, batch, ints, ints.float())
    with pytest.raises(pagedkv.ArgumentTypeError, match=r"^q: expected a float dtype .*int64"):
        cache.attention(0, batch, torch.zeros((3, NUM_HEADS, HEAD_DIM), dtype=torch.int64))


def test_import_and_numpy_use_never_import_torch(backend):
    code = textwrap.dedent(f"""
        import sys
        import numpy as np
        import pagedkv
        assert "torch" not in sys.modules, "import pagedkv imported torch"
        pagedkv.available_backends()
        cache = pagedkv.PagedKVCache(1, 2, 16, num_pages=8, page_size=4, backend={backend!r})
        s = cache.add_sequence()
        batch = cache.append([s], 5)
        kv = np.ones((5, 2, 16), np.float32)
        cache.store(0, batch, kv, kv)
        out = cache.attention(0, batch, np.ones((5, 4, 16), np.float16), sinks=[0.0] * 4)
        assert isinstance(out, np.ndarray)
        cache.gather(0, s)
        assert "torch" not in sys.modules, "using pagedkv with numpy imported torch"
        print("ok")
    """)
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
