"""What KV storage costs in model quality: float16 and int8 (with and without the
Hadamard rotation) against float32 KV, on real models.

Each model reads the first ``--tokens`` tokens of the Apache License 2.0 text
(the repository's LICENSE file) through ``PagedKVCache`` in prefill chunks, so
that every attention call reads the K/V back from the pages in the storage
dtype under test.  For every position the next-token distribution is compared
with the float32-KV run's: mean KL divergence KL(p_float32 || p_dtype), top-1
agreement, and the text's perplexity under each.

    python benchmarks/bench_kv_quality.py [--models smollm2,gemma3] [--tokens 1024]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

import pagedkv
from _common import fmt_table
from pagedkv.models.engine import paged_attend

TEXT = Path(__file__).resolve().parents[1] / "LICENSE"
FORMATS = (("float32", {}), ("float16", {}), ("int8", {}),
           ("int8, no rotation", {"dtype": "int8", "kv_rotation": False}))


def load(name):
    """(model, tokenizer) of a model name the demo knows (smollm2, gemma3)."""
    from pagedkv.models.default_model import resolve_model
    from pagedkv.models.gguf_loader import load_gguf_model, read_gguf_header
    from pagedkv.models.tokenizer import GGUFTokenizer
    header = read_gguf_header(resolve_model(name))
    return load_gguf_model(header).model, GGUFTokenizer.from_metadata(header.metadata)


def log_softmax(logits):
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def log_probs(model, tokens, options, chunk, backend):
    """[len(tokens), vocab] log-probabilities of the next token at every position."""
    c = model.config
    windows = list(c.layer_windows) if getattr(c, "has_windowed_layers", False) else None
    cache = pagedkv.PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim,
                                 num_pages=-(-len(tokens) // 16) + 1, page_size=16,
                                 backend=backend, layer_windows=windows,
                                 **({"dtype": options} if isinstance(options, str) else options))
    s = cache.add_sequence()
    out = []
    for start in range(0, len(tokens), chunk):
        ids = np.asarray(tokens[start:start + chunk])
        batch = cache.append([s], len(ids))
        logits = model.forward(ids, np.arange(start, start + len(ids)),
                               paged_attend(cache, batch), np.arange(len(ids)))
        out.append(log_softmax(logits).astype(np.float32))
    return np.concatenate(out)


def quality_rows(name, args):
    model, tokenizer = load(name)
    tokens = tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:args.tokens + 1]
    inputs, targets = tokens[:-1], np.asarray(tokens[1:])
    reference = None
    rows = []
    for label, options in FORMATS:
        lp = log_probs(model, inputs, options or label, args.chunk, args.backend)
        nll = -lp[np.arange(len(targets)), targets]
        ppl = float(np.exp(nll.mean()))
        if reference is None:
            reference = (lp, ppl)
            rows.append([f"{name} {label}", "-", "-", f"{ppl:.4f}", "-"])
            continue
        ref_lp, ref_ppl = reference
        kl = float((np.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1).mean())
        top1 = float((ref_lp.argmax(-1) == lp.argmax(-1)).mean())
        rows.append([f"{name} {label}", f"{kl:.2e}", f"{100 * top1:.2f}%", f"{ppl:.4f}",
                     f"{100 * (ppl / ref_ppl - 1):+.3f}%"])
    return rows, len(inputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128, help="prefill tokens per step")
    parser.add_argument("--backend", default="host")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        model_rows, n = quality_rows(name, args)
        rows += model_rows
        print(f"# {name}: {n} tokens of LICENSE, prefill chunks of {args.chunk}, "
              f"{args.backend} backend", file=sys.stderr)
    print(fmt_table(["model, KV dtype", "mean KL vs float32", "top-1 agreement",
                     "perplexity", "vs float32"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
