"""Attention speed of this checkout against an older commit, interleaved in one run.

The other side ("base", default 970316e) is checked out as a detached git worktree
in a temporary folder and built there (``setup.py build_ext --inplace``); this
side ("head") is the checkout the script lives in, which must be built in place.
Every measurement runs in a fresh interpreter with ``PYTHONPATH=<tree>`` and a
working directory outside both trees; the child checks that it imported that
tree's ``pagedkv`` (and its OpenCL kernel sources), and fails otherwise.  One
child builds one cache and times one case, so that no case runs on a process
that an earlier case warmed, fragmented or left PoCL threads in.

Cases (32 query heads over 8 KV heads, head_dim 128, float32, page 16, one layer):
  decode    32 sequences x 2,048 tokens, one new token each
  prefill   one sequence, 2,048 new tokens (causal)
  windowed  32 sequences x 8,192 tokens, one new token each, ``sliding_window=512``
  int8      the decode case with ``dtype="int8"``
  softcap   the decode case with ``logits_soft_cap=30.0``
  cascade   32 forks of a 2,048-token prefix with 64 tokens each of their own, one
            new token each (``cascade="auto"``: the shared pages read once)

Each round runs base and head once for every (backend, case), base first in
even rounds and head first in odd ones; each child times its case as the best
of ``--repeat`` calls after a warm-up.  The figure per case is the median over
rounds of the per-round time ratio head/base, with its range, next to each
side's median time; "no regression" when that median ratio is <= 1.05.  The
verdict also says when the two sides' outputs differ (sum of |output| off by
more than 1e-3 relative): then the sides do not compute the same thing.  A
default run (5 rounds, both backends, every case: 100 children) takes about
3 minutes on two cores (160 s of children, 2026-12-02), plus the base build
(1 minute with a warm compiler cache, up to 4 without).

    python benchmarks/bench_ab.py [--base 970316e] [--backends host,opencl] [--rounds 5]
        [--cases decode,prefill,windowed,int8,softcap,cascade] [--repeat 5] [--keep-base DIR]

``--keep-base DIR`` keeps the base worktree (built) in DIR and reuses it on
later runs, which saves the build.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
HEAD_TREE = os.path.dirname(HERE)
CASES = ("decode", "prefill", "windowed", "int8", "softcap", "cascade")
NUM_SEQS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 32, 8, 128, 16
DECODE_LEN, PREFILL_LEN, WINDOW_LEN, WINDOW = 2048, 2048, 8192, 512
CASCADE_OWN = 64
SOFT_CAP = 30.0
# The sides' sums of |attention output| may differ by this much (relative): summation
# order and int8 rounding may change between commits, the result may not.
CHECKSUM_RTOL = 1e-3
# case -> attention keyword arguments
CASE_KWARGS = {
    "decode": {},
    "prefill": {},
    "windowed": {"sliding_window": WINDOW},
    "int8": {},
    "softcap": {"logits_soft_cap": SOFT_CAP},
    "cascade": {},
}
BUILT_MARKER = ".bench_ab_built"


# -- the child: one tree, one backend ------------------------------------------------

def _import_tree_pagedkv(tree):
    """Import ``pagedkv`` from ``tree`` (first on PYTHONPATH) and check that it did.

    A setuptools editable install maps ``pagedkv.opencl`` (the kernel sources)
    to the installed checkout with a meta-path finder, which would hand the
    base side the head's kernels; the finder is dropped so that both sides read
    ``<tree>/opencl``.
    """
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]
    import pagedkv
    from pagedkv.backends import kernel_source

    def inside(path):
        path = os.path.realpath(str(path))
        return os.path.commonpath([path, os.path.realpath(tree)]) == os.path.realpath(tree)

    kernels = kernel_source.source_dir()
    if not inside(pagedkv.__file__) or not inside(kernels):
        raise SystemExit(f"bench_ab child: expected pagedkv from {tree}, got "
                         f"{pagedkv.__file__} (kernel sources {kernels})")
    return pagedkv, str(kernels)


def _kv_rows(length):
    """Random K and V rows, shape [length + NUM_SEQS, NUM_KV_HEADS, HEAD_DIM]: sequence i
    stores rows i .. i + its length (the same bytes on both sides, and quick)."""
    rng = np.random.default_rng(0)
    shape = (length + NUM_SEQS, NUM_KV_HEADS, HEAD_DIM)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape,
                                                                             dtype=np.float32)


def _decode_cache(pagedkv, backend, dtype, length, rows):
    """NUM_SEQS sequences of ``length`` tokens and one new token each, stored;
    returns (cache, batch, q)."""
    k, v = rows
    pages = NUM_SEQS * -(-(length + 1) // PAGE)
    cache = pagedkv.PagedKVCache(1, NUM_KV_HEADS, HEAD_DIM, num_pages=pages, page_size=PAGE,
                                 dtype=dtype, backend=backend)
    seqs = [cache.add_sequence() for _ in range(NUM_SEQS)]
    for i, s in enumerate(seqs):        # one store per sequence: large, no huge temporaries
        cache.store(0, cache.append([s], length), k[i:i + length], v[i:i + length])
    batch = cache.append(seqs, 1)
    cache.store(0, batch, k[length:length + NUM_SEQS], v[length:length + NUM_SEQS])
    q = np.random.default_rng(1).standard_normal((NUM_SEQS, NUM_HEADS, HEAD_DIM),
                                                 dtype=np.float32)
    return cache, batch, q


def _prefill_cache(pagedkv, backend, rows):
    k, v = rows
    cache = pagedkv.PagedKVCache(1, NUM_KV_HEADS, HEAD_DIM, num_pages=-(-PREFILL_LEN // PAGE),
                                 page_size=PAGE, backend=backend)
    batch = cache.append([cache.add_sequence()], PREFILL_LEN)
    cache.store(0, batch, k[:PREFILL_LEN], v[:PREFILL_LEN])
    q = np.random.default_rng(1).standard_normal((PREFILL_LEN, NUM_HEADS, HEAD_DIM),
                                                 dtype=np.float32)
    return cache, batch, q


def _cascade_cache(pagedkv, backend, rows):
    """NUM_SEQS forks of a DECODE_LEN-token prefix, CASCADE_OWN tokens each of their
    own and one new token each, stored; returns (cache, batch, q)."""
    k, v = rows
    own_pages = -(-(CASCADE_OWN + 1) // PAGE) + 1
    cache = pagedkv.PagedKVCache(1, NUM_KV_HEADS, HEAD_DIM,
                                 num_pages=-(-DECODE_LEN // PAGE) + NUM_SEQS * own_pages,
                                 page_size=PAGE, backend=backend, cascade="auto")
    root = cache.add_sequence()
    cache.store(0, cache.append([root], DECODE_LEN), k[:DECODE_LEN], v[:DECODE_LEN])
    seqs = [cache.fork(root) for _ in range(NUM_SEQS)]
    cache.free(root)
    batch = cache.append(seqs, CASCADE_OWN)
    n = NUM_SEQS * CASCADE_OWN
    cache.store(0, batch, k[:n], v[:n])
    batch = cache.append(seqs, 1)
    cache.store(0, batch, k[n:n + NUM_SEQS], v[n:n + NUM_SEQS])
    q = np.random.default_rng(1).standard_normal((NUM_SEQS, NUM_HEADS, HEAD_DIM),
                                                 dtype=np.float32)
    return cache, batch, q


def _case_cache(pagedkv, backend, case):
    """The cache, batch and queries that ``case`` times."""
    if case == "cascade":
        return _cascade_cache(pagedkv, backend, _kv_rows(DECODE_LEN))
    if case == "prefill":
        return _prefill_cache(pagedkv, backend, _kv_rows(PREFILL_LEN))
    if case == "windowed":
        return _decode_cache(pagedkv, backend, "float32", WINDOW_LEN, _kv_rows(WINDOW_LEN))
    dtype = "int8" if case == "int8" else "float32"
    return _decode_cache(pagedkv, backend, dtype, DECODE_LEN, _kv_rows(DECODE_LEN))


def child(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", required=True, help="the tree whose pagedkv to time")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--case", required=True, choices=CASES)
    parser.add_argument("--repeat", type=int, required=True)
    args = parser.parse_args(argv)
    pagedkv, kernels = _import_tree_pagedkv(args.child)
    from _common import best_seconds

    cache, batch, q = _case_cache(pagedkv, args.backend, args.case)
    kwargs = CASE_KWARGS[args.case]
    out = np.asarray(cache.attention(0, batch, q, **kwargs))     # also the warm-up
    seconds = best_seconds(lambda: cache.attention(0, batch, q, **kwargs),
                           repeat=args.repeat, warmup=0)
    print(json.dumps({"pagedkv": pagedkv.__file__, "kernels": kernels, "seconds": seconds,
                      "checksum": float(np.abs(out.astype(np.float64)).sum())}))


# -- the parent: the base worktree, the rounds, the table ----------------------------

def _git(*args, cwd=HEAD_TREE):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def _check_built(tree, what):
    if not glob.glob(os.path.join(tree, "pagedkv", "_allocator*.so")) and \
            not glob.glob(os.path.join(tree, "pagedkv", "_allocator*.pyd")):
        raise SystemExit(f"{what} ({tree}) is not built in place: run "
                         f"'python setup.py build_ext --inplace' there")


def _build(tree):
    print(f"building the base in {tree} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", "2"],
                   cwd=tree, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(tree, BUILT_MARKER), "w") as f:
        f.write(_git("rev-parse", "HEAD", cwd=tree) + "\n")
    print(f"built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def _base_tree(commit, keep):
    """The base worktree's path, made and built unless ``keep`` holds a built one."""
    tree = os.path.abspath(keep) if keep else \
        os.path.join(tempfile.mkdtemp(prefix="pagedkv-ab-"), "base")
    if os.path.exists(tree):
        if _git("rev-parse", "HEAD", cwd=tree) != commit:
            raise SystemExit(f"--keep-base {tree}: holds another commit than {commit[:12]}")
    else:
        _git("worktree", "add", "--detach", tree, commit)
    marker = os.path.join(tree, BUILT_MARKER)
    if not (os.path.exists(marker) and open(marker).read().strip() == commit):
        _build(tree)
    _check_built(tree, "the base")
    return tree


