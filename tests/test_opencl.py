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
from opencl_devices import TEST_DEVICES, implementation
from reference import TOLERANCE, dense_attention

HAS_OPENCL = "opencl" in pagedkv.available_backends()
needs_opencl = pytest.mark.skipif(not HAS_OPENCL, reason="no usable OpenCL device")

if HAS_OPENCL:
    import pyopencl as cl
    import pyopencl.array as cl_array

    from pagedkv.backends.schedule import ITEM
    from pagedkv.backends._opencl_program import KernelBuildError, build_program
    from pagedkv.backends.kernel_source import read_source


def opencl_cache(device, num_kv_heads=2, head_dim=32, *, num_layers=1, num_pages=64,
                 page_size=16, dtype="float32", **kwargs):
    """An opencl cache on ``device`` (a pyopencl Device, Context or device string)."""
    return pagedkv.PagedKVCache(num_layers, num_kv_heads, head_dim, num_pages=num_pages,
                                page_size=page_size, dtype=dtype, backend="opencl",
                                device=device, **kwargs)


@pytest.fixture(params=TEST_DEVICES, ids=lambda d: d.id)
def cl_device(request):
    """Each OpenCL test device (``opencl_devices.py``): a pyopencl Device."""
    return request.param.device


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


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI must have two implementations")
def test_ci_tests_two_opencl_implementations():
    # pip's PoCL (pagedkv[opencl]) and Debian's pocl-opencl-icd (.ci/run installs it)
    found = sorted({implementation(d.device) for d in TEST_DEVICES})
    assert len(found) >= 2, (f"CI runs the OpenCL tests on {found}: expected two OpenCL "
                             f"implementations; devices:\n{_opencl_device.describe_devices()}")


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
    from pagedkv.backends.kernel_source import source_dir
    assert str(source_dir()) == str(importlib.resources.files("pagedkv.opencl"))
    text = read_source("kv_pages.cl")
    assert '#include "pkv_common.h"' not in text     # the header is expanded in place
    assert "pkv_half_to_float" in text and '#line 1 "kv_pages.cl"' in text


@needs_opencl
def test_build_error_names_the_file_options_and_log(cl_device, tmp_path):
    (tmp_path / "broken.cl").write_text(
        '#include "helper.h"\n__kernel void f(__global float* x) {\n  x[0] = undeclared;\n}\n')
    (tmp_path / "helper.h").write_text("#define HELPER 1\n")
    context = opencl_cache(cl_device)._backend.context
    options = ("-DPKV_PROBE=1",)
    with pytest.raises(KernelBuildError) as info:
        build_program(context, "broken.cl", options,
                      source=read_source("broken.cl", directory=tmp_path))
    message = str(info.value)
    assert "opencl/broken.cl" in message and "-DPKV_PROBE=1" in message
    assert "undeclared" in message                   # the compiler's log
    # Where the compiler honours #line (Oclgrind's ignores it), the log names the
    # original file and line, not the expanded text's.
    if "broken.cl:" in message.split("failed:", 1)[1]:
        assert "broken.cl:3" in message


@needs_opencl
def test_programs_are_built_once_per_context(cl_device):
    from pagedkv import _process
    first = opencl_cache(cl_device)._backend
    built = len(_process.opencl.programs[first.context])
    second = opencl_cache(cl_device, num_pages=32, num_layers=2)._backend   # same shapes, other sizes
    assert first.context is second.context
    assert len(_process.opencl.programs[first.context]) == built


# -- device selection ---------------------------------------------------------------------

