"""Finding an OpenCL device for the opencl backend, and saying why there is none.

Selection order (first that applies):

1. ``device=`` given to ``PagedKVCache``: a ``pyopencl.Device``, a
   ``pyopencl.Context``, or a string: ``"P:D"`` (platform index : device
   index, as ``clinfo -l`` and ``PYOPENCL_CTX`` count them), or a name,
   ``"name:TEXT"`` or plain ``"TEXT"``: the first device whose platform name,
   platform version or device name contains ``TEXT`` (case-insensitive), e.g.
   ``"name:pthread"``, ``"PoCL 3.1"``, ``"rusticl"``.  Indices move when
   another OpenCL implementation is installed; names do not;
2. ``$PAGEDKV_DEVICE``, a string as above;
3. ``$PYOPENCL_CTX``, pyopencl's own selector (via ``create_some_context``);
4. the first GPU of any platform, else the first accelerator, else the first
   CPU; a device that claims several kinds at once (the Oclgrind simulator
   says GPU, CPU and accelerator) only when nothing else exists.

pyopencl is imported lazily everywhere here, so this module imports (and
``unavailable_reason`` answers) on a machine without it.
"""
import os
import re
from types import ModuleType
from typing import TYPE_CHECKING, Any, List, Optional, Tuple, cast

from pagedkv import _process
from pagedkv.errors import ArgumentTypeError, BackendUnavailableError

if TYPE_CHECKING:   # annotations only: pyopencl is imported lazily
    import pyopencl

INSTALL_HINT = ('pip install "pagedkv[opencl]" (pyopencl plus the PoCL CPU driver), or install '
                'a system OpenCL driver (ICD) such as Debian\'s pocl-opencl-icd or your GPU '
                "vendor's")

# The answers, the shared contexts and the fork hook live in pagedkv._process.
FORKED_CHILD_REASON = _process.FORKED_CHILD_REASON


def unavailable_reason() -> Optional[str]:
    """None if pyopencl imports and sees at least one device; else why not and how to fix it.

    The answer is cached for the process (``reset_availability_cache`` forgets it).
    """
    state = _process.opencl
    if state.unavailable is _process.UNSET:
        state.unavailable = _probe()
    return cast(Optional[str], state.unavailable)     # worked out: None or a str


def has_preferred_device() -> bool:
    """Whether ``backend="auto"`` should take opencl (call only when it is available).

    Yes when ``$PAGEDKV_DEVICE`` or ``$PYOPENCL_CTX`` names a device, or when a
    GPU or an accelerator exists (a simulator that claims every kind does
    not count).  A machine whose only OpenCL device is a CPU
    driver (PoCL) runs the host backend's own kernels faster on the same
    cores (see the README's figures), so auto takes host there.  The device
    scan is cached for the process, like ``unavailable_reason``.
    """
    if os.environ.get("PAGEDKV_DEVICE") or os.environ.get("PYOPENCL_CTX"):
        return True
    state = _process.opencl
    if state.preferred is _process.UNSET:
        import pyopencl as cl
        state.preferred = any(_preference(cl, device) < _KINDS.index("CPU")
                              for _, _, device in _all_devices(cl))
    return cast(bool, state.preferred)     # worked out: a bool


def reset_availability_cache() -> None:
    """Forget the cached answers above (for tests that fake a driver); a forked child's
    refusal stays."""
    state = _process.opencl
    if state.unavailable is not FORKED_CHILD_REASON:
        state.unavailable = state.preferred = _process.UNSET


def _probe() -> Optional[str]:
    try:
        import pyopencl as cl
    except Exception as exc:  # ImportError, or a broken binary install (OSError, ...)
        return f"the opencl backend needs pyopencl, which cannot be imported ({exc}); {INSTALL_HINT}"
    try:
        devices = _all_devices(cl)
    except Exception as exc:  # e.g. LogicError: PLATFORM_NOT_FOUND_KHR with no ICD installed
        return f"pyopencl found no OpenCL platform ({exc}); {INSTALL_HINT}"
    if not devices:
        return f"pyopencl found no OpenCL device; {INSTALL_HINT}"
    return None


def _all_devices(cl: ModuleType) -> "List[Tuple[int, int, pyopencl.Device]]":
    """[(platform_index, device_index, Device)] over every platform."""
    _process.opencl.driver_started = True
    found: "List[Tuple[int, int, pyopencl.Device]]" = []
    for p, platform in enumerate(cl.get_platforms()):
        try:
            devices = platform.get_devices()
        except cl.Error:  # a platform with no device raises DEVICE_NOT_FOUND
            continue
        found.extend((p, d, device) for d, device in enumerate(devices))
    return found


def describe_devices() -> str:
    """One line per device: ``"P:D  platform / device (type)"``, for error messages."""
    import pyopencl as cl
    try:
        devices = _all_devices(cl)
    except cl.Error as exc:
        return f"  (none: {exc})"
    if not devices:
        return "  (none)"
    return "\n".join(f"  {p}:{d}  {device_label(dev)} ({_kind(cl, dev)})"
                     for p, d, dev in devices)


def device_label(device: "pyopencl.Device") -> str:
    """``"platform / device [platform version]"``: what a device name is matched against."""
    platform = device.platform
    return f"{platform.name.strip()} / {device.name.strip()} [{platform.version.strip()}]"


_KINDS = ("GPU", "ACCELERATOR", "CPU")


