"""One caller at a time per cache: the threading model of ``PagedKVCache``.

Every public method and property of a cache runs under the cache's lock, so
threads that share a cache are serialised; the kernels still run without the
GIL (threads on other caches, or doing other work, run meanwhile), on state
that no other thread can change under them.  A call made from inside another
call on the same cache (a ``prefix_hash`` callback that touches the cache)
is refused with a clear error instead of deadlocking or seeing a half-done
step.  In a ``fork()``ed child every lock starts free (the fork hook in
:mod:`pagedkv._process` resets them).
"""
import functools
import threading
from typing import Any, Callable, Optional, TypeVar, cast

from pagedkv import _process
from pagedkv.errors import ReentrantCallError

_Method = TypeVar("_Method", bound=Callable[..., Any])


class Guard:
    """The lock of one cache, and which thread holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: Optional[int] = None
        _process.track_guard(self)

    def _reset(self) -> None:
        """A free lock, in a forked child (another thread of the parent may have held it)."""
        self._lock = threading.Lock()
        self._owner = None


def exclusive(method: _Method) -> _Method:
    """Run ``method`` (of an object with a ``_guard``) under its cache's lock."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = self._guard
        me = threading.get_ident()
        if guard._owner == me:
            raise ReentrantCallError(
                f"{method.__name__}: called from inside another call on this cache (a "
                f"prefix_hash callback?); callbacks must not use the cache they serve")
        with guard._lock:
            guard._owner = me
            try:
                return method(self, *args, **kwargs)
            finally:
                guard._owner = None
    return cast(_Method, wrapper)

