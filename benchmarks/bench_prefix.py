"""Prefix caching: memory and compute saved on a shared system prompt, and the
per-step bookkeeping cost against a pure-Python block manager.

Workload: 64 requests share a 1,024-token system prompt, each with a distinct
128-token suffix (page size 16).  Reported with prefix caching on and off:
pages in use once every request is prefilled, and prompt tokens the engine
had to compute (prefill).

Bookkeeping: one decode step for 256 sequences (append one token to each and
build the step's tables: slot mapping, CSR page table, block table), timed
through pagedkv and through a straightforward pure-Python block manager
written below the way vLLM's Python block pool works (a free-block queue,
ref counts, per-sequence block lists, tables built in Python loops).

    python benchmarks/bench_prefix.py
"""
import argparse
import sys
from collections import deque

import numpy as np

import pagedkv
from _common import best_seconds, fmt_table


def serve_shared_prompt(enable, num_requests=64, system_len=1024, suffix_len=128, page_size=16):
    cache = pagedkv.PagedKVCache(1, 1, 8, num_pages=num_requests * 80, page_size=page_size,
                                 backend="host", enable_prefix_caching=enable)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, system_len).tolist()
    computed = 0
    for _ in range(num_requests):
        prompt = system + rng.integers(0, 32000, suffix_len).tolist()
        s = cache.add_sequence(token_ids=prompt)
        rest = len(prompt) - cache.seq_len(s)
        batch = cache.append([s], rest, token_ids=prompt[-rest:])
        kv = np.zeros((rest, 1, 8), np.float32)
        cache.store(0, batch, kv, kv)               # the engine's prefill of the rest
        computed += rest
    return cache.num_pages - cache.num_free_pages, computed, cache.stats()["prefix_hit_rate"]


class PythonBlockManager:
    """The reference: a pure-Python paged block manager with per-step tables."""

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_blocks = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables = {}
        self.seq_lens = {}

    def add(self, seq_id):
        self.block_tables[seq_id] = []
        self.seq_lens[seq_id] = 0

    def append(self, seq_ids, num_new):
        bs = self.block_size
        slot_mapping, page_indices, page_indptr, last_page_len = [], [], [0], []
        query_start, seq_lens = [0], []
        for seq_id, n in zip(seq_ids, num_new):
            table = self.block_tables[seq_id]
            length = self.seq_lens[seq_id]
            while len(table) * bs < length + n:
                block = self.free_blocks.popleft()
                self.ref_counts[block] += 1
                table.append(block)
            for pos in range(length, length + n):
                slot_mapping.append(table[pos // bs] * bs + pos % bs)
            length += n
            self.seq_lens[seq_id] = length
            page_indices.extend(table)
            page_indptr.append(len(page_indices))
            last_page_len.append(length - (len(table) - 1) * bs)
            query_start.append(query_start[-1] + n)
            seq_lens.append(length)
        width = max(len(self.block_tables[s]) for s in seq_ids)
        block_table = [self.block_tables[s] + [-1] * (width - len(self.block_tables[s]))
                       for s in seq_ids]
        return (np.array(slot_mapping, np.int64), np.array(page_indices, np.int32),
                np.array(page_indptr, np.int32), np.array(last_page_len, np.int32),
                np.array(query_start, np.int32), np.array(seq_lens, np.int32),
                np.array(block_table, np.int32))

    def truncate(self, seq_id, new_len):
        table = self.block_tables[seq_id]
        while len(table) * self.block_size - self.block_size >= new_len:
            block = table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        self.seq_lens[seq_id] = new_len


def bookkeeping(num_seqs, context, page_size=16, repeat=200):
    """Microseconds per decode step of ``num_seqs`` sequences at ``context`` tokens."""
    rows = []
    for caching in (False, True):
        cache = pagedkv.PagedKVCache(1, 1, 8, num_pages=num_seqs * (context // page_size + 2),
                                     page_size=page_size, backend="host",
                                     enable_prefix_caching=caching)
        seqs = [cache.add_sequence() for _ in range(num_seqs)]
        cache.append(seqs, context, token_ids=np.zeros(num_seqs * context, np.int64))
        tokens = np.arange(num_seqs)
        state = {"n": 0}

        def step():
            # 16 steps fill a page per sequence; then roll back so contexts stay fixed
            cache.append(seqs, 1, token_ids=tokens)
            state["n"] += 1
            if state["n"] % page_size == 0:
                for s in seqs:
                    cache.truncate(s, context)

        t = best_seconds(step, repeat=repeat, warmup=page_size)
        label = "pagedkv, prefix caching on (token ids hashed)" if caching else "pagedkv"
        rows.append((label, t))
    ref = PythonBlockManager(num_seqs * (context // page_size + 2), page_size)
    for s in range(num_seqs):
        ref.add(s)
    ref.append(list(range(num_seqs)), [context] * num_seqs)
    state = {"n": 0}

    def ref_step():
        ref.append(list(range(num_seqs)), [1] * num_seqs)
        state["n"] += 1
        if state["n"] % page_size == 0:
            for s in range(num_seqs):
                ref.truncate(s, context)

    rows.append(("pure-Python block manager (vLLM-style)", best_seconds(ref_step, repeat=repeat,
                                                                         warmup=page_size)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()

    print("# 64 requests: a shared 1,024-token system prompt + a distinct 128-token suffix each,"
          " page size 16\n")
    rows = []
    for enable in (False, True):
        pages, computed, hit_rate = serve_shared_prompt(enable)
        rows.append(["on" if enable else "off", str(pages), str(computed), f"{hit_rate:.1%}"])
    print(fmt_table(["prefix caching", "pages in use", "prefill tokens computed", "hit rate"],
                    rows))

    print(f"\n# bookkeeping of one decode step: {args.num_seqs} sequences at "
          f"{args.context} tokens, append 1 token each + build the step's tables\n")
    rows = bookkeeping(args.num_seqs, args.context)
    python_t = rows[-1][1]
    print(fmt_table(["implementation", "us per step", "speed-up vs pure Python"],
                    [[label, f"{t * 1e6:.1f}", f"{python_t / t:.1f}x"] for label, t in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
