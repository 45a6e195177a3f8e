"""A gated DeltaNet layer (Qwen3.5, Qwen3-Next) with its state in a ``PagedKVCache``.

One recurrent layer of a hybrid model with random weights, beside an
attention layer: the layer's short convolution (``causal_conv1d``) mixes
its q/k/v channels over the last four tokens, then the gated delta rule
(``gated_delta_rule``) updates each head's ``[k_dim, v_dim]`` state.  Both
states live in the cache's state pool.  It shows:

1. two prompts prefilled in one ragged step, then decoding;
2. speculative decoding: three draft tokens, two accepted, the rest rolled
   back (``state_rollback_tokens``), the state restored exactly;
3. a prefix hit: a third prompt that repeats the first one starts on its
   cached pages and state snapshot.

Every output is checked against the same layer run from scratch over the
whole history without a cache, in float64.

    python examples/hybrid_layer.py
"""
import numpy as np

import pagedkv

HK, HV, DK, DV, KERNEL = 2, 4, 16, 16, 4          # k-heads, v-heads, head widths, conv kernel
CHANNELS = 2 * HK * DK + HV * DV                   # the convolution's q, k and v channels
SPEC = pagedkv.StateSpec([(CHANNELS, KERNEL - 1), (HV, DK, DV)])


class DeltaNetLayer:
    """The recurrent core of one gated DeltaNet layer, from its projected inputs on."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.conv_weight = rng.standard_normal((CHANNELS, KERNEL)).astype(np.float32) / 2

    def split(self, mixed, gates):
        """The convolution's output [n, CHANNELS] into q, k, v; gates [n, 2, HV] into g, beta."""
        n = len(mixed)
        q = mixed[:, :HK * DK].reshape(n, HK, DK)
        k = mixed[:, HK * DK:2 * HK * DK].reshape(n, HK, DK)
        v = mixed[:, 2 * HK * DK:].reshape(n, HV, DV)
        g = -np.log1p(np.exp(gates[:, 0]))              # a log decay < 0, as softplus makes it
        beta = 1 / (1 + np.exp(-gates[:, 1]))
        return q, k, v, g, beta

    def cached(self, cache, layer, batch, x, gates):
        """x [n, CHANNELS], gates [n, 2, HV] of the step's rows -> [n, HV, DV]."""
        mixed = cache.causal_conv1d(layer, batch, x, self.conv_weight, activation="silu")
        return cache.gated_delta_rule(layer, batch, *self.split(mixed, gates), qk_l2norm=True)

    def from_scratch(self, x, gates):
        """The same over a whole history x [L, CHANNELS], in float64 -> [L, HV, DV]."""
        padded = np.concatenate([np.zeros((KERNEL - 1, CHANNELS)), x.astype(np.float64)])
        conv = sum(self.conv_weight[:, j] * padded[j:j + len(x)] for j in range(KERNEL))
        q, k, v, g, beta = self.split(conv / (1 + np.exp(-conv)), gates.astype(np.float64))
        state, out = np.zeros((HV, DK, DV)), np.zeros((len(x), HV, DV))
        for t in range(len(x)):
            for h in range(HV):
                qt, kt = q[t, h // (HV // HK)], k[t, h // (HV // HK)]
                qt, kt = qt / np.sqrt(qt @ qt + 1e-6), kt / np.sqrt(kt @ kt + 1e-6)
                state[h] *= np.exp(g[t, h])
                state[h] += np.outer(kt, beta[t, h] * (v[t, h] - state[h].T @ kt))
                out[t, h] = state[h].T @ (qt * DK ** -0.5)
        return out


def main(backend="auto"):
    layer = DeltaNetLayer()
    rng = np.random.default_rng(1)
    cache = pagedkv.PagedKVCache(2, 2, 16, num_pages=64, page_size=8, backend=backend,
                                 layer_states=[None, SPEC], num_state_slots=16,
                                 state_rollback_tokens=3,
                                 enable_prefix_caching=True, state_snapshot_interval=16)
    history = {}                    # seq_id -> (tokens, x rows, gate rows)

    def step(seq_ids, counts):
        tokens = [rng.integers(0, 100, n).tolist() for n in counts]
        xs = [rng.standard_normal((n, CHANNELS)).astype(np.float32) for n in counts]
        gates = [rng.standard_normal((n, 2, HV)).astype(np.float32) for n in counts]
        batch = cache.append(seq_ids, counts, sum(tokens, []))
        total = batch.num_tokens
        kv = rng.standard_normal((total, 2, 16)).astype(np.float32)
        cache.store(0, batch, kv, kv)                   # the attention layer, as usual
        out = layer.cached(cache, 1, batch, np.concatenate(xs), np.concatenate(gates))
        at = 0
        for s, n, t, x, gate in zip(seq_ids, counts, tokens, xs, gates):
            old = history.get(s, ([], np.zeros((0, CHANNELS)), np.zeros((0, 2, HV))))
            history[s] = (old[0] + t, np.concatenate([old[1], x]), np.concatenate([old[2], gate]))
            if n:
                want = layer.from_scratch(history[s][1], history[s][2])[-n:]
                assert np.allclose(out[at:at + n], want, rtol=1e-4, atol=1e-4), "mismatch"
            at += n

    def truncate(s, new_len):
        cache.truncate(s, new_len)
        tokens, x, gates = history[s]
        history[s] = (tokens[:new_len], x[:new_len], gates[:new_len])

    a, b = cache.add_sequence(), cache.add_sequence()
    step([a, b], [37, 21])                  # prefill: one ragged step
    for _ in range(3):
        step([a, b], [1, 1])                # decode
    print(f"state per sequence: {SPEC.nbytes:,} bytes, {cache.num_state_slots} slots; "
          f"after prefill and decode: {cache.seq_len(a)} and {cache.seq_len(b)} tokens")
    step([a], [3])                          # three draft tokens ...
    truncate(a, cache.seq_len(a) - 1)       # ... one rejected: state after the second
    step([a], [1])
    print(f"speculative step: 3 drafted, 2 accepted, state rolled back; "
          f"now {cache.seq_len(a)} tokens")
    c = cache.add_sequence(history[a][0][:40] + [7])
    hit = cache.seq_len(c)
    history[c] = tuple(part[:hit] for part in history[a])
    step([c], [41 - hit])
    print(f"prefix hit: {hit} of 41 prompt tokens from the cache (pages and a state "
          f"snapshot), {cache.stats()['num_cached_state_slots']} snapshots unused")
    print("every output matched the layer run from scratch")


if __name__ == "__main__":
    main()
