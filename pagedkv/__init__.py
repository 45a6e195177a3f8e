"""pagedkv: a paged KV cache for LLM inference, on the CPU or any OpenCL device.

>>> import pagedkv
>>> cache = pagedkv.PagedKVCache(num_layers, num_kv_heads, head_dim, num_pages=1024)
>>> s = cache.add_sequence()
>>> batch = cache.append([s], [prompt_len])
>>> cache.store(layer, batch, k, v); out = cache.attention(layer, batch, q)
"""
try:
    # the compiled core; _cpu imports the host kernels of this CPU's level
    from pagedkv import _allocator, _cpu, _page_table  # noqa: F401
except ImportError:  # pragma: no cover - depends on how Python was started
    import sys as _sys
    from importlib.machinery import EXTENSION_SUFFIXES as _SUFFIXES
    from os import listdir as _listdir
    if any(name.startswith("_allocator") and name.endswith(tuple(_SUFFIXES))
           for name in _listdir(__path__[0])):
        raise                                   # built, but failing to load: show why
    _message = (f"pagedkv's compiled modules are missing from {__path__[0]}: this is the "
                f"source tree without a build (Python puts the current directory first on "
                f"`python -m`). Run from another directory, or build in place with "
                f"`pip install -e .`")
    if _sys.argv[:1] == ["-m"]:
        # `python -m pagedkv ...` while Python locates the module: the message, no traceback.
        print(f"error: {_message}", file=_sys.stderr)
        raise SystemExit(1) from None
    raise ImportError(_message) from None

from pagedkv.backends import available_backends
from pagedkv.cache import PagedKVCache
from pagedkv.state_spec import StateSpec
from pagedkv.checkpoint import Checkpoint
from pagedkv.step import StepBatch, WindowTables
from pagedkv.storage import StorageFormat
from pagedkv.transfer import SequenceKV
from pagedkv.errors import (ArgumentTypeError, BackendUnavailableError, OutOfPagesError,
                            ReentrantCallError, UnknownSequenceError)
from pagedkv._config import show_config
from pagedkv._version import __version__  # noqa: F401  (public: pagedkv.__version__)

__all__ = [
    "ArgumentTypeError", "BackendUnavailableError", "Checkpoint", "OutOfPagesError",
    "PagedKVCache", "ReentrantCallError", "SequenceKV", "StateSpec", "StepBatch", "StorageFormat",
    "UnknownSequenceError",
    "WindowTables", "available_backends", "show_config",
]
