"""A hybrid model through transformers: pagedkv.hf.generate_batch against padded generate, and
a multi-turn chat's prefix reuse.

The model: a random float32 model of Qwen3.5's shape at small size (8 layers,
three gated DeltaNet layers to each attention layer as Qwen3.5 alternates
them, hidden size 256), built from its config with a fixed seed, so no
download is needed.  Two measurements, one run each in one process (after a
small warm-up of each path):

- **throughput**: 16 prompts of 32 to 512 tokens (random ids, a fixed seed),
  64 new tokens each, greedy: ``pagedkv.hf.generate_batch`` (continuous
  batching, steps of at most 512 tokens, attention in pages and the DeltaNet
  states in the state pool) against ``model.generate`` on the left-padded
  batch with transformers' own cache (sdpa attention, its torch
  DeltaNet); tokens per second of wall time, and how many prompts got the
  same tokens from both;
- **multi-turn chat**: 8 turns of one conversation, each turn's prompt the
  previous prompt, its answer and a new 24-token message, through
  ``generate_batch`` on one cache with prefix caching (state snapshots every
  32 tokens): the share of prompt tokens served from the cache, and the
  tokens computed against those a cache-less run would compute.

Each pagedkv backend runs in its own process (``--backends``).  OpenMP waits
passively (``OMP_WAIT_POLICY=passive`` unless the environment sets it): the host
backend's OpenMP threads otherwise spin between its calls, which here alternate
with torch's every layer, and on a 2-core machine that spinning took the cores
from torch (attention calls of 0.7 ms took 20 ms).

    python benchmarks/bench_hf_hybrid.py [--backends host,opencl] [--torch-threads N]
"""
import os
import sys
import time

# before any OpenMP runtime starts (see the docstring); the children inherit it
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np  # noqa: E402

from _common import backends_parser, fmt_table, run_each_backend_alone  # noqa: E402

NUM_PROMPTS, MIN_LEN, MAX_LEN, NEW_TOKENS, STEP_TOKENS = 16, 32, 512, 64, 512
TURNS, MESSAGE_TOKENS, TURN_TOKENS, PAGE_SIZE, SNAPSHOT_INTERVAL = 8, 24, 16, 16, 32
VOCAB = 4000


def tiny_qwen3_5(seed=0):
    """A random Qwen3.5-shaped float32 model (eval mode, attention "pagedkv")."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    import pagedkv.hf  # noqa: F401  (registers "pagedkv")
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, initializer_range=0.1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="pagedkv").eval()
    model.generation_config.eos_token_id = None       # every prompt gets all its tokens
    return model


def workload(seed=0):
    """16 prompts of random ids, lengths spread evenly over [32, 512] in a shuffled order."""
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.linspace(MIN_LEN, MAX_LEN, NUM_PROMPTS).astype(int))
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def run_pagedkv(model, prompts, backend, new_tokens=NEW_TOKENS):
    import pagedkv.hf
    start = time.perf_counter()
    out = pagedkv.hf.generate_batch(model, prompts, new_tokens, backend=backend,
                                    page_size=PAGE_SIZE, max_num_batched_tokens=STEP_TOKENS)
    return out, time.perf_counter() - start


def run_padded(model, prompts, new_tokens=NEW_TOKENS):
    import torch
    model.set_attn_implementation("sdpa")
    try:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
    finally:
        model.set_attn_implementation("pagedkv")
    return out[:, width:].tolist(), seconds


def run_chat(model, backend, seed=1):
    """One conversation of TURNS turns on one cache: per turn (prompt tokens, hit rate so far)."""
    import pagedkv.hf
    rng = np.random.default_rng(seed)
    cache = pagedkv.hf.PagedCache(model.config, num_pages=256, page_size=PAGE_SIZE,
                                  backend=backend, enable_prefix_caching=True,
                                  num_state_slots=2 * TURNS + 4,
                                  state_snapshot_interval=SNAPSHOT_INTERVAL)
    prompt: list = []
    prompt_tokens = 0
    start = time.perf_counter()
    for _ in range(TURNS):
        prompt = prompt + rng.integers(3, VOCAB, MESSAGE_TOKENS).tolist()
        answer = pagedkv.hf.generate_batch(model, [prompt], TURN_TOKENS, cache=cache,
                                           max_num_batched_tokens=STEP_TOKENS)[0]
        prompt_tokens += len(prompt)
        prompt = prompt + answer
    seconds = time.perf_counter() - start
    stats = cache.stats()
    # a cache-less run computes every prompt token and all but the last generated one
    return dict(hit_rate=stats["prefix_hit_rate"], computed=stats["num_stored_tokens"],
                without_reuse=prompt_tokens + TURNS * (TURN_TOKENS - 1), seconds=seconds,
                prompt_tokens=prompt_tokens)


def measure(backend, torch_threads):
    import torch
    if torch_threads:
        torch.set_num_threads(torch_threads)
    model = tiny_qwen3_5()
    prompts = workload()
    warm = [p[:40] for p in prompts[:2]]
    run_pagedkv(model, warm, backend, 4)
    run_padded(model, warm, 4)
    ours, ours_s = run_pagedkv(model, prompts, backend)
    padded, padded_s = run_padded(model, prompts)
    assert all(len(t) == NEW_TOKENS for t in ours + padded)
    num_tokens = NUM_PROMPTS * NEW_TOKENS
    return dict(backend=backend, torch_threads=torch.get_num_threads(),
                prompt_tokens=sum(map(len, prompts)), pagedkv=num_tokens / ours_s,
                padded=num_tokens / padded_s,
                same=sum(a == b for a, b in zip(ours, padded)), chat=run_chat(model, backend))


def main(argv=None):
    parser = backends_parser(__doc__)
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if run_each_backend_alone(__file__, sys.argv[1:] if argv is None else argv, backends):
        return
    row = measure(backends[0], args.torch_threads)
    chat = row["chat"]
    print(f"Random Qwen3.5-shaped model (8 layers: 6 gated DeltaNet, 2 attention), "
          f"{NUM_PROMPTS} prompts of {MIN_LEN}-{MAX_LEN} tokens ({row['prompt_tokens']} in all), "
          f"{NEW_TOKENS} new tokens each, torch threads {row['torch_threads']}, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; one run each (provisional)")
    print(fmt_table(
        ["pagedkv backend", "pagedkv tok/s", "padded generate tok/s", "vs padded",
         "same tokens as padded", f"chat: {TURNS} turns, prefix hit rate",
         "chat: tokens computed / without reuse"],
        [[row["backend"], f"{row['pagedkv']:.1f}", f"{row['padded']:.1f}",
          f"{row['pagedkv'] / row['padded']:.2f}x", f"{row['same']}/{NUM_PROMPTS}",
          f"{chat['hit_rate']:.0%} of {chat['prompt_tokens']}",
          f"{chat['computed']} / {chat['without_reuse']}"]]))


if __name__ == "__main__":
    main()