@needs_opencl
class TestDeviceSelection:
    @pytest.fixture(autouse=True)
    def _device(self, cl_device, monkeypatch):
        for name in ("PAGEDKV_DEVICE", "PYOPENCL_CTX"):
            monkeypatch.delenv(name, raising=False)
        self.device = cl_device
        self.index = _opencl_device.device_index(cl_device)

    def test_by_index_string(self):
        assert opencl_cache(self.index)._backend.device == self.device

    def test_by_name(self):
        # the device name and platform version: unique unless two devices are identical
        label = _opencl_device.device_label(self.device)
        text = label[label.index(" / ") + 3:]
        for name in (f"name:{text}", text.upper()):
            chosen = opencl_cache(name)._backend.device
            assert _opencl_device.device_label(chosen) == label
        assert _opencl_device.find_devices(f"name:{self.device.name.strip()}", "device")

    def test_by_device_and_by_context(self):
        device = self.device
        assert opencl_cache(device)._backend.device == device
        context = cl.Context([device])
        cache = opencl_cache(context)
        assert cache._backend.context is context and cache._backend.device == device
        s = cache.add_sequence()                 # programs build for the new context
        batch = cache.append([s], [5])
        kv = np.ones((5, 2, 32), dtype=np.float32)
        cache.store(0, batch, kv, kv)
        np.testing.assert_allclose(cache.attention(0, batch, np.ones((5, 4, 32))), 1.0)

    def test_by_environment(self, monkeypatch):
        monkeypatch.setenv("PAGEDKV_DEVICE", self.index)
        assert opencl_cache(None)._backend.device == self.device
        monkeypatch.setenv("PAGEDKV_DEVICE", f"name:{self.device.name.strip()}")
        assert opencl_cache(None)._backend.device.name == self.device.name
        monkeypatch.delenv("PAGEDKV_DEVICE")
        monkeypatch.setenv("PYOPENCL_CTX", self.index)
        assert opencl_cache(None)._backend.device == self.device

    @pytest.mark.parametrize("text", ["99:9", "0:99", "no such device", "name:", "0", "1:2:3",
                                      ""])
    def test_bad_strings_name_the_argument_and_the_devices(self, text):
        with pytest.raises(ValueError) as info:
            opencl_cache(text)
        message = str(info.value)
        assert message.startswith("device:") and f"{self.index}  " in message
        assert self.device.name.strip() in message

    def test_bad_environment_names_the_variable(self, monkeypatch):
        monkeypatch.setenv("PAGEDKV_DEVICE", "77:0")
        with pytest.raises(ValueError, match=r"^PAGEDKV_DEVICE: no OpenCL device '77:0'"):
            opencl_cache(None)
        monkeypatch.setenv("PAGEDKV_DEVICE", "name:no such device")
        with pytest.raises(ValueError, match=r"^PAGEDKV_DEVICE: no OpenCL device matches"):
            opencl_cache(None)
        monkeypatch.delenv("PAGEDKV_DEVICE")
        monkeypatch.setenv("PYOPENCL_CTX", "77")
        with pytest.raises(ValueError, match=r"^PYOPENCL_CTX: '77' selects no device"):
            opencl_cache(None)

    def test_bad_type(self):
        with pytest.raises(TypeError, match="device: expected a pyopencl Device or Context"):
            opencl_cache(0)


def test_automatic_choice_prefers_a_gpu_and_leaves_simulators_last(monkeypatch):
    cl = pytest.importorskip("pyopencl")

    class FakeDevice:
        def __init__(self, name, *kinds):
            self.name = name
            self.type = sum(getattr(cl.device_type, kind) for kind in kinds)

    def fake(*devices):
        class FakePlatform:
            def get_devices(self):
                return list(devices)
        monkeypatch.setattr(cl, "get_platforms", lambda: [FakePlatform()])
        monkeypatch.setattr(_opencl_device, "context_for_device", lambda dev: None)
        return _opencl_device.select_device()[1].name

    for name in ("PAGEDKV_DEVICE", "PYOPENCL_CTX"):
        monkeypatch.delenv(name, raising=False)
    grind = FakeDevice("grind", "CPU", "GPU", "ACCELERATOR")
    assert fake(grind, FakeDevice("cpu", "CPU"), FakeDevice("gpu", "GPU")) == "gpu"
    assert fake(grind, FakeDevice("cpu", "CPU"), FakeDevice("acc", "ACCELERATOR")) == "acc"
    assert fake(grind, FakeDevice("cpu", "CPU")) == "cpu"
    assert fake(grind) == "grind"


# -- one workload through both backends --------------------------------------------------

