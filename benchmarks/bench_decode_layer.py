"""What one decode layer's KV hook costs: ``store`` then ``attention``, per backend and array kind.

The engine's KV hook (``paged_attend``) runs once per layer per step; at a
small batch and a short context its fixed costs (argument checks, launches,
waits) are as large as the attention itself.  This times that hook alone for
SmolLM2-135M's shape (3 KV heads, 9 query heads, head_dim 64), one decode step
of ``--batch`` sequences at ``--context`` tokens, 30 layers a step, and the
same hook over the contiguous NumPy cache of ``bench_generate``:

* ``numpy``: q, K and V as numpy arrays, the output back in numpy (what the
  engine in ``pagedkv.models`` does);
* ``device`` (opencl): q, K, V and the output as pyopencl arrays, so nothing
  waits for the device within a step (what an engine whose layers run on the
  device would do); the step ends with one read of the last output.

With ``--matmuls`` each layer first runs the four matrix products of a SmolLM2
layer on the host (1 BLAS thread), as in the engine: they evict the caches,
and PoCL's worker threads go to sleep between layers, so every cost grows.
Rounds alternate between the kinds; the median round counts.  Each backend
runs in its own process.

    python benchmarks/bench_decode_layer.py [--backends host,opencl] [--matmuls]
"""
import sys
import time

import numpy as np

import pagedkv
from _common import backends_parser, fmt_table, run_each_backend_alone
from bench_generate import ContiguousKVCache
from pagedkv.models.threads import blas_threads

LAYERS, KV_HEADS, HEADS, HEAD_DIM, HIDDEN, FFN = 30, 3, 9, 64, 576, 1536


class Hook:
    """One kind of KV hook over its own cache: ``step()`` runs every layer of one step."""

    def __init__(self, cache, seqs, q, k, finish=None):
        self.cache, self.seqs, self.q, self.k, self.finish = cache, seqs, q, k, finish
        self.context = cache.seq_len(seqs[0])

    def step(self, between_layers):
        """One decode step (then rolled back); seconds of hook per layer, the final
        ``finish`` included.  ``between_layers()`` runs untimed before each layer."""
        batch = self.cache.append(self.seqs, [1] * len(self.seqs))
        seconds = 0.0
        for layer in range(LAYERS):
            between_layers()
            start = time.perf_counter()
            self.cache.store(layer, batch, self.k, self.k)
            out = self.cache.attention(layer, batch, self.q)
            seconds += time.perf_counter() - start
        start = time.perf_counter()
        if self.finish is not None:
            self.finish(out)
        seconds += time.perf_counter() - start
        for s in self.seqs:
            self.cache.truncate(s, self.context)
        return seconds / LAYERS


def make_hooks(backend, batch, context, rng):
    """``{name: Hook}``: the contiguous cache's, and ``backend``'s for each array kind
    (one paged cache, ``context`` tokens stored in every layer)."""
    q = rng.standard_normal((batch, HEADS, HEAD_DIM), dtype=np.float32)
    k = rng.standard_normal((batch, KV_HEADS, HEAD_DIM), dtype=np.float32)
    hooks = {}
    contiguous = ContiguousKVCache(LAYERS, KV_HEADS, HEAD_DIM, max_seqs=batch,
                                   max_len=context + 2)
    seqs = [contiguous.add_sequence() for _ in range(batch)]
    contiguous.append(seqs, [context] * batch)
    hooks["contiguous numpy"] = Hook(contiguous, seqs, q, k)
    cache = pagedkv.PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, backend=backend, page_size=16,
                                 num_pages=batch * (-(-(context + 1) // 16)))
    seqs = [cache.add_sequence() for _ in range(batch)]
    step = cache.append(seqs, [context] * batch)
    prompt = rng.standard_normal((batch * context, KV_HEADS, HEAD_DIM), dtype=np.float32)
    for layer in range(LAYERS):
        cache.store(layer, step, prompt, prompt)
    hooks[f"{backend} numpy"] = Hook(cache, seqs, q, k)
    if backend == "opencl":
        import pyopencl.array as cl_array
        queue = cache._backend.queue      # the arrays on the cache's own queue
        hooks["opencl device arrays"] = Hook(
            cache, seqs, cl_array.to_device(queue, q), cl_array.to_device(queue, k),
            finish=lambda out: out.get())
    return hooks


def main():
    parser = backends_parser(__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=100, help="tokens before the step")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--matmuls", action="store_true",
                        help="a SmolLM2 layer's matrix products before each layer's hook")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if run_each_backend_alone(__file__, sys.argv[1:], backends):
        return 0
    rng = np.random.default_rng(0)
    hooks = make_hooks(backends[0], args.batch, args.context, rng)
    x = rng.standard_normal((args.batch, HIDDEN), dtype=np.float32)
    weights = [rng.standard_normal(shape, dtype=np.float32) for shape in
               ((HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN),
                (HIDDEN, 2 * FFN), (FFN, HIDDEN))]
    h = np.zeros((args.batch, FFN), np.float32)

    def layer_products():
        x @ weights[0]
        x @ weights[1][:HIDDEN]
        x @ weights[2]
        h @ weights[3]

    between = layer_products if args.matmuls else (lambda: None)
    times = {name: [] for name in hooks}
    with blas_threads(1):
        for hook in hooks.values():
            hook.step(between)                            # warm-up: plans, builds
        for _ in range(args.rounds):
            for name, hook in hooks.items():
                times[name].append(hook.step(between))
    base = np.median(times["contiguous numpy"])
    rows = [[name, f"{np.median(t) * 1e6:.1f}", f"{min(t) * 1e6:.1f}",
             f"{np.median(t) / base:.2f}x"] for name, t in times.items()]
    print(f"# one decode step's KV hook (store + attention) per layer: batch {args.batch}, "
          f"{args.context} tokens of context, SmolLM2-135M's shape, {LAYERS} layers a step, "
          f"{'with' if args.matmuls else 'without'} the layer's matrix products in between; "
          f"median of {args.rounds} rounds")
    print(fmt_table(["hook", "us per layer (median)", "us (best round)", "vs contiguous"],
                    rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
