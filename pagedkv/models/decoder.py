"""What every decoder here shares: norms, activations, RoPE, the step loop and the attention call.

A model (:class:`~pagedkv.models.llama.LlamaModel`,
:class:`~pagedkv.models.gemma.GemmaModel`) subclasses :class:`DecoderModel`
and says how it embeds tokens, which RoPE each layer uses and what one layer
computes; :meth:`DecoderModel.forward` runs the step (validation, layers,
final norm, logits of the selected rows) and :meth:`DecoderModel.attention`
the part of a layer that goes through the KV store: the fused QKV matmul,
optional per-head QK-norm, RoPE, the ``attend`` callback and the output
projection.
"""
from typing import Callable, NamedTuple

import numpy as np

#: ``attend(layer, q, k, v) -> out``: store this step's ``k``/``v``
#: ``[total_new, num_kv_heads, head_dim]`` of ``layer`` and return the causal
#: attention of ``q`` ``[total_new, num_heads, head_dim]`` over each
#: sequence's keys, ``[total_new, num_heads, head_dim]`` float32.  A layer
#: with a sliding window attends only to its window: that is the KV store's
#: business (a ``PagedKVCache`` built with ``layer_windows`` knows it).
AttendFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Rope:
    """Rotary position embedding over the first ``rope_dim`` dims of each head.

    Pair ``i`` turns by ``p * theta**(-2i / rope_dim)`` at position ``p``
    (divided by ``freq_factors[i]`` when given).  The pairs are either
    adjacent dims ``(x[2i], x[2i+1])`` (llama.cpp's "normal" mode, which the
    Llama GGUFs' permuted Q/K weights expect) or, with ``neox=True``, the two
    halves ``(x[i], x[i + rope_dim/2])`` (GPT-NeoX style, as Gemma and the
    Hugging Face checkpoints rotate).

    Parameters
    ----------
    rope_dim : int
        Even, at most ``head_dim``.
    theta : float
        Base frequency.
    freq_factors : array_like, shape [rope_dim // 2], optional
    neox : bool, default False
    """

    def __init__(self, rope_dim, theta, freq_factors=None, *, neox=False):
        inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
        if freq_factors is not None:
            inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
        self.rope_dim = rope_dim
        self.theta = theta
        self.neox = bool(neox)
        self.inv_freq = inv_freq

    def tables(self, positions):
        """cos and sin of every pair's angle.

        Parameters
        ----------
        positions : ndarray, shape [n], int

        Returns
        -------
        cos, sin : ndarray, shape [n, 1, rope_dim // 2], float32
        """
        # Angles in float64: position * frequency loses digits in float32 at long contexts.
        angles = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        return (np.cos(angles).astype(np.float32)[:, None, :],
                np.sin(angles).astype(np.float32)[:, None, :])

    def apply(self, x, cos, sin):
        """Rotate ``x`` in place.

        Parameters
        ----------
        x : ndarray, shape [n, heads, head_dim], float32, writable
        cos, sin : ndarray, shape [n, 1, rope_dim // 2], float32
            From :meth:`tables`.
        """
        if self.neox:
            half = self.rope_dim // 2
            first, second = x[:, :, :half], x[:, :, half:self.rope_dim]
        else:
            first, second = x[:, :, 0:self.rope_dim:2], x[:, :, 1:self.rope_dim:2]
        new_first = first * cos - second * sin
        second *= cos
        second += first * sin
        first[...] = new_first


class LayerRope(NamedTuple):
    """The RoPE of one layer for one step: the rotation and its tables for the step's positions."""
    rope: Rope
    cos: np.ndarray
    sin: np.ndarray


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis.

    Parameters
    ----------
    x : ndarray, shape [..., d], float32
    weight : ndarray, shape [d], float32
    eps : float

    Returns
    -------
    ndarray, shape [..., d], float32 (a new array)
    """
    mean_square = np.einsum("...i,...i->...", x, x, dtype=np.float32)[..., None] \
        / np.float32(x.shape[-1])
    return x * (1.0 / np.sqrt(mean_square + np.float32(eps))) * weight


def silu(x):
    """``x * sigmoid(x)``, written with tanh so that large ``|x|`` cannot overflow."""
    return x * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x))


_GELU_C = np.float32(np.sqrt(2.0 / np.pi))


def gelu_tanh(x):
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x**3)))``."""
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(
        _GELU_C * (x + np.float32(0.044715) * x * x * x)))


