"""Next-token choice: greedy, or sampling from a seeded generator.

Sampling follows transformers' order of logits warpers: temperature, then
top-k, then top-p (nucleus), then one draw from what is left.
"""
import numpy as np


def _per_row(name, values, num_rows, default, dtype):
    if values is None:
        return np.full(num_rows, default, dtype=dtype)
    values = np.asarray(values, dtype=dtype)
    if values.shape != (num_rows,):
        raise ValueError(f"{name}: expected shape [{num_rows}], got {values.shape}")
    return values


def sample(logits, temperatures, rng, top_ks=None, top_ps=None):
    """Pick one token per row.

    Parameters
    ----------
    logits : ndarray, shape [B, vocab_size], float
    temperatures : ndarray, shape [B], float
        ``0`` takes the argmax (greedy); ``T > 0`` samples from ``softmax(logits / T)``.
    rng : numpy.random.Generator
        Consumed once per sampled (non-greedy) row, in row order, so a seed
        reproduces a run.
    top_ks : ndarray, shape [B], int, optional
        ``k >= 1`` samples among the ``k`` most likely tokens only (ties at the
        ``k``-th logit stay in); ``0`` (the default) keeps every token.
    top_ps : ndarray, shape [B], float in (0, 1], optional
        ``p < 1`` samples among the most likely tokens whose probabilities
        (after temperature and top-k) sum to at least ``p``: each token whose
        more likely tokens already reach ``p`` is dropped.  ``1`` (the
        default) keeps every token.

    Returns
    -------
    ndarray, shape [B], int64
    """
    logits = np.asarray(logits)
    temperatures = np.asarray(temperatures, dtype=np.float64)
    if logits.ndim != 2 or temperatures.shape != logits.shape[:1]:
        raise ValueError(f"logits and temperatures: expected shapes [B, vocab] and [B], got "
                         f"{logits.shape} and {temperatures.shape}")
    if np.any(temperatures < 0) or not np.all(np.isfinite(temperatures)):
        raise ValueError(f"temperatures: expected finite values >= 0, got {temperatures}")
    top_ks = _per_row("top_ks", top_ks, len(logits), 0, np.int64)
    top_ps = _per_row("top_ps", top_ps, len(logits), 1.0, np.float64)
    if np.any(top_ks < 0):
        raise ValueError(f"top_ks: expected ints >= 0, got {top_ks}")
    if not np.all((top_ps > 0) & (top_ps <= 1)):
        raise ValueError(f"top_ps: expected values in (0, 1], got {top_ps}")
    tokens = np.argmax(logits, axis=-1).astype(np.int64)
    for row in np.flatnonzero(temperatures > 0):
        # float64: exp of (logit - max) / T for small T underflows float32 quickly.
        scaled = (logits[row].astype(np.float64) - logits[row].max()) / temperatures[row]
        if 0 < top_ks[row] < len(scaled):
            kth = np.partition(scaled, len(scaled) - top_ks[row])[len(scaled) - top_ks[row]]
            scaled[scaled < kth] = -np.inf
        weights = np.exp(scaled)
        if top_ps[row] < 1:
            order = np.argsort(-weights, kind="stable")
            before = np.cumsum(weights[order]) - weights[order]     # mass of likelier tokens
            weights[order[before >= top_ps[row] * weights.sum()]] = 0.0
        cdf = np.cumsum(weights)
        tokens[row] = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")),
                          len(cdf) - 1)
    return tokens