def _kinds(cl: ModuleType, device: "pyopencl.Device") -> List[str]:
    """The kinds among GPU, accelerator and CPU that ``device`` claims."""
    return [kind for kind in _KINDS if device.type & getattr(cl.device_type, kind)]


def is_simulator(cl: ModuleType, device: "pyopencl.Device") -> bool:
    """Whether ``device`` claims several kinds at once, as simulators do (Oclgrind)."""
    return len(_kinds(cl, device)) > 1


def _preference(cl: ModuleType, device: "pyopencl.Device") -> int:
    """Sort key of the automatic choice: a GPU, an accelerator, a CPU, then the rest."""
    kinds = _kinds(cl, device)
    return _KINDS.index(kinds[0]) if len(kinds) == 1 else len(_KINDS)


def _kind(cl: ModuleType, device: "pyopencl.Device") -> str:
    kinds = _kinds(cl, device)
    return "+".join(k if k != "ACCELERATOR" else "accelerator" for k in kinds) or "other"


_INDEX = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*")


def find_device(text: str, what: str) -> "pyopencl.Device":
    """The Device that ``text`` names: ``"P:D"``, ``"name:TEXT"`` or a name ``TEXT``.

    A name matches a device whose platform name, platform version or device
    name contains it, ignoring case; the first match in platform and device
    order wins (:func:`find_devices` returns them all).

    Raises
    ------
    ValueError
        ``text`` names no device (or is empty, or looks like a malformed
        index); the message starts with ``what`` and lists the devices.
    """
    return find_devices(text, what)[0]


def find_devices(text: str, what: str) -> "List[pyopencl.Device]":
    """Every Device that ``text`` names, in platform and device order; see :func:`find_device`."""
    import pyopencl as cl
    devices = _all_devices(cl)
    listing = f"available devices:\n{describe_devices()}"
    index = _INDEX.fullmatch(text)
    if index:
        key = (int(index.group(1)), int(index.group(2)))
        found = [dev for p, d, dev in devices if (p, d) == key]
        if not found:
            raise ValueError(f"{what}: no OpenCL device {text!r}; {listing}")
        return found
    name = text.strip()
    if name.lower().startswith("name:"):
        name = name[len("name:"):].strip()
    elif re.fullmatch(r"[\d:\s]*", name):     # "", "0", "1:2:3": an index gone wrong
        name = ""
    if not name:
        raise ValueError(f"{what}: expected 'P:D' (platform index : device index), "
                         f"'name:TEXT' or a device name, got {text!r}; {listing}")
    found = [dev for _, _, dev in devices if name.casefold() in device_label(dev).casefold()]
    if not found:
        raise ValueError(f"{what}: no OpenCL device matches {text!r} (by platform name, "
                         f"platform version or device name); {listing}")
    return found


def device_index(device: "pyopencl.Device") -> str:
    """The ``"P:D"`` string of ``device`` in this process's platform and device order."""
    import pyopencl as cl
    for p, d, dev in _all_devices(cl):
        if dev == device:
            return f"{p}:{d}"
    raise ValueError(f"device: {device_label(device)} is not among the devices pyopencl lists")


def context_for_device(device: "pyopencl.Device") -> "pyopencl.Context":
    """A Context on ``device``, shared by every backend on it (programs are cached per context).

    Held for the process until ``pagedkv._process.clear_caches()``.
    """
    import pyopencl as cl
    state = _process.opencl
    with state.lock:
        context = state.contexts.get(device)
        if context is None:
            context = state.contexts[device] = cl.Context([device])
    return context


def select_device(device: Any = None) -> "Tuple[pyopencl.Context, pyopencl.Device]":
    """The ``(Context, Device)`` the backend runs on; see the module docstring for the rules.

    Parameters
    ----------
    device : pyopencl.Device, pyopencl.Context, str or None

    Raises
    ------
    ValueError
        A string (in ``device`` or ``$PAGEDKV_DEVICE``) that names no device.
    ArgumentTypeError
        ``device`` of another type.
    """
    import pyopencl as cl
    if isinstance(device, cl.Context):
        return device, device.devices[0]
    if isinstance(device, cl.Device):
        return context_for_device(device), device
    if isinstance(device, str):
        dev = find_device(device, "device")
        return context_for_device(dev), dev
    if device is not None:
        raise ArgumentTypeError(f"device: expected a pyopencl Device or Context, or a 'P:D' "
                                f"or name string, got {type(device).__name__}")
    env = os.environ.get("PAGEDKV_DEVICE", "").strip()
    if env:
        dev = find_device(env, "PAGEDKV_DEVICE")
        return context_for_device(dev), dev
    if os.environ.get("PYOPENCL_CTX", "").strip():
        # pyopencl's own syntax ("P:D", "P", name fragments).  Keep only its
        # device: the shared context keeps the program cache warm.
        try:
            dev = cl.create_some_context(interactive=False).devices[0]
        except cl.Error as exc:
            raise ValueError(f"PYOPENCL_CTX: {os.environ['PYOPENCL_CTX']!r} selects no device "
                             f"({exc}); available devices:\n{describe_devices()}") from None
        return context_for_device(dev), dev
    devices = [dev for _, _, dev in _all_devices(cl)]
    if not devices:
        raise BackendUnavailableError(f"pyopencl found no OpenCL device; {INSTALL_HINT}")
    dev = min(devices, key=lambda dev: _preference(cl, dev))   # min keeps the first of ties
    return context_for_device(dev), dev
