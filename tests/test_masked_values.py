"""Positions a query cannot see never reach its output (DESIGN.md "Attention variants").

NaN and inf are stored in K and V at positions some queries cannot see: later
positions of the same step (causal), positions outside a sliding window, and
stale slots of freed pages that another sequence reuses.  Every query whose
visible range holds none of them must come out finite and equal to the dense
reference (tests/reference.py) over the stored rows with the poison replaced
by zeros, on every path (decode, prefill and chunked prefill, the host's
block path, split-K, GQA, ragged batches), with soft caps and sinks, in
every storage dtype, on both backends.
"""
import numpy as np
import pytest

import pagedkv
from reference import TOLERANCE, dense_attention

POISONS = (np.nan, np.inf, -np.inf)


class Poisoned:
    """A one-layer cache whose steps store random K/V with poison at chosen positions.

    ``poison[s]`` is the set of positions of sequence ``s`` that hold a
    non-finite value in K, V or both."""

    def __init__(self, backend, *, dtype="float32", num_kv_heads=2, group=1, head_dim=64,
                 page_size=16, num_pages=64, seed=0):
        self.cache = pagedkv.PagedKVCache(1, num_kv_heads, head_dim, num_pages=num_pages,
                                          page_size=page_size, dtype=dtype, backend=backend)
        self.num_heads = num_kv_heads * group
        self.rng = np.random.default_rng(seed)
        self.tol = TOLERANCE[dtype]
        self.poison = {}
        self.checked = 0

    def add(self):
        s = self.cache.add_sequence()
        self.poison[s] = set()
        return s

    def free(self, s):
        self.cache.free(s)
        del self.poison[s]

    def step(self, seq_ids, counts, poison=(), check=None, **variant):
        """Store one step, poisoning ``poison``: (seq index, offset in the step,
        "k" / "v" / "kv") triples, and compare the attention of every query
        that sees no poisoned position (``check``: at most that many of them,
        spread over the step, for long steps)."""
        c = self.cache
        counts = list(counts)
        batch = c.append(seq_ids, counts)
        total = sum(counts)
        shape = (total, c.num_kv_heads, c.head_dim)
        k = self.rng.standard_normal(shape, dtype=np.float32)
        v = self.rng.standard_normal(shape, dtype=np.float32)
        q = self.rng.standard_normal((total, self.num_heads, c.head_dim), dtype=np.float32)
        starts = np.concatenate([[0], np.cumsum(counts)])
        for i, (b, offset, which) in enumerate(poison):
            row = starts[b] + offset
            value = POISONS[i % len(POISONS)]
            # one element of one head, or a whole row: both must stay out
            head = i % c.num_kv_heads
            cols = slice(None) if i % 2 else slice(i % c.head_dim, i % c.head_dim + 1)
            if "k" in which:
                k[row, head, cols] = value
            if "v" in which:
                v[row, head, cols] = value
            self.poison[seq_ids[b]].add(c.seq_len(seq_ids[b]) - counts[b] + offset)
        c.store(0, batch, k, v)
        out = c.attention(0, batch, q, **variant)
        for b, s in enumerate(seq_ids):
            length = c.seq_len(s)
            positions = np.arange(length - counts[b], length)
            rows = np.arange(starts[b], starts[b + 1])
            clean = np.array([not self.sees_poison(s, p, variant.get("sliding_window"))
                              for p in positions], dtype=bool)
            rows, positions = rows[clean], positions[clean]
            if check is not None and len(rows) > check:
                pick = np.linspace(0, len(rows) - 1, check).astype(int)
                rows, positions = rows[pick], positions[pick]
            if len(rows) == 0:
                continue
            got = out[rows]
            assert np.isfinite(got).all(), f"sequence {s}: masked poison reached rows {rows}"
            np.testing.assert_allclose(got, self.reference(s, q[rows], positions, **variant),
                                       **self.tol)
            self.checked += len(rows)
        return out

    def sees_poison(self, s, position, window):
        first = 0 if window is None else position - window + 1
        return any(first <= p <= position for p in self.poison[s])

    def reference(self, s, q, positions, **variant):
        """Dense attention over what the cache holds for ``s``, the poison zeroed
        (the queries compared see none of it)."""
        k, v = self.cache.gather(0, s)
        k = np.where(np.isfinite(k), k, 0.0)
        v = np.where(np.isfinite(v), v, 0.0)
        return dense_attention(q, k, v, positions, **variant)


def sinks(num_heads):
    return np.random.default_rng(1).uniform(-1.0, 3.0, num_heads)


def variant_of(name, num_heads, window):
    return {
        "plain": {},
        "window": dict(sliding_window=window),
        "soft_cap": dict(logits_soft_cap=1.5),
        "sinks": dict(sinks=sinks(num_heads)),
        "combined": dict(sliding_window=window, logits_soft_cap=1.5, sinks=sinks(num_heads),
                         scale=0.2),
    }[name]


