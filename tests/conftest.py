"""The shared ``backend`` fixture: behaviour tests run once per backend and OpenCL device.

A test takes ``backend`` and passes ``backend=backend`` to ``PagedKVCache``;
its body never branches on it.  The params are ``"host"`` and one per OpenCL
test device (``opencl_devices.TEST_DEVICES``, picked by
``$PAGEDKV_TEST_DEVICES`` or ``$PYOPENCL_TEST``); an OpenCL param hands the
test ``"opencl"`` with ``PAGEDKV_DEVICE`` set to that device, so the cache
runs there.  Tests marked ``one_opencl_device`` run on the primary device only.

Tests marked ``slow`` are the few that take most of the suite's time (whole
models, builds, emulators, simulators, model checkers); ``pytest -m "not
slow"`` leaves them out for a first check, and CI runs everything.
"""
import os

import pytest

import pagedkv
from opencl_devices import TEST_DEVICES


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "one_opencl_device: run on the primary OpenCL test device only (whole-model "
                   "tests, to keep the suite's time in bounds)")
    config.addinivalue_line(
        "markers", "slow: one of the tests that take most of the suite's time (whole models, "
                   "sanitizer and fallback builds, qemu, Oclgrind, model checkers); "
                   "-m 'not slow' leaves them out")


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames:
        return
    params = []
    if "host" in pagedkv.available_backends():
        params.append(pytest.param("host", id="host"))
    devices = TEST_DEVICES
    if metafunc.definition.get_closest_marker("one_opencl_device"):
        devices = devices[:1]
    params += [pytest.param(device, id=device.id) for device in devices]
    metafunc.parametrize("backend", params, indirect=True)


@pytest.fixture
def backend(request, monkeypatch):
    """``"host"``, or ``"opencl"`` on one test device (through ``$PAGEDKV_DEVICE``)."""
    if request.param == "host":
        return "host"
    monkeypatch.setenv("PAGEDKV_DEVICE", request.param.index)
    return "opencl"


@pytest.fixture(scope="session")
def hf_converted_dir(tmp_path_factory):
    """Where tests keep GGUF models dequantized by transformers (``pagedkv.hf.loading``):
    converting takes about a minute per model, loading the result a second.  Once per
    session, or once for good with ``$PAGEDKV_HF_MODEL_CACHE`` naming a folder."""
    folder = os.environ.get("PAGEDKV_HF_MODEL_CACHE")
    return folder if folder else str(tmp_path_factory.mktemp("hf-models"))
