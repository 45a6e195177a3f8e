"""What only the opencl backend has: devices, pyopencl arrays, kernel builds, layouts.

The shared behaviour tests (test_attention.py, test_lifecycle.py, ...) run on
opencl through the ``backend`` fixture; these add cross-backend equality,
device selection, the unavailable-backend message, the split-K path, kernel
loading and build errors.
"""
import importlib.resources
import os
import sys

import numpy as np
import pytest

import pagedkv
from pagedkv.backends import _opencl_device, resolve_backend
from reference import TOLERANCE, dense_attention

HAS_OPENCL = "opencl" in pagedkv.available_backends()
needs_opencl = pytest.mark.skipif(not HAS_OPENCL, reason="no usable OpenCL device")

if HAS_OPENCL:
    import pyopencl as cl
    import pyopencl.array as cl_array

    from pagedkv.backends import opencl as opencl_backend
    from pagedkv.backends._opencl_program import KernelBuildError, build_program, read_source


def opencl_cache(num_kv_heads=2, head_dim=32, *, num_layers=1, num_pages=64, page_size=16,
                 dtype="float32", **kwargs):
    return pagedkv.PagedKVCache(num_layers, num_kv_heads, head_dim, num_pages=num_pages,
                                page_size=page_size, dtype=dtype, backend="opencl", **kwargs)


@pytest.fixture
def fresh_availability():
    """Forget the cached availability before and after (tests fake a missing driver)."""
    _opencl_device.reset_availability_cache()
    yield
    _opencl_device.reset_availability_cache()


# -- CI and availability ------------------------------------------------------------------

@pytest.mark.skipif(not os.environ.get("CI"),
                    reason="only CI is required to have an OpenCL device (CI is not set here)")
def test_ci_has_an_opencl_device():
    assert "opencl" in pagedkv.available_backends(), _opencl_device.unavailable_reason()


def test_missing_pyopencl_says_how_to_install(monkeypatch, fresh_availability):
    monkeypatch.setitem(sys.modules, "pyopencl", None)   # `import pyopencl` now fails
    monkeypatch.delenv("PAGEDKV_BACKEND", raising=False)
    assert "opencl" not in pagedkv.available_backends()
    with pytest.raises(pagedkv.BackendUnavailableError) as info:
        pagedkv.PagedKVCache(1, 2, 32, num_pages=8, backend="opencl")
    message = str(info.value)
    assert 'pip install "pagedkv[opencl]"' in message
    assert "pocl-opencl-icd" in message
    assert pagedkv.PagedKVCache(1, 2, 32, num_pages=8).backend == "host"   # auto falls back


@needs_opencl
@pytest.mark.parametrize("failure", ["no platform", "no device"])
def test_no_device_says_how_to_install(monkeypatch, fresh_availability, failure):
    class EmptyPlatform:
        def get_devices(self):
            return []

    def get_platforms():
        if failure == "no platform":
            raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")
        return [EmptyPlatform()]

    monkeypatch.setattr(cl, "get_platforms", get_platforms)
    with pytest.raises(pagedkv.BackendUnavailableError, match=r'pip install "pagedkv\[opencl\]"'):
        pagedkv.PagedKVCache(1, 2, 32, num_pages=8, backend="opencl")


