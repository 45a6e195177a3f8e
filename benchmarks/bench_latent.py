"""Latent attention (``kv_layout="latent"``) decode shaped like DeepSeek-V2-Lite, in one run.

8 sequences of 4,096 tokens decode one token each: 16 query heads over one
latent row per token of 576 values (the 512-wide latent, then the 64-wide
rotary key), output 512 wide per head, float32, page 16.

  paged vs torch    ``cache.attention`` against torch on the same rows held
                    contiguously, [8, 4096, 576]: bmm, softmax, bmm (the
                    values the rows' first 512 columns).  Target <= 1.0x.
  GFLOP/s           the decode's useful FLOPs (2 x heads x keys x (576 + 512)
                    per sequence) per second, against torch's float32 sgemm
                    (2,048 x 2,048 x 2,048) measured in the same run.
                    Target >= 0.5x.
  vs transformers   DeepSeek-V2's attention module (hidden 2,048, q_proj,
                    kv_b_proj, o_proj) decoding one token per sequence at that
                    context: transformers' eager attention over its
                    DynamicCache (it expands the whole history through
                    kv_b_proj every step) against the same module with
                    ``attn_implementation="pagedkv"`` over a PagedCache
                    (absorbed: one latent row per token).  The ratio is
                    transformers' time over pagedkv's.

Each paired figure is the median over ``--rounds`` rounds of the ratio of
the best of ``--repeat`` calls of each side, timed alternately.

    python benchmarks/bench_latent.py [--backends host,opencl] [--rounds 5]
"""
import sys

import numpy as np

import pagedkv
from _common import backends_parser, best_seconds, fmt_table, paired_ratio, \
    run_each_backend_alone

NUM_SEQS, CONTEXT, NUM_HEADS, HEAD_DIM, V_HEAD_DIM, PAGE = 8, 4096, 16, 576, 512, 16
ROPE, NOPE, MODEL_V, HIDDEN = 64, 128, 128, 2048
SCALE = (NOPE + ROPE) ** -0.5
SGEMM = 2048


