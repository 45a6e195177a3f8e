"""Finding an OpenCL device for the opencl backend, and saying why there is none.

Selection order (first that applies):

1. ``device=`` given to ``PagedKVCache``: a ``pyopencl.Device``, a
   ``pyopencl.Context``, or a ``"P:D"`` string (platform index : device index,
   as ``clinfo -l`` and ``PYOPENCL_CTX`` count them);
2. ``$PAGEDKV_DEVICE``, a ``"P:D"`` string;
3. ``$PYOPENCL_CTX``, pyopencl's own selector (via ``create_some_context``);
4. the first GPU of any platform, else the first device of any kind.

pyopencl is imported lazily everywhere here, so this module imports (and
``unavailable_reason`` answers) on a machine without it.
"""
import os

from pagedkv.errors import ArgumentTypeError, BackendUnavailableError

INSTALL_HINT = ('pip install "pagedkv[opencl]" (pyopencl plus the PoCL CPU driver), or install '
                'a system OpenCL driver (ICD) such as Debian\'s pocl-opencl-icd or your GPU '
                "vendor's")

_UNSET = object()
_unavailable = _UNSET          # cached answer of unavailable_reason()
_preferred = _UNSET            # cached: is any device a GPU or accelerator?
_contexts: dict = {}           # Device -> Context, so that every cache on a device shares programs


def unavailable_reason():
    """None if pyopencl imports and sees at least one device; else why not and how to fix it.

    The answer is cached for the process (``reset_availability_cache`` forgets it).
    """
    global _unavailable
    if _unavailable is _UNSET:
        _unavailable = _probe()
    return _unavailable


def has_preferred_device():
    """Whether ``backend="auto"`` should take opencl (call only when it is available).

    Yes when ``$PAGEDKV_DEVICE`` or ``$PYOPENCL_CTX`` names a device, or when a
    GPU or accelerator exists.  A machine whose only OpenCL device is a CPU
    driver (PoCL) runs the host backend's own kernels faster on the same
    cores (see the README's figures), so auto takes host there.  The device
    scan is cached for the process, like ``unavailable_reason``.
    """
    global _preferred
    if os.environ.get("PAGEDKV_DEVICE") or os.environ.get("PYOPENCL_CTX"):
        return True
    if _preferred is _UNSET:
        import pyopencl as cl
        _preferred = any(not device.type & cl.device_type.CPU
                         for _, _, device in _all_devices(cl))
    return _preferred


def reset_availability_cache():
    """Forget the cached answers above (for tests that fake a driver)."""
    global _unavailable, _preferred
    _unavailable = _preferred = _UNSET


def _probe():
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


def _all_devices(cl):
    """[(platform_index, device_index, Device)] over every platform."""
    found = []
    for p, platform in enumerate(cl.get_platforms()):
        try:
            devices = platform.get_devices()
        except cl.Error:  # a platform with no device raises DEVICE_NOT_FOUND
            continue
        found.extend((p, d, device) for d, device in enumerate(devices))
    return found


def describe_devices():
    """One line per device: ``"P:D  platform / device (type)"``, for error messages."""
    import pyopencl as cl
    try:
        devices = _all_devices(cl)
    except cl.Error as exc:
        return f"  (none: {exc})"
    if not devices:
        return "  (none)"
    return "\n".join(f"  {p}:{d}  {dev.platform.name.strip()} / {dev.name.strip()} "
                     f"({_kind(cl, dev)})" for p, d, dev in devices)


def _kind(cl, device):
    for flag, word in ((cl.device_type.GPU, "GPU"), (cl.device_type.CPU, "CPU"),
                       (cl.device_type.ACCELERATOR, "accelerator")):
        if device.type & flag:
            return word
    return "other"


def _parse_index(text, what):
    """The Device that a ``"P:D"`` string names; ValueError naming ``what`` otherwise."""
    import pyopencl as cl
    parts = text.strip().split(":")
    devices = {(p, d): dev for p, d, dev in _all_devices(cl)}
    try:
        key = (int(parts[0]), int(parts[1])) if len(parts) == 2 else None
    except ValueError:
        key = None
    if key is None:
        raise ValueError(f"{what}: expected a 'P:D' string (platform index : device index), "
                         f"got {text!r}; available devices:\n{describe_devices()}")
    if key not in devices:
        raise ValueError(f"{what}: no OpenCL device {text!r}; available devices:\n"
                         f"{describe_devices()}")
    return devices[key]


def context_for_device(device):
    """A Context on ``device``, shared by every backend on it (programs are cached per context)."""
    import pyopencl as cl
    if device not in _contexts:
        _contexts[device] = cl.Context([device])
    return _contexts[device]


def select_device(device=None):
    """The ``(Context, Device)`` the backend runs on; see the module docstring for the rules.

    Parameters
    ----------
    device : pyopencl.Device, pyopencl.Context, str or None

    Raises
    ------
    ValueError
        A malformed or unknown ``"P:D"`` string (in ``device`` or ``$PAGEDKV_DEVICE``).
    ArgumentTypeError
        ``device`` of another type.
    """
    import pyopencl as cl
    if isinstance(device, cl.Context):
        return device, device.devices[0]
    if isinstance(device, cl.Device):
        return context_for_device(device), device
    if isinstance(device, str):
        dev = _parse_index(device, "device")
        return context_for_device(dev), dev
    if device is not None:
        raise ArgumentTypeError(f"device: expected a pyopencl Device or Context or a 'P:D' "
                                f"string, got {type(device).__name__}")
    env = os.environ.get("PAGEDKV_DEVICE", "").strip()
    if env:
        dev = _parse_index(env, "PAGEDKV_DEVICE")
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
    gpus = [dev for dev in devices if dev.type & cl.device_type.GPU]
    dev = (gpus or devices)[0]
    return context_for_device(dev), dev
