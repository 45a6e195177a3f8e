"""The gated delta rule kernel on a Qwen3.5-shaped gated DeltaNet layer, in one run.

16 key heads, 32 value heads, k_dim = v_dim = 128, float32: a state of
32 x 128 x 128 floats (2 MiB) per sequence; q and k L2-normalised, scale
k_dim ** -0.5, g < 0, beta in (0, 1).  The backend's ``gated_delta_rule`` on
its state store (``Backend.state_store``), against:

  decode vs copy         32 sequences, one token each, against ``np.copyto``
                         of the same state bytes ([32, 32, 128, 128] float32:
                         64 MiB read and written, what any update of the
                         states in place must move).  Target <= 1.5x.
  decode vs transformers the same step by transformers'
                         ``torch_recurrent_gated_delta_rule`` (its states
                         passed in and returned).  Target >= 5x faster.
  prefill vs transformers one sequence of 2,048 tokens against
                         ``torch_chunk_gated_delta_rule`` (chunk 64).
                         Target >= 5x faster.
  GFLOP/s                the prefill's useful FLOPs (per token and value
                         head 3 x k_dim x v_dim multiply-adds: S^T k, the
                         rank-one update, S^T q) per second, against torch's
                         float32 sgemm (2,048^3) measured in the same run.
  (opencl) device arrays the prefill again with q, k, v, g, beta already
                         pyopencl arrays (the result one too): the kernels
                         without the upload and read-back of numpy inputs.

Each paired figure is the median over ``--rounds`` rounds of the ratio of
the best of ``--repeat`` calls of each side (of one call for the prefill
against transformers, whose chunked form takes seconds), timed alternately;
each backend runs in a process of its own.

    python benchmarks/bench_recurrent.py [--backends host,opencl] [--rounds 3]
"""
import sys
from types import SimpleNamespace

import numpy as np

import pagedkv
from _common import backends_parser, best_seconds, fmt_table, paired_ratio, \
    run_each_backend_alone

NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM = 16, 32, 128, 128
DECODE_SEQS, PREFILL_TOKENS = 32, 2048
SCALE = K_DIM ** -0.5
SGEMM = 2048


def inputs(rng, num_rows):
    """q, k [num_rows, 16, 128], v [num_rows, 32, 128], g, beta [num_rows, 32], float32."""
    q = rng.standard_normal((num_rows, NUM_K_HEADS, K_DIM), dtype=np.float32)
    k = rng.standard_normal((num_rows, NUM_K_HEADS, K_DIM), dtype=np.float32)
    v = rng.standard_normal((num_rows, NUM_V_HEADS, V_DIM), dtype=np.float32)
    g = -rng.uniform(0.01, 0.5, (num_rows, NUM_V_HEADS)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (num_rows, NUM_V_HEADS)).astype(np.float32)
    return q, k, v, g, beta


def step(rows):
    """A step of sequences with ``rows[b]`` new rows each, sequence b in slot b, no saves."""
    return SimpleNamespace(query_start=np.concatenate([[0], np.cumsum(rows)]).astype(np.int32),
                           slots=np.arange(len(rows), dtype=np.int32),
                           save_rows=np.zeros(0, np.int32), save_slots=np.zeros(0, np.int32))