def run_workload(backend, dtype, variant=None, **kwargs):
    """Ragged prefill over page boundaries, decode, a fork with copy-on-write, chunked
    prefill; GQA 4; ``variant``: attention keyword arguments.  Returns every attention
    output and the final gathered K/V."""
    rng = np.random.default_rng(7)
    cache = pagedkv.PagedKVCache(2, 2, 64, num_pages=96, page_size=16, dtype=dtype,
                                 backend=backend, **kwargs)
    outputs = []

    def step(seqs, counts):
        batch = cache.append(seqs, counts)
        n = batch.num_tokens
        for layer in range(2):
            k, v = rng.standard_normal((2, n, 2, 64), dtype=np.float32)
            cache.store(layer, batch, k, v)
            outputs.append(cache.attention(layer, batch, rng.standard_normal((n, 8, 64)),
                                           **(variant or {})))

    a, b, c = (cache.add_sequence() for _ in range(3))
    step([a, b, c], [37, 16, 5])
    for _ in range(3):
        step([a, b, c], 1)
    fork = cache.fork(a)                       # a's last page is partly full: shared
    step([fork, a], [3, 1])                    # both write into it: copy-on-write
    step([b, fork, c], [20, 1, 0])
    gathered = [cache.gather(layer, s) for layer in range(2) for s in (a, b, c, fork)]
    return outputs, gathered


# Layouts forced on every device: each kind's defaults, and shapes that a GPU
# with a smaller work-group limit or little local memory would get.
LAYOUTS = {
    "cpu": dict(kind="cpu"),
    "gpu": dict(kind="gpu"),
    "gpu64": dict(work_group_size=64, vector_width=4, query_tile=1, key_tile=1, column_tile=1,
                  max_queries=32, chunk=16),
    "unstaged": dict(stage_k=False, stage_v=False, work_group_size=4),
    "small": dict(work_group_size=2, vector_width=2, chunk=4, max_queries=4, query_tile=2),
}
KINDS = ["cpu", "gpu"]


def layout_options(name):
    return {"layout": LAYOUTS[name]}


