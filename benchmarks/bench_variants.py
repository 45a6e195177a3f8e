"""What the attention variants cost in decode, against plain decode on the same machine,
interleaved in one run.

Cases (32 sequences, 32 query heads over 8 KV heads, head_dim 128, float32, page 16):
  chunked   each sequence holds 8,000 tokens and decodes one more with
            ``attention_chunk_size=2048``: the new token (position 8,000) sees
            the 1,857 keys of its chunk.  Against full decode over 2,048 keys
            (sequences of 2,047 tokens): O(chunk), not O(context), is <= 1.1x.
  alibi     full decode over 2,048 keys with ``alibi_slopes`` (the standard
            geometric slopes) against the same decode without: <= 1.05x.
            Skipped, with a message, where the cache has no ``alibi_slopes``.

Each round times both sides (best of ``--repeat`` calls each, alternating);
the figure is the median of the per-round ratios.

    python benchmarks/bench_variants.py [--backends host,opencl] [--rounds 9]
"""
import inspect
import sys

import numpy as np

import pagedkv
from _common import backends_parser, fmt_table, paired_ratio, run_each_backend_alone

NUM_SEQS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 32, 8, 128, 16
CHUNK, LONG, SHORT = 2048, 8000, 2047


def filled_cache(backend, length):
    """A one-layer cache of NUM_SEQS sequences of ``length`` tokens, and the batch of
    one more token each (stored), ready for ``attention``."""
    pages = NUM_SEQS * (-(-(length + 1) // PAGE))
    cache = pagedkv.PagedKVCache(1, NUM_KV_HEADS, HEAD_DIM, num_pages=pages, page_size=PAGE,
                                 backend=backend)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((1000, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
    seqs = [cache.add_sequence() for _ in range(NUM_SEQS)]
    for s in seqs:
        done = 0
        while done < length:
            n = min(len(block), length - done)
            cache.store(0, cache.append([s], n), block[:n], block[:n])
            done += n
    batch = cache.append(seqs, 1)
    one = block[:NUM_SEQS]
    cache.store(0, batch, one, one)
    return cache, batch


def main(argv):
    parser = backends_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if run_each_backend_alone(__file__, argv, backends):
        return
    backend = backends[0]
    q = np.random.default_rng(1).standard_normal((NUM_SEQS, NUM_HEADS, HEAD_DIM),
                                                 dtype=np.float32)
    long_cache, long_batch = filled_cache(backend, LONG)
    short_cache, short_batch = filled_cache(backend, SHORT)
    rows = []

    def chunked():
        long_cache.attention(0, long_batch, q, attention_chunk_size=CHUNK)

    def full():
        short_cache.attention(0, short_batch, q)

    median, lo, hi, ta, tb = paired_ratio(chunked, full, args.rounds, args.repeat)
    rows.append([f"chunked decode, {LONG:,} tokens, C={CHUNK} (1,857 keys seen)",
                 f"full decode, {SHORT + 1:,} keys", f"{ta * 1e3:.2f}", f"{tb * 1e3:.2f}",
                 f"**{median:.3f}** ({lo:.2f}-{hi:.2f})", "<= 1.1"])
    if "alibi_slopes" in inspect.signature(short_cache.attention).parameters:
        slopes = 2.0 ** (-8.0 * np.arange(1, NUM_HEADS + 1) / NUM_HEADS)

        def alibi():
            short_cache.attention(0, short_batch, q, alibi_slopes=slopes)

        median, lo, hi, ta, tb = paired_ratio(alibi, full, args.rounds, args.repeat)
        rows.append([f"ALiBi decode, {SHORT + 1:,} keys", f"full decode, {SHORT + 1:,} keys",
                     f"{ta * 1e3:.2f}", f"{tb * 1e3:.2f}",
                     f"**{median:.3f}** ({lo:.2f}-{hi:.2f})", "<= 1.05"])
    else:
        print("alibi: this pagedkv has no alibi_slopes; skipped", file=sys.stderr)
    print(f"backend {backend}, {args.rounds} rounds, best of {args.repeat} calls per side")
    print(fmt_table(["case", "against", "case ms", "against ms",
                     "time ratio (median, range)", "target"], rows))


if __name__ == "__main__":
    main(sys.argv[1:])
