"""Paged attention speed: decode and prefill, against bandwidth and contiguous baselines.

Decode case: 32 sequences x 2,048 tokens, 8 KV heads, 32 query heads,
head_dim 128, page size 16.  Decode attention reads every K and V byte once,
so its speed is reported as KV bytes / time, next to this machine's streaming
read bandwidth measured by the same run, and next to the same attention on
contiguous arrays with NumPy (and torch, when installed).  Prefill is
reported in GFLOP/s next to this machine's sgemm rate (torch.mm, else numpy).

The variants (float16, the decode case's heads): a windowed decode of 32 x
8,192 tokens with W=512 against a full decode of 32 x 512; a windowed prefill
of 4,096 tokens with W=512 against the full causal one; soft cap, sinks and
ALiBi slopes against the plain decode case.

Each backend runs in a process of its own (PoCL's worker threads would
take CPU from the host backend's timings).

    python benchmarks/bench_attention.py [--backends host,opencl] [--quick]
"""
import math
import sys

import numpy as np

import pagedkv
from _common import backends_parser, best_seconds, fmt_table, read_bandwidth, run_each_backend_alone

try:
    import torch
except ImportError:  # torch is optional: its rows are left out
    torch = None


DTYPES = ("float32", "float16", "int8")


def fill_cache(backend, dtype, num_seqs, seq_len, num_kv_heads, head_dim, page_size, rng,
               keep_contiguous=True):
    """A cache holding ``num_seqs`` sequences of random K/V; returns (cache, seqs, K, V) with
    the contiguous copies K, V of shape [num_seqs, num_kv_heads, seq_len, head_dim] (None
    unless ``keep_contiguous``).  Room is left for one more token per sequence."""
    pages = num_seqs * -(-(seq_len + 1) // page_size)
    cache = pagedkv.PagedKVCache(1, num_kv_heads, head_dim, num_pages=pages,
                                 page_size=page_size, dtype=dtype, backend=backend)
    seqs = [cache.add_sequence() for _ in range(num_seqs)]
    shape = (num_seqs, num_kv_heads, seq_len, head_dim)
    K = np.empty(shape, np.float32) if keep_contiguous else None
    V = np.empty(shape, np.float32) if keep_contiguous else None
    for i, s in enumerate(seqs):     # one sequence at a time: long ones need no huge temporaries
        k = rng.standard_normal((seq_len, num_kv_heads, head_dim), dtype=np.float32)
        v = rng.standard_normal((seq_len, num_kv_heads, head_dim), dtype=np.float32)
        cache.store(0, cache.append([s], seq_len), k, v)
        if keep_contiguous:
            K[i], V[i] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    return cache, seqs, K, V


def numpy_decode(q, k, v, scale):
    """Contiguous decode attention. q [B, Hq, D]; k, v [B, Hkv, L, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = np.matmul(qg, k.transpose(0, 1, 3, 2)) * scale          # [B, Hkv, G, L]
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v).reshape(b, hq, d)


def torch_sdpa(q, k, v, causal):
    """torch scaled_dot_product_attention on contiguous tensors [B, H, L, D], GQA native."""
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                enable_gqa=True)


def decode_rows(backend, args, rng, bandwidth, num_kv_heads=8, dtypes=DTYPES):
    """Decode rows per storage dtype: ms, KV bytes read per second (values and int8
    scales), that against the read bandwidth.  Returns (rows, {dtype: seconds}, (K, V))."""
    B, L, hkv, hq, d, ps = args.num_seqs, args.seq_len, num_kv_heads, 32, 128, 16
    rows, times = [], {}
    contiguous = (None, None)
    for dtype in dtypes:
        cache, seqs, K, V = fill_cache(backend, dtype, B, L - 1, hkv, d, ps, rng,
                                       keep_contiguous=dtype == "float32")
        if K is not None:
            contiguous = (K, V)
        q = rng.standard_normal((B, hq, d), dtype=np.float32)
        k1 = rng.standard_normal((B, hkv, d), dtype=np.float32)
        step = decode_step(cache, seqs, L, q, k1)
        t = best_seconds(step, repeat=args.repeat)
        kv_bytes = 2 * B * L * hkv * cache.storage.row_bytes(d)
        times[dtype] = t
        label = f"{backend} paged, {dtype}" + (f", {hkv} KV heads" if hkv != 8 else "")
        rows.append([label, f"{t * 1e3:.2f}", f"{kv_bytes / t / 1e9:.2f}",
                     f"{kv_bytes / t / bandwidth:.2f}"])
        if hasattr(cache._backend, "last_attention_kernel_seconds"):
            # the best of as many steps as the wall-clock row, from profiling events
            kernel_s = float("inf")
            for _ in range(args.repeat):
                step()
                kernel_s = min(kernel_s, cache._backend.last_attention_kernel_seconds)
            rows.append([f"  {backend} kernels only (profiling events)", f"{kernel_s * 1e3:.2f}",
                         f"{kv_bytes / kernel_s / 1e9:.2f}", f"{kv_bytes / kernel_s / bandwidth:.2f}"])
        del cache
    return rows, times, contiguous


def cached_rows(backend, args, rng):
    """The same decode attention with every page in cache: all sequences are forks
    of one, so the K/V read (16 MiB at 2,048 tokens) stays in L3 and the time is
    the kernels' arithmetic.  The decode rows against it tell memory from compute."""
    B, L, hkv, hq, d, ps = args.num_seqs, args.seq_len, 8, 32, 128, 16
    rows = []
    for dtype in DTYPES:
        cache = pagedkv.PagedKVCache(1, hkv, d, num_pages=-(-L // ps) + B, page_size=ps,
                                     dtype=dtype, backend=backend)
        first = cache.add_sequence()
        k = rng.standard_normal((L - 1, hkv, d), dtype=np.float32)
        cache.store(0, cache.append([first], L - 1), k, k)
        seqs = [first] + [cache.fork(first) for _ in range(B - 1)]
        batch = cache.append(seqs, 1)
        cache.store(0, batch, k[:B], k[:B])
        q = rng.standard_normal((B, hq, d), dtype=np.float32)
        t = best_seconds(lambda: cache.attention(0, batch, q), repeat=args.repeat)  # noqa: F821 (deleted after its last call)
        rows.append([f"{backend} paged, {dtype}, pages in cache", f"{t * 1e3:.2f}", "-", "-"])
        del cache
    return rows


def decode_step(cache, seqs, seq_len, q, k1, **variant):
    """One timed decode step on sequences of ``seq_len - 1`` stored tokens: the last
    token's K/V joins, attention reads all ``seq_len``, and the sequences roll back."""
    def step():
        batch = cache.append(seqs, 1)
        cache.store(0, batch, k1, k1)
        out = cache.attention(0, batch, q, **variant)
        for s in seqs:
            cache.truncate(s, seq_len - 1)
        return out
    return step


def prefill_step(cache, s, q, k, **variant):
    """One timed prefill of ``len(q)`` tokens, rolled back afterwards."""
    def prefill():
        batch = cache.append([s], len(q))
        cache.store(0, batch, k, k)
        out = cache.attention(0, batch, q, **variant)
        cache.truncate(s, 0)
        return out
    return prefill


def variant_rows(backend, args, rng):
    """Windowed decode and prefill, soft cap, sinks and ALiBi, float16, decode-case heads.

    Returns rows of [case, ms, ratio, what the ratio compares to]."""
    B, hkv, hq, d, ps, window = args.num_seqs, 8, 32, 128, 16, args.window
    long_len, short_len = args.window_seq_len, window
    q = rng.standard_normal((B, hq, d), dtype=np.float32)
    k1 = rng.standard_normal((B, hkv, d), dtype=np.float32)
    rows = []
    times = {}
    for name, length in (("short", short_len), ("long", long_len)):
        cache, seqs, _, _ = fill_cache(backend, "float16", B, length - 1, hkv, d, ps, rng,
                                       keep_contiguous=False)
        variant = {"sliding_window": window} if name == "long" else {}
        times[name] = best_seconds(decode_step(cache, seqs, length, q, k1, **variant),
                                   repeat=args.repeat)
        del cache
    rows.append([f"{backend} decode {B} x {long_len}, window {window}",
                 f"{times['long'] * 1e3:.2f}", f"{times['long'] / times['short']:.2f}",
                 f"x full decode of {B} x {short_len} ({times['short'] * 1e3:.2f} ms)"])

    cache, seqs, _, _ = fill_cache(backend, "float16", B, args.seq_len - 1, hkv, d, ps, rng,
                                   keep_contiguous=False)
    for label, variant in (("soft cap 50", {"logits_soft_cap": 50.0}),
                           ("sinks", {"sinks": rng.standard_normal(hq)}),
                           ("ALiBi", {"alibi_slopes": 2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)})):
        # plain and variant alternate, best of each over the rounds: the machine's
        # noise then hits both alike
        plain = timed = float("inf")
        for _ in range(args.rounds):
            plain = min(plain, best_seconds(decode_step(cache, seqs, args.seq_len, q, k1),
                                            repeat=args.repeat, warmup=1))
            timed = min(timed, best_seconds(decode_step(cache, seqs, args.seq_len, q, k1,
                                                        **variant),
                                            repeat=args.repeat, warmup=1))
        rows.append([f"{backend} decode {B} x {args.seq_len}, {label}", f"{timed * 1e3:.2f}",
                     f"{timed / plain:.3f}", f"x the same decode without it ({plain * 1e3:.2f} ms)"])
    del cache

    n = args.window_prefill_len
    cache = pagedkv.PagedKVCache(1, hkv, d, num_pages=-(-n // ps), page_size=ps,
                                 dtype="float16", backend=backend)
    s = cache.add_sequence()
    qp = rng.standard_normal((n, hq, d), dtype=np.float32)
    kp = rng.standard_normal((n, hkv, d), dtype=np.float32)
    reps = max(2, args.repeat // 2)
    full = best_seconds(prefill_step(cache, s, qp, kp), repeat=reps, warmup=1)
    windowed = best_seconds(prefill_step(cache, s, qp, kp, sliding_window=window),
                            repeat=reps, warmup=1)
    rows.append([f"{backend} prefill {n}, window {window}", f"{windowed * 1e3:.1f}",
                 f"{full / windowed:.2f}",
                 f"x faster than the full causal prefill ({full * 1e3:.1f} ms)"])
    return rows


def sgemm_rate(rng, n=2048):
    """This machine's float32 matrix-multiply rate in FLOP/s (torch.mm on every
    thread torch uses, else numpy's BLAS), the ceiling prefill is compared to."""
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    if torch is not None:
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        t = best_seconds(lambda: torch.mm(ta, tb), repeat=5)
    else:
        t = best_seconds(lambda: a @ b, repeat=5)
    return 2 * n ** 3 / t


def main(argv=None):
    parser = backends_parser(__doc__)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--window-seq-len", type=int, default=8192)
    parser.add_argument("--window-prefill-len", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of the with/without comparisons")
    parser.add_argument("--sections", default="decode,variants,prefill",
                        help="comma-separated subset of decode, variants, prefill")
    parser.add_argument("--quick", action="store_true", help="a small case, for a smoke run")
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if run_each_backend_alone(__file__, argv or sys.argv[1:], backends):
        return 0
    if args.quick:
        args.num_seqs, args.seq_len, args.prefill_len, args.repeat, args.rounds = 4, 512, 256, 2, 1
        args.window, args.window_seq_len, args.window_prefill_len = 64, 1024, 512
    sections = set(args.sections.split(","))
    rng = np.random.default_rng(0)

    bandwidth = read_bandwidth(repeat=args.repeat)
    B, L, hkv, hq, d = args.num_seqs, args.seq_len, 8, 32, 128
    kv_bytes = 2 * B * L * hkv * d * 4
    print(f"machine streaming read bandwidth: {bandwidth / 1e9:.2f} GB/s")
    if "decode" in sections:
        print(f"\n# decode: {B} seqs x {L} tokens, {hkv} KV heads, {hq} query heads, "
              f"head_dim {d}, page 16 (K+V {kv_bytes / 2**20:.0f} MiB in float32)")
        decode_section(backends, args, rng, bandwidth)
    if "variants" in sections:
        print(f"\n# variants: float16, {hkv} KV heads, {hq} query heads, head_dim {d}, page 16")
        rows = []
        for backend in backends:
            rows += variant_rows(backend, args, rng)
        print(fmt_table(["variant", "ms", "ratio", "ratio to"], rows))
    if "prefill" in sections:
        prefill_section(backends, args, rng)
    return 0


def decode_section(backends, args, rng, bandwidth):
    B, L, hkv, hq, d = args.num_seqs, args.seq_len, 8, 32, 128
    kv_bytes = 2 * B * L * hkv * d * 4
    header = ["decode attention", "ms", "KV GB/s", "x read bandwidth"]
    rows, contiguous = [], None
    ratios = {}
    for backend in backends:
        r, times, contiguous = decode_rows(backend, args, rng, bandwidth)
        rows += r + cached_rows(backend, args, rng)
        # the same with as many KV heads as query heads (MHA: memory-bound even in float16)
        r, mha, _ = decode_rows(backend, args, rng, bandwidth, num_kv_heads=32,
                                dtypes=("float16", "int8"))
        rows += r
        ratios[backend] = [("float16 storage", "float32", times["float16"] / times["float32"]),
                           ("int8 storage", "float16", times["int8"] / times["float16"]),
                           ("int8 storage with 32 KV heads", "float16", mha["int8"] / mha["float16"])]
    K, V = contiguous
    q = rng.standard_normal((B, hq, d), dtype=np.float32)
    scale = 1 / math.sqrt(d)
    t = best_seconds(lambda: numpy_decode(q, K, V, scale), repeat=args.repeat)  # noqa: F821 (deleted after its last call)
    rows.append(["numpy contiguous, float32", f"{t * 1e3:.2f}", f"{kv_bytes / t / 1e9:.2f}",
                 f"{kv_bytes / t / bandwidth:.2f}"])
    numpy_t = t
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(x) for x in (q[:, :, None, :], K, V))
        t = best_seconds(lambda: torch_sdpa(tq, tk, tv, False), repeat=args.repeat)
        rows.append([f"torch {torch.__version__} SDPA contiguous", f"{t * 1e3:.2f}",
                     f"{kv_bytes / t / 1e9:.2f}", f"{kv_bytes / t / bandwidth:.2f}"])
    del K, V, contiguous
    print(fmt_table(header, rows))
    for backend, lines in ratios.items():
        for what, than, ratio in lines:
            print(f"{backend}: {what} takes {ratio:.2f}x the time of {than}")
    host_t = next((float(r[1]) / 1e3 for r in rows if r[0] == "host paged, float32"), None)
    if host_t:
        print(f"host paged decode vs numpy contiguous: {numpy_t / host_t:.1f}x faster")


def prefill_section(backends, args, rng):
    """One causal sequence, against contiguous torch SDPA and the machine's sgemm rate."""
    n, hkv, hq, d = args.prefill_len, 8, 32, 128
    sgemm = sgemm_rate(rng)
    print(f"\n# prefill: one sequence of {n} tokens, causal, {hkv} KV heads, {hq} query heads, "
          f"head_dim {d}; sgemm ({'torch.mm' if torch is not None else 'numpy'}) "
          f"{sgemm / 1e9:.1f} GFLOP/s")
    q = rng.standard_normal((n, hq, d), dtype=np.float32)
    k = rng.standard_normal((n, hkv, d), dtype=np.float32)
    flops = 4 * n * n / 2 * hq * d                      # QK^T and PV, causal half
    rows, times = [], {}
    for backend in backends:
        cache = pagedkv.PagedKVCache(1, hkv, d, num_pages=-(-n // 16), backend=backend)
        s = cache.add_sequence()
        t = best_seconds(prefill_step(cache, s, q, k), repeat=max(2, args.repeat // 2), warmup=1)
        times[backend] = t
        rows.append([f"{backend} paged", f"{t * 1e3:.1f}", f"{flops / t / 1e9:.1f}",
                     f"{flops / t / sgemm:.2f}"])
    if torch is not None:
        tq = torch.from_numpy(q.transpose(1, 0, 2).copy())[None]
        tk = torch.from_numpy(k.transpose(1, 0, 2).copy())[None]
        t = best_seconds(lambda: torch_sdpa(tq, tk, tk, True), repeat=max(2, args.repeat // 2))
        rows.append([f"torch {torch.__version__} SDPA contiguous", f"{t * 1e3:.1f}",
                     f"{flops / t / 1e9:.1f}", f"{flops / t / sgemm:.2f}"])
        for backend, bt in times.items():
            rows.append([f"  {backend} speed / torch SDPA", f"{t / bt:.2f}x", "", ""])
    print(fmt_table(["prefill attention", "ms", "GFLOP/s", "x sgemm rate"], rows))


if __name__ == "__main__":
    sys.exit(main())