@needs_opencl
@pytest.mark.parametrize("layout", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_same_results_as_host(cl_device, layout, dtype):
    host_out, host_kv = run_workload("host", dtype)
    ocl_out, ocl_kv = run_workload("opencl", dtype, device=cl_device,
                                   backend_options=layout_options(layout))
    for expected, got in zip(host_out, ocl_out):
        np.testing.assert_allclose(got, expected, **TOLERANCE["float32"])
    for (hk, hv), (ok, ov) in zip(host_kv, ocl_kv):
        # same stored bits: float16 rounding and its conversion back are exact in both
        assert hk.tobytes() == ok.tobytes() and hv.tobytes() == ov.tobytes()


@needs_opencl
@pytest.mark.parametrize("layout", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_same_results_as_host_with_variants(cl_device, layout, dtype):
    variant = dict(sliding_window=19, logits_soft_cap=1.3, scale=0.25,
                   sinks=np.random.default_rng(9).uniform(-1, 2, 8))
    host_out, host_kv = run_workload("host", dtype, variant)
    ocl_out, ocl_kv = run_workload("opencl", dtype, variant, device=cl_device,
                                   backend_options=layout_options(layout))
    for expected, got in zip(host_out, ocl_out):
        np.testing.assert_allclose(got, expected, **TOLERANCE["float32"])
    for (hk, hv), (ok, ov) in zip(host_kv, ocl_kv):
        assert hk.tobytes() == ok.tobytes() and hv.tobytes() == ov.tobytes()


@needs_opencl
@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("layout", ["gpu64", "unstaged", "small"])
def test_other_layouts_give_the_same_results(cl_device, layout, windowed):
    variant = dict(sliding_window=21, logits_soft_cap=2.0,
                   sinks=np.linspace(-1, 2, 8)) if windowed else None
    host_out, host_kv = run_workload("host", "float16", variant)
    ocl_out, ocl_kv = run_workload("opencl", "float16", variant, device=cl_device,
                                   backend_options=layout_options(layout))
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
        assert layout.work_group_size <= 32 and layout.local_memory == 2048
        assert head_dim % layout.vector_width == 0
        assert layout.max_queries % layout.query_tile == 0


@needs_opencl
@pytest.mark.parametrize("budget", [6144, 16384])
def test_kernel_local_memory_fits_the_layout_budget(cl_device, budget):
    # the driver's count of the built kernel, not a formula, decides: a small
    # budget gets a smaller layout, with the same results
    options = {"layout": dict(kind="gpu", local_memory=budget)}
    cache = opencl_cache(cl_device, 2, 32, backend_options=options)
    backend = cache._backend
    assert backend._k_attention.local_memory(backend.device) <= budget
    default = opencl_cache(cl_device, 2, 32, backend_options=layout_options("gpu"))._backend
    assert backend.layout.chunk * backend.layout.max_queries <= \
        default.layout.chunk * default.layout.max_queries
    host_out, _ = run_workload("host", "float16")
    ocl_out, _ = run_workload("opencl", "float16", device=cl_device, backend_options=options)
    for expected, got in zip(host_out, ocl_out):
        np.testing.assert_allclose(got, expected, **TOLERANCE["float32"])


def test_layout_kind_follows_the_gpu_bit():
    cl = pytest.importorskip("pyopencl")
    from pagedkv.backends._opencl_layout import KernelLayout

    def device(*kinds):
        class Fake:
            type = sum(getattr(cl.device_type, kind) for kind in kinds)
            max_work_group_size, max_work_item_sizes = 1024, [1024, 1024, 1024]
            local_mem_size, name = 32768, "fake"
        return Fake

    assert KernelLayout(device("CPU"), 64).kind == "cpu"
    assert KernelLayout(device("GPU"), 64).kind == "gpu"
    assert KernelLayout(device("CPU", "GPU", "ACCELERATOR"), 64).kind == "gpu"   # Oclgrind
    assert KernelLayout(device("ACCELERATOR"), 64).kind == "gpu"
    assert KernelLayout(device("GPU"), 64, kind="cpu").kind == "cpu"
    with pytest.raises(ValueError, match="layout: kind must be 'cpu' or 'gpu'"):
        KernelLayout(device("GPU"), 64, kind="tpu")


def test_only_a_pocl_cpu_device_lifts_the_loop_bound():
    # PoCL on a CPU has no watchdog and no loop limit; PoCL's CUDA device is a
    # GPU, and forcing the CPU shape on it must not lift its bound
    cl = pytest.importorskip("pyopencl")
    from pagedkv.backends._opencl_layout import (MAX_WORK_ITEM_ITERATIONS,
                                                 POCL_CPU_WORK_ITEM_ITERATIONS, KernelLayout)

    def device(kind, platform_name):
        class Platform:
            name = platform_name

        class Fake:
            type = getattr(cl.device_type, kind)
            max_work_group_size, max_work_item_sizes = 1024, [1024, 1024, 1024]
            local_mem_size, name, platform = 49152, "fake", Platform
        return Fake

    pocl = "Portable Computing Language"
    assert KernelLayout(device("CPU", pocl), 64).max_work_item_iterations == \
        POCL_CPU_WORK_ITEM_ITERATIONS
    for kind in ("cpu", "gpu"):
        assert KernelLayout(device("GPU", pocl), 64, kind=kind).max_work_item_iterations == \
            MAX_WORK_ITEM_ITERATIONS
        assert KernelLayout(device("GPU", "NVIDIA CUDA"), 64, kind=kind) \
            .max_work_item_iterations == MAX_WORK_ITEM_ITERATIONS
    assert KernelLayout(device("CPU", "Intel(R) OpenCL"), 64).max_work_item_iterations == \
        MAX_WORK_ITEM_ITERATIONS


#: half arithmetic, which needs cl_khr_fp16 (the control of the test below)
HALF_ARITHMETIC = ("__kernel void twice(__global half* p, __global float* out) {\n"
                   "    const half x = p[0];\n    out[0] = (float)(x + x);\n}\n")


@needs_opencl
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_kernels_need_no_half_arithmetic(cl_device, dtype):
    # NVIDIA's OpenCL has no cl_khr_fp16: the kernels may use half only as the
    # type of a pointer that vload_half / vstore_half read and write.  Built
    # with the extension disabled, half arithmetic does not compile, also on
    # a device that has the extension (the control shows that it does not).
    from pagedkv.backends._opencl_layout import KernelLayout
    from pagedkv.storage import storage_format
    disable = "#pragma OPENCL EXTENSION cl_khr_fp16 : disable\n"
    context = cl.Context([cl_device])
    try:
        build_program(context, "half_arithmetic.cl", (), source=disable + HALF_ARITHMETIC)
        pytest.skip(f"{cl_device.name.strip()} builds half arithmetic even with cl_khr_fp16 "
                    f"disabled, so it cannot tell")
    except KernelBuildError:
        pass
    for kind in ("cpu", "gpu"):
        layout = KernelLayout(cl_device, 64, storage_format(dtype, 64), kind=kind)
        for name, options in (("attention.cl", layout.options()),
                              ("kv_pages.cl", layout.storage_options())):
            assert build_program(context, name, options, source=disable + read_source(name))


@needs_opencl
@pytest.mark.parametrize("head_dim,group,rows", [(128, 4, 1), (128, 1, 64), (64, 8, 3),
                                                 (256, 2, 40)])
def test_cpu_layout_work_per_work_item_is_bounded(cl_device, head_dim, group, rows):
    # A CPU-typed device gets the CPU layout, where one work-item does a whole
    # item's work (llvmpipe stops a work-item after 65,535 loop iterations).
    # However long the context, every item and every merge stays within the
    # layout's budget: longer key ranges become more split-K parts.
    cache = opencl_cache(cl_device, 1, head_dim, num_pages=8, page_size=16,
                         backend_options=layout_options("cpu"))
    backend = cache._backend
    layout = backend.layout
    assert layout.kind == "cpu"
    from pagedkv.backends.opencl import _Plan

    class Tables:      # one sequence's step: `rows` new tokens at the end of `seq_len`
        def __init__(self, seq_len):
            self.query_start = np.array([0, rows], np.int32)
            self.seq_lens = np.array([seq_len], np.int32)
            self.key_cut = None

    # Bounded up to 4,000 parts per merge: 390,000 keys for 64 queries at head_dim 128
    # (the worst case), millions for decode; past that, parts grow.
    worst = []
    for seq_len in (rows, 2_000, 20_000, 100_000, 300_000):
        plan = _Plan(backend, Tables(seq_len), group, None)
        items = plan.host_items
        queries = (items[:, ITEM.ROW1] - items[:, ITEM.ROW0]) * plan.group
        keys = items[:, ITEM.KEY1] - items[:, ITEM.KEY0]
        work = layout.attention_iterations(queries, keys)
        assert work.max() <= layout.max_work_item_iterations, (seq_len, work.max())
        assert keys.sum() >= seq_len * (rows == 1)              # every key is covered
        if plan.num_segments:
            parts = np.diff(plan.host_seg_parts)
            merge = layout.merge_iterations(queries[plan.host_seg_items], parts)
            assert merge.max() <= layout.max_work_item_iterations, (seq_len, merge.max())
        worst.append(int(work.max()))
    assert max(worst[2:]) <= layout.max_work_item_iterations
    assert layout.attention_iterations(rows * group, 300_000) > layout.max_work_item_iterations


@needs_opencl
@pytest.mark.parametrize("head_dim,group,rows", [(128, 4, 1), (64, 8, 3), (128, 1, 64)])
def test_kernel_loop_counts_stay_within_the_bound(cl_device, head_dim, group, rows):
    # The kernel counts its own loop iterations (a PKV_COUNT_LOOPS build): every
    # work-item of every item and merge stays within the layout's budget, and
    # within the model (KernelLayout.attention_iterations, merge_iterations)
    # the planner cuts key ranges by.
    from pagedkv.attention_spec import AttentionSpec
    from pagedkv.backends.base import StepTables
    options = {"layout": dict(kind="cpu", count_loops=True)}
    cache = opencl_cache(cl_device, 1, head_dim, num_pages=4, page_size=16,
                         backend_options=options)
    backend = cache._backend
    layout = backend.layout
    spec = AttentionSpec.from_arguments(head_dim=head_dim, num_heads=group, logits_soft_cap=30.0)
    for seq_len in (rows, 3_000, 12_000 if rows == 64 else 40_000):
        # every page of the table is page 0: the counts depend on the plan alone
        pages = -(-seq_len // 16)
        tables = StepTables(query_start=np.array([0, rows], np.int32),
                            seq_lens=np.array([seq_len], np.int32),
                            slot_mapping=np.full(rows, -1, np.int64),
                            page_indptr=np.array([0, pages], np.int32),
                            page_indices=np.zeros(pages, np.int32))
        backend.prepare_step(tables)
        q = np.random.default_rng(0).standard_normal((rows, group, head_dim), dtype=np.float32)
        assert np.isfinite(backend.attention(0, tables, q, spec)).all()
        plan = backend.plan(tables, group, None)
        items = plan.host_items
        queries = (items[:, ITEM.ROW1] - items[:, ITEM.ROW0]) * plan.group
        keys = items[:, ITEM.KEY1] - items[:, ITEM.KEY0]
        attention, merge = backend.last_loop_counts
        busiest = attention.reshape(plan.num_items, layout.work_group_size).max(axis=1)
        assert busiest.max() <= layout.max_work_item_iterations, (seq_len, busiest.max())
        assert (busiest <= layout.attention_iterations(queries, keys)).all()
        assert busiest.min() > 0
        if plan.num_segments:
            parts = np.diff(plan.host_seg_parts)
            merged = merge.reshape(plan.num_segments, layout.merge_work_group_size).max(axis=1)
            assert merged.max() <= layout.max_work_item_iterations
            assert (merged <= layout.merge_iterations(queries[plan.host_seg_items], parts)).all()
        else:
            assert merge is None


def attend_at_the_end(cache, seed, seq_len, new, num_heads):
    """Store ``seq_len - new`` tokens of one sequence, then a step of ``new`` more, and
    attend with them.  Returns (output, the dense reference's output, the batch)."""
    rng = np.random.default_rng(seed)
    d = cache.head_dim
    s = cache.add_sequence()
    k, v = rng.standard_normal((2, seq_len, 1, d), dtype=np.float32)
    old = seq_len - new
    cache.store(0, cache.append([s], [old]), k[:old], v[:old])
    batch = cache.append([s], [new])
    cache.store(0, batch, k[old:], v[old:])
    q = rng.standard_normal((new, num_heads, d), dtype=np.float32)
    return cache.attention(0, batch, q), dense_attention(q, k, v, np.arange(old, seq_len)), batch


@needs_opencl
def test_long_context_on_the_cpu_layout_matches_reference(cl_device):
    # 64 query rows over 1,500 keys: one work-item of the CPU layout would run
    # ~450,000 loop iterations over them, 7x what llvmpipe allows
    cache = opencl_cache(cl_device, 1, 128, num_pages=100, backend_options=layout_options("cpu"))
    out, expected, batch = attend_at_the_end(cache, 6, 1500, 64, 1)
    assert cache._backend.plan(batch._tables, 1, None).num_parts > 1
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])


# -- split-K -------------------------------------------------------------------------------

@needs_opencl
@pytest.mark.parametrize("layout", KINDS)
def test_split_k_long_decode_matches_reference(cl_device, layout):
    cache = opencl_cache(cl_device, 1, 64, num_pages=320, backend_options=layout_options(layout))
    out, expected, batch = attend_at_the_end(cache, 3, 5000, 1, 4)
    plan = cache._backend.plan(batch._tables, 4, None)
    assert plan.num_segments == 1 and plan.num_parts > 1      # split, then merged
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])


