"""Helpers shared by the benchmarks: timing, the machine's read bandwidth, the
``--backends`` option and one process per backend.

Machines are noisy, so every benchmark reports ratios measured in one run:
against the bandwidth this script measures on the spot, and against a
contiguous baseline on the same data.
"""
import argparse
import ctypes
import functools
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def best_seconds(fn, *, repeat=7, warmup=2):
    """Fastest wall time of ``fn()`` over ``repeat`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def paired_ratio(a, b, rounds, repeat):
    """Median over rounds of time(a) / time(b), the two timed alternately."""
    ratios, times = [], []
    for _ in range(rounds):
        ta = best_seconds(a, repeat=repeat, warmup=1)
        tb = best_seconds(b, repeat=repeat, warmup=1)
        ratios.append(ta / tb)
        times.append((ta, tb))
    ta, tb = (statistics.median(t[i] for t in times) for i in (0, 1))
    return statistics.median(ratios), min(ratios), max(ratios), ta, tb


def num_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


_STREAM_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_read.c")


@functools.lru_cache(maxsize=None)
def _stream_library():
    """``stream_read.c`` compiled for this CPU with OpenMP and loaded with ctypes;
    None when no C compiler here takes ``-fopenmp``."""
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    lib = os.path.join(tempfile.mkdtemp(prefix="pagedkv-stream-"), "stream_read.so")
    for arch in (["-march=native"], []):
        cmd = cc + ["-O3", *arch, "-fopenmp", "-shared", "-fPIC", _STREAM_SOURCE, "-o", lib]
        try:
            if subprocess.run(cmd, capture_output=True).returncode == 0:
                break
        except OSError:     # no compiler at all
            return None
    else:
        return None
    dll = ctypes.CDLL(lib)  # ctypes releases the GIL for the call
    dll.stream_read.restype = ctypes.c_float
    dll.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    dll.paged_read.restype = ctypes.c_float
    dll.paged_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                               ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    return dll


class StreamRead:
    """The machine's streaming-read bandwidth: a C/OpenMP float sum over
    ``nbytes`` (``stream_read.c``), on every core and on one.

    Without a C compiler that takes OpenMP it falls back on numpy sums, one
    per core in threads (numpy releases the GIL in reductions); ``what`` says
    which it is.  Keep the object to measure again in later rounds: the
    buffer stays allocated and touched.
    """

    def __init__(self, nbytes=1 << 30):
        self.data = np.ones(nbytes // 4, dtype=np.float32)
        self.nbytes = self.data.nbytes
        self.cores = num_cores()
        self._lib = _stream_library()
        self.what = "C/OpenMP stream read" if self._lib else "numpy sum in threads (no OpenMP C compiler)"

    def _read(self, threads):
        if self._lib is not None:
            self._lib.stream_read(self.data.ctypes.data, self.data.size, threads)
        elif threads == 1:
            np.sum(self.data)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(np.sum, np.array_split(self.data, threads)))

    def bandwidth(self, repeat=7):
        """Bytes/s: the better of one thread and all cores (so that the denominator
        of a ratio is never flattering), each the best of ``repeat`` reads."""
        t_all = best_seconds(lambda: self._read(self.cores), repeat=repeat)
        t_one = best_seconds(lambda: self._read(1), repeat=repeat) if self.cores > 1 else t_all
        return self.nbytes / min(t_all, t_one)


class PagedRead:
    """The bandwidth of a paged decode's reads alone: ``paged_read`` of
    ``stream_read.c`` reads K and V pages of ``page_bytes`` at the page ids
    ``pages`` [num_seqs, pages_per_seq] (two pools of ``num_pages`` pages, as
    the cache's pools hold them) in the host kernel's order, ``span`` pages at
    a time, summing them and nothing else, on every core.  Beside the stream
    read it shows what the page placement alone costs.  ``available`` is
    False without a C compiler that takes OpenMP.
    """

    def __init__(self, pages, page_bytes, num_pages, span):
        self._lib = _stream_library()
        self.available = self._lib is not None
        self.pages = np.ascontiguousarray(pages, dtype=np.int32)
        self.page_floats = page_bytes // 4
        self.span = span
        self.k, self.v = (np.ones(num_pages * self.page_floats, dtype=np.float32) for _ in "kv")
        self.nbytes = 2 * self.pages.size * self.page_floats * 4
        self.cores = num_cores()

    def bandwidth(self, repeat=3):
        """Bytes/s of the paged read on every core, best of ``repeat``."""
        seqs, per_seq = self.pages.shape
        t = best_seconds(lambda: self._lib.paged_read(
            self.k.ctypes.data, self.v.ctypes.data, self.pages.ctypes.data, seqs, per_seq,
            self.page_floats, self.span, self.cores), repeat=repeat)
        return self.nbytes / t


def read_bandwidth(nbytes=1 << 30, repeat=7):
    """The machine's streaming-read bandwidth in bytes/s (see :class:`StreamRead`)."""
    return StreamRead(nbytes).bandwidth(repeat)


def backends_parser(doc):
    """An argument parser that prints ``doc`` (a script's docstring) as its help,
    with ``--backends`` (comma-separated; default: every available one)."""
    import pagedkv    # here, not at the top: device_check.py renders its tables without it
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(pagedkv.available_backends()),
                        help="comma-separated pagedkv backends (default: every available one)")
    return parser


def run_each_backend_alone(script, argv, backends):
    """Run ``script`` once per backend, each in a fresh interpreter, when there are several.

    PoCL's worker threads, once started, take CPU from the host backend's
    timings in the same process, so each backend is timed alone.  The child
    gets ``argv`` followed by ``--backends <one>`` (its last ``--backends``
    wins).

    Returns
    -------
    bool
        True when the children ran (the caller is done), False when
        ``backends`` has one backend (the caller measures it itself).
    """
    if len(backends) < 2:
        return False
    for backend in backends:
        print(f"## backend {backend}", flush=True)
        subprocess.run([sys.executable, script, *argv, "--backends", backend], check=True)
    return True


def fmt_table(header, rows):
    """Render rows (lists of str) under ``header`` as a Markdown table."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])
