"""Helpers shared by the benchmarks: timing, the machine's read bandwidth, the
``--backends`` option and one process per backend.

Machines are noisy, so every benchmark reports ratios measured in one run:
against the bandwidth this script measures on the spot, and against a
contiguous baseline on the same data.
"""
import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import pagedkv


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


def num_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def read_bandwidth(nbytes=1 << 30, repeat=7):
    """The machine's streaming-read bandwidth in bytes/s: a float32 sum over
    ``nbytes`` split across every core (numpy releases the GIL in reductions).

    Returns the better of one thread and all cores, so the denominator of a
    ratio is never flattering.
    """
    data = np.ones(nbytes // 4, dtype=np.float32)
    cores = num_cores()
    chunks = np.array_split(data, cores)
    with ThreadPoolExecutor(cores) as pool:
        def parallel_sum():
            list(pool.map(np.sum, chunks))
        t_par = best_seconds(parallel_sum, repeat=repeat)
    t_one = best_seconds(lambda: np.sum(data), repeat=repeat)
    return nbytes / min(t_par, t_one)


def backends_parser(doc):
    """An argument parser that prints ``doc`` (a script's docstring) as its help,
    with ``--backends`` (comma-separated; default: every available one)."""
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
