"""Bring your own model: a minimal engine loop over ``pagedkv.PagedKVCache``.

A toy decoder-only transformer (random weights, NumPy only) continues a few
prompts at once: one prefill step for all of them, then decode steps that add
one token per sequence.  The model never sees a page.  Per layer it hands
the step's K/V to ``cache.store`` and its queries to ``cache.attention``
(the ``attend`` function below); the cache owns the memory and the tables.

    python examples/engine_loop.py [--backend host|opencl|auto] [--max-new-tokens N]
"""
import argparse

import numpy as np

import pagedkv


def rms_norm(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class ToyDecoder:
    """Token and position embeddings, per layer GQA attention and a ReLU MLP, an unembedding.

    ``forward`` takes the attention as a function, ``attend(layer, q, k, v)``,
    with ``q`` of shape ``[n, num_heads, head_dim]``, ``k`` and ``v`` of shape
    ``[n, num_kv_heads, head_dim]`` (float32), returning an array shaped like
    ``q``: an engine passes one over its KV cache, a test a dense one.
    """

    def __init__(self, vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 max_positions=512, seed=0):
        rng = np.random.default_rng(seed)
        d, kv = num_heads * head_dim, num_kv_heads * head_dim

        def weight(rows, cols):
            return rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(rows)

        self.num_layers, self.num_heads = num_layers, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.embed = rng.standard_normal((vocab_size, d), dtype=np.float32)
        self.positions = 0.1 * rng.standard_normal((max_positions, d), dtype=np.float32)
        self.unembed = weight(d, vocab_size)
        self.layers = [dict(q=weight(d, d), k=weight(d, kv), v=weight(d, kv), o=weight(d, d),
                            up=weight(d, 4 * d), down=weight(4 * d, d))
                       for _ in range(num_layers)]

    def forward(self, tokens, positions, attend):
        """Logits of every row: ``tokens``, ``positions`` [n] int -> [n, vocab_size] float32."""
        n = len(tokens)
        x = self.embed[tokens] + self.positions[positions]
        for layer, w in enumerate(self.layers):
            h = rms_norm(x)
            q = (h @ w["q"]).reshape(n, self.num_heads, self.head_dim)
            k = (h @ w["k"]).reshape(n, self.num_kv_heads, self.head_dim)
            v = (h @ w["v"]).reshape(n, self.num_kv_heads, self.head_dim)
            x = x + attend(layer, q, k, v).reshape(n, -1) @ w["o"]
            x = x + np.maximum(rms_norm(x) @ w["up"], 0) @ w["down"]
        return rms_norm(x) @ self.unembed


def cache_attention(cache, batch):
    """The model's ``attend`` for one step: store the step's K/V, then attend over the pages."""
    def attend(layer, q, k, v):
        cache.store(layer, batch, k, v)            # the step's K/V join the pages first
        return cache.attention(layer, batch, q)    # causal, over each sequence's pages
    return attend


def generate(model, prompts, max_new_tokens, *, backend="auto", page_size=16):
    """Greedy continuation of every prompt, all of them batched in each step.

    Parameters
    ----------
    model : ToyDecoder
    prompts : list of list of int
        Token ids; each prompt at least one token.
    max_new_tokens : int
        Tokens generated per prompt (the first comes from the prefill step).

    Returns
    -------
    tokens : list of list of int
        The generated tokens of each prompt.
    logits : list of ndarray, shape [max_new_tokens, vocab_size], float32
        For each prompt, the logits each generated token was picked from.
    """
    num_pages = len(prompts) * -(-(max(map(len, prompts)) + max_new_tokens) // page_size)
    cache = pagedkv.PagedKVCache(model.num_layers, model.num_kv_heads, model.head_dim,
                                 num_pages=num_pages, page_size=page_size, backend=backend)
    seqs = [cache.add_sequence() for _ in prompts]
    tokens, logits = [[] for _ in prompts], [[] for _ in prompts]
    step_tokens = [list(p) for p in prompts]       # prefill: whole prompts; decode: one each
    for _ in range(max_new_tokens):
        counts = [len(t) for t in step_tokens]
        batch = cache.append(seqs, counts)         # reserve this step's slots (all or nothing)
        positions = np.concatenate([np.arange(end - n, end)
                                    for end, n in zip(batch.seq_lens, counts)])
        attend = cache_attention(cache, batch)
        step_logits = model.forward(np.concatenate(step_tokens), positions, attend)
        last_rows = step_logits[batch.query_start[1:] - 1]   # each sequence's last token
        for b, row in enumerate(last_rows):
            tokens[b].append(int(row.argmax()))
            logits[b].append(row)
        step_tokens = [[t[-1]] for t in tokens]
    for s in seqs:
        cache.free(s)                              # pages go back to the pool
    return tokens, [np.stack(rows) for rows in logits]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    model = ToyDecoder()
    prompts = [[1, 2, 3, 4, 5], [10, 20, 30], [7] * 40]
    generated, _ = generate(model, prompts, args.max_new_tokens, backend=args.backend)
    for prompt, new in zip(prompts, generated):
        print(f"prompt of {len(prompt)} tokens {prompt[:5]}... -> {new}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
