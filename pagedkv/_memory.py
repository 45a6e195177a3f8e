"""How much memory this process may use, so that an oversized cache fails at once.

A cache far larger than the machine is otherwise accepted (numpy and most
OpenCL CPU drivers back pools lazily) and the process is OOM-killed, or the
driver crashes, when the pages get written.  The limit is the smallest of the
physical memory, the cgroup (container) limit and the address-space rlimit.
"""
import os
from typing import List, Optional, Tuple

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",                    # cgroup v2
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v1


def memory_limit() -> Tuple[Optional[int], Optional[str]]:
    """``(bytes, what)``: the most memory this process can still allocate, and what limits it.

    ``(None, None)`` where nothing can be read (then nothing is refused).
    """
    limits: List[Tuple[int, str]] = []
    try:
        limits.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                       "physical memory"))
    except (AttributeError, ValueError, OSError):   # not a POSIX system
        pass
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            limits.append((int(text), f"container memory limit ({path})"))
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limits.append((max(soft - used, 0), "address-space limit (ulimit -v) left"))
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else (None, None)


def check_fits(nbytes: int, what: str) -> None:
    """Raise ``MemoryError`` naming ``what`` if ``nbytes`` exceed :func:`memory_limit`."""
    limit, name = memory_limit()
    if limit is not None and nbytes > limit:
        raise MemoryError(f"{what}: needs {nbytes / 2**30:.2f} GiB ({nbytes} bytes), more than "
                          f"this machine's {name} of {limit / 2**30:.2f} GiB")
