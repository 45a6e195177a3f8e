"""The oracle: a plain NumPy model of what the cache should hold and compute.

It knows nothing of pages: each sequence is a dense list of K/V rows, and
attention is dense causal softmax over them.
"""
import numpy as np

# Tolerances per storage dtype for attention outputs and gathered K/V.  int8
# outputs are compared with attention over the rows gather returns (what int8
# kept: tests/test_int8.py), so float32 rounding is all that separates them.
TOLERANCE = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=2e-5, atol=2e-5),
    "int8": dict(rtol=2e-5, atol=2e-5),
}


def round_to_bfloat16(x):
    """bfloat16 storage of float32 ``x``, returned as float32: round to nearest even.

    Done on the float32 bits (numpy has no bfloat16): the low 16 bits are
    dropped after adding ``0x7FFF`` plus the lowest kept bit, so that a tie
    goes to the even neighbour, values above the largest bfloat16 round to
    inf, and denormals round like any other value.  NaN stays NaN (its sign
    kept, quieted), which plain rounding would turn into inf for small payloads.

    Parameters
    ----------
    x : array-like, any shape; converted to float32 first

    Returns
    -------
    ndarray, same shape, float32, every value representable in bfloat16
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lowest_kept = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits.astype(np.uint64) + np.uint64(0x7FFF) + lowest_kept) >> np.uint64(16)
    rounded = rounded.astype(np.uint32)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x0040)
    high = np.where(nan, quiet, rounded).astype(np.uint32)
    return (high << np.uint32(16)).view(np.float32)


def round_to_storage(x, dtype):
    """What storage in ``dtype`` keeps of float32 ``x`` (``"bfloat16"`` included)."""
    if isinstance(dtype, str) and dtype == "bfloat16" or getattr(dtype, "name", None) == "bfloat16":
        return round_to_bfloat16(x)
    return np.asarray(x, dtype=np.float32).astype(dtype).astype(np.float32)


def visible_keys(positions, num_keys, sliding_window=None, attention_chunk_size=None):
    """Which keys each query sees.

    Parameters
    ----------
    positions : ndarray, shape [n], int
    num_keys : int
    sliding_window : int, optional
        Query at ``p`` sees only ``max(0, p - W + 1) .. p``.
    attention_chunk_size : int, optional
        Query at ``p`` sees only ``C * floor(p / C) .. p``.  With a window as
        well: the keys both allow.

    Returns
    -------
    ndarray, shape [n, num_keys], bool
    """
    positions = np.asarray(positions, dtype=np.int64)
    keys = np.arange(num_keys, dtype=np.int64)
    visible = keys[None, :] <= positions[:, None]
    if sliding_window is not None:
        visible &= keys[None, :] > positions[:, None] - sliding_window
    if attention_chunk_size is not None:
        chunk_start = positions // attention_chunk_size * attention_chunk_size
        visible &= keys[None, :] >= chunk_start[:, None]
    return visible


def dense_attention(q, k, v, positions, scale=None, sliding_window=None, logits_soft_cap=None,
                    sinks=None, attention_chunk_size=None, alibi_slopes=None,
                    alibi_before_soft_cap=False):
    """Attention of queries at ``positions`` over one sequence's keys, in float64.

    Parameters
    ----------
    q : ndarray, shape [n, num_heads, D]
    k, v : ndarray, shape [L, num_kv_heads, D]
    positions : ndarray, shape [n], int
        Query ``i`` sees keys ``0 .. positions[i]`` (causal), or only those
        that ``sliding_window`` and ``attention_chunk_size`` allow
        (:func:`visible_keys`).  Keys no query sees never reach the result,
        whatever they hold (NaN included).
    scale : float, default ``1/sqrt(D)``
    logits_soft_cap : float, optional
        Logits ``x`` become ``c * tanh(x / c)``.
    sinks : ndarray, shape [num_heads], optional
        ``exp(sinks[h])`` joins head ``h``'s softmax denominator.
    attention_chunk_size : int, optional
        Query at ``p`` sees only keys ``C * floor(p / C) .. p``.
    alibi_slopes : ndarray, shape [num_heads], optional
        Head ``h``'s logit for key ``j`` of the query at ``p`` gains
        ``alibi_slopes[h] * (j - p)``, ``j - p`` an integer, after ``scale``
        and after the soft cap.
    alibi_before_soft_cap : bool
        Add the ALiBi bias before the soft cap instead (not the contract's
        order: for tests that show the order matters).

    Returns
    -------
    out : ndarray, shape [n, num_heads, D], float64
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n, num_heads, head_dim = q.shape
    if n == 0:
        return np.zeros(q.shape)
    group = num_heads // k.shape[1]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    positions = np.asarray(positions, dtype=np.int64)
    visible = visible_keys(positions, k.shape[0], sliding_window, attention_chunk_size)
    seen = visible.any(axis=0)
    lo = int(np.argmax(seen))                    # keys before every window are never read
    k = np.where(seen[:, None, None], k, 0.0)    # nor are any others no query sees
    v = np.where(seen[:, None, None], v, 0.0)
    k = np.repeat(k[lo:], group, axis=1)         # [L', num_heads, D]
    v = np.repeat(v[lo:], group, axis=1)
    visible = visible[:, lo:]
    scores = np.einsum("nhd,lhd->hnl", q, k) * scale
    bias = None
    if alibi_slopes is not None:
        distance = np.arange(lo, lo + k.shape[0], dtype=np.int64)[None, :] - positions[:, None]
        bias = np.asarray(alibi_slopes, dtype=np.float64)[:, None, None] * distance[None]
    if bias is not None and alibi_before_soft_cap:
        scores = scores + bias
    if logits_soft_cap is not None:
        scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
    if bias is not None and not alibi_before_soft_cap:
        scores = scores + bias
    scores[:, ~visible] = -np.inf
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[:, None, None]
        top = np.maximum(top, sink)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sink - top)
    return np.einsum("hnl,lhd->nhd", weights / total, v)


