"""What ``cascade="auto"`` costs a step whose sequences share nothing.

Workload: 256 sequences (no forks, no prefix-cache hits) decode one token
each, host backend, page size 16, a small head (1 KV head, 1 query head,
head_dim 8) so that attention itself is cheap and the planner's share shows.
A step is ``append`` + ``store`` + ``attention`` over ``--layers`` layers +
``StepBatch.sharing`` (what an engine reads for its stats); every 16th step
rolls the sequences back so that their contexts stay fixed.

Reported per context length: microseconds per step with ``cascade="auto"`` and
with ``"off"`` (best of ``--repeat`` steps, the two sides alternating over
``--rounds`` rounds, medians), the median of the rounds' differences, and the time of
``StepBatch.sharing`` alone on a fresh batch (the planner's search, once).

    python benchmarks/bench_cascade_plan.py [--contexts 128,512,2048] [--layers 2]
"""
import argparse
import statistics
import sys
import time

import numpy as np

import pagedkv
from _common import best_seconds, fmt_table

NUM_SEQS, PAGE, HEAD_DIM = 256, 16, 8


def make_side(cascade, context, num_layers):
    """A cache of ``NUM_SEQS`` unshared sequences at ``context`` tokens and its step."""
    cache = pagedkv.PagedKVCache(num_layers, 1, HEAD_DIM, page_size=PAGE, backend="host",
                                 num_pages=NUM_SEQS * (context // PAGE + 2), cascade=cascade)
    seqs = [cache.add_sequence() for _ in range(NUM_SEQS)]
    rng = np.random.default_rng(0)
    batch = cache.append(seqs, context)
    k = rng.standard_normal((batch.num_tokens, 1, HEAD_DIM)).astype(np.float32)
    for layer in range(num_layers):
        cache.store(layer, batch, k, k)
    k1 = rng.standard_normal((NUM_SEQS, 1, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((NUM_SEQS, 1, HEAD_DIM)).astype(np.float32)
    state = {"n": 0}
    shared = {"reads": 0}         # stays 0: nothing is shared

    def step():
        batch = cache.append(seqs, 1)
        for layer in range(num_layers):
            cache.store(layer, batch, k1, k1)
            cache.attention(layer, batch, q)
        shared["reads"] += batch.sharing.saved_token_reads
        state["n"] += 1
        if state["n"] % PAGE == 0:
            for s in seqs:
                cache.truncate(s, context)

    def sharing_alone():
        batch = cache.append(seqs, 1)
        t0 = time.perf_counter()
        shared["reads"] += batch.sharing.saved_token_reads
        elapsed = time.perf_counter() - t0
        for s in seqs:
            cache.truncate(s, context)
        return elapsed

    return step, sharing_alone


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=48)
    args = parser.parse_args(argv)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        auto, auto_sharing = make_side("auto", context, args.layers)
        off, _ = make_side("off", context, args.layers)
        times = {"auto": [], "off": []}
        for _ in range(args.rounds):
            times["auto"].append(best_seconds(auto, repeat=args.repeat, warmup=PAGE))
            times["off"].append(best_seconds(off, repeat=args.repeat, warmup=PAGE))
        t_auto, t_off = (statistics.median(times[side]) for side in ("auto", "off"))
        diff = statistics.median(a - o for a, o in zip(times["auto"], times["off"]))
        t_sharing = min(auto_sharing() for _ in range(args.repeat))
        rows.append([context, f"{t_auto * 1e6:.1f}", f"{t_off * 1e6:.1f}",
                     f"{diff * 1e6:+.1f}", f"{t_auto / t_off:.3f}x",
                     f"{t_sharing * 1e6:.1f}"])
    print(f"# {NUM_SEQS} unshared sequences, decode, host, {args.layers} layers, "
          f"1 KV head x {HEAD_DIM}: us per step\n")
    print(fmt_table(["context", "auto", "off", "auto - off", "auto / off",
                     "StepBatch.sharing alone"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
