"""A small store + attention + gather workload through the installed pagedkv.

    python cpu_probe.py INPUTS.npz OUTPUTS.npz

For each case of ``CASES`` (storage dtype, head_dim) it runs the steps of
``STEPS`` (a ragged prefill of two sequences, then a decode step) through a
host-backend cache, on the arrays of INPUTS (``make_inputs``), and writes the
attention output of every step, the K/V that ``gather`` returns at the end,
and the kernel level that ran.  ``test_cpu_dispatch.py`` runs it in a fresh
process under qemu CPU models and with ``PAGEDKV_CPU_LEVEL`` set, and checks
what it wrote against NumPy.  It imports only numpy and pagedkv, so that it
runs wherever the installed package does.
"""
import sys

import numpy as np

# (storage dtype, head_dim): a head size with a fixed-offset kernel (64, 128)
# and one that takes the generic path with scalar tails (40).
CASES = (("float32", 128), ("float16", 64), ("float32", 40))
STEPS = ((37, 5), (1, 1))            # new tokens of each sequence, per step
NUM_KV_HEADS, NUM_HEADS, PAGE_SIZE = 2, 4, 16


def key(dtype, head_dim, name):
    """The npz key of one array of a case."""
    return f"{dtype}_{head_dim}_{name}"


def make_inputs(seed=0):
    """Random q, k, v of every step of every case.

    Returns
    -------
    dict of str to ndarray
        ``key(dtype, head_dim, f"step{i}_{x}")`` for x in q, k, v: float32,
        ``[total_new, num_heads or num_kv_heads, head_dim]``.
    """
    rng = np.random.default_rng(seed)
    inputs = {}
    for dtype, head_dim in CASES:
        for i, counts in enumerate(STEPS):
            n = sum(counts)
            for name, heads in (("q", NUM_HEADS), ("k", NUM_KV_HEADS), ("v", NUM_KV_HEADS)):
                inputs[key(dtype, head_dim, f"step{i}_{name}")] = rng.standard_normal(
                    (n, heads, head_dim), dtype=np.float32)
    return inputs


def run(inputs):
    """Run every case on ``inputs``; returns the arrays ``main`` writes.

    Returns
    -------
    dict of str to ndarray
        ``step{i}_out`` ([total_new, num_heads, head_dim] float32) per step,
        ``gather_k{b}``/``gather_v{b}`` ([seq_len, num_kv_heads, head_dim]
        float32) per sequence, under each case's ``key``; and ``level``, the
        name of the kernel level that ran.
    """
    import pagedkv
    from pagedkv import _cpu

    outputs = {"level": np.array(_cpu.level.name)}
    for dtype, head_dim in CASES:
        cache = pagedkv.PagedKVCache(1, NUM_KV_HEADS, head_dim, num_pages=16,
                                     page_size=PAGE_SIZE, dtype=dtype, backend="host")
        seqs = [cache.add_sequence() for _ in STEPS[0]]
        for i, counts in enumerate(STEPS):
            q, k, v = (inputs[key(dtype, head_dim, f"step{i}_{x}")] for x in "qkv")
            batch = cache.append(seqs, list(counts))
            cache.store(0, batch, k, v)
            outputs[key(dtype, head_dim, f"step{i}_out")] = cache.attention(0, batch, q)
        for b, s in enumerate(seqs):
            k, v = cache.gather(0, s)
            outputs[key(dtype, head_dim, f"gather_k{b}")] = k
            outputs[key(dtype, head_dim, f"gather_v{b}")] = v
    return outputs


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with np.load(argv[0]) as inputs:
        outputs = run(dict(inputs))
    np.savez(argv[1], **outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