@needs_opencl
@pytest.mark.parametrize("kinds,env,expected", [
    (["CPU"], {}, "host"),                      # PoCL alone: the host kernels are faster
    (["CPU", "GPU"], {}, "opencl"),
    (["ACCELERATOR"], {}, "opencl"),
    (["CPU"], {"PAGEDKV_DEVICE": "0:0"}, "opencl"),   # a device named on purpose
])
def test_auto_takes_opencl_for_a_gpu_or_a_named_device(monkeypatch, fresh_availability, kinds,
                                                       env, expected):
    class FakeDevice:
        def __init__(self, kind):
            self.type = getattr(cl.device_type, kind)

    class FakePlatform:
        def get_devices(self):
            return [FakeDevice(kind) for kind in kinds]

    monkeypatch.setattr(cl, "get_platforms", lambda: [FakePlatform()])
    for name in ("PAGEDKV_BACKEND", "PAGEDKV_DEVICE", "PYOPENCL_CTX"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resolve_backend("auto") == expected


@needs_opencl
def test_availability_is_cached(monkeypatch):
    assert _opencl_device.unavailable_reason() is None
    monkeypatch.setattr(cl, "get_platforms", lambda: pytest.fail("availability re-probed"))
    assert _opencl_device.unavailable_reason() is None


# -- kernel sources and builds ------------------------------------------------------------

def test_kernels_ship_in_the_package():
    files = importlib.resources.files("pagedkv.opencl")
    names = {entry.name for entry in files.iterdir()}
    assert {"attention.cl", "kv_pages.cl", "pkv_common.h"} <= names
    assert "__kernel" in files.joinpath("attention.cl").read_text()


@needs_opencl
def test_loader_reads_the_package_resources():
    from pagedkv.backends._opencl_program import source_dir
    assert str(source_dir()) == str(importlib.resources.files("pagedkv.opencl"))
    text = read_source("kv_pages.cl")
    assert '#include "pkv_common.h"' not in text     # the header is expanded in place
    assert "pkv_half_to_float" in text and '#line 1 "kv_pages.cl"' in text


@needs_opencl
def test_build_error_names_the_file_options_and_log(tmp_path):
    (tmp_path / "broken.cl").write_text(
        '#include "helper.h"\n__kernel void f(__global float* x) {\n  x[0] = undeclared;\n}\n')
    (tmp_path / "helper.h").write_text("#define HELPER 1\n")
    context = opencl_cache()._backend.context
    options = ("-DPKV_PROBE=1",)
    with pytest.raises(KernelBuildError) as info:
        build_program(context, "broken.cl", options,
                      source=read_source("broken.cl", directory=tmp_path))
    message = str(info.value)
    assert "opencl/broken.cl" in message and "-DPKV_PROBE=1" in message
    assert "undeclared" in message                   # the compiler's log
    assert "broken.cl:3" in message                  # #line keeps the original line numbers


@needs_opencl
def test_programs_are_built_once_per_context():
    from pagedkv.backends import _opencl_program
    first = opencl_cache()._backend
    built = len(_opencl_program._programs)
    second = opencl_cache(num_pages=32, num_layers=2)._backend   # same shapes, other sizes
    assert first.context is second.context
    assert len(_opencl_program._programs) == built


# -- device selection ---------------------------------------------------------------------

@needs_opencl
class TestDeviceSelection:
    def only_device(self):
        platform = cl.get_platforms()[0]
        return platform.get_devices()[0]

    def test_by_index_string(self):
        backend = opencl_cache(device="0:0")._backend
        assert backend.device == self.only_device()

    def test_by_device_and_by_context(self):
        device = self.only_device()
        assert opencl_cache(device=device)._backend.device == device
        context = cl.Context([device])
        cache = opencl_cache(device=context)
        assert cache._backend.context is context and cache._backend.device == device
        s = cache.add_sequence()                 # programs build for the new context
        batch = cache.append([s], [5])
        kv = np.ones((5, 2, 32), dtype=np.float32)
        cache.store(0, batch, kv, kv)
        np.testing.assert_allclose(cache.attention(0, batch, np.ones((5, 4, 32))), 1.0)

    def test_by_environment(self, monkeypatch):
        monkeypatch.setenv("PAGEDKV_DEVICE", "0:0")
        assert opencl_cache()._backend.device == self.only_device()
        monkeypatch.delenv("PAGEDKV_DEVICE")
        monkeypatch.setenv("PYOPENCL_CTX", "0:0")
        assert opencl_cache()._backend.device == self.only_device()

    @pytest.mark.parametrize("text", ["9:9", "0:99", "gpu", "0", "1:2:3", ""])
    def test_bad_strings_name_the_argument_and_the_devices(self, text):
        with pytest.raises(ValueError) as info:
            opencl_cache(device=text)
        message = str(info.value)
        assert message.startswith("device:") and "0:0" in message
        assert self.only_device().name.strip() in message

    def test_bad_environment_names_the_variable(self, monkeypatch):
        monkeypatch.setenv("PAGEDKV_DEVICE", "7:0")
        with pytest.raises(ValueError, match=r"^PAGEDKV_DEVICE: no OpenCL device '7:0'"):
            opencl_cache()
        monkeypatch.delenv("PAGEDKV_DEVICE")
        monkeypatch.setenv("PYOPENCL_CTX", "7")
        with pytest.raises(ValueError, match=r"^PYOPENCL_CTX: '7' selects no device"):
            opencl_cache()

    def test_bad_type(self):
        with pytest.raises(TypeError, match="device: expected a pyopencl Device or Context"):
            opencl_cache(device=0)


# -- one workload through both backends --------------------------------------------------

def run_workload(backend, dtype):
    """Ragged prefill over page boundaries, decode, a fork with copy-on-write, chunked
    prefill; GQA 4.  Returns every attention output and the final gathered K/V."""
    rng = np.random.default_rng(7)
    cache = pagedkv.PagedKVCache(2, 2, 64, num_pages=96, page_size=16, dtype=dtype,
                                 backend=backend)
    outputs = []

    def step(seqs, counts):
        batch = cache.append(seqs, counts)
        n = batch.num_tokens
        for layer in range(2):
            k, v = rng.standard_normal((2, n, 2, 64), dtype=np.float32)
            cache.store(layer, batch, k, v)
            outputs.append(cache.attention(layer, batch, rng.standard_normal((n, 8, 64))))

    a, b, c = (cache.add_sequence() for _ in range(3))
    step([a, b, c], [37, 16, 5])
    for _ in range(3):
        step([a, b, c], 1)
    fork = cache.fork(a)                       # a's last page is partly full: shared
    step([fork, a], [3, 1])                    # both write into it: copy-on-write
    step([b, fork, c], [20, 1, 0])
    gathered = [cache.gather(layer, s) for layer in range(2) for s in (a, b, c, fork)]
    return outputs, gathered


@needs_opencl
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_same_results_as_host(dtype):
    host_out, host_kv = run_workload("host", dtype)
    ocl_out, ocl_kv = run_workload("opencl", dtype)
    for expected, got in zip(host_out, ocl_out):
        np.testing.assert_allclose(got, expected, **TOLERANCE["float32"])
    for (hk, hv), (ok, ov) in zip(host_kv, ocl_kv):
        # same stored bits: float16 rounding and its conversion back are exact in both
        assert hk.tobytes() == ok.tobytes() and hv.tobytes() == ov.tobytes()


# Layouts a GPU (or a device with little local memory) would get, run here.
LAYOUTS = {
    "gpu": dict(work_group_size=64, vector_width=4, query_tile=1, key_tile=1, column_tile=1,
                max_queries=32, chunk=16),
    "unstaged": dict(stage_k=False, stage_v=False, work_group_size=4),
    "small": dict(work_group_size=2, vector_width=2, chunk=4, max_queries=4, query_tile=2),
}


@needs_opencl
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_other_layouts_give_the_same_results(monkeypatch, layout):
    host_out, host_kv = run_workload("host", "float16")
    monkeypatch.setattr(opencl_backend, "LAYOUT_OVERRIDES", LAYOUTS[layout])
    ocl_out, ocl_kv = run_workload("opencl", "float16")
    for expected, got in zip(host_out, ocl_out):
        np.testing.assert_allclose(got, expected, **TOLERANCE["float32"])
    for (hk, hv), (ok, ov) in zip(host_kv, ocl_kv):
        assert hk.tobytes() == ok.tobytes() and hv.tobytes() == ov.tobytes()


def test_layout_fits_small_devices():
    pytest.importorskip("pyopencl")
    from pagedkv.backends._opencl_layout import KernelLayout

    class Tiny:   # a made-up GPU: 32 work-items, 4 KiB of local memory
        type, max_work_group_size, max_work_item_sizes = 4, 32, [32, 32, 32]
        local_mem_size, name = 4096, "tiny"

    for head_dim in (8, 64, 128, 256):
        layout = KernelLayout(Tiny, head_dim)
        assert layout.work_group_size <= 32 and layout.local_bytes <= 2048
        assert head_dim % layout.vector_width == 0
        assert layout.max_queries % layout.query_tile == 0


# -- split-K -------------------------------------------------------------------------------

@needs_opencl
def test_split_k_long_decode_matches_reference():
    rng = np.random.default_rng(3)
    cache = opencl_cache(1, 64, num_pages=320)
    s = cache.add_sequence()
    k, v = rng.standard_normal((2, 5000, 1, 64), dtype=np.float32)
    batch = cache.append([s], [4999])
    cache.store(0, batch, k[:4999], v[:4999])
    batch = cache.append([s], [1])
    cache.store(0, batch, k[4999:], v[4999:])
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    out = cache.attention(0, batch, q)
    plan = batch._tables.cache[("opencl_plan", 4)]
    assert plan.num_segments == 1 and plan.num_parts > 1      # split, then merged
    np.testing.assert_allclose(out, dense_attention(q, k, v, [4999]), **TOLERANCE["float32"])


@needs_opencl
def test_split_k_part_that_some_queries_cannot_see():
    # page_size 1024: a 64-row chunk at positions 986..1049 gets key parts
    # [0, 1024) and [1024, 1050); rows before 1024 see nothing of the second
    rng = np.random.default_rng(4)
    cache = opencl_cache(1, 32, num_pages=4, page_size=1024)
    s = cache.add_sequence()
    k, v = rng.standard_normal((2, 1050, 1, 32), dtype=np.float32)
    batch = cache.append([s], [986])
    cache.store(0, batch, k[:986], v[:986])
    batch = cache.append([s], [64])
    cache.store(0, batch, k[986:], v[986:])
    q = rng.standard_normal((64, 1, 32), dtype=np.float32)
    out = cache.attention(0, batch, q)
    assert batch._tables.cache[("opencl_plan", 1)].num_segments >= 1
    expected = dense_attention(q, k, v, np.arange(986, 1050))
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])


