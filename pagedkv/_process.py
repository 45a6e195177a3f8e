"""Per-process state: what pagedkv keeps for the whole process, and the one fork hook.

Everything a process shares between its caches lives here, and nowhere else:

* OpenCL (used by :mod:`pagedkv.backends._opencl_device` and
  :mod:`pagedkv.backends._opencl_program`, see :data:`opencl`):

  - the answers of ``unavailable_reason()`` and ``has_preferred_device()``
    (a device scan is slow), and whether this process has asked the
    drivers anything yet;
  - one ``Context`` per ``Device``, so that caches on one device share
    their built programs;
  - the built programs, per context.  They are keyed *weakly* by the
    context: a context that nothing else references (one a caller passed
    as ``device=`` and dropped, or one :func:`clear_caches` forgot) is
    released together with its programs;

* host: whether this process is a ``fork()``ed child (:func:`in_forked_child`),
  where OpenMP must not start a team (libgomp is not fork-safe);
* every cache's lock (:func:`track_guard`), which a child must start free.

:func:`clear_caches` drops the cached contexts and programs (for tests, or
for an engine that moves to another device); caches made later build
afresh, live caches keep what they hold.

A single ``os.register_at_fork`` hook (:func:`_after_fork_in_child`) resets
all of it in a child: the lock is new, every cache's lock starts free, the
OpenCL caches start empty, and, if the parent had started its OpenCL driver,
OpenCL is unavailable in the child with :data:`FORKED_CHILD_REASON` (drivers
hang there).  The parent's contexts and programs are kept referenced, not
released, in the child: releasing them would call into that driver.
"""
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:   # annotations only
    from pagedkv._exclusive import Guard

FORKED_CHILD_REASON = (
    "this process was fork()ed from one that had already started its OpenCL driver, and "
    "OpenCL drivers (PoCL among them) hang in such a child; create OpenCL caches only in "
    "processes that have not inherited a started driver, e.g. with multiprocessing's "
    "\"spawn\" start method (multiprocessing.set_start_method(\"spawn\"))")

UNSET = object()    # an answer not worked out yet


class OpenCLState:
    """The OpenCL state of this process (one instance, :data:`opencl`).

    Attributes
    ----------
    unavailable : str, None or UNSET
        ``unavailable_reason()``'s answer.
    preferred : bool or UNSET
        ``has_preferred_device()``'s device scan.
    driver_started : bool
        Whether this process has asked the OpenCL drivers anything.
    contexts : dict
        ``{pyopencl.Device: pyopencl.Context}``, shared by every cache on a device.
    programs : weakref.WeakKeyDictionary
        ``{pyopencl.Context: {(file name, options, text): {kernel name: KernelCall}}}``.
    lock : threading.Lock
        Held while building or looking up a program.
    """

    def __init__(self) -> None:
        self.unavailable: object = UNSET     # then None or a str
        self.preferred: object = UNSET       # then a bool
        self.driver_started = False
        self.contexts: dict = {}
        self.programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()

    def programs_for(self, context: Any) -> Dict[Any, Any]:
        """The program cache of ``context``, ``{(name, options, text): kernels}``; call
        under :attr:`lock`."""
        return self.programs.setdefault(context, {})


opencl = OpenCLState()

_forked_child = False
_guards: weakref.WeakSet = weakref.WeakSet()   # every cache's Guard (pagedkv._exclusive)
_inherited: list = []   # a child's parent-made OpenCL objects, never released (see above)


def in_forked_child() -> bool:
    """Whether this process is a ``fork()``ed child (of a process that imported pagedkv)."""
    return _forked_child


def track_guard(guard: "Guard") -> None:
    """Give ``guard`` (a cache's lock, :class:`pagedkv._exclusive.Guard`) a fresh lock in a
    forked child; held weakly."""
    _guards.add(guard)


def clear_caches() -> None:
    """Drop the cached OpenCL contexts and built programs of this process.

    For tests, and for an engine that moves to another device: caches made
    afterwards get a fresh context and build their programs again (from
    pyopencl's binary cache where it has them); live caches keep the context
    and the kernels they hold.  The availability answers stay (see
    ``pagedkv.backends._opencl_device.reset_availability_cache``).
    """
    with opencl.lock:
        opencl.contexts.clear()
        opencl.programs.clear()


def _after_fork_in_child() -> None:
    """Reset what a forked child must not inherit (see the module docstring)."""
    global _forked_child
    _forked_child = True
    for guard in list(_guards):
        guard._reset()
    # Another thread of the parent may have held the lock at fork time.
    opencl.lock = threading.Lock()
    _inherited.append((opencl.contexts.copy(), dict(opencl.programs)))
    opencl.contexts.clear()
    opencl.programs = weakref.WeakKeyDictionary()
    if opencl.driver_started:
        opencl.unavailable = FORKED_CHILD_REASON
        opencl.preferred = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