@needs_opencl
@pytest.mark.parametrize("layout", KINDS)
def test_split_k_part_that_some_queries_cannot_see(cl_device, layout):
    # page_size 1024: a 64-row chunk at positions 986..1049 gets key parts
    # [0, 1024) and [1024, 1050); rows before 1024 see nothing of the second
    cache = opencl_cache(cl_device, 1, 32, num_pages=4, page_size=1024,
                         backend_options=layout_options(layout))
    out, expected, batch = attend_at_the_end(cache, 4, 1050, 64, 1)
    assert cache._backend.plan(batch._tables, 1, None).num_segments >= 1
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])


@needs_opencl
def test_group_larger_than_a_work_group_holds(cl_device):
    # 1 KV head, 128 query heads: more than max_queries, so the group is cut
    rng = np.random.default_rng(5)
    cache = opencl_cache(cl_device, 1, 16)
    s = cache.add_sequence()
    k, v = rng.standard_normal((2, 9, 1, 16), dtype=np.float32)
    q = rng.standard_normal((9, 128, 16), dtype=np.float32)
    batch = cache.append([s], [9])
    cache.store(0, batch, k, v)
    out = cache.attention(0, batch, q)
    assert cache._backend.plan(batch._tables, 128, None).sub_groups > 1
    np.testing.assert_allclose(out, dense_attention(q, k, v, np.arange(9)),
                               **TOLERANCE["float32"])


