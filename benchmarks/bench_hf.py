"""SmolLM2-135M through transformers: pagedkv.hf.generate_batch against transformers' own generation.

The workload: 16 prompts of mixed lengths (50 to 1,000 tokens, random ids, a
fixed seed), 64 new tokens each, greedy, with the end-of-sequence token off
so that every prompt gets all 64.  Three ways to run it on the same model
object, in one process, one run each (after a small warm-up of each):

- **pagedkv**: ``pagedkv.hf.generate_batch`` (attention ``"pagedkv"``):
  continuous batching, steps of at most 512 tokens (prefill chunks beside
  decodes), every step one packed forward pass, paged attention on the
  backend under test;
- **transformers CB**: ``model.generate_batch`` (attention ``"sdpa"``), its
  own continuous batching over its ``PagedAttentionCache``, given the same
  512-token step budget and a cache sized for the workload (its default
  sizing allocates most of the machine's memory first), warm-up off;
- **padded generate**: ``model.generate`` on the left-padded batch (sdpa,
  the default dynamic cache).

Throughput is generated tokens per second of wall time of the call.  KV
memory compares what each holds when every sequence has its full length: the
pages pagedkv needs then (K and V of every layer) against the tensors of
transformers' dynamic cache at the end of the padded ``generate`` (measured),
which hold every row at the padded width.

Each pagedkv backend runs in its own process beside its own baselines
(``--backends``), so that PoCL's threads never compete with a host timing.

    python benchmarks/bench_hf.py [--backends host,opencl] [--converted-dir DIR]
                                  [--torch-threads N]
"""
import sys
import time

import numpy as np

from _common import backends_parser, fmt_table, run_each_backend_alone

NUM_PROMPTS, MIN_LEN, MAX_LEN, NEW_TOKENS, STEP_TOKENS = 16, 50, 1000, 64, 512
_MIB = 1024 * 1024


def workload(seed=0):
    """16 prompts of random ids, lengths spread evenly over [50, 1000] in a shuffled order."""
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.linspace(MIN_LEN, MAX_LEN, NUM_PROMPTS).astype(int))
    return [rng.integers(100, 20000, n).tolist() for n in lengths]


def run_pagedkv(model, prompts, backend):
    import pagedkv.hf
    model.set_attn_implementation("pagedkv")
    cache = pagedkv.hf.PagedCache(
        model.config, backend=backend, page_size=16,
        num_pages=sum(-(-(len(p) + NEW_TOKENS) // 16) for p in prompts))
    start = time.perf_counter()
    out = pagedkv.hf.generate_batch(model, prompts, NEW_TOKENS, cache=cache,
                                    max_num_batched_tokens=STEP_TOKENS)
    seconds = time.perf_counter() - start
    # every sequence at its full length: the pages it needs, in bytes
    full_pages = sum(-(-(len(p) + NEW_TOKENS - 1) // cache.kv.page_size) for p in prompts)
    held = full_pages * cache.kv.memory_bytes / cache.kv.num_pages
    return out, seconds, held


def run_transformers_cb(model, prompts):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    model.set_attn_implementation("sdpa")
    page = 256
    blocks = sum(-(-(len(p) + NEW_TOKENS) // page) for p in prompts) + NUM_PROMPTS
    config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                      max_batch_tokens=STEP_TOKENS)
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=generation,
                                   continuous_batching_config=config, warmup=False)
    seconds = time.perf_counter() - start
    by_id = {int(key.split("_")[-1]): value.generated_tokens for key, value in results.items()}
    return [by_id[i] for i in range(len(prompts))], seconds


def run_padded(model, prompts):
    import torch
    from transformers import DynamicCache
    model.set_attn_implementation("sdpa")
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return out[:, width:].tolist(), seconds, held


def measure(backend, converted_dir, torch_threads):
    import torch

    import pagedkv.hf  # noqa: F401  (registers "pagedkv")
    from pagedkv.hf.loading import load_causal_lm
    from pagedkv.models.default_model import default_model_path
    if torch_threads:
        torch.set_num_threads(torch_threads)
    model = load_causal_lm(default_model_path(), converted_dir=converted_dir)
    model.generation_config.eos_token_id = None        # every prompt gets all its tokens
    prompts = workload()
    warm = [p[:40] for p in prompts[:2]]
    run_pagedkv(model, warm, backend)
    run_transformers_cb(model, warm)
    run_padded(model, warm)

    ours, ours_s, ours_bytes = run_pagedkv(model, prompts, backend)
    cb, cb_s = run_transformers_cb(model, prompts)
    padded, padded_s, padded_bytes = run_padded(model, prompts)
    num_tokens = NUM_PROMPTS * NEW_TOKENS
    assert all(len(t) == NEW_TOKENS for t in ours + cb + padded)
    return dict(backend=backend, torch_threads=torch.get_num_threads(),
                prompt_tokens=sum(map(len, prompts)),
                pagedkv=num_tokens / ours_s, cb=num_tokens / cb_s, padded=num_tokens / padded_s,
                pagedkv_bytes=ours_bytes, padded_bytes=padded_bytes,
                same_as_cb=sum(a == b for a, b in zip(ours, cb)),
                same_as_padded=sum(a == b for a, b in zip(ours, padded)))


def main(argv=None):
    parser = backends_parser(__doc__)
    parser.add_argument("--converted-dir", default=None,
                        help="keep the GGUF's dequantized weights here (default: load the GGUF)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if run_each_backend_alone(__file__, sys.argv[1:] if argv is None else argv, backends):
        return
    row = measure(backends[0], args.converted_dir, args.torch_threads)
    print(f"SmolLM2-135M through transformers, {NUM_PROMPTS} prompts of {MIN_LEN}-{MAX_LEN} "
          f"tokens ({row['prompt_tokens']} in all), {NEW_TOKENS} new tokens each, torch threads "
          f"{row['torch_threads']}; one run each (provisional)")
    print(fmt_table(
        ["pagedkv backend", "pagedkv tok/s", "transformers CB tok/s", "padded generate tok/s",
         "vs CB (>= 1.3x)", "vs padded (>= 1.5x)", "same tokens as CB / padded"],
        [[row["backend"], f"{row['pagedkv']:.1f}", f"{row['cb']:.1f}", f"{row['padded']:.1f}",
          f"{row['pagedkv'] / row['cb']:.2f}x", f"{row['pagedkv'] / row['padded']:.2f}x",
          f"{row['same_as_cb']}/{NUM_PROMPTS}, {row['same_as_padded']}/{NUM_PROMPTS}"]]))
    print(f"KV memory with every sequence at full length: pagedkv "
          f"{row['pagedkv_bytes'] / _MIB:.1f} MiB, transformers' dynamic cache (padded) "
          f"{row['padded_bytes'] / _MIB:.1f} MiB: "
          f"{row['padded_bytes'] / row['pagedkv_bytes']:.2f}x")


if __name__ == "__main__":
    main()
