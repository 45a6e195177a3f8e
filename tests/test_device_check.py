"""benchmarks/device_check.py, the GPU check in one call (docs/gpu.md).

A GPU comes rarely and briefly, so the check must work the first time it
runs there: its quick mode runs end to end here on an OpenCL test device,
with what needs a GPU or CUDA reported as skipped and why; its parts that
do not need a GPU (the ICD file, the test outcomes, what a build lacks)
are tested on their own, and its kernels under Oclgrind
(``test_oclgrind.py``).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from opencl_devices import TEST_DEVICES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)
import device_check  # noqa: E402  (benchmarks/ is no package)

needs_device = pytest.mark.skipif(not TEST_DEVICES, reason="no OpenCL test device")


@pytest.mark.slow
@needs_device
def test_quick_check_runs_end_to_end(tmp_path):
    # one device (the primary test device) and torch's code path on the CPU:
    # every step of the check, at small sizes
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "device_check.py"), str(out), "--quick",
         "--devices", TEST_DEVICES[0].index, "--torch-device", "cpu", "--budget", "300",
         "--site", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    assert "fatal" not in report
    # 1. every platform's devices, with their limits
    listed = {d["index"]: d for d in report["devices"]}
    assert TEST_DEVICES[0].index in listed
    for d in listed.values():
        assert d["compute_units"] >= 1 and d["local_mem_bytes"] > 0
        assert d["max_work_group_size"] >= 1 and isinstance(d["fp16"], bool)
        assert d["fp16"] == ("cl_khr_fp16" in d["extensions"])
    # 2.-4. the device's ceilings and pagedkv's cases as fractions of them, checked
    (checked,) = report["checked"]
    assert checked["index"] == TEST_DEVICES[0].index
    ceilings = checked["ceilings"]
    assert ceilings["copy"] > 0 and ceilings["read"] > 0 and ceilings["sgemm"] > 0
    assert ceilings["buffer_bytes"] >= ceilings["cache_bytes"]
    cases = {c["case"]: c for c in checked["cases"]}
    for name in ("decode 2 x 256, float16", "decode 2 x 256, float32", "decode 2 x 256, int8",
                 "decode 2 x 512, window 64, float16", "prefill 128, causal, float16"):
        case = cases[name]
        assert case["correct"], case
        assert case["kernel_s"] > 0 and case["ratio"] > 0
    latent = [c for c in checked["cases"] if c["case"].startswith("latent")]
    assert latent and ("skipped" in latent[0] or latent[0]["correct"])
    if device_check.latent_available() is not None:
        assert "no latent layout" in latent[0]["skipped"]
    delta = [c for c in checked["cases"] if c["case"].startswith("gated delta rule")]
    assert delta and delta[0]["correct"] and delta[0]["ratio"] > 0, delta
    # 5. torch's rows (here its code path on the CPU), when torch is installed
    try:
        import torch  # noqa: F401
        assert report["torch"]["cases"] and all(
            "seconds" in row or "unavailable" in row
            for case in report["torch"]["cases"] for row in case["rows"])
    except ImportError:
        assert any(s["what"] == "torch comparison" for s in report["skipped"])
    # 6. the tests ran on that device, and the reasons for what was skipped
    tests = checked["tests"]
    assert tests["complete"] and tests["passed"] >= 1 and tests["failed"] == tests["error"] == 0
    skipped = {s["what"]: s["reason"] for s in report["skipped"]}
    if device_check.find_library(device_check.NVIDIA_LIBRARY) is None:
        assert "no libnvidia-opencl.so.1" in skipped["an ICD file for libnvidia-opencl.so.1"]
    assert report["elapsed_s"] < 300
    for text in (markdown, done.stdout):
        assert "| device " in text and "decode 2 x 256, float16" in text


def test_test_outcomes_are_counted_with_the_first_failures(tmp_path):
    # the plugin writes each outcome as it comes (a run cut short keeps them),
    # and a failure outside the test body counts as an error
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup broke')\n"
        "def test_errors(broken): pass\n")
    outcomes = tmp_path / "outcomes.jsonl"
    env = dict(os.environ, PAGEDKV_TEST_OUTCOMES=str(outcomes), PYTHONPATH=BENCHMARKS)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "_test_outcomes", "test_sample.py"], cwd=tmp_path, env=env,
                   capture_output=True, timeout=120)
    counts, failures = device_check.read_outcomes(str(outcomes))
    assert counts == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    messages = {f["test"].split("::")[-1]: f["message"] for f in failures}
    assert "one is not two" in messages["test_fails"]
    assert "setup broke" in messages["test_errors"]


DEBIAN_POCL = device_check.find_library("libpocl.so.2")


@pytest.mark.skipif(DEBIAN_POCL is None and not os.environ.get("CI"),
                    reason="needs Debian's pocl-opencl-icd (libpocl.so.2), which CI installs")
def test_a_driver_without_its_icd_file_is_registered(tmp_path):
    # Debian's PoCL stands in for NVIDIA's driver in a container that lacks the
    # ICD file: the loader is pointed at an empty vendors folder, so its
    # platform does not show until ensure_icd writes a file naming the library
    pytest.importorskip("pyopencl")
    empty = tmp_path / "vendors"
    empty.mkdir()
    env = dict(os.environ, OCL_ICD_VENDORS=str(empty))
    record = device_check.ensure_icd("libpocl.so.2", "PoCL 3.1", env=env)
    assert not any("PoCL 3.1" in p for p in record["platforms_before"])
    assert record["action"] == "created" and record["shows"], record
    assert record["library"] == DEBIAN_POCL and env["OCL_ICD_VENDORS"] == record["folder"]
    again = device_check.ensure_icd("libpocl.so.2", "PoCL 3.1", env=env)
    assert again["action"] == "none needed"


def test_no_driver_library_is_said(tmp_path):
    pytest.importorskip("pyopencl")
    record = device_check.ensure_icd("libno-such-opencl.so.1", "No Such Vendor",
                                     dirs=[str(tmp_path)], env=dict(os.environ))
    assert record["action"] == "not possible"
    assert "no libno-such-opencl.so.1" in record["reason"]


def test_a_build_says_what_it_lacks(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert any("no-such-compiler-here" in m for m in device_check.build_requirements())
    monkeypatch.setitem(sys.modules, "Cython", None)      # import Cython fails
    assert any(m.startswith("Cython") for m in device_check.build_requirements())


@needs_device
def test_ceilings_on_a_device(monkeypatch):
    # the bandwidth and sgemm kernels check their own results (a read that
    # sums wrong or a product unlike numpy's raises)
    import pyopencl as cl
    sizes = device_check.Sizes("cpu", True)
    sizes.min_buffer = sizes.max_buffer = 1 << 20
    sizes.sgemm_n = 64
    device = TEST_DEVICES[0].device
    ceilings = device_check.bandwidth(cl, device, sizes)
    assert ceilings["buffer_bytes"] == 1 << 20 and ceilings["read"] > 0
    product = device_check.sgemm_rate(cl, device, sizes, np.random.default_rng(0))
    assert product["n"] == 64 and product["flops"] > 0
    assert set(product["layouts_tried"]) <= {f"{a}/{b}/{c}" for a, b, c
                                            in device_check.SGEMM_LAYOUTS}


def test_imports_no_pyopencl_before_its_install():
    # the install steps must run before pyopencl or pagedkv is imported (a
    # probe in a fresh interpreter): importing the script imports neither
    code = ("import sys; sys.path.insert(0, %r); import device_check; "
            "print('pyopencl' in sys.modules, 'pagedkv' in sys.modules)" % BENCHMARKS)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.stdout.split() == ["False", "False"], done.stderr