# -- pyopencl arrays -----------------------------------------------------------------------

class _NoFloat64:
    """A device as the backend sees it, without cl_khr_fp64 (llvmpipe, Apple, Intel Arc)."""

    def __init__(self, device):
        self._device = device
        self.extensions = " ".join(e for e in device.extensions.split() if e != "cl_khr_fp64")

    def __getattr__(self, name):
        return getattr(self._device, name)


@needs_opencl
class TestPyOpenCLArrays:
    @pytest.fixture(autouse=True)
    def _cache(self, cl_device):
        self.cache = opencl_cache(cl_device, 2, 32)
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
        q_cl = self.device(q)
        out_cl = self.cache.attention(0, batch, q_cl)
        np.testing.assert_array_equal(q_cl.get(), q)    # scaled in a copy, not in place
        assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float32
        assert isinstance(out_cl, cl_array.Array) and out_cl.dtype == np.float32
        assert out_cl.queue is self.backend.queue and out_cl.shape == q.shape
        np.testing.assert_array_equal(out_cl.get(), out_np)
        np.testing.assert_allclose(out_np, dense_attention(q, k, v, np.arange(21)),
                                   **TOLERANCE["float32"])
        assert self.backend.last_attention_kernel_seconds > 0

    @pytest.mark.parametrize("dtype", [np.float16, np.float64])
    def test_other_float_dtypes_convert_on_the_device(self, dtype):
        if dtype == np.float64 and "cl_khr_fp64" not in self.backend.device.extensions:
            pytest.skip(f"{self.backend.device.name.strip()} lacks cl_khr_fp64")
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

    def test_float64_without_cl_khr_fp64_is_refused(self, monkeypatch):
        s = self.cache.add_sequence()
        batch = self.cache.append([s], [3])
        kv = self.device(np.ones((3, 2, 32)), np.float64)
        monkeypatch.setattr(self.backend, "device", _NoFloat64(self.backend.device))
        with pytest.raises(TypeError, match="k: a float64 pyopencl array needs a device with "
                                            "cl_khr_fp64"):
            self.cache.store(0, batch, kv, kv)

    @pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
    def test_arrays_on_the_callers_own_queue(self, dtype):
        if dtype == np.float64 and "cl_khr_fp64" not in self.backend.device.extensions:
            pytest.skip(f"{self.backend.device.name.strip()} lacks cl_khr_fp64")
        mine = cl.CommandQueue(self.backend.context)
        s = self.cache.add_sequence()
        batch = self.cache.append([s], [5])
        k, v = self.rng.standard_normal((2, 5, 2, 32)).astype(dtype)
        q = self.rng.standard_normal((5, 4, 32)).astype(dtype)
        self.cache.store(0, batch, cl_array.to_device(mine, k), cl_array.to_device(mine, v))
        out = self.cache.attention(0, batch, cl_array.to_device(mine, q))
        np.testing.assert_array_equal(self.cache.gather(0, s)[0], k.astype(np.float32))
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
        # keep the context referenced: a queue alone does not keep every driver's
        # context alive (Intel's frees it: INVALID_CONTEXT)
        other_context = cl.Context([self.backend.device])
        other = cl.CommandQueue(other_context)
        foreign = cl_array.zeros(other, (4, 2, 32), np.float32)
        with pytest.raises(ValueError, match="k: the pyopencl array lives in another OpenCL"):
            self.cache.store(0, batch, foreign, foreign)
        queueless = self.device(np.zeros((4, 2, 32))).with_queue(None)
        with pytest.raises(ValueError, match=r"k: the pyopencl array has no queue.*with_queue"):
            self.cache.store(0, batch, queueless, queueless)
        self.cache.store(0, batch, np.ones((4, 2, 32), np.float32), np.ones((4, 2, 32), np.float32))
        with pytest.raises(ValueError, match=r"q: the pyopencl array has no queue"):
            self.cache.attention(0, batch, self.device(np.zeros((4, 4, 32))).with_queue(None))
        wide = self.device(np.zeros((4, 2, 64)))
        strided = wide[:, :, ::2]
        assert not strided.flags.c_contiguous
        with pytest.raises(ValueError, match="k: expected a C-contiguous pyopencl array"):
            self.cache.store(0, batch, strided, strided)


