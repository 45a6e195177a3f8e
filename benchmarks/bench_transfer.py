"""K/V that leaves the cache: export + import, save + load, a warm start from a file, and
the K/V transfer of the disaggregated demo.

1. **export + import**: a SmolLM2-shaped cache (30 layers, 3 KV heads,
   head_dim 64, float32) holding one 4,096-token sequence (189 MB of K/V);
   ``export_sequence`` then ``import_sequence`` into a second cache, against
   two numpy copies of the same bytes into existing arrays (memory
   bandwidth alone; export's arrays are new ones).  Target: >= 0.5x their
   speed.
2. **save + load** of that sequence against ``np.save`` + ``np.load`` of the
   same bytes in the same folder (``--folder``).  Target: >= 0.5x.  ``save``
   also flushes its file to disk (fsync), which ``np.save`` does not: the
   table shows ``np.save`` + fsync as well.
3. **time to first token** of a 2,000-token prompt in the demo engine on
   SmolLM2-135M: computed, against a fresh cache that loads a file saved
   after computing it (its prefix cache) and computes only the last page.
   Target: >= 20x faster (the load included).
4. **disaggregated demo** (``--ray``): the demo's prompts through a prefill
   actor and a decode actor on a local Ray cluster; K/V transfer time per
   request (export, object store put and fetch, import) and its share of
   the request's time.

Alternatives are timed interleaved in one process, best of ``--repeat``;
parts 1 and 2 run once per backend, each backend in its own process.

    python benchmarks/bench_transfer.py [--backends host,opencl] [--ray]
"""
import os
import sys
import tempfile
import time

import numpy as np

import pagedkv
from _common import backends_parser, fmt_table, run_each_backend_alone

LAYERS, KV_HEADS, HEAD_DIM, TOKENS, PAGE_SIZE = 30, 3, 64, 4096, 16


def filled_cache(backend, rng):
    cache = pagedkv.PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, num_pages=TOKENS // PAGE_SIZE + 1,
                                 page_size=PAGE_SIZE, backend=backend)
    s = cache.add_sequence()
    batch = cache.append([s], TOKENS)
    k = rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)).astype(np.float32)
    for layer in range(LAYERS):
        cache.store(layer, batch, k, k)
    return cache, s


def interleaved(alternatives, repeat):
    """Best seconds of each ``name -> fn`` over ``repeat`` rounds, one call of each per round."""
    best = {name: float("inf") for name in alternatives}
    for fn in alternatives.values():
        fn()                                  # warm up
    for _ in range(repeat):
        for name, fn in alternatives.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_moves(backend, folder, repeat):
    """Parts 1 and 2 on one backend: (table rows, the two ratios)."""
    rng = np.random.default_rng(0)
    source, s = filled_cache(backend, rng)
    target = pagedkv.PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM,
                                  num_pages=TOKENS // PAGE_SIZE + 1, page_size=PAGE_SIZE,
                                  backend=backend)
    nbytes = source.export_sequence(s).nbytes
    data = np.ones(nbytes // 4, np.float32)
    first, second = np.zeros_like(data), np.zeros_like(data)
    path = os.path.join(folder, "bench_transfer.safetensors")
    npy = os.path.join(folder, "bench_transfer.npy")

    def export_import():
        target.free(target.import_sequence(source.export_sequence(s)))

    def two_copies():
        np.copyto(first, data)
        np.copyto(second, first)

    def save_load():
        source.save(path)
        target.free(target.load(path)[0])

    def np_save_load(fsync=False):
        np.save(npy, data)
        if fsync:
            with open(npy, "rb") as f:
                os.fsync(f.fileno())
        np.load(npy)

    times = interleaved({"export + import": export_import, "two numpy copies": two_copies,
                         "save + load": save_load, "np.save + np.load": np_save_load,
                         "np.save + fsync + np.load": lambda: np_save_load(True)}, repeat)
    for name in (path, npy):
        os.unlink(name)
    rows = [[backend, name, f"{1e3 * t:.1f}", f"{nbytes / t / 1e9:.2f}"]
            for name, t in times.items()]
    move = times["two numpy copies"] / times["export + import"]
    files = times["np.save + np.load"] / times["save + load"]
    return rows, move, files, times["np.save + fsync + np.load"] / times["save + load"]


def bench_first_token(backend, folder, prompt_len=2000):
    """Part 3: (seconds computed, seconds from a file, of which loading)."""
    from pagedkv.models.default_model import resolve_model
    from pagedkv.models.engine import Engine
    from pagedkv.models.gguf_loader import load_gguf_model, read_gguf_header
    from pagedkv.models.threads import blas_threads
    header = read_gguf_header(resolve_model(None))
    c = header.config
    model = load_gguf_model(header).model
    prompt = np.random.default_rng(1).integers(0, c.vocab_size, prompt_len).tolist()
    path = os.path.join(folder, "bench_first_token.safetensors")

    def new_engine():
        cache = pagedkv.PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim,
                                     num_pages=prompt_len // PAGE_SIZE + 8, page_size=PAGE_SIZE,
                                     backend=backend, enable_prefix_caching=True)
        engine = Engine(model, cache, max_seq_len=c.max_position)
        engine.warm_up()
        return engine

    def first_token(engine):
        engine.add_request(prompt, max_new_tokens=1)
        while engine.has_unfinished():
            engine.step()

    with blas_threads(1):
        engine = new_engine()
        start = time.perf_counter()
        first_token(engine)
        computed = time.perf_counter() - start
        engine.cache.save(path)               # its prefix cache: the prompt's full pages
        engine = new_engine()
        start = time.perf_counter()
        engine.cache.load(path)
        loading = time.perf_counter() - start
        first_token(engine)
        loaded = time.perf_counter() - start
    os.unlink(path)
    return computed, loaded, loading


