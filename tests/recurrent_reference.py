"""The oracle of the recurrence kernels: both recurrences in float64 NumPy, token by token.

Written from the contract (docs: DESIGN.md "Recurrent layers"), not from the
kernels: a ragged step of sequences, each with its own state, walked one
token at a time in the plainest form.  The chunked form is not used here.
"""
from typing import Dict, List, Optional, Tuple

import numpy as np


def l2norm(x: np.ndarray) -> np.ndarray:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis (transformers' ``l2norm``)."""
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def delta_rule_sequence(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                        g: np.ndarray, beta: np.ndarray, scale: float,
                        use_l2norm: bool) -> Tuple[np.ndarray, List[np.ndarray]]:
    """One sequence's rows of the gated delta rule.

    Parameters
    ----------
    state : ndarray, shape [Hv, dk, dv]
    q, k : ndarray, shape [n, Hk, dk]
    v : ndarray, shape [n, Hv, dv]
    g, beta : ndarray, shape [n, Hv]

    Returns
    -------
    o : ndarray, shape [n, Hv, dv], float64
    states : list of n ndarrays [Hv, dk, dv]: the state after each row
    """
    S = np.array(state, np.float64)
    n, Hk, _ = k.shape
    Hv = v.shape[1]
    group = Hv // Hk
    o = np.zeros(v.shape, np.float64)
    states = []
    for t in range(n):
        for h in range(Hv):
            qt = np.asarray(q[t, h // group], np.float64)
            kt = np.asarray(k[t, h // group], np.float64)
            if use_l2norm:
                qt, kt = l2norm(qt), l2norm(kt)
            S[h] *= np.exp(float(g[t, h]))
            delta = float(beta[t, h]) * (v[t, h] - S[h].T @ kt)
            S[h] += np.outer(kt, delta)
            o[t, h] = S[h].T @ (scale * qt)
        states.append(S.copy())
    return o, states


def conv_sequence(state: np.ndarray, x: np.ndarray, weight: np.ndarray,
                  bias: Optional[np.ndarray], silu: bool) -> Tuple[np.ndarray, List[np.ndarray]]:
    """One sequence's rows of the causal depthwise convolution.

    Parameters
    ----------
    state : ndarray, shape [C, K - 1]: the last inputs, oldest first
    x : ndarray, shape [n, C]
    weight : ndarray, shape [C, K]
    bias : ndarray, shape [C], or None

    Returns
    -------
    y : ndarray, shape [n, C], float64
    states : list of n ndarrays [C, K - 1]: the state after each row
    """
    C, K = weight.shape
    u = np.concatenate([np.asarray(state, np.float64).T, np.asarray(x, np.float64)])
    y = np.zeros(x.shape, np.float64)
    states = []
    for t in range(len(x)):
        p = t + K - 1                        # row t's place in u
        acc = np.zeros(C) if bias is None else np.asarray(bias, np.float64).copy()
        for j in range(K):
            acc += weight[:, j] * u[p + j - K + 1]
        y[t] = acc / (1.0 + np.exp(-acc)) if silu else acc
        states.append(u[p - K + 2:p + 1].T.copy())
    return y, states


def ragged(step, run, states: Dict[int, np.ndarray], *inputs: np.ndarray,
           **kwargs) -> Tuple[np.ndarray, Dict[int, np.ndarray]]:
    """A ragged step: ``run`` (one of the two above) for each sequence of ``step``.

    Parameters
    ----------
    step
        ``query_start`` [B+1], ``slots`` [B], ``save_rows`` [M], ``save_slots`` [M].
    states : dict
        slot -> its state before the step (missing slots: zeros, of ``zeros``'s shape).
    inputs
        Per-row arrays (first axis: the step's rows), then per-layer arrays
        after ``per_row`` of them (``kwargs['per_row']``).

    Returns
    -------
    out : ndarray, the rows' outputs (float64)
    states : dict
        slot -> state after the step, for every slot the step wrote
        (sequences' own and save slots), the others as given.
    """
    per_row = kwargs.pop("per_row")
    zeros = kwargs.pop("zeros")
    rows, fixed = inputs[:per_row], inputs[per_row:]
    out: Optional[np.ndarray] = None
    after = {slot: s.copy() for slot, s in states.items()}
    saves = dict(zip(np.asarray(step.save_rows).tolist(), np.asarray(step.save_slots).tolist()))
    qs = np.asarray(step.query_start)
    for b, slot in enumerate(np.asarray(step.slots).tolist()):
        r0, r1 = int(qs[b]), int(qs[b + 1])
        if r1 == r0:
            continue
        o, seq_states = run(states.get(slot, zeros), *(x[r0:r1] for x in rows), *fixed,
                            **kwargs)
        if out is None:
            out = np.zeros((int(qs[-1]),) + o.shape[1:])
        out[r0:r1] = o
        for r in range(r0, r1):
            if r in saves:
                after[saves[r]] = seq_states[r - r0]
        after[slot] = seq_states[-1]
    return out, after


def delta_rule_step(step, states: Dict[int, np.ndarray], q, k, v, g, beta, scale: float,
                    use_l2norm: bool, zeros: np.ndarray):
    """:func:`delta_rule_sequence` over a ragged step (see :func:`ragged`)."""
    return ragged(step, delta_rule_sequence, states, q, k, v, g, beta, scale, use_l2norm,
                  per_row=5, zeros=zeros)


def conv_step(step, states: Dict[int, np.ndarray], x, weight, bias, silu: bool,
              zeros: np.ndarray):
    """:func:`conv_sequence` over a ragged step (see :func:`ragged`)."""
    return ragged(step, conv_sequence, states, x, weight, bias, silu, per_row=1, zeros=zeros)