@needs_opencl
def test_group_larger_than_a_work_group_holds():
    # 1 KV head, 128 query heads: more than max_queries, so the group is cut
    rng = np.random.default_rng(5)
    cache = opencl_cache(1, 16)
    s = cache.add_sequence()
    k, v = rng.standard_normal((2, 9, 1, 16), dtype=np.float32)
    q = rng.standard_normal((9, 128, 16), dtype=np.float32)
    batch = cache.append([s], [9])
    cache.store(0, batch, k, v)
    out = cache.attention(0, batch, q)
    assert batch._tables.cache[("opencl_plan", 128)].sub_groups > 1
    np.testing.assert_allclose(out, dense_attention(q, k, v, np.arange(9)),
                               **TOLERANCE["float32"])


# -- pyopencl arrays -----------------------------------------------------------------------

@needs_opencl
class TestPyOpenCLArrays:
    def setup_method(self):
        self.cache = opencl_cache(2, 32)
        self.backend = self.cache._backend
        self.rng = np.random.default_rng(9)

    def device(self, x, dtype=np.float32):
        return cl_array.to_device(self.backend.queue, np.asarray(x, dtype=dtype))

    def test_attention_returns_the_kind_it_was_given(self):
        s = self.cache.add_sequence()
        batch = self.cache.append([s], [21])
        k, v = self.rng.standard_normal((2, 21, 2, 32), dtype=np.float32)
        q = self.rng.standard_normal((21, 8, 32), dtype=np.float32)
        self.cache.store(0, batch, self.device(k), self.device(v))
        out_np = self.cache.attention(0, batch, q)
        out_cl = self.cache.attention(0, batch, self.device(q))
        assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float32
        assert isinstance(out_cl, cl_array.Array) and out_cl.dtype == np.float32
        assert out_cl.queue is self.backend.queue and out_cl.shape == q.shape
        np.testing.assert_array_equal(out_cl.get(), out_np)
        np.testing.assert_allclose(out_np, dense_attention(q, k, v, np.arange(21)),
                                   **TOLERANCE["float32"])
        assert self.backend.last_attention_kernel_seconds > 0

    @pytest.mark.parametrize("dtype", [np.float16, np.float64])
    def test_other_float_dtypes_convert_on_the_device(self, dtype):
        s = self.cache.add_sequence()
        batch = self.cache.append([s], [6])
        k, v = self.rng.standard_normal((2, 6, 2, 32)).astype(dtype)
        self.cache.store(0, batch, self.device(k, dtype), self.device(v, dtype))
        got_k, got_v = self.cache.gather(0, s)
        np.testing.assert_array_equal(got_k, k.astype(np.float32))
        np.testing.assert_array_equal(got_v, v.astype(np.float32))
        q = self.rng.standard_normal((6, 4, 32)).astype(dtype)
        out = self.cache.attention(0, batch, self.device(q, dtype))
        np.testing.assert_array_equal(out.get(), self.cache.attention(0, batch, q))

    def test_views_with_an_offset(self):
        s = self.cache.add_sequence()
        batch = self.cache.append([s], [3])
        kv = self.rng.standard_normal((8, 2, 32), dtype=np.float32)
        view = self.device(kv)[5:]                     # starts 5 rows into its buffer
        assert view.offset
        self.cache.store(0, batch, view, view)
        np.testing.assert_array_equal(self.cache.gather(0, s)[0], kv[5:])

    def test_bad_arrays(self):
        s = self.cache.add_sequence()
        batch = self.cache.append([s], [4])
        other = cl.CommandQueue(cl.Context([self.backend.device]))
        foreign = cl_array.zeros(other, (4, 2, 32), np.float32)
        with pytest.raises(ValueError, match="k: the pyopencl array lives in another OpenCL"):
            self.cache.store(0, batch, foreign, foreign)
        wide = self.device(np.zeros((4, 2, 64)))
        strided = wide[:, :, ::2]
        assert not strided.flags.c_contiguous
        with pytest.raises(ValueError, match="k: expected a C-contiguous pyopencl array"):
            self.cache.store(0, batch, strided, strided)


