"""What this pagedkv runs with, for bug reports: ``pagedkv.show_config()``."""
import platform
import sys
from types import ModuleType
from typing import Dict, Optional, TextIO

from pagedkv import _cpu
from pagedkv._version import __version__


def _openmp_text(kernels: ModuleType) -> str:
    version = getattr(kernels, "OPENMP_VERSION", 0)
    if not version:
        return "off (the compiler had no OpenMP: the host kernels run serially)"
    from pagedkv.backends.host import _max_threads
    return (f"on (_OPENMP {version}); the host backend uses up to {_max_threads()} threads "
            f"(the cores this process may run on, capped by OMP_NUM_THREADS)")


def _opencl_text() -> str:
    from pagedkv.backends import _opencl_device
    reason = _opencl_device.unavailable_reason()
    if reason is not None:
        return f"not available: {reason}"
    return "devices (platform:device):\n" + _opencl_device.describe_devices()


def _auto_backend_text() -> str:
    from pagedkv.backends import resolve_backend
    try:
        return resolve_backend("auto")
    except (ValueError, RuntimeError) as exc:   # a bad $PAGEDKV_BACKEND, say
        return f"none ({exc})"


def config() -> Dict[str, str]:
    """What :func:`show_config` prints, as a dict of str.

    Returns
    -------
    dict of str to str
        Keys ``version``, ``python``, ``host kernels``, ``levels built``,
        ``levels this CPU runs``, ``level chosen by``, ``OpenMP``,
        ``OpenCL``, ``backend="auto"``.
    """
    level = _cpu.level
    requested = _cpu.REQUESTED
    return {
        "version": f"pagedkv {__version__}",
        "python": f"{platform.python_implementation()} {platform.python_version()} on "
                  f"{sys.platform} {platform.machine()}",
        "host kernels": f"{level.name}: {level.description} ({_cpu.kernels.__name__})",
        "levels built": ", ".join(_cpu.BUILT),
        "levels this CPU runs": ", ".join(_cpu.SUPPORTED),
        "level chosen by": (f"{_cpu.ENV_VAR}={requested}" if requested else
                            f"the CPU (set {_cpu.ENV_VAR} to force a lower level)"),
        "OpenMP": _openmp_text(_cpu.kernels),
        "OpenCL": _opencl_text(),
        'backend="auto"': _auto_backend_text(),
    }


def show_config(file: Optional[TextIO] = None) -> None:
    """Print the version, the host kernels' CPU level, OpenMP and threads, and the OpenCL devices.

    Parameters
    ----------
    file : file-like, optional
        Where to print (default ``sys.stdout``).

    Examples
    --------
    >>> import pagedkv
    >>> pagedkv.show_config()                        # doctest: +SKIP
    version:              pagedkv 0.1.0
    host kernels:         avx2: AVX2 + FMA + F16C (x86-64-v3) (pagedkv._kernels_avx2)
    ...
    """
    items = config()
    width = max(len(name) for name in items) + 2
    for name, text in items.items():
        print(f"{name + ':':<{width}}{text}", file=file or sys.stdout)