class DecoderModel:
    """The step loop shared by the decoders; subclasses supply the parts that differ.

    A subclass has ``config`` (a :class:`~pagedkv.models.llama.LlamaConfig`)
    and ``weights`` (a :class:`~pagedkv.models.llama.LlamaWeights`) and
    implements :meth:`embed`, :meth:`layer_ropes` and :meth:`layer`.
    """

    @property
    def lm_head(self):
        """The output projection, ``[vocab_size, hidden_size]`` (the embedding when tied)."""
        w = self.weights
        return w.token_embedding if w.output is None else w.output

    # -- what a subclass supplies -----------------------------------------------------
    def embed(self, token_ids):
        """Input rows of the step: ndarray ``[n, hidden_size]`` float32, a new array."""
        raise NotImplementedError

    def layer_ropes(self, positions):
        """The RoPE of every layer for this step: list of :class:`LayerRope`, one per layer."""
        raise NotImplementedError

    def layer(self, index, layer, x, rope, attend):
        """Run decoder layer ``index`` on ``x`` ``[n, hidden_size]`` in place."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    def forward(self, token_ids, positions, attend, logit_rows):
        """Run one step: embed, all layers, and logits for the selected rows only.

        Parameters
        ----------
        token_ids : ndarray, shape [total_new], int
            The step's new tokens, sequence after sequence (the row order of
            the KV store's step, e.g. a ``StepBatch``).
        positions : ndarray, shape [total_new], int
            Position of each token in its sequence (for RoPE).
        attend : AttendFn
            ``attend(layer, q, k, v) -> out`` stores ``k``/``v`` of this step and
            returns causal attention (windowed on sliding-window layers);
            ``q`` ``[total_new, num_heads, head_dim]``, ``k``/``v``
            ``[total_new, num_kv_heads, head_dim]``.
        logit_rows : ndarray, shape [num_logits], int
            Rows whose next-token logits are wanted, typically the last new
            token of each sequence that samples this step.  Only these rows go
            through the final norm and the LM head (the largest matmul).

        Returns
        -------
        logits : ndarray, shape [num_logits, vocab_size], float32
        """
        c, w = self.config, self.weights
        token_ids = np.asarray(token_ids)
        positions = np.asarray(positions)
        if token_ids.ndim != 1 or positions.shape != token_ids.shape:
            raise ValueError(f"token_ids and positions: expected equal 1-D shapes, got "
                             f"{token_ids.shape} and {positions.shape}")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= c.vocab_size):
            raise ValueError(f"token_ids: expected ids in [0, {c.vocab_size}), got "
                             f"[{token_ids.min()}, {token_ids.max()}]")
        x = self.embed(token_ids)                                       # [n, hidden]
        ropes = self.layer_ropes(positions)
        for index, layer in enumerate(w.layers):
            self.layer(index, layer, x, ropes[index], attend)
        last = rms_norm(x[np.asarray(logit_rows, dtype=np.intp)], w.output_norm, c.rms_norm_eps)
        return last @ self.lm_head.T

    def attention(self, index, layer, h, rope, attend, *, q_norm=None, k_norm=None,
                  q_scale=None):
        """The attention half of a layer, through the KV store.

        Parameters
        ----------
        index : int
            The layer's index (``attend``'s first argument).
        layer : LayerWeights
            Uses ``wqkv`` and ``wo``.
        h : ndarray, shape [n, hidden_size], float32
            The normalized input.
        rope : LayerRope
        attend : AttendFn
        q_norm, k_norm : ndarray, shape [head_dim], optional
            RMSNorm weights applied to each query / key head before RoPE (QK-norm).
        q_scale : float, optional
            Multiplies the queries after RoPE, for models whose attention scale
            is not the store's default ``1/sqrt(head_dim)``.

        Returns
        -------
        ndarray, shape [n, hidden_size], float32
            The attention output after the output projection.
        """
        c = self.config
        n = h.shape[0]
        qkv = h @ layer.wqkv
        q_end, k_end = c.q_size, c.q_size + c.kv_size
        q = qkv[:, :q_end].reshape(n, c.num_heads, c.head_dim)
        k = qkv[:, q_end:k_end].reshape(n, c.num_kv_heads, c.head_dim)
        # v is a strided view into qkv; the cache copies it on store anyway.
        v = qkv[:, k_end:].reshape(n, c.num_kv_heads, c.head_dim)
        if q_norm is not None:
            q = rms_norm(q, q_norm, c.rms_norm_eps)
        if k_norm is not None:
            k = rms_norm(k, k_norm, c.rms_norm_eps)
        rope.rope.apply(q, rope.cos, rope.sin)
        rope.rope.apply(k, rope.cos, rope.sin)
        if q_scale is not None:
            q *= np.float32(q_scale)
        out = attend(index, q, k, v)                                    # [n, heads, head_dim]
        return np.asarray(out, dtype=np.float32).reshape(n, c.q_size) @ layer.wo

    @staticmethod
    def feed_forward(layer, h, activation):
        """The gated FFN ``down(activation(gate(h)) * up(h))``.

        Parameters
        ----------
        layer : LayerWeights
            Uses ``w_gate_up`` and ``w_down``.
        h : ndarray, shape [n, hidden_size], float32
        activation : callable
            :func:`silu` (SwiGLU) or :func:`gelu_tanh` (GeGLU).

        Returns
        -------
        ndarray, shape [n, hidden_size], float32
        """
        gate_up = h @ layer.w_gate_up
        size = gate_up.shape[1] // 2
        return (activation(gate_up[:, :size]) * gate_up[:, size:]) @ layer.w_down