# -- odd sizes -----------------------------------------------------------------------------

@needs_opencl
def test_nothing_to_do_launches_nothing():
    cache = opencl_cache()
    s = cache.add_sequence()
    batch = cache.append([s], [0])
    empty = np.zeros((0, 2, 32), dtype=np.float32)
    cache.store(0, batch, empty, empty)
    assert cache.attention(0, batch, np.zeros((0, 4, 32))).shape == (0, 4, 32)
    assert cache._backend.last_attention_kernel_seconds == 0.0
    on_device = cache.attention(0, batch, cl_array.zeros(cache._backend.queue, (0, 4, 32),
                                                         np.float32))
    assert isinstance(on_device, cl_array.Array) and on_device.shape == (0, 4, 32)
    k, v = cache.gather(0, s)
    assert k.shape == v.shape == (0, 2, 32)


@needs_opencl
def test_memory_bytes_and_pool_limits():
    cache = opencl_cache(2, 32, num_layers=3, num_pages=10, page_size=8, dtype="float16")
    assert cache.memory_bytes == 2 * 3 * 10 * 2 * 8 * 32 * 2
    device = cache._backend.device
    too_many = device.max_mem_alloc_size // (2 * 8 * 32 * 4) + 1
    with pytest.raises(ValueError, match="num_pages: .* use fewer pages"):
        opencl_cache(2, 32, num_pages=too_many, page_size=8)
