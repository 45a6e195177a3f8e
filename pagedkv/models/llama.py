"""The Llama decoder in NumPy, with the KV cache and attention injected.

One function computes a step for any mix of prefill chunks and decodes: the
rows of the step are the new tokens of every sequence, concatenated.  Dense
math (RMSNorm, projections, RoPE, SwiGLU, logits) is float32 NumPy; the
attention of each layer is a callable the caller passes in, so the same
forward runs over a :class:`pagedkv.PagedKVCache` (the engine) or over any
other KV store (the contiguous baseline of ``benchmarks/bench_generate.py``).
The step loop, norms and RoPE are shared with the other decoders
(:mod:`pagedkv.models.decoder`); this module holds the config and weight
containers they all use and the Llama layer.

Weights follow the GGUF layout (llama.cpp's conversion of a Llama
checkpoint): the rows of ``attn_q`` and ``attn_k`` are permuted within each
head so that RoPE rotates *adjacent* pairs ``(x[2i], x[2i+1])``, llama.cpp's
"normal" rope mode, rather than the ``(x[i], x[i + d/2])`` halves of the
original checkpoint.  Llama's :class:`Rope` therefore rotates adjacent pairs.
"""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from pagedkv.models.decoder import (AttendFn, DecoderModel, LayerRope, Rope,  # noqa: F401
                                    rms_norm, silu)


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
    layer_windows : sequence of (None or int), length num_layers, optional
        Per layer, ``None`` for full attention or ``W`` for a sliding window
        of the ``W`` most recent positions (the token itself included).
        Stored as a tuple; default: every layer full.  The forward pass does
        not apply windows itself: the KV store does (a ``PagedKVCache`` built
        with ``layer_windows=list(config.layer_windows)``).
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
    layer_windows: Optional[Tuple[Optional[int], ...]] = None

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
        object.__setattr__(self, "layer_windows", _check_layer_windows(
            self.layer_windows, self.num_layers))

    @property
    def has_windowed_layers(self):
        """True when some layer attends through a sliding window."""
        return any(w is not None for w in self.layer_windows)

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


def _check_layer_windows(windows, num_layers):
    """``layer_windows`` as a tuple of ``None`` or ints >= 1, one per layer."""
    if windows is None:
        return (None,) * num_layers
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__len__"):
        raise ValueError(f"layer_windows: expected a sequence of {num_layers} entries (None or "
                         f"an int >= 1), got {windows!r}")
    windows = tuple(windows)
    if len(windows) != num_layers:
        raise ValueError(f"layer_windows: expected {num_layers} entries (one per layer), got "
                         f"{len(windows)}")
    for index, w in enumerate(windows):
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer))
                              or w < 1):
            raise ValueError(f"layer_windows[{index}]: expected None or an int >= 1, got {w!r}")
    return tuple(None if w is None else int(w) for w in windows)


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

    def expected_shapes(self, config):
        """Shape each weight must have for ``config``: dict attribute name -> tuple."""
        c = config
        return {"attn_norm": (c.hidden_size,),
                "wqkv": (c.hidden_size, c.q_size + 2 * c.kv_size),
                "wo": (c.q_size, c.hidden_size),
                "ffn_norm": (c.hidden_size,),
                "w_gate_up": (c.hidden_size, 2 * c.intermediate_size),
                "w_down": (c.intermediate_size, c.hidden_size)}

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
            for name, shape in layer.expected_shapes(c).items():
                expected[f"layers[{i}].{name}"] = (getattr(layer, name), shape)
        if len(self.layers) != c.num_layers:
            raise ValueError(f"layers: expected {c.num_layers}, got {len(self.layers)}")
        for name, (array, shape) in expected.items():
            if array is None:
                raise ValueError(f"{name}: expected an array of shape {shape}, got None")
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


@dataclass
class LlamaModel(DecoderModel):
    """A Llama decoder: config, float32 weights and the forward pass.

    Each layer is ``x += attention(rms_norm(x))`` then
    ``x += down(silu(gate(h)) * up(h))`` with ``h = rms_norm(x)``; RoPE
    rotates adjacent pairs (the GGUF's permuted Q/K).  :meth:`forward` (from
    :class:`~pagedkv.models.decoder.DecoderModel`) runs a step.

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

    def embed(self, token_ids):
        return self.weights.token_embedding[token_ids]

    def layer_ropes(self, positions):
        return [LayerRope(self.rope, *self.rope.tables(positions))] * self.config.num_layers

    def layer(self, index, layer, x, rope, attend):
        eps = self.config.rms_norm_eps
        x += self.attention(index, layer, rms_norm(x, layer.attn_norm, eps), rope, attend)
        x += self.feed_forward(layer, rms_norm(x, layer.ffn_norm, eps), silu)
