"""How much of the allocated KV memory holds real tokens: paged vs preallocated.

The workload imitates chat traffic: prompt and output lengths are long-tailed
(log-normal), prompts average about 200 tokens and outputs about 100, and a
sequence never exceeds 2,048 tokens.  Requests are served in continuous
batches of ``--concurrency`` live sequences: each wave prefills its prompts,
then decodes one token per live sequence per step; a finished sequence is
freed at once.  The run goes through a real ``PagedKVCache`` (bookkeeping
only: 1 layer, head_dim 1) and samples, after every step, the tokens stored
against the memory reserved:

* paged: the pages in use times ``page_size``;
* preallocated to the max length (how pre-paging servers such as Orca(Max)
  and FasterTransformer reserve): 2,048 slots per live sequence;
* preallocated to the next power of two of the sequence's final length
  (Orca(Pow2), which already needs to know the output length).

    python benchmarks/bench_memory.py [--requests 2048] [--concurrency 256]
"""
import argparse
import sys

import numpy as np

import pagedkv
from _common import fmt_table

MAX_LEN = 2048


def chat_lengths(num_requests, rng):
    """Long-tailed (prompt, output) lengths; each total in [2, MAX_LEN]."""
    prompt = np.clip(rng.lognormal(np.log(120), 1.0, num_requests), 1, MAX_LEN - 1).astype(int)
    output = np.clip(rng.lognormal(np.log(60), 1.0, num_requests), 1, None).astype(int)
    output = np.minimum(output, MAX_LEN - prompt)
    return prompt, output


def serve(prompt, output, page_size, concurrency):
    """Run the workload; return summed (stored tokens, paged slots, max slots, pow2 slots)."""
    num_pages = concurrency * (MAX_LEN // page_size + 1)
    cache = pagedkv.PagedKVCache(1, 1, 1, num_pages=num_pages, page_size=page_size,
                                 backend="host")
    pow2 = 2 ** np.ceil(np.log2(prompt + output)).astype(int)
    stored = paged = reserved_max = reserved_pow2 = 0
    for start in range(0, len(prompt), concurrency):
        wave = range(start, min(start + concurrency, len(prompt)))
        seqs = {cache.add_sequence(): r for r in wave}
        cache.append(list(seqs), [int(prompt[r]) for r in seqs.values()])
        remaining = {s: int(output[r]) for s, r in seqs.items()}
        while remaining:
            live = list(remaining)
            cache.append(live, 1)
            tokens = sum(cache.seq_len(s) for s in live)
            stored += tokens
            paged += (cache.num_pages - cache.num_free_pages) * page_size
            reserved_max += len(live) * MAX_LEN
            reserved_pow2 += int(sum(pow2[seqs[s]] for s in live))
            for s in live:
                remaining[s] -= 1
                if remaining[s] == 0:
                    del remaining[s]
                    cache.free(s)
    return stored, paged, reserved_max, reserved_pow2


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompt, output = chat_lengths(args.requests, np.random.default_rng(args.seed))
    total = prompt + output
    print(f"# {args.requests} requests, {args.concurrency} concurrent: prompt mean "
          f"{prompt.mean():.0f} / p99 {np.percentile(prompt, 99):.0f}, output mean "
          f"{output.mean():.0f} / p99 {np.percentile(output, 99):.0f}, total mean "
          f"{total.mean():.0f}, max {total.max()} tokens\n")
    rows = []
    for page_size in (1, 8, 16, 32, 128):
        stored, paged, res_max, res_pow2 = serve(prompt, output, page_size, args.concurrency)
        rows.append([str(page_size), f"{100 * stored / paged:.1f}%"])
    print(fmt_table(["page size", "paged: share of KV memory holding tokens"], rows))
    print(f"\npreallocated to {MAX_LEN} tokens per sequence: {100 * stored / res_max:.1f}%")
    print(f"preallocated to the next power of two of the final length: "
          f"{100 * stored / res_pow2:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
