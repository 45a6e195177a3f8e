"""The backend registry: names, availability, and construction.

A backend owns the K/V page pools of every layer and runs the data-path
kernels.  It knows pages, slots and tables, never sequences.  The protocol
(``Backend`` in :mod:`pagedkv.backends.base`) is what ``PagedKVCache`` calls;
backends are imported lazily so that a missing optional dependency (pyopencl)
only matters to the backend that needs it.
"""
import importlib
import os
from typing import TYPE_CHECKING, Any, List, Optional, Type

from pagedkv.errors import BackendUnavailableError

if TYPE_CHECKING:   # annotations only: backends are imported lazily
    from pagedkv.backends.base import Backend

# name -> "module:Class"; "auto" tries them in this order and takes the first that
# can run here and suits it (see ``Backend.suits_auto``).
_REGISTRY = {
    "opencl": "pagedkv.backends.opencl:OpenCLBackend",
    "host": "pagedkv.backends.host:HostBackend",
}
_AUTO_ORDER = ("opencl", "host")


def backend_class(name: Any) -> "Type[Backend]":
    """The backend class registered as ``name``.

    Raises
    ------
    ValueError
        ``name`` is not a known backend.
    BackendUnavailableError
        The backend's module cannot be imported here.
    """
    if name not in _REGISTRY:
        raise ValueError(f"backend: expected one of {sorted(_REGISTRY) + ['auto']}, got {name!r}")
    module_name, class_name = _REGISTRY[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BackendUnavailableError(f"backend {name!r} cannot be imported: {exc}") from exc
    return getattr(module, class_name)


def unavailable_reason(name: str) -> Optional[str]:
    """None if backend ``name`` can run here, else a message saying how to fix it."""
    try:
        return backend_class(name).unavailable_reason()
    except BackendUnavailableError as exc:
        return str(exc)


def available_backends() -> List[str]:
    """Names of the backends usable on this machine, e.g. ``["host", "opencl"]``."""
    return [name for name in ("host", "opencl") if unavailable_reason(name) is None]


def resolve_backend(name: Any) -> str:
    """Turn ``"auto"`` (or the ``PAGEDKV_BACKEND`` override) into a concrete backend name."""
    if name == "auto":
        name = os.environ.get("PAGEDKV_BACKEND", "auto") or "auto"
        if name == "auto":
            return next(n for n in _AUTO_ORDER
                        if unavailable_reason(n) is None and backend_class(n).suits_auto())
    if not isinstance(name, str) or name not in _REGISTRY:
        from_env = os.environ.get("PAGEDKV_BACKEND") == name
        raise ValueError(f"backend: expected one of {sorted(_REGISTRY) + ['auto']}, got "
                         f"{name!r}" + (" from $PAGEDKV_BACKEND, which overrides 'auto' (unset "
                                        "it or fix its value)" if from_env else ""))
    reason = unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailableError(reason)
    return name
