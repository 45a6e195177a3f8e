"""The Llama forward pass in NumPy, with the KV cache and attention injected.

One function computes a step for any mix of prefill chunks and decodes: the
rows of the step are the new tokens of every sequence, concatenated.  Dense
math (RMSNorm, projections, RoPE, SwiGLU, logits) is float32 NumPy; the
attention of each layer is a callable the caller passes in, so the same
forward runs over a :class:`pagedkv.PagedKVCache` (the engine) or over any
other KV store (the contiguous baseline of ``benchmarks/bench_generate.py``).

Weights follow the GGUF layout (llama.cpp's conversion of a Llama
checkpoint): the rows of ``attn_q`` and ``attn_k`` are permuted within each
head so that RoPE rotates *adjacent* pairs ``(x[2i], x[2i+1])``, llama.cpp's
"normal" rope mode, rather than the ``(x[i], x[i + d/2])`` halves of the
original checkpoint.  :class:`Rope` therefore rotates adjacent pairs.
"""
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

#: ``attend(layer, q, k, v) -> out``: store this step's ``k``/``v``
#: ``[total_new, num_kv_heads, head_dim]`` of ``layer`` and return the causal
#: attention of ``q`` ``[total_new, num_heads, head_dim]`` over each
#: sequence's keys, ``[total_new, num_heads, head_dim]`` float32.
AttendFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and constants of a Llama-family decoder.

    Parameters
    ----------
    vocab_size, hidden_size, intermediate_size, num_layers : int
    num_heads, num_kv_heads, head_dim : int
        ``num_heads`` a multiple of ``num_kv_heads`` (GQA).
    rope_theta : float
        RoPE base frequency.
    rms_norm_eps : float
    rope_dim : int, optional
        Leading dims of each head that RoPE rotates (default: all of ``head_dim``).
    max_position : int
        The context length the model was trained for.
    """
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    rope_dim: Optional[int] = None
    max_position: int = 2048

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads="
                             f"{self.num_kv_heads}, got {self.num_heads}")
        if self.rope_dim is None:
            object.__setattr__(self, "rope_dim", self.head_dim)
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"rope_dim: expected an even int in [2, head_dim={self.head_dim}], "
                             f"got {self.rope_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(f"rope_theta and rms_norm_eps: expected positive floats, got "
                             f"{self.rope_theta!r} and {self.rms_norm_eps!r}")

    @property
    def q_size(self):
        """Width of the query projection, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self):
        """Width of the key (or value) projection, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self):
        """Bytes of float32 K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * 4


@dataclass
class LayerWeights:
    """One decoder layer, float32, laid out ``[in, out]`` so that ``y = x @ w``.

    Attributes
    ----------
    attn_norm, ffn_norm : ndarray, shape [hidden_size]
    wqkv : ndarray, shape [hidden_size, q_size + 2 * kv_size]
        Query, key and value projections side by side (one matmul per layer).
    wo : ndarray, shape [q_size, hidden_size]
    w_gate_up : ndarray, shape [hidden_size, 2 * intermediate_size]
        Gate and up projections side by side.
    w_down : ndarray, shape [intermediate_size, hidden_size]
    """
    attn_norm: np.ndarray
    wqkv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate_up: np.ndarray
    w_down: np.ndarray

    @classmethod
    def from_projections(cls, *, attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down):
        """Build a layer from ``[out, in]`` matrices as checkpoints store them.

        Parameters
        ----------
        attn_norm, ffn_norm : array_like, shape [hidden_size]
        wq : array_like, shape [q_size, hidden_size]
        wk, wv : array_like, shape [kv_size, hidden_size]
        wo : array_like, shape [hidden_size, q_size]
        w_gate, w_up : array_like, shape [intermediate_size, hidden_size]
        w_down : array_like, shape [hidden_size, intermediate_size]
        """
        def f32(a):
            return np.ascontiguousarray(a, dtype=np.float32)
        return cls(attn_norm=f32(attn_norm),
                   wqkv=f32(np.concatenate([wq, wk, wv], axis=0).T),
                   wo=f32(np.asarray(wo).T),
                   ffn_norm=f32(ffn_norm),
                   w_gate_up=f32(np.concatenate([w_gate, w_up], axis=0).T),
                   w_down=f32(np.asarray(w_down).T))


