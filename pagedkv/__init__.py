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
except ImportError as exc:  # pragma: no cover - depends on how Python was started
    raise ImportError(
        f"pagedkv's compiled modules are missing from {__path__[0]}: this is the source tree "
        f"without a build (Python puts the current directory first on `python -m`). Run from "
        f"another directory, or build in place with `pip install -e .`") from exc

from pagedkv.backends import available_backends
from pagedkv.cache import PagedKVCache
from pagedkv.checkpoint import Checkpoint
from pagedkv.step import StepBatch
from pagedkv.errors import (ArgumentTypeError, BackendUnavailableError, OutOfPagesError,
                            UnknownSequenceError)
from pagedkv._config import show_config
from pagedkv._version import __version__  # noqa: F401  (public: pagedkv.__version__)

__all__ = [
    "ArgumentTypeError", "BackendUnavailableError", "Checkpoint", "OutOfPagesError",
    "PagedKVCache", "StepBatch", "UnknownSequenceError", "available_backends",
    "show_config",
]
