"""Multi-head latent attention (DeepSeek V2/V3) over a ``kv_layout="latent"`` cache.

One attention layer of DeepSeek-V2-Lite's shape with random weights: each
token keeps one row of 576 values (its 512-wide latent, then its 64-wide
rotary key), and attention runs in the absorbed form, multi-query attention
over those rows: ``kv_b_proj``'s key half is folded into the queries and the
output goes through its value half.  Two prompts are prefilled together,
then decode a few steps; every step is checked against the textbook form
(expand the whole history into per-head K and V, then attend) in float64.

    python examples/latent_attention.py
"""
import numpy as np

import pagedkv

NUM_HEADS, RANK, ROPE, NOPE, V_DIM = 16, 512, 64, 128, 128
SCALE = (NOPE + ROPE) ** -0.5


class LatentLayer:
    """The attention of one layer, from the per-head queries and the new latent rows on."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        # kv_b_proj: per head, the key half [NOPE, RANK] and the value half [V_DIM, RANK]
        self.w_uk = rng.standard_normal((NUM_HEADS, NOPE, RANK)).astype(np.float32) / RANK ** 0.5
        self.w_uv = rng.standard_normal((NUM_HEADS, V_DIM, RANK)).astype(np.float32) / RANK ** 0.5

    def absorbed(self, cache, layer, batch, q, rows):
        """q [n, NUM_HEADS, NOPE + ROPE], rows [n, 1, RANK + ROPE] -> out [n, NUM_HEADS, V_DIM]."""
        cache.store(layer, batch, rows)                        # one row per token, no V
        q_latent = np.concatenate([np.einsum("nhd,hdr->nhr", q[..., :NOPE], self.w_uk),
                                   q[..., NOPE:]], axis=-1)    # [n, heads, 576]
        out = cache.attention(layer, batch, q_latent, scale=SCALE)   # [n, heads, 512]
        return np.einsum("nhr,hvr->nhv", out, self.w_uv)

    def expanded(self, q, history, positions):
        """The same attention, expanding ``history`` [L, RANK + ROPE] into K/V per head."""
        latent, k_rope = history[:, :RANK].astype(np.float64), history[:, RANK:]
        k = np.concatenate([np.einsum("hdr,lr->lhd", self.w_uk, latent),
                            np.broadcast_to(k_rope[:, None], (len(history), NUM_HEADS, ROPE))],
                           axis=-1)
        v = np.einsum("hvr,lr->lhv", self.w_uv, latent)
        scores = np.einsum("nhd,lhd->hnl", q, k) * SCALE
        scores[:, np.arange(len(history))[None, :] > positions[:, None]] = -np.inf
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return np.einsum("hnl,lhv->nhv", weights / weights.sum(-1, keepdims=True), v)


def main(decode_steps=4, backend="auto"):
    cache = pagedkv.PagedKVCache(1, 1, RANK + ROPE, num_pages=16, backend=backend,
                                 kv_layout="latent", v_head_dim=RANK)
    layer, rng = LatentLayer(), np.random.default_rng(1)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    history = {s: np.zeros((0, RANK + ROPE), np.float32) for s in seqs}
    counts = [23, 9]                                           # ragged prefill, then decode
    for step in range(1 + decode_steps):
        batch = cache.append(seqs, counts)
        n = sum(counts)
        q = rng.standard_normal((n, NUM_HEADS, NOPE + ROPE)).astype(np.float32)
        rows = rng.standard_normal((n, 1, RANK + ROPE)).astype(np.float32)
        out = layer.absorbed(cache, 0, batch, q, rows)
        at, worst = 0, 0.0
        for s, count in zip(seqs, counts):
            history[s] = np.concatenate([history[s], rows[at:at + count, 0]])
            positions = np.arange(len(history[s]) - count, len(history[s]))
            want = layer.expanded(q[at:at + count], history[s], positions)
            worst = max(worst, float(np.abs(out[at:at + count] - want).max()))
            at += count
        print(f"step {step}: {n} tokens, out {list(out.shape)}, max |absorbed - expanded| "
              f"= {worst:.1e}")
        assert worst < 1e-4
        counts = [1, 1]
    print(f"{cache.memory_bytes:,} bytes of latent rows for {cache.num_pages * cache.page_size} "
          f"tokens: {cache.memory_bytes // (cache.num_pages * cache.page_size):,} per token")


if __name__ == "__main__":
    main()
