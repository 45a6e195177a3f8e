"""The Gemma 3 decoder in NumPy (text only), on the step loop shared with Llama.

What differs from :class:`~pagedkv.models.llama.LlamaModel` (as Hugging
Face's ``Gemma3ForCausalLM`` and llama.cpp's ``gemma3`` graph compute it):

- the token embedding is multiplied by ``sqrt(hidden_size)``; the LM head is
  tied to the (unscaled) embedding;
- QK-norm: an RMSNorm over ``head_dim`` on each query and key head, before
  RoPE;
- sandwich norms: ``x += post_attention_norm(attention(attn_norm(x)))``, then
  ``x += post_ffw_norm(ffn(ffn_norm(x)))``;
- the FFN is GeGLU, ``down(gelu_tanh(gate(h)) * up(h))``;
- layers mix sliding-window and full attention
  (:attr:`GemmaConfig.layer_windows`), and the two kinds use different RoPE
  bases: ``rope_theta`` on full layers, ``rope_theta_sliding`` (10,000) on
  sliding ones; RoPE rotates the two halves of each head (NEOX style: the
  GGUF converter does not permute Gemma's Q/K as it does Llama's);
- the attention scale is ``1/sqrt(query_pre_attn_scalar)``, which the GGUF
  does not store: 1/sqrt(head_dim) for every size but 27B.

The norm weights here already include Gemma's ``+1`` (the GGUF converter
adds it), so every norm is the plain :func:`~pagedkv.models.decoder.rms_norm`.
The window of a sliding layer is applied by the KV store, not here: build the
cache with ``layer_windows=list(config.layer_windows)``.
"""
from dataclasses import dataclass, field

from typing import Optional

import numpy as np

from pagedkv.models.decoder import DecoderModel, LayerRope, Rope, gelu_tanh, rms_norm
from pagedkv.models.llama import LayerWeights, LlamaConfig, LlamaWeights

#: Gemma 3's sliding-window layer pattern: every ``GEMMA3_FULL_EVERY``-th
#: layer (5, 11, 17, ...) has full attention, the others a sliding window.
GEMMA3_FULL_EVERY = 6
#: RoPE base of Gemma 3's sliding-window layers (not in the GGUF; llama.cpp
#: and transformers hard-code it).
GEMMA3_ROPE_THETA_SLIDING = 10000.0


def gemma3_layer_windows(num_layers, sliding_window, full_every=GEMMA3_FULL_EVERY):
    """Per-layer windows of Gemma 3: ``None`` on layers ``full_every - 1, 2 * full_every - 1, ...``.

    Parameters
    ----------
    num_layers : int
    sliding_window : int
        The window of the other layers (``gemma3.attention.sliding_window``).
    full_every : int

    Returns
    -------
    tuple of (None or int), length num_layers
    """
    return tuple(None if (i + 1) % full_every == 0 else int(sliding_window)
                 for i in range(num_layers))


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """Shape and constants of a Gemma 3 decoder: a :class:`LlamaConfig` and three more.

    Parameters
    ----------
    (those of LlamaConfig)
        ``rope_theta`` is the full layers' base; ``layer_windows`` says which
        layers are sliding (``W``) and which full (``None``).
    rope_theta_sliding : float, default 10000
        RoPE base of the sliding-window layers.
    rope_scale_full : float, default 1
        Linear RoPE scaling factor of the full layers only (Gemma 3 4B and up
        use 8); positions are divided by it.
    attention_scale : float, optional
        Factor of ``q . k`` (``1/sqrt(query_pre_attn_scalar)``); default
        ``1/sqrt(head_dim)``.
    embedding_scale : float, optional
        Factor of the token embedding; default ``sqrt(hidden_size)``.
    """
    rope_theta_sliding: float = GEMMA3_ROPE_THETA_SLIDING
    rope_scale_full: float = 1.0
    attention_scale: Optional[float] = None
    embedding_scale: Optional[float] = None

    def __post_init__(self):
        super().__post_init__()
        if self.attention_scale is None:
            object.__setattr__(self, "attention_scale", 1.0 / float(np.sqrt(self.head_dim)))
        if self.embedding_scale is None:
            object.__setattr__(self, "embedding_scale", float(np.sqrt(self.hidden_size)))
        for name in ("rope_theta_sliding", "rope_scale_full", "attention_scale",
                     "embedding_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (float, int, np.floating)) and np.isfinite(value)
                    and value > 0):
                raise ValueError(f"{name}: expected a positive finite float, got {value!r}")


