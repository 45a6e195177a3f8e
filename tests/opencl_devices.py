"""The OpenCL devices the tests run on, in the style of pyopencl's ``ctx_factory``.

Tests that need OpenCL run once per test device instead of on whatever
device a module global points at: the shared ``backend`` fixture
(``conftest.py``) has one param per device, and ``test_opencl.py``'s
``cl_device`` fixture hands each test the device itself.

Which devices:

* ``$PAGEDKV_TEST_DEVICES``: entries separated by ``;``, each what
  ``PAGEDKV_DEVICE`` takes (``"P:D"``, ``"name:TEXT"`` or a name), selecting
  every device it matches, e.g. ``"name:PoCL 3.1"`` or ``"pthread;rusticl"``;
* else pyopencl's ``$PYOPENCL_TEST`` (``"0:0,1;intel:i5"``, parsed by
  ``pyopencl.tools``);
* else every device except simulators: Oclgrind (which claims to be a GPU, a
  CPU and an accelerator at once) runs only ``test_oclgrind.py``, whose
  checks make it thousands of times slower than a driver.

The first device is the primary one: tests marked ``one_opencl_device``
(whole-model tests that exercise the engine more than the kernels) run on it
alone, to keep CI's time in bounds.
"""
import os
import re
from dataclasses import dataclass

import pagedkv


@dataclass(frozen=True)
class TestDevice:
    """One OpenCL device under test.

    Attributes
    ----------
    id : str
        Test id, ``"opencl-<implementation>"``, e.g. ``"opencl-pocl3.1"``:
        stable across installs, unlike indices, so ``-k`` can select it.
    index : str
        ``"P:D"`` in this process (what the fixtures put in ``PAGEDKV_DEVICE``).
    device : pyopencl.Device
    """

    __test__ = False          # not a test class, despite its name
    id: str
    index: str
    device: object


def implementation(device):
    """A short name of the device's OpenCL implementation: ``"pocl3.1"``, ``"oclgrind21.10"``."""
    version = device.platform.version.strip()
    words = re.sub(r"^OpenCL \d+\.\d+", "", version).replace("(", " ").replace(")", " ").split()
    words = words[:2] if words else [device.platform.name.strip()]
    words[-1] = words[-1].split("+")[0].split("-")[0]       # "3.1+debian" -> "3.1"
    return re.sub(r"[^a-z0-9.]+", "", "".join(words).lower()) or "device"


def _selected():
    from pagedkv.backends import _opencl_device
    import pyopencl as cl
    wanted = os.environ.get("PAGEDKV_TEST_DEVICES", "").strip()
    if wanted:
        devices = []
        for entry in filter(None, (e.strip() for e in wanted.split(";"))):
            devices += _opencl_device.find_devices(entry, "PAGEDKV_TEST_DEVICES")
    elif os.environ.get("PYOPENCL_TEST", "").strip():
        from pyopencl.tools import get_test_platforms_and_devices
        devices = [dev for _, devs in get_test_platforms_and_devices() for dev in devs]
    else:
        devices = [dev for _, _, dev in _opencl_device._all_devices(cl)
                   if not _opencl_device.is_simulator(cl, dev)]
    unique = []
    for dev in devices:
        if dev not in unique:
            unique.append(dev)
    return unique


def _test_devices():
    if "opencl" not in pagedkv.available_backends():
        return []
    from pagedkv.backends._opencl_device import device_index
    found, ids = [], set()
    for dev in _selected():
        base = name = f"opencl-{implementation(dev)}"
        n = 1
        while name in ids:                 # two devices of one implementation
            n += 1
            name = f"{base}-{n}"
        ids.add(name)
        found.append(TestDevice(name, device_index(dev), dev))
    return found


#: The devices under test, primary first (empty without a usable OpenCL).
TEST_DEVICES = _test_devices()
