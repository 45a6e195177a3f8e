"""Random operation streams over a cache, and what each operation leaves behind.

The differential test of the memory house (``test_house_differential.py``)
replays these streams and compares each operation's outcome with the digests
recorded by the page tables before they were rebuilt over pool specs.  An
outcome is the operation's result (ids, the step's tables in every pool) or
its error (type and message), then the whole observable state: every
sequence's length, page ids in every pool and swap state, every pool's free
queue in order and every page's reference count, the cache's counters, and
at the end of a stream the K/V of every sequence in every layer.

Run as a script to record the digests of the code it imports::

    python tests/house_trace.py tests/data/house_trace.json

The cache is reached only through its public API and three read-outs of its
pools' allocators (``allocators``), so that the same stream runs on the
commit before the rebuild and after it.
"""
import hashlib
import json
import os
import sys
import tempfile

import numpy as np

import pagedkv

H, D = 2, 4
CONFIGS = [   # (page_size, num_pages, layer_windows, num_window_pages, rollback, prefix caching)
    (4, 24, None, None, 1, False),
    (4, 24, None, None, 1, True),
    (4, 20, [None, 3, 6], 10, 1, False),
    (4, 20, [None, 3, 6], 10, 3, True),
    (2, 40, [5, None], 12, 2, True),
    (8, 12, [None, 9], 6, 1, True),
]
OPS_PER_STREAM = 100
SEEDS_PER_CONFIG = 10


def allocators(cache):
    """The cache's page allocators, one per pool, full pool first."""
    pools = cache._holdings.pools if hasattr(cache, "_holdings") else cache._pools
    return [pool.allocator for pool in pools]


def make(config):
    page_size, num_pages, windows, window_pages, rollback, caching = config
    return pagedkv.PagedKVCache(
        len(windows) if windows else 2, H, D, num_pages=num_pages, page_size=page_size,
        backend="host", enable_prefix_caching=caching, layer_windows=windows,
        num_window_pages=window_pages, window_rollback_tokens=rollback, max_seq_len=64)


def state(cache):
    """Everything the page tables decide, as plain data."""
    seqs = []
    windowed = cache.num_window_pages > 0
    for s in cache.seq_ids():
        if cache.is_swapped(s):
            seqs.append([s, cache.seq_len(s), "swapped"])
            continue
        seqs.append([s, cache.seq_len(s), cache.page_ids(s).tolist(),
                     cache.window_page_ids(s).tolist() if windowed else None])
    pools = [[a.free_queue().tolist(), a.refcount(np.arange(a.num_pages)).tolist(),
              [bool(a.is_cached(p)) for p in range(a.num_pages)]]
             for a in allocators(cache)]
    stats = {k: v for k, v in cache.stats().items() if k != "swapped_bytes"}
    return [seqs, pools, stats]


def batch_tables(batch):
    out = [batch.seq_ids.tolist(), batch.query_start.tolist(), batch.seq_lens.tolist(),
           batch.slot_mapping.tolist(), batch.page_indptr.tolist(),
           batch.page_indices.tolist(), batch.last_page_len.tolist(),
           batch.block_table.tolist()]
    if batch.window_tables is not None:
        w = batch.window_tables
        out.append([w.slot_mapping.tolist(), w.page_indices.tolist(), w.block_table.tolist()])
    return out


