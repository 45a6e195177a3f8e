"""The oracle: a plain NumPy model of what the cache should hold and compute.

It knows nothing of pages: each sequence is a dense list of K/V rows, and
attention is dense causal softmax over them.
"""
import numpy as np

# Tolerances per storage dtype for attention outputs and gathered K/V.
TOLERANCE = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "float16": dict(rtol=2e-3, atol=2e-3),
}


def round_to_storage(x, dtype):
    """What storage in ``dtype`` keeps of float32 ``x``."""
    return np.asarray(x, dtype=np.float32).astype(dtype).astype(np.float32)


def dense_attention(q, k, v, positions, scale=None):
    """Causal attention of queries at ``positions`` over one sequence's keys.

    Parameters
    ----------
    q : ndarray, shape [n, num_heads, D]
    k, v : ndarray, shape [L, num_kv_heads, D]
    positions : ndarray, shape [n], int
        Query ``i`` sees keys ``0 .. positions[i]``.

    Returns
    -------
    out : ndarray, shape [n, num_heads, D], float64
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    k = np.repeat(k, group, axis=1)          # [L, num_heads, D]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("nhd,lhd->hnl", q, k) * scale
    mask = np.arange(k.shape[0])[None, :] > np.asarray(positions)[:, None]
    scores[:, mask] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hnl,lhd->nhd", weights, v)


class ReferenceCache:
    """Dense per-sequence K/V, mirrored step by step next to a ``PagedKVCache``."""

    def __init__(self, num_layers, dtype="float32"):
        self.num_layers = num_layers
        self.dtype = dtype
        self.k = {}   # seq_id -> list per layer of [L, H, D] arrays
        self.v = {}

    def add(self, seq_id, like=None):
        src = like if like is not None else None
        self.k[seq_id] = [a.copy() for a in self.k[src]] if src is not None else None
        self.v[seq_id] = [a.copy() for a in self.v[src]] if src is not None else None

    def free(self, seq_id):
        del self.k[seq_id], self.v[seq_id]

    def truncate(self, seq_id, new_len):
        if self.k[seq_id] is not None:
            self.k[seq_id] = [a[:new_len] for a in self.k[seq_id]]
            self.v[seq_id] = [a[:new_len] for a in self.v[seq_id]]

    def store(self, layer, seq_ids, counts, k, v):
        """Append this step's rows (``k``, ``v`` [total_new, H, D]) to each sequence."""
        row = 0
        for s, n in zip(seq_ids, counts):
            kk = round_to_storage(k[row:row + n], self.dtype)
            vv = round_to_storage(v[row:row + n], self.dtype)
            if self.k[s] is None:
                empty = np.zeros((0,) + k.shape[1:], dtype=np.float32)
                self.k[s] = [empty] * self.num_layers
                self.v[s] = [empty] * self.num_layers
            self.k[s][layer] = np.concatenate([self.k[s][layer], kk])
            self.v[s][layer] = np.concatenate([self.v[s][layer], vv])
            row += n

    def kv(self, layer, seq_id):
        return self.k[seq_id][layer], self.v[seq_id][layer]

    def attention(self, layer, seq_ids, counts, q, scale=None):
        """Reference output [total_new, num_heads, D] for a step already stored."""
        out, row = [], 0
        for s, n in zip(seq_ids, counts):
            k, v = self.kv(layer, s)
            positions = np.arange(len(k) - n, len(k))
            out.append(dense_attention(q[row:row + n], k, v, positions, scale))
            row += n
        return np.concatenate(out) if out else np.zeros((0,) + q.shape[1:])