# -- odd sizes -----------------------------------------------------------------------------

@needs_opencl
def test_nothing_to_do_launches_nothing(cl_device):
    cache = opencl_cache(cl_device)
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
@pytest.mark.parametrize("dtype,fused", [("float32", True), ("float16", True), ("int8", False)])
def test_a_decode_layer_is_one_launch(cl_device, dtype, fused):
    # With numpy K/V, a float format's store runs in its layer's attention
    # launch; int8 rows are quantized by their own scatter first.
    cache = opencl_cache(cl_device, dtype=dtype)
    backend = cache._backend
    launches = []

    def counted(kernel):
        def call(*args, **kwargs):
            launches.append(kernel.name)
            return kernel(*args, **kwargs)
        return call

    backend._k_scatter = counted(backend._k_scatter)
    backend._k_attention = counted(backend._k_attention)
    s = cache.add_sequence()
    rng = np.random.default_rng(0)
    cache.store(0, cache.append([s], 20), *rng.standard_normal((2, 20, 2, 32), np.float32))
    batch = cache.append([s], 1)
    launches.clear()
    cache.store(0, batch, *rng.standard_normal((2, 1, 2, 32), np.float32))
    assert launches == ([] if fused else ["scatter_kv_int8"])
    cache.attention(0, batch, rng.standard_normal((1, 4, 32), np.float32))
    assert launches == ["paged_attention"] if fused else ["scatter_kv_int8", "paged_attention"]