def filled(backend, rows):
    """A one-layer latent cache holding ``rows`` [NUM_SEQS, CONTEXT - 1, 576] and the
    step of one more token per sequence (stored), ready for ``attention``."""
    pages = NUM_SEQS * (-(-CONTEXT // PAGE))
    cache = pagedkv.PagedKVCache(1, 1, HEAD_DIM, num_pages=pages, page_size=PAGE,
                                 backend=backend, kv_layout="latent", v_head_dim=V_HEAD_DIM)
    seqs = [cache.add_sequence() for _ in range(NUM_SEQS)]
    for s in seqs:
        cache.store(0, cache.append([s], CONTEXT - 1), rows[s, :-1, None])
    batch = cache.append(seqs, 1)
    cache.store(0, batch, rows[:, -1, None])
    return cache, batch


def module_pair(backend):
    """DeepSeek-V2's attention at CONTEXT: (transformers' eager step, pagedkv's step)."""
    import torch
    from transformers import DeepseekV2Config, DynamicCache
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    import pagedkv.hf
    config = DeepseekV2Config(hidden_size=HIDDEN, num_attention_heads=NUM_HEADS,
                              num_key_value_heads=NUM_HEADS, kv_lora_rank=V_HEAD_DIM,
                              q_lora_rank=None, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
                              v_head_dim=MODEL_V, num_hidden_layers=1,
                              max_position_embeddings=2 * CONTEXT)
    torch.manual_seed(0)
    module = ds.DeepseekV2Attention(config, 0).eval()
    rotary = ds.DeepseekV2RotaryEmbedding(config)
    past = CONTEXT - 1
    latent = torch.randn(NUM_SEQS, 1, past, V_HEAD_DIM)
    k_rope = torch.randn(NUM_SEQS, 1, past, ROPE)
    hidden = torch.randn(NUM_SEQS, 1, HIDDEN)
    positions = torch.full((NUM_SEQS, 1), past)
    dynamic = DynamicCache(config=config)
    dynamic.update(latent, k_rope, 0)

    def eager():
        config._attn_implementation = "eager"
        with torch.inference_mode():
            module(hidden, None, cache=dynamic, position_embeddings=rotary(hidden, positions))
        dynamic.crop(-1)

    paged = pagedkv.hf.PagedCache(config, num_pages=NUM_SEQS * (-(-CONTEXT // PAGE)),
                                  backend=backend)
    seqs = [paged.kv.add_sequence() for _ in range(NUM_SEQS)]
    rows = torch.cat([latent, k_rope], dim=-1).transpose(1, 2)    # [B, past, 1, 576]
    for s in seqs:
        paged.kv.store(0, paged.kv.append([s], past), rows[s])
    packed = hidden.reshape(1, NUM_SEQS, HIDDEN)
    packed_positions = positions.reshape(1, NUM_SEQS)

    def absorbed():
        config._attn_implementation = "pagedkv"
        batch = paged.kv.append(seqs, 1)
        with torch.inference_mode(), paged.step(batch):
            module(packed, None, cache=paged,
                   position_embeddings=rotary(packed, packed_positions),
                   position_ids=packed_positions)
        for s in seqs:
            paged.kv.truncate(s, past)

    return eager, absorbed


def main(argv):
    parser = backends_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if run_each_backend_alone(__file__, argv, backends):
        return
    backend = backends[0]
    import torch
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((NUM_SEQS, CONTEXT, HEAD_DIM), dtype=np.float32)
    q = rng.standard_normal((NUM_SEQS, NUM_HEADS, HEAD_DIM), dtype=np.float32)
    cache, batch = filled(backend, rows)
    contiguous, q_t = torch.from_numpy(rows), torch.from_numpy(q)

    def paged():
        cache.attention(0, batch, q, scale=SCALE)

    def dense():
        weights = torch.softmax(torch.bmm(q_t, contiguous.transpose(1, 2)) * SCALE, dim=-1)
        torch.bmm(weights, contiguous[:, :, :V_HEAD_DIM])

    out = cache.attention(0, batch, q, scale=SCALE)
    np.testing.assert_allclose(out, torch.bmm(torch.softmax(
        torch.bmm(q_t, contiguous.transpose(1, 2)) * SCALE, dim=-1),
        contiguous[:, :, :V_HEAD_DIM]).numpy(), rtol=1e-4, atol=1e-4)
    median, lo, hi, t_paged, t_dense = paired_ratio(paged, dense, args.rounds, args.repeat)
    a, b = torch.randn(SGEMM, SGEMM), torch.randn(SGEMM, SGEMM)
    sgemm = 2 * SGEMM ** 3 / best_seconds(lambda: torch.mm(a, b), repeat=args.repeat)
    flops = 2 * NUM_SEQS * NUM_HEADS * CONTEXT * (HEAD_DIM + V_HEAD_DIM)
    eager, absorbed = module_pair(backend)
    speedup, s_lo, s_hi, t_eager, t_absorbed = paired_ratio(eager, absorbed, args.rounds,
                                                            args.repeat)
    print(f"backend {backend}, {NUM_SEQS} x {CONTEXT:,} tokens, {NUM_HEADS} heads, "
          f"{HEAD_DIM}/{V_HEAD_DIM}, float32, torch threads {torch.get_num_threads()}; "
          f"{args.rounds} rounds, best of {args.repeat} calls per side")
    print(fmt_table(["figure", "pagedkv", "against", "ratio", "target"], [
        ["decode time, paged vs torch contiguous (bmm, softmax, bmm)",
         f"{t_paged * 1e3:.2f} ms", f"{t_dense * 1e3:.2f} ms",
         f"**{median:.2f}x** ({lo:.2f}-{hi:.2f})", "<= 1.0x"],
        ["GFLOP/s, paged decode vs torch float32 sgemm",
         f"{flops / t_paged / 1e9:.1f}", f"{sgemm / 1e9:.1f}",
         f"**{flops / t_paged / sgemm:.2f}x**", ">= 0.5x"],
        ["DeepSeek-V2 attention module, one decode step: transformers eager (expand, "
         "then attend) over pagedkv absorbed", f"{t_absorbed * 1e3:.2f} ms",
         f"{t_eager * 1e3:.2f} ms", f"**{speedup:.2f}x** ({s_lo:.2f}-{s_hi:.2f})", "(ratio)"],
    ]))


if __name__ == "__main__":
    main(sys.argv[1:])