@dataclass
class GemmaLayerWeights(LayerWeights):
    """One Gemma 3 layer: a Llama layer's weights plus QK-norm and sandwich norms.

    Attributes
    ----------
    (those of LayerWeights)
        ``attn_norm`` is the input norm, ``ffn_norm`` the pre-FFN norm.
    q_norm, k_norm : ndarray, shape [head_dim]
        RMSNorm weights of every query / key head.
    post_attention_norm, post_ffw_norm : ndarray, shape [hidden_size]
        Norms of the attention output and the FFN output, before each residual add.
    """
    q_norm: Optional[np.ndarray] = None
    k_norm: Optional[np.ndarray] = None
    post_attention_norm: Optional[np.ndarray] = None
    post_ffw_norm: Optional[np.ndarray] = None

    def expected_shapes(self, config):
        c = config
        return {**super().expected_shapes(config),
                "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
                "post_attention_norm": (c.hidden_size,), "post_ffw_norm": (c.hidden_size,)}

    @classmethod
    def from_projections(cls, *, q_norm, k_norm, post_attention_norm, post_ffw_norm,
                         **projections):
        """Build a layer from ``[out, in]`` matrices and the four extra norms.

        Parameters
        ----------
        q_norm, k_norm : array_like, shape [head_dim]
        post_attention_norm, post_ffw_norm : array_like, shape [hidden_size]
        **projections
            As :meth:`LayerWeights.from_projections` (``attn_norm``, ``wq``,
            ``wk``, ``wv``, ``wo``, ``ffn_norm``, ``w_gate``, ``w_up``, ``w_down``).
        """
        base = LayerWeights.from_projections(**projections)

        def f32(a):
            return np.ascontiguousarray(a, dtype=np.float32)
        return cls(**vars(base), q_norm=f32(q_norm), k_norm=f32(k_norm),
                   post_attention_norm=f32(post_attention_norm),
                   post_ffw_norm=f32(post_ffw_norm))


@dataclass
class GemmaModel(DecoderModel):
    """A Gemma 3 decoder: config, float32 weights (Gemma layers) and the forward pass.

    Parameters
    ----------
    config : GemmaConfig
    weights : LlamaWeights
        With :class:`GemmaLayerWeights` layers; ``output`` None (tied) or an
        explicit LM head; ``rope_freq_factors`` must be None.
    """
    config: GemmaConfig
    weights: LlamaWeights
    rope_full: Rope = field(init=False, repr=False)
    rope_sliding: Rope = field(init=False, repr=False)

    def __post_init__(self):
        c = self.config
        if not isinstance(c, GemmaConfig):
            raise ValueError(f"config: expected a GemmaConfig, got {type(c).__name__}")
        bad = [i for i, layer in enumerate(self.weights.layers)
               if not isinstance(layer, GemmaLayerWeights)]
        if bad:
            raise ValueError(f"weights.layers[{bad[0]}]: expected GemmaLayerWeights, got "
                             f"{type(self.weights.layers[bad[0]]).__name__}")
        if self.weights.rope_freq_factors is not None:
            raise ValueError("weights.rope_freq_factors: Gemma takes none (use "
                             "GemmaConfig.rope_scale_full)")
        self.weights.check(c)
        half = c.rope_dim // 2
        full_factors = None if c.rope_scale_full == 1 else np.full(half, c.rope_scale_full)
        self.rope_full = Rope(c.rope_dim, c.rope_theta, full_factors, neox=True)
        self.rope_sliding = Rope(c.rope_dim, c.rope_theta_sliding, neox=True)
        # The cache attends with 1/sqrt(head_dim); other scales are folded into q.
        ratio = c.attention_scale * np.sqrt(c.head_dim)
        self._q_scale = None if abs(ratio - 1.0) < 1e-12 else float(ratio)

    def embed(self, token_ids):
        return self.weights.token_embedding[token_ids] * np.float32(self.config.embedding_scale)

    def layer_ropes(self, positions):
        full = LayerRope(self.rope_full, *self.rope_full.tables(positions))
        sliding = LayerRope(self.rope_sliding, *self.rope_sliding.tables(positions))
        return [full if w is None else sliding for w in self.config.layer_windows]

    def layer(self, index, layer, x, rope, attend):
        eps = self.config.rms_norm_eps
        out = self.attention(index, layer, rms_norm(x, layer.attn_norm, eps), rope, attend,
                             q_norm=layer.q_norm, k_norm=layer.k_norm, q_scale=self._q_scale)
        x += rms_norm(out, layer.post_attention_norm, eps)
        out = self.feed_forward(layer, rms_norm(x, layer.ffn_norm, eps), gelu_tanh)
        x += rms_norm(out, layer.post_ffw_norm, eps)