def torch_side(fn, batched, states):
    """transformers' ``fn`` on the step's rows as a batch [B, T, H, d] (one
    sequence per batch row), from ``states`` [B, 32, 128, 128]: a call."""
    import torch
    q, k, v, g, beta = (torch.from_numpy(x) for x in batched)
    initial = torch.from_numpy(states)

    def call():
        return fn(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    return call


def main(argv):
    parser = backends_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if run_each_backend_alone(__file__, argv, backends):
        return
    backend_name = backends[0]
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)
    rng = np.random.default_rng(0)
    backend = pagedkv.PagedKVCache(1, 1, 8, num_pages=2, backend=backend_name)._backend
    shape = (NUM_V_HEADS, K_DIM, V_DIM)
    store = backend.state_store([(shape,)], DECODE_SEQS)
    states = rng.standard_normal((DECODE_SEQS,) + shape, dtype=np.float32) * 0.1
    every = np.arange(DECODE_SEQS, dtype=np.int32)

    # decode: one row per sequence; torch takes them as a batch of one-token sequences
    decode, decode_in = step([1] * DECODE_SEQS), inputs(rng, DECODE_SEQS)
    store.write(0, 0, every, states)
    ours = backend.gated_delta_rule(store, 0, 0, decode, *decode_in, SCALE, True)
    theirs, final = torch_side(torch_recurrent_gated_delta_rule,
                               [x[:, None] for x in decode_in], states)()
    np.testing.assert_allclose(ours, theirs[:, 0].numpy(), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(store.read(0, 0, every), final.numpy(), rtol=1e-3, atol=1e-4)

    def ours_decode():
        backend.gated_delta_rule(store, 0, 0, decode, *decode_in, SCALE, True)

    src, dst = np.ones((DECODE_SEQS,) + shape, np.float32), np.empty((DECODE_SEQS,) + shape,
                                                                     np.float32)
    vs_copy = paired_ratio(ours_decode, lambda: np.copyto(dst, src), args.rounds, args.repeat)
    torch_decode = torch_side(torch_recurrent_gated_delta_rule,
                              [x[:, None] for x in decode_in], states)
    vs_torch_decode = paired_ratio(torch_decode, ours_decode, args.rounds, args.repeat)

    # prefill: one sequence of 2,048 tokens from a zero state
    prefill, prefill_in = step([PREFILL_TOKENS]), inputs(rng, PREFILL_TOKENS)
    zeros = np.zeros((1,) + shape, np.float32)
    slot0 = every[:1]

    def ours_prefill():
        store.zero(slot0)
        return backend.gated_delta_rule(store, 0, 0, prefill, *prefill_in, SCALE, True)

    torch_prefill = torch_side(torch_chunk_gated_delta_rule, [x[None] for x in prefill_in], zeros)
    theirs, final = torch_prefill()
    np.testing.assert_allclose(ours_prefill(), theirs[0].numpy(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(store.read(0, 0, slot0), final.numpy(), rtol=1e-3, atol=1e-3)
    vs_torch_prefill = paired_ratio(torch_prefill, ours_prefill, args.rounds, 1)
    native_rows = []
    if backend.array_types:   # the device's own arrays: no upload of q, k, v, no read back
        from pyopencl import array as cl_array
        on_device = [cl_array.to_device(backend.queue, x) for x in prefill_in]

        def ours_native():
            store.zero(slot0)
            backend.gated_delta_rule(store, 0, 0, prefill, *on_device, SCALE, True)
            backend.queue.finish()

        native = paired_ratio(torch_prefill, ours_native, args.rounds, 1)
        native_rows.append([
            f"prefill {PREFILL_TOKENS:,} tokens, inputs and output as pyopencl arrays: "
            "transformers torch_chunk_gated_delta_rule over pagedkv",
            f"{native[4] * 1e3:.1f} ms", f"{native[3] * 1e3:.1f} ms",
            f"**{native[0]:.2f}x** ({native[1]:.2f}-{native[2]:.2f})", ">= 5x"])
    a, b = torch.randn(SGEMM, SGEMM), torch.randn(SGEMM, SGEMM)
    sgemm = 2 * SGEMM ** 3 / best_seconds(lambda: torch.mm(a, b), repeat=args.repeat)
    flops = 6 * PREFILL_TOKENS * NUM_V_HEADS * K_DIM * V_DIM
    t_prefill = vs_torch_prefill[4]

    def ratio(r):
        median, lo, hi = r[:3]
        return f"**{median:.2f}x** ({lo:.2f}-{hi:.2f})"

    print(f"backend {backend_name}, gated DeltaNet {NUM_K_HEADS}/{NUM_V_HEADS} heads, "
          f"{K_DIM}x{V_DIM} state (2 MiB per sequence), float32, torch threads "
          f"{torch.get_num_threads()}; {args.rounds} rounds, best of {args.repeat} calls per side")
    print(fmt_table(["figure", "pagedkv", "against", "ratio", "target"], [
        [f"decode {DECODE_SEQS} x 1 token, time vs np.copyto of the states (64 MiB)",
         f"{vs_copy[3] * 1e3:.2f} ms", f"{vs_copy[4] * 1e3:.2f} ms", ratio(vs_copy),
         "<= 1.5x"],
        ["decode: transformers torch_recurrent_gated_delta_rule over pagedkv",
         f"{vs_torch_decode[4] * 1e3:.2f} ms", f"{vs_torch_decode[3] * 1e3:.2f} ms",
         ratio(vs_torch_decode), ">= 5x"],
        [f"prefill {PREFILL_TOKENS:,} tokens: transformers torch_chunk_gated_delta_rule "
         "over pagedkv", f"{t_prefill * 1e3:.1f} ms", f"{vs_torch_prefill[3] * 1e3:.1f} ms",
         ratio(vs_torch_prefill), ">= 5x"],
        ["prefill GFLOP/s vs torch float32 sgemm", f"{flops / t_prefill / 1e9:.1f}",
         f"{sgemm / 1e9:.1f}", f"**{flops / t_prefill / sgemm:.2f}x**", "(ratio)"],
    ] + native_rows))


if __name__ == "__main__":
    main(sys.argv[1:])