class Stream:
    """One seeded random stream of operations on one cache."""

    def __init__(self, config, seed, workdir):
        self.config = config
        self.rng = np.random.default_rng(seed)
        self.cache = make(config)
        self.workdir = workdir
        self.exported = []          # SequenceKV objects to import later
        self.saved = None           # a file to load later
        self.vocab = 5              # few tokens: prompts repeat, so the prefix cache hits

    def live(self):
        return [s for s in self.cache.seq_ids() if not self.cache.is_swapped(s)]

    def some(self, ids, bad=0.05):
        """One of ``ids``, or (now and then) an id that is not there."""
        if not ids or self.rng.random() < bad:
            return int(self.rng.integers(-2, 40))
        return int(self.rng.choice(ids))

    def tokens(self, n):
        return self.rng.integers(0, self.vocab, n).astype(np.int32)

    def store_all(self, batch):
        cache = self.cache
        for layer in range(cache.num_layers):
            k = self.rng.standard_normal((batch.num_tokens, H, D)).astype(np.float32)
            cache.store(layer, batch, k, -k)

    def op(self):
        """Run one random operation; returns (name, result)."""
        c, rng = self.cache, self.rng
        r = rng.random()
        live = self.live()
        if r < 0.12 or not live:
            n = int(rng.integers(0, 14))
            prompt = self.tokens(n).tolist() if rng.random() < 0.8 else None
            return "add", c.add_sequence(prompt)
        if r < 0.45:
            ids = list(rng.permutation(live)[:int(rng.integers(1, min(4, len(live)) + 1))])
            if rng.random() < 0.04:
                ids.append(ids[0])                  # a duplicate: refused
            counts = [int(rng.integers(0, 9 if rng.random() < 0.3 else 3)) for _ in ids]
            if rng.random() < 0.03:
                counts[0] = -1
            token_ids = self.tokens(sum(max(n, 0) for n in counts)).tolist() \
                if rng.random() < 0.85 else None
            batch = c.append([int(s) for s in ids], counts, token_ids)
            if rng.random() < 0.85:
                self.store_all(batch)
            return "append", batch_tables(batch)
        if r < 0.53:
            return "fork", c.fork(self.some(live))
        if r < 0.61:
            return "free", c.free(self.some(c.seq_ids()))
        if r < 0.70:
            s = self.some(live)
            n = c.seq_len(s) if s in live else 3
            return "truncate", c.truncate(s, int(rng.integers(-1, n + 2)))
        if r < 0.76:
            return "swap_out", c.swap_out(self.some(live))
        if r < 0.82:
            swapped = [s for s in c.seq_ids() if c.is_swapped(s)]
            return "swap_in", c.swap_in(self.some(swapped, 0.2))
        if r < 0.87:
            kv = c.export_sequence(self.some(live))
            self.exported.append(kv)
            return "export", [kv.num_tokens]
        if r < 0.91 and self.exported:
            return "import", c.import_sequence(self.exported[int(rng.integers(len(self.exported)))])
        if r < 0.94:
            if self.saved is None or rng.random() < 0.5:
                self.saved = os.path.join(self.workdir, f"s{int(rng.integers(1 << 30))}.safetensors")
                ids = c.seq_ids()
                return "save", c.save(self.saved, ids[:int(rng.integers(0, len(ids) + 1))])
            return "load", c.load(self.saved)
        if r < 0.96:
            return "reset_prefix_cache", c.reset_prefix_cache()
        if r < 0.98:
            return "clear", c.clear()
        return "restore", c.restore(c.checkpoint(self.some(live)))

    def outcomes(self):
        """Each operation's outcome, as a canonical string, then the stream's K/V."""
        out = []
        for _ in range(OPS_PER_STREAM):
            try:
                name, result = self.op()
                outcome = [name, result]
            except (ValueError, KeyError, MemoryError, TypeError) as error:
                outcome = ["error", type(error).__name__, str(error)]
            out.append(json.dumps([outcome, state(self.cache)], default=repr)
                       .replace(self.workdir, "<dir>"))
        kv = []
        for s in self.live():
            for layer in range(self.cache.num_layers):
                k, v = self.cache.gather(layer, s, 0 if self.cache.num_window_pages == 0 else
                                         self.held_from(s, layer))
                kv.append(hashlib.sha256(k.tobytes() + v.tobytes()).hexdigest())
        out.append(json.dumps(kv))
        return out

    def held_from(self, s, layer):
        return self.cache.export_sequence(s).layer_start[layer]


def digest(outcome):
    return hashlib.sha1(outcome.encode()).hexdigest()[:16]


def digests():
    """{"config/seed": [sha1 of each outcome]} over every stream."""
    result = {}
    with tempfile.TemporaryDirectory() as workdir:
        for c, config in enumerate(CONFIGS):
            for seed in range(SEEDS_PER_CONFIG):
                outcomes = Stream(config, 1000 * c + seed, workdir).outcomes()
                result[f"{c}/{seed}"] = [digest(o) for o in outcomes]
    return result


def outcome_strings(key):
    """The outcome strings of one stream (to see what differs)."""
    c, seed = map(int, key.split("/"))
    with tempfile.TemporaryDirectory() as workdir:
        return Stream(CONFIGS[c], 1000 * c + seed, workdir).outcomes()


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(digests(), f, indent=0)