class ReferenceCache:
    """Dense per-sequence K/V, mirrored step by step next to a ``PagedKVCache``."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype="float32"):
        self.num_layers = num_layers
        self.dtype = dtype
        self.empty = np.zeros((0, num_kv_heads, head_dim), dtype=np.float32)
        self.k = {}   # seq_id -> per layer, [L, num_kv_heads, head_dim] float32
        self.v = {}

    def add(self, seq_id, like=None):
        self.k[seq_id] = list(self.k[like]) if like is not None else [self.empty] * self.num_layers
        self.v[seq_id] = list(self.v[like]) if like is not None else [self.empty] * self.num_layers

    def free(self, seq_id):
        del self.k[seq_id], self.v[seq_id]

    def seq_len(self, seq_id):
        return len(self.k[seq_id][0])

    def truncate(self, seq_id, new_len):
        self.k[seq_id] = [a[:new_len] for a in self.k[seq_id]]
        self.v[seq_id] = [a[:new_len] for a in self.v[seq_id]]

    def store(self, layer, seq_ids, counts, k, v):
        """Append this step's rows (``k``, ``v`` [total_new, H, D]) to each sequence."""
        row = 0
        for s, n in zip(seq_ids, counts):
            kk = round_to_storage(k[row:row + n], self.dtype)
            vv = round_to_storage(v[row:row + n], self.dtype)
            self.k[s][layer] = np.concatenate([self.k[s][layer], kk])
            self.v[s][layer] = np.concatenate([self.v[s][layer], vv])
            row += n

    def attention(self, layer, seq_ids, counts, q, **variant):
        """Reference output [total_new, num_heads, D] for a step already stored;
        ``variant``: the keyword arguments of :func:`dense_attention`."""
        out, row = [np.zeros((0,) + q.shape[1:])], 0
        for s, n in zip(seq_ids, counts):
            k, v = self.k[s][layer], self.v[s][layer]
            positions = np.arange(len(k) - n, len(k))
            out.append(dense_attention(q[row:row + n], k, v, positions, **variant))
            row += n
        return np.concatenate(out)


