"""A hybrid model (gated DeltaNet layers beside attention) through ``pagedkv.hf.generate_batch``.

A tiny Qwen3.5-shaped model with random weights (three gated DeltaNet layers
and one attention layer, as Qwen3.5 alternates them): the attention layer
keeps K/V in pages, each DeltaNet layer a fixed-size state per sequence (its
convolution's last inputs and the delta rule's matrix) in the cache's state
pool.  Four requests that share a system prompt run with continuous batching,
then a second turn of the first conversation starts from the cached prefix
(pages and a state snapshot); every output is checked against transformers'
own cache.

    python examples/hf_hybrid.py [--backend host|opencl] [--max-new-tokens 8]
"""
import argparse

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

import pagedkv.hf


def tiny_qwen3_5(seed=0):
    """A random float32 Qwen3.5 of four layers (linear, linear, linear, full), eval mode."""
    config = Qwen3_5TextConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        max_position_embeddings=1024, initializer_range=0.1)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                            attn_implementation="pagedkv").eval()


def own_cache_tokens(model, prompt, max_new_tokens):
    """The greedy tokens of ``prompt`` alone with transformers' own cache (sdpa)."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False)
    finally:
        model.set_attn_implementation("pagedkv")
    return out[0, len(prompt):].tolist()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    model = tiny_qwen3_5()
    rng = np.random.default_rng(0)
    system = rng.integers(3, 1000, 64).tolist()                  # a shared system prompt
    prompts = [system + rng.integers(3, 1000, n).tolist() for n in (5, 17, 9, 30)]

    # pages of 16 tokens; a state snapshot every 32 tokens, so later prompts that share
    # the system prompt start on its cached pages and the states after it
    cache = pagedkv.hf.PagedCache(model.config, num_pages=64, page_size=16,
                                  backend=args.backend, enable_prefix_caching=True,
                                  num_state_slots=12, state_snapshot_interval=32)
    outputs = pagedkv.hf.generate_batch(model, prompts, args.max_new_tokens, cache=cache,
                                        max_num_batched_tokens=32)
    # the conversation's next turn: the first prompt, its answer and a new message
    second = prompts[0] + outputs[0] + rng.integers(3, 1000, 6).tolist()
    outputs += pagedkv.hf.generate_batch(model, [second], args.max_new_tokens, cache=cache,
                                         max_num_batched_tokens=32)
    prompts.append(second)

    same = 0
    for prompt, output in zip(prompts, outputs):
        own = own_cache_tokens(model, prompt, args.max_new_tokens)
        same += output == own
        print(f"{len(prompt):3d} prompt tokens -> {output}  (transformers' own cache: "
              f"{'same' if output == own else own})")
    stats = cache.stats()
    print(f"same tokens as transformers' own cache: {same}/{len(prompts)}")
    print(f"{stats['num_stored_tokens']} tokens computed, "
          f"{stats['prefix_hit_rate']:.0%} of the prompt tokens reused from the prefix cache; "
          f"state pool: {cache.kv.num_state_slots} slots, backend {cache.kv.backend}")
    return same == len(prompts)


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
