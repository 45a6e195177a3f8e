"""How ``load``'s time and memory grow with the file: each kind of file at sizes
1x, 2x, 4x and 8x, its load time per MB and its peak traced memory over its size.
Linear cost shows as flat columns.

Kinds of file (1 layer, 1 KV head, head_dim 64, float32):

* ``sequence``: one sequence of 2,048 x k tokens, loaded at the same page size;
* ``chains, re-cut``: a prefix cache of page size 4, 1,000 x k branches of 4
  pages off a 64-token trunk, loaded at page size 16 (every chain re-cut);
* ``chains, refused``: page size 1, a 2,047-page trunk and 2,500 x k one-page
  leaves, into a 4-page cache of page size 2,048 (each leaf would complete a
  2,048-token page: the ``OutOfPagesError`` must come before that work).

Peak memory is what ``tracemalloc`` sees (numpy's buffers included) during the
load alone (the cache's own allocation included).  One run, best of
``--repeat`` for time.

    python benchmarks/bench_load_scaling.py [--backend host] [--repeat 3]
"""
import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc

import numpy as np

import pagedkv
from pagedkv import kv_file

HEAD_DIM = 64


def write(path, tensors, config, sequences, chains):
    metadata = {key: json.dumps(value) for key, value in dict(
        num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM, num_pages=1, dtype="float32",
        max_seq_len=None, enable_prefix_caching=True, layer_windows=[None],
        num_window_pages=None, window_rollback_tokens=1, kv_rotation=False, **config).items()}
    metadata.update(pagedkv_format_version=kv_file.FORMAT_VERSION, rotation_block="0",
                    sequences=json.dumps(sequences), prefix_cache=json.dumps(chains))
    metadata["checksum"] = kv_file.checksum(metadata, tensors)
    import safetensors.numpy
    safetensors.numpy.save_file(tensors, path, metadata=metadata)


def rows(n, rng):
    return rng.standard_normal((n, 1, HEAD_DIM)).astype(np.float32)


def sequence_file(path, k, rng):
    n = 2048 * k
    tensors = {"sequence.0.k.0": rows(n, rng), "sequence.0.v.0": rows(n, rng)}
    write(path, tensors, {"page_size": 16},
          [{"num_tokens": n, "layer_start": [0], "token_ids": False}],
          {"num_pages": 0, "num_window_pages": 0})
    return lambda: pagedkv.PagedKVCache(1, 1, HEAD_DIM, num_pages=n // 16 + 1, page_size=16,
                                        enable_prefix_caching=True, backend=BACKEND)


def chain_file(path, trunk, branches, branch_pages, page_size, rng):
    parents = list(range(-1, trunk - 1))
    for _ in range(branches):
        parents += [trunk - 1] + list(range(len(parents), len(parents) + branch_pages - 1))
    n = len(parents)
    tokens = rng.integers(0, 32000, (n, page_size)).astype(np.int32)
    tensors = {"prefix_cache.token_ids": tokens,
               "prefix_cache.parents": np.array(parents, np.int64),
               "prefix_cache.has_window": np.zeros(n, np.uint8),
               "prefix_cache.k.0": rows(n * page_size, rng),
               "prefix_cache.v.0": rows(n * page_size, rng)}
    write(path, tensors, {"page_size": page_size}, [], {"num_pages": n, "num_window_pages": 0})


def recut_file(path, k, rng):
    chain_file(path, 16, 1000 * k, 4, 4, rng)
    pages = (16 * 4 + 1000 * k * 16) // 16 + 16
    return lambda: pagedkv.PagedKVCache(1, 1, HEAD_DIM, num_pages=pages, page_size=16,
                                        enable_prefix_caching=True, backend=BACKEND)


def refused_file(path, k, rng):
    chain_file(path, 2047, 2500 * k, 1, 1, rng)
    return lambda: pagedkv.PagedKVCache(1, 1, HEAD_DIM, num_pages=4, page_size=2048,
                                        enable_prefix_caching=True, backend=BACKEND)


def load(make_cache, path):
    cache = make_cache()
    try:
        cache.load(path)
    except pagedkv.OutOfPagesError:
        pass


def measure(make_cache, path, repeat):
    """Best time of ``repeat`` loads, and the peak memory of one more under
    tracemalloc (which slows the Python parts, so it is not timed)."""
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        load(make_cache, path)
        best = min(best, time.perf_counter() - began)
    tracemalloc.start()
    load(make_cache, path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best, peak


def main(argv=None):
    global BACKEND
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    BACKEND = args.backend
    rng = np.random.default_rng(0)
    print("| file | size | MB | load ms | ms per MB | peak MB | peak / size |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name, build in (("sequence", sequence_file), ("chains, re-cut", recut_file),
                            ("chains, refused", refused_file)):
            for k in (1, 2, 4, 8):
                path = os.path.join(folder, f"{name}{k}")
                make_cache = build(path, k, rng)
                mb = os.path.getsize(path) / 1e6
                seconds, peak = measure(make_cache, path, args.repeat)
                print(f"| {name} | {k}x | {mb:.2f} | {seconds * 1e3:.1f} | "
                      f"{seconds * 1e3 / mb:.1f} | {peak / 1e6:.1f} | {peak / 1e6 / mb:.2f} |")
                os.unlink(path)
    return 0


BACKEND = "host"

if __name__ == "__main__":
    sys.exit(main())