def bench_disaggregated(backend):
    """Part 4: the disaggregated demo's report lines."""
    import ray
    from pagedkv.models.default_model import resolve_model
    from pagedkv.models.demo import DEFAULT_PROMPTS, build_parser, check_pool
    from pagedkv.models.disaggregated import serve
    from pagedkv.models.gguf_loader import read_gguf_header
    from pagedkv.models.tokenizer import GGUFTokenizer, encode_prompts
    path = resolve_model(None)
    header = read_gguf_header(path)
    tokenizer = GGUFTokenizer.from_metadata(header.metadata)
    prompt_ids = encode_prompts(tokenizer, list(DEFAULT_PROMPTS), chat=True)
    args = build_parser().parse_args(["--backend", backend, "--max-new-tokens", "32"])
    num_pages = check_pool([len(p) for p in prompt_ids], args, header.config.max_position)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        _, report, _ = serve(args, path, prompt_ids, tokenizer.stop_ids, num_pages,
                             lambda index, token: None, max_seq_len=header.config.max_position)
    finally:
        ray.shutdown()
    return report


def main(argv=None):
    parser = backends_parser(__doc__)
    parser.add_argument("--folder", default=tempfile.gettempdir(),
                        help="where save and np.save write (default: the temp folder)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ray", action="store_true",
                        help="also run part 4, the disaggregated demo (needs ray)")
    parser.add_argument("--skip-model", action="store_true",
                        help="skip parts 3 and 4 (SmolLM2)")
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if run_each_backend_alone(__file__, [a for a in (argv or sys.argv[1:])], backends):
        return
    backend = backends[0]
    rows, move, files, files_fsync = bench_moves(backend, args.folder, args.repeat)
    gb = LAYERS * 2 * TOKENS * KV_HEADS * HEAD_DIM * 4 / 1e9
    print(f"1-2. one {TOKENS}-token sequence of a SmolLM2-shaped cache ({gb:.3f} GB of K/V), "
          f"best of {args.repeat}, folder {args.folder}")
    print(fmt_table(["backend", "what", "ms", "GB/s"], rows))
    print(f"export + import: {move:.2f}x the speed of two numpy copies (target >= 0.5x)")
    print(f"save + load: {files:.2f}x the speed of np.save + np.load (target >= 0.5x); "
          f"{files_fsync:.2f}x np.save + fsync + np.load")
    if args.skip_model:
        return
    computed, loaded, loading = bench_first_token(backend, args.folder)
    print(f"3. time to first token of a 2,000-token prompt, SmolLM2-135M on {backend}: "
          f"computed {computed:.2f} s, from a loaded file {loaded:.3f} s (of which loading "
          f"{loading:.3f} s): {computed / loaded:.1f}x faster (target >= 20x)")
    if args.ray:
        print(f"4. disaggregated demo on a local Ray cluster ({backend}):")
        for line in bench_disaggregated(backend):
            print("   " + line)


if __name__ == "__main__":
    main()