class Harness:
    """Drives a ``PagedKVCache`` and a ``ReferenceCache`` side by side with random data.

    Every step stores random K/V in each layer, runs attention with random
    queries, and asserts the output equals the dense reference.
    """

    def __init__(self, cache, num_heads=None, seed=0, dtype=None):
        # ``dtype``: the storage dtype's name, when ``cache.dtype.name`` is not it
        # (bfloat16, which numpy has no dtype for)
        self.cache = cache
        self.dtype_name = cache.dtype.name if dtype is None else dtype
        self.ref = ReferenceCache(cache.num_layers, cache.num_kv_heads, cache.head_dim,
                                  self.dtype_name)
        self.num_heads = num_heads or cache.num_kv_heads
        self.rng = np.random.default_rng(seed)
        self.tol = TOLERANCE[self.dtype_name]

    def add(self):
        s = self.cache.add_sequence()
        self.ref.add(s)
        return s

    def fork(self, parent):
        child = self.cache.fork(parent)
        self.ref.add(child, like=parent)
        return child

    def free(self, s):
        self.cache.free(s)
        self.ref.free(s)

    def truncate(self, s, new_len):
        self.cache.truncate(s, new_len)
        self.ref.truncate(s, new_len)

    def restore(self, checkpoint):
        self.cache.restore(checkpoint)
        self.ref.truncate(checkpoint.seq_id, checkpoint.seq_len)

    def random(self, *shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def step(self, seq_ids, counts, check=True, **variant):
        """One engine step over every layer; returns the StepBatch.

        ``check=False`` skips the attention comparison (for a huge prefill
        whose dense reference would not fit in memory).  ``variant``: keyword
        arguments of ``attention`` (scale, sliding_window, ...)."""
        counts = [int(c) for c in np.broadcast_to(counts, (len(seq_ids),))]
        batch = self.cache.append(seq_ids, counts)
        total = sum(counts)
        c = self.cache
        for layer in range(c.num_layers):
            k = self.random(total, c.num_kv_heads, c.head_dim)
            v = self.random(total, c.num_kv_heads, c.head_dim)
            q = self.random(total, self.num_heads, c.head_dim)
            c.store(layer, batch, k, v)
            self.record(layer, seq_ids, counts, k, v)
            if not check:
                continue
            out = c.attention(layer, batch, q, **variant)
            assert out.shape == q.shape and out.dtype == np.float32
            self.compare(layer, seq_ids, counts, q, out, self.layer_variant(layer, variant))
        return batch

    def record(self, layer, seq_ids, counts, k, v):
        """The reference's side of ``store``: it holds what the cache should."""
        self.ref.store(layer, seq_ids, counts, k, v)

    def compare(self, layer, seq_ids, counts, q, out, variant):
        """``out`` of ``attention`` against the reference."""
        np.testing.assert_allclose(out, self.ref.attention(layer, seq_ids, counts, q, **variant),
                                   **self.tol)

    def layer_variant(self, layer, variant):
        """The variant a layer computes: its own window (``layer_windows``), or a
        smaller one passed to ``attention``."""
        window = self.cache.layer_windows[layer]
        if window is None:
            return variant
        asked = variant.get("sliding_window")
        return dict(variant, sliding_window=window if asked is None else min(asked, window))

    def held_from(self, layer, s):
        """The first position whose K/V layer ``layer`` still holds for sequence ``s``."""
        if self.cache.layer_windows[layer] is None:
            return 0
        held = np.flatnonzero(self.cache.window_page_ids(s) >= 0)
        return int(held[0]) * self.cache.page_size if len(held) else self.cache.seq_len(s)

    def check_contents(self):
        """Every live sequence reads back exactly what was written (a windowed
        layer: the positions it still holds)."""
        assert sorted(self.cache.seq_ids()) == sorted(self.ref.k)
        for s in self.ref.k:
            assert self.cache.seq_len(s) == self.ref.seq_len(s)
            for layer in range(self.cache.num_layers):
                start = self.held_from(layer, s)
                k, v = self.cache.gather(layer, s, start)
                np.testing.assert_array_equal(k, self.ref.k[s][layer][start:])
                np.testing.assert_array_equal(v, self.ref.v[s][layer][start:])


# -- scenarios that every storage format runs through a Harness -----------------------------
def fork_divergence_steps(h):
    """A fork of a partly filled page, then writes into it from both sides: one copies it
    first (and its scales, for int8); both keep their own contents."""
    a = h.add()
    h.step([a], 10)                        # last page partly filled: shared by the fork
    b = h.fork(a)
    h.step([a, b], [2, 3])
    h.step([a, b], 1)
    h.check_contents()


def rollback_steps(h):
    """Checkpoint, grow, restore, grow, truncate, grow: the contents follow each rollback."""
    s = h.add()
    h.step([s], 12)
    ck = h.cache.checkpoint(s)
    h.step([s], 5)
    h.restore(ck)
    h.step([s], 2)
    h.truncate(s, 3)
    h.step([s], 4)
    h.check_contents()