@dataclass
class LlamaWeights:
    """All weights of a Llama decoder, float32.

    Attributes
    ----------
    token_embedding : ndarray, shape [vocab_size, hidden_size]
    layers : list of LayerWeights, length num_layers
    output_norm : ndarray, shape [hidden_size]
    output : ndarray, shape [vocab_size, hidden_size], or None
        The LM head; None when tied to ``token_embedding``.
    rope_freq_factors : ndarray, shape [rope_dim // 2], or None
        Per-frequency divisors (Llama 3.1 style ``rope_freqs``).
    """
    token_embedding: np.ndarray
    layers: List[LayerWeights]
    output_norm: np.ndarray
    output: Optional[np.ndarray] = None
    rope_freq_factors: Optional[np.ndarray] = None

    def check(self, config):
        """Raise ``ValueError`` naming the first weight whose shape disagrees with ``config``."""
        c = config
        expected = {
            "token_embedding": (self.token_embedding, (c.vocab_size, c.hidden_size)),
            "output_norm": (self.output_norm, (c.hidden_size,)),
        }
        if self.output is not None:
            expected["output"] = (self.output, (c.vocab_size, c.hidden_size))
        if self.rope_freq_factors is not None:
            expected["rope_freq_factors"] = (self.rope_freq_factors, (c.rope_dim // 2,))
        for i, layer in enumerate(self.layers):
            for name, shape in (("attn_norm", (c.hidden_size,)),
                                ("wqkv", (c.hidden_size, c.q_size + 2 * c.kv_size)),
                                ("wo", (c.q_size, c.hidden_size)),
                                ("ffn_norm", (c.hidden_size,)),
                                ("w_gate_up", (c.hidden_size, 2 * c.intermediate_size)),
                                ("w_down", (c.intermediate_size, c.hidden_size))):
                expected[f"layers[{i}].{name}"] = (getattr(layer, name), shape)
        if len(self.layers) != c.num_layers:
            raise ValueError(f"layers: expected {c.num_layers}, got {len(self.layers)}")
        for name, (array, shape) in expected.items():
            if array.shape != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {array.shape}")

    @classmethod
    def random(cls, config, rng, *, scale=0.5, tied=True):
        """Random weights for tests and benchmarks (not a trained model).

        Parameters
        ----------
        config : LlamaConfig
        rng : numpy.random.Generator
        scale : float
            Projections are ``N(0, scale**2 / fan_in)``, which keeps activations O(1).
        tied : bool
            Share the LM head with the token embedding.
        """
        c = config

        def mat(rows, cols):
            return (rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))).astype(np.float32)

        def norm():
            return (1.0 + 0.1 * rng.standard_normal(c.hidden_size)).astype(np.float32)

        layers = [LayerWeights.from_projections(
            attn_norm=norm(), wq=mat(c.q_size, c.hidden_size), wk=mat(c.kv_size, c.hidden_size),
            wv=mat(c.kv_size, c.hidden_size), wo=mat(c.hidden_size, c.q_size), ffn_norm=norm(),
            w_gate=mat(c.intermediate_size, c.hidden_size),
            w_up=mat(c.intermediate_size, c.hidden_size),
            w_down=mat(c.hidden_size, c.intermediate_size)) for _ in range(c.num_layers)]
        embedding = rng.standard_normal((c.vocab_size, c.hidden_size)).astype(np.float32)
        output = None if tied else mat(c.vocab_size, c.hidden_size)
        return cls(token_embedding=embedding, layers=layers, output_norm=norm(), output=output)


class Rope:
    """Rotary position embedding over adjacent pairs ``(x[2i], x[2i+1])``.

    Pair ``i`` of a head at position ``p`` turns by ``p * theta**(-2i / rope_dim)``
    (divided by ``freq_factors[i]`` when given).  Only the first ``rope_dim``
    dims of each head rotate.
    """

    def __init__(self, rope_dim, theta, freq_factors=None):
        inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
        if freq_factors is not None:
            inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
        self.rope_dim = rope_dim
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
        even = x[:, :, 0:self.rope_dim:2]
        odd = x[:, :, 1:self.rope_dim:2]
        new_even = even * cos - odd * sin
        odd *= cos
        odd += even * sin
        even[...] = new_even


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis.

    Parameters
    ----------
    x : ndarray, shape [n, hidden_size], float32
    weight : ndarray, shape [hidden_size], float32
    eps : float

    Returns
    -------
    ndarray, shape [n, hidden_size], float32
    """
    mean_square = np.einsum("ij,ij->i", x, x, dtype=np.float32)[:, None] / np.float32(x.shape[-1])
    return x * (1.0 / np.sqrt(mean_square + np.float32(eps))) * weight


def silu(x):
    """``x * sigmoid(x)``, written with tanh so that large ``|x|`` cannot overflow."""
    return x * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x))


@dataclass
class LlamaModel:
    """A Llama decoder: config, float32 weights and the forward pass.

    Parameters
    ----------
    config : LlamaConfig
    weights : LlamaWeights
    """
    config: LlamaConfig
    weights: LlamaWeights
    rope: Rope = field(init=False, repr=False)

    def __post_init__(self):
        self.weights.check(self.config)
        self.rope = Rope(self.config.rope_dim, self.config.rope_theta,
                         self.weights.rope_freq_factors)

    @property
    def lm_head(self):
        """The output projection, ``[vocab_size, hidden_size]`` (the embedding when tied)."""
        w = self.weights
        return w.token_embedding if w.output is None else w.output

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
            returns causal attention; ``q`` ``[total_new, num_heads, head_dim]``,
            ``k``/``v`` ``[total_new, num_kv_heads, head_dim]``.
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
        n = len(token_ids)
        cos, sin = self.rope.tables(positions)
        x = w.token_embedding[token_ids]                      # [n, hidden]
        q_end, k_end = c.q_size, c.q_size + c.kv_size
        for index, layer in enumerate(w.layers):
            qkv = rms_norm(x, layer.attn_norm, c.rms_norm_eps) @ layer.wqkv
            q = qkv[:, :q_end].reshape(n, c.num_heads, c.head_dim)
            k = qkv[:, q_end:k_end].reshape(n, c.num_kv_heads, c.head_dim)
            # v is a strided view into qkv; the cache copies it on store anyway.
            v = qkv[:, k_end:].reshape(n, c.num_kv_heads, c.head_dim)
            self.rope.apply(q, cos, sin)
            self.rope.apply(k, cos, sin)
            out = attend(index, q, k, v)                      # [n, heads, head_dim]
            x += np.asarray(out, dtype=np.float32).reshape(n, c.q_size) @ layer.wo
            gate_up = rms_norm(x, layer.ffn_norm, c.rms_norm_eps) @ layer.w_gate_up
            gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
            x += (silu(gate) * up) @ layer.w_down
        last = rms_norm(x[np.asarray(logit_rows, dtype=np.intp)], w.output_norm, c.rms_norm_eps)
        return last @ self.lm_head.T