@needs_opencl
def test_memory_bytes_and_pool_limits(cl_device):
    cache = opencl_cache(cl_device, 2, 32, num_layers=3, num_pages=10, page_size=8, dtype="float16")
    assert cache.memory_bytes == 2 * 3 * 10 * 2 * 8 * 32 * 2
    device = cache._backend.device
    too_many = device.max_mem_alloc_size // (2 * 8 * 32 * 4) + 1
    with pytest.raises(MemoryError, match="num_pages: .* use fewer pages"):
        opencl_cache(cl_device, 2, 32, num_pages=too_many, page_size=8)


@needs_opencl
def test_int8_rows_at_the_ends_of_float32_store_the_same_bits(cl_device):
    from test_int8 import extreme_rows
    rows = extreme_rows(64, np.random.default_rng(0))
    kept = []
    for backend, device in (("host", None), ("opencl", cl_device)):
        cache = pagedkv.PagedKVCache(1, 1, 64, num_pages=4, page_size=16, dtype="int8",
                                     backend=backend, device=device)
        s = cache.add_sequence()
        cache.store(0, cache.append([s], len(rows)), rows, rows[::-1].copy())
        kept.append(cache.gather(0, s))
    for a, b in zip(*kept):
        assert a.tobytes() == b.tobytes()


@needs_opencl
def test_latent_attention_of_pyopencl_arrays_stays_on_the_device(cl_device):
    # the values' columns of each head's output are cut on the device, not through the host
    cache = opencl_cache(cl_device, 1, 96, kv_layout="latent", v_head_dim=64)
    queue = cache._backend.queue
    s = cache.add_sequence()
    batch = cache.append([s], 5)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((5, 1, 96)).astype(np.float32)
    q = rng.standard_normal((5, 4, 96)).astype(np.float32)
    cache.store(0, batch, cl_array.to_device(queue, k))
    out = cache.attention(0, batch, cl_array.to_device(queue, q))
    assert isinstance(out, cl_array.Array) and out.shape == (5, 4, 64)
    want = dense_attention(q, k, k[..., :64], np.arange(5))
    np.testing.assert_allclose(out.get(), want, **TOLERANCE["float32"])