def _remove_tree(tree):
    subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=HEAD_TREE,
                   capture_output=True)
    shutil.rmtree(os.path.dirname(tree), ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=HEAD_TREE, capture_output=True)


def _run_child(tree, backend, case, repeat, workdir):
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, "--backend", backend,
           "--case", case, "--repeat", str(repeat)]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"bench_ab: the child for {tree} ({backend}, {case}) failed "
                         f"(exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv):
    from _common import backends_parser, fmt_table

    parser = backends_parser(__doc__)
    parser.add_argument("--base", default="970316e", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per case (best)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--keep-base", metavar="DIR",
                        help="keep the built base worktree in DIR (reused when there)")
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    cases = [c for c in CASES if c in args.cases.split(",")]
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown or not cases:
        parser.error(f"--cases: expected some of {','.join(CASES)}, got {args.cases}")
    base = _git("rev-parse", "--verify", args.base + "^{commit}")
    head = _git("rev-parse", "HEAD") + (" (with uncommitted changes)"
                                        if _git("status", "--porcelain", "--untracked-files=no")
                                        else "")
    _check_built(HEAD_TREE, "this checkout")
    t_start = time.perf_counter()
    base_tree = _base_tree(base, args.keep_base)
    workdir = tempfile.mkdtemp(prefix="pagedkv-ab-run-")
    trees = {"base": base_tree, "head": HEAD_TREE}
    # (backend, case) -> per-round times {"base": [...], "head": [...]}
    times = {(b, c): {"base": [], "head": []} for b in backends for c in cases}
    # (backend, case) -> side -> sum of |output|: both sides must compute the same thing
    checksums = {(b, c): {} for b in backends for c in cases}
    imported = {}
    t_rounds = time.perf_counter()
    try:
        for r in range(args.rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            for backend in backends:
                for case in cases:
                    took = []
                    for side in order:
                        t0 = time.perf_counter()
                        got = _run_child(trees[side], backend, case, args.repeat, workdir)
                        times[backend, case][side].append(got["seconds"])
                        checksums[backend, case][side] = got["checksum"]
                        imported[side] = (f"{os.path.dirname(got['pagedkv'])}, "
                                          f"kernels {got['kernels']}")
                        took.append(f"{side} {got['seconds'] * 1e3:.2f} ms "
                                    f"({time.perf_counter() - t0:.1f} s)")
                    print(f"round {r + 1}/{args.rounds} {backend} {case}: {', '.join(took)}",
                          file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if not args.keep_base:
            _remove_tree(base_tree)
    rows = []
    for (backend, case), t in times.items():
        ratios = [h / b for h, b in zip(t["head"], t["base"])]
        median = statistics.median(ratios)
        verdict = "no regression" if median <= 1.05 else "slower"
        sums = checksums[backend, case]
        if abs(sums["head"] - sums["base"]) > CHECKSUM_RTOL * abs(sums["base"]):
            verdict += f" (outputs differ: sum |out| {sums['base']:.6g} vs {sums['head']:.6g})"
        rows.append([backend, case, f"{statistics.median(t['base']) * 1e3:.2f}",
                     f"{statistics.median(t['head']) * 1e3:.2f}",
                     f"**{median:.3f}** ({min(ratios):.3f}-{max(ratios):.3f})", verdict])
    print(f"base {base[:12]} ({_git('log', '-1', '--format=%s', base)}): "
          f"{imported.get('base')}")
    print(f"head {head[:12]}{head[40:]}: {imported.get('head')}")
    print(f"{args.rounds} rounds, best of {args.repeat} calls per case and side; "
          f"children {time.perf_counter() - t_rounds:.0f} s, "
          f"whole run {time.perf_counter() - t_start:.0f} s")
    print(fmt_table(["backend", "case", "base ms", "head ms", "head/base (median, range)",
                     "verdict"], rows))


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        child(sys.argv[1:])
    else:
        main(sys.argv[1:])