VARIANTS = ["plain", "window", "soft_cap", "sinks", "combined"]
DTYPES = ["float32", "float16", "int8"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [8, 40])
@pytest.mark.parametrize("which", ["k", "v", "kv"])
def test_prefill_later_position_of_the_step(backend, dtype, count, which):
    """The issue's case: a prefill whose last token holds NaN (then inf)."""
    h = Poisoned(backend, dtype=dtype)
    s = h.add()
    h.step([s], [count], poison=[(0, count - 1, which)])
    assert h.checked == count - 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("group", [1, 4])
def test_ragged_prefill_chunk_and_decode(backend, dtype, name, group):
    """Ragged prefill with poison late in each sequence's step, a chunk next to
    decodes with poison late in the chunk, then decodes (window variants: after
    the poison left every window)."""
    h = Poisoned(backend, dtype=dtype, group=group, page_size=7, num_pages=128)
    window = 9
    variant = variant_of(name, h.num_heads, window)
    a, b, c, d = h.add(), h.add(), h.add(), h.add()
    # a: poison at its step's end only; b: several late positions, K and V;
    # c: poison early (a window hides it from the later rows); d: clean
    h.step([a, b, c, d], [37, 20, 30, 10],
           poison=[(0, 36, "v"), (1, 12, "k"), (1, 15, "v"), (1, 19, "kv"), (2, 3, "kv")],
           **variant)
    checked = h.checked
    assert checked >= 36 + 12 + 3 + 10
    if "sliding_window" in variant:
        # c's poison at 3 is out of every window from position 3 + window on
        h.step([a, b, c], [3, 1, 17], poison=[(2, 16, "v")], **variant)
    # a chunk of d after its context, next to decodes, poisoned late in the chunk
    h.step([d, a, c], [20, 1, 1], poison=[(0, 17, "kv"), (0, 19, "v")], **variant)
    assert h.checked >= checked + 17
    # a short step (few queries per item: the host's page path)
    e = h.add()
    h.step([e], [6], poison=[(0, 4, "v"), (0, 5, "k")], **variant)
    assert h.checked >= checked + 17 + 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_block_path_long_prefill(backend, dtype, group):
    """A prefill long enough for the host's block path (many queries per item),
    poison on and near the diagonal of several blocks."""
    h = Poisoned(backend, dtype=dtype, group=group, page_size=16, num_pages=64)
    s = h.add()
    n = 300
    poison = [(0, p, "kv" if p % 3 else "v") for p in (97, 98, 150, 233, 299)]
    h.step([s], [n], poison=poison, sliding_window=None)
    assert h.checked == 97


@pytest.mark.parametrize("dtype", DTYPES)
def test_windows_hide_old_poison(backend, dtype):
    """Poison early in a long prefill; with a window the later rows and every
    decode never see it, on the block and the page path."""
    h = Poisoned(backend, dtype=dtype, group=2, page_size=16, num_pages=64)
    s = h.add()
    window = 33
    variant = dict(sliding_window=window, logits_soft_cap=3.0, sinks=sinks(h.num_heads))
    h.step([s], [200], poison=[(0, p, "kv") for p in (0, 5, 16, 40, 41)], **variant)
    for _ in range(3):
        h.step([s], [1], **variant)
    h.step([s], [5], poison=[(0, 4, "k")], **variant)
    assert h.checked > 200 - 41 - window


@pytest.mark.parametrize("dtype", DTYPES)
def test_stale_poison_in_reused_pages(backend, dtype):
    """A freed sequence leaves poison in its pages past the length of the one
    that reuses them: never read."""
    h = Poisoned(backend, dtype=dtype, group=2, page_size=16, num_pages=4)
    old = h.add()
    h.step([old], [64], poison=[(0, p, "kv") for p in range(5, 64)])
    h.free(old)
    new = h.add()
    h.step([new], [5])
    for _ in range(4):
        h.step([new], [1])
    h.step([new], [3])
    assert h.checked == 5 + 5 + 4 + 3     # old's clean rows, then new's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 300])
def test_split_k_over_long_context(backend, dtype, window):
    """Decode and a chunk over > 2048 keys take split-K: poison later in the
    chunk, and (with a window) early in the context."""
    h = Poisoned(backend, dtype=dtype, num_kv_heads=1, group=4, page_size=16, num_pages=320)
    s = h.add()
    variant = {} if window is None else dict(sliding_window=window, logits_soft_cap=2.0)
    early = [(0, p, "kv") for p in (10, 500, 1500)] if window else []
    h.step([s], [4000], poison=early, check=8, **variant)
    h.step([s], [1], **variant)
    h.step([s], [64], poison=[(0, 20, "v"), (0, 40, "k"), (0, 63, "kv")], **variant)
    assert h.checked >= 8 + 1 + 20
