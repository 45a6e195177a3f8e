"""A dense NumPy KV store for one sequence, with sliding windows: the model tests' attention oracle.

It knows nothing of pages: each layer keeps every K/V row of the sequence,
and a query at position ``p`` of a layer with window ``W`` attends to
positions ``max(0, p - W + 1) .. p`` (its ``W`` most recent, itself
included), the meaning of ``sliding_window`` in DESIGN.md and in Hugging
Face configs.
"""
import numpy as np


def windowed_attention(q, k, v, positions, window=None):
    """Causal attention of queries at ``positions`` over one sequence's keys, float32.

    Parameters
    ----------
    q : ndarray, shape [n, num_heads, D]
    k, v : ndarray, shape [L, num_kv_heads, D]
    positions : ndarray, shape [n], int
        Query ``i`` sees keys ``max(0, positions[i] - window + 1) .. positions[i]``.
    window : int, optional
        None = full causal attention.

    Returns
    -------
    out : ndarray, shape [n, num_heads, D], float32
    """
    q, k, v = (np.asarray(a, dtype=np.float32) for a in (q, k, v))
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    keys = np.arange(k.shape[0])
    positions = np.asarray(positions)
    visible = keys[None, :] <= positions[:, None]
    if window is not None:
        visible &= keys[None, :] > positions[:, None] - window
    out = np.empty_like(q)
    scale = np.float32(1.0 / np.sqrt(head_dim))
    for head in range(num_heads):
        kv = head // group
        scores = (q[:, head] @ k[:, kv].T) * scale                  # [n, L]
        scores = np.where(visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, head] = (weights / weights.sum(axis=1, keepdims=True)) @ v[:, kv]
    return out


class DenseKV:
    """The ``attend(layer, q, k, v)`` callback of a model forward over one dense sequence.

    Parameters
    ----------
    layer_windows : sequence of (None or int)
        One entry per layer, as ``config.layer_windows``.
    """

    def __init__(self, layer_windows):
        self.layer_windows = list(layer_windows)
        self.k = [None] * len(self.layer_windows)
        self.v = [None] * len(self.layer_windows)

    @property
    def seq_len(self):
        return 0 if self.k[0] is None else len(self.k[0])

    def __call__(self, layer, q, k, v):
        self.k[layer] = np.array(k) if self.k[layer] is None else np.concatenate([self.k[layer], k])
        self.v[layer] = np.array(v) if self.v[layer] is None else np.concatenate([self.v[layer], v])
        length = len(self.k[layer])
        positions = np.arange(length - len(q), length)
        return windowed_attention(q, self.k[layer], self.v[layer], positions,
                                  self.layer_windows[layer])


def greedy(model, prompt_ids, num_new, layer_windows=None):
    """Greedy continuation of one prompt through ``model.forward`` over a :class:`DenseKV`.

    Parameters
    ----------
    model : DecoderModel
    prompt_ids : list of int
    num_new : int
    layer_windows : sequence, optional
        Default: ``model.config.layer_windows``.

    Returns
    -------
    list of int, length num_new
    """
    store = DenseKV(model.config.layer_windows if layer_windows is None else layer_windows)
    ids = list(prompt_ids)
    logits = model.forward(np.array(ids), np.arange(len(ids)), store, np.array([len(ids) - 1]))
    out = []
    for _ in range(num_new):
        token = int(np.argmax(logits[0]))
        out.append(token)
        logits = model.forward(np.array([token]), np.array([len(ids)]), store, np.array([0]))
        ids.append(token)
    return out
