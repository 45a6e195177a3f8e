"""Next-token choice: greedy, or temperature sampling from a seeded generator."""
import numpy as np


def sample(logits, temperatures, rng):
    """Pick one token per row.

    Parameters
    ----------
    logits : ndarray, shape [B, vocab_size], float
    temperatures : ndarray, shape [B], float
        ``0`` takes the argmax (greedy); ``T > 0`` samples from ``softmax(logits / T)``.
    rng : numpy.random.Generator
        Consumed once per sampled (non-greedy) row, in row order, so a seed
        reproduces a run.

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
    tokens = np.argmax(logits, axis=-1).astype(np.int64)
    for row in np.flatnonzero(temperatures > 0):
        # float64: exp of (logit - max) / T for small T underflows float32 quickly.
        scaled = (logits[row].astype(np.float64) - logits[row].max()) / temperatures[row]
        cdf = np.cumsum(np.exp(scaled))
        tokens[row] = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")),
                          len(cdf) - 1)
    return tokens
