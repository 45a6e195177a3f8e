"""What one attention call computes besides its inputs: scale, window, soft cap, sinks, ALiBi.

:class:`AttentionSpec` is validated once, by the facade, and travels down to
the backends as one object: the planner turns its :class:`Band`
(``sliding_window``, ``attention_chunk_size``) into each work item's visible key band, and the kernels
apply ``scale``, ``logits_soft_cap``, ``alibi_slopes`` and ``sinks``.  A new variant is a field
here, its check in :meth:`AttentionSpec.from_arguments`, and its use in the
variant contract of the kernels (``opencl/pkv_variant.h``) or the planner.
"""
import math
import numbers
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import numpy.typing as npt

from pagedkv._arrays import FLOAT_DTYPES
from pagedkv.errors import ArgumentTypeError

#: Positions are int32, so a window (or a chunk) this wide already sees every position.
MAX_WINDOW = 2**31 - 1


def _positive_int(name, value):
    """``value`` as an int >= 1 (no bool), capped at MAX_WINDOW, or ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an int >= 1, got "
                                f"{type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return min(int(value), MAX_WINDOW)


def _positive_float32(name, value):
    """``value`` as a float that is positive and finite in float32, or ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a positive finite float, got "
                                f"{type(value).__name__} {value!r}")
    try:
        as_float = float(value)
    except OverflowError:      # an int beyond any float, e.g. 10**400
        as_float = math.inf
    with np.errstate(over="ignore"):
        single = np.float32(as_float)
    if not (np.isfinite(single) and single > 0):
        raise ValueError(f"{name}: expected a positive float that is finite and nonzero in "
                         f"float32, got {value!r}")
    return float(single)


def _as_given(name, value):
    """``value`` unchanged (``np.asarray`` converts it later)."""
    return value


@dataclass(frozen=True)
class Band:
    """Which key positions the token at position ``p`` sees, besides ``j <= p``.

    What the planner (:func:`pagedkv.backends.schedule.plan_attention`) turns
    into each work item's band fields (``opencl/pkv_variant.h``), and the key
    of a step's cached plans (hashable).

    Attributes
    ----------
    sliding_window : int or None
        ``W``: no position before ``p - W + 1``.
    chunk_size : int or None
        ``C``: no position before ``C * floor(p / C)``.
    """
    sliding_window: Optional[int] = None
    chunk_size: Optional[int] = None

    def first_visible(self, position: "npt.NDArray[np.int64]") -> "npt.NDArray[np.int64]":
        """The first key position that the token at each ``position`` sees (an int64
        array of any shape; the same shape back): the planner's first key of a
        block's first row, cascade's first key of a sequence's last row."""
        first = np.zeros_like(position)
        if self.sliding_window is not None:
            first = np.maximum(first, position - self.sliding_window + 1)
        if self.chunk_size is not None:
            first = np.maximum(first, position // self.chunk_size * self.chunk_size)
        return first


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """One attention variant.

    For query head ``h`` of the new token at position ``p``, with logits
    ``x_j = scale * q . k_j`` over the visible positions ``j``:

    * visible positions: ``max(0, p - sliding_window + 1) .. p`` (every
      ``j <= p`` when ``sliding_window`` is None), and with
      ``attention_chunk_size = C`` only those from ``C * floor(p / C)`` on;
    * ``logits_soft_cap = c``: ``x_j`` becomes ``c * tanh(x_j / c)``;
    * ``alibi_slopes``: then ``x_j`` gains ``alibi_slopes[h] * (j - p)`` (ALiBi;
      ``j - p`` an integer, made a float only to be multiplied);
    * ``sinks``: the softmax denominator gains ``exp(sinks[h])`` (not scaled,
      nothing added to the numerator), i.e.
      ``out = sum_j exp(x_j) v_j / (sum_j exp(x_j) + exp(sinks[h]))``.

    Attributes
    ----------
    scale : float
    sliding_window : int or None
        ``W``: FlashInfer's ``window_left`` is ``W - 1``; Hugging Face's
        ``sliding_window`` is ``W``.
    logits_soft_cap : float or None
    sinks : ndarray, shape [num_heads], float32, read-only, or None
    attention_chunk_size : int or None
        ``C``: Llama 4's ``attention_chunk_size`` (vLLM's chunked local attention).
    alibi_slopes : ndarray, shape [num_heads], float32, read-only, or None
        ALiBi's slope of each query head (vLLM's and FlashInfer's ``alibi_slopes``).
    """
    scale: float
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    sinks: Optional[np.ndarray] = None
    attention_chunk_size: Optional[int] = None
    alibi_slopes: Optional[np.ndarray] = None

    @classmethod
    def from_arguments(cls, *, head_dim, num_heads, scale=None, sliding_window=None,
                       logits_soft_cap=None, sinks=None, attention_chunk_size=None,
                       alibi_slopes=None, as_numpy=None, max_seq_len=None):
        """Validate the variant arguments of ``PagedKVCache.attention``.

        Parameters
        ----------
        head_dim, num_heads : int
        scale : float, optional
            Default ``1 / sqrt(head_dim)``.
        sliding_window : int >= 1, optional
        logits_soft_cap : float > 0, optional
        sinks : array-like, shape [num_heads], optional
        attention_chunk_size : int >= 1, optional
        alibi_slopes : array-like, shape [num_heads], optional
        as_numpy : callable
            ``as_numpy(name, value)`` turns ``sinks`` or ``alibi_slopes`` into
            an ndarray (the facade passes its converter for torch tensors and
            other array types); None: ``np.asarray``.
        max_seq_len : int, optional
            The longest sequence the cache holds (None: the tables' int32
            limit): ALiBi's bias ``alibi_slopes[h] * (j - p)`` must stay well
            inside float32 over that many positions.

        Raises
        ------
        ValueError
            A value out of range or not finite, ``sinks`` or ``alibi_slopes``
            of another shape, or slopes whose bias would leave float32's range
            within ``max_seq_len``; the message names the argument.
        """
        scale = 1.0 / math.sqrt(head_dim) if scale is None else _positive_float32("scale", scale)
        if sliding_window is not None:
            sliding_window = _positive_int("sliding_window", sliding_window)
        if attention_chunk_size is not None:
            attention_chunk_size = _positive_int("attention_chunk_size", attention_chunk_size)
        if logits_soft_cap is not None:
            logits_soft_cap = _positive_float32("logits_soft_cap", logits_soft_cap)
        as_numpy = as_numpy or _as_given
        if sinks is not None:
            sinks = cls._check_per_head("sinks", as_numpy("sinks", sinks), num_heads)
        if alibi_slopes is not None:
            alibi_slopes = cls._check_per_head("alibi_slopes",
                                               as_numpy("alibi_slopes", alibi_slopes), num_heads)
            # A quarter of float32's range, so that a bias, the logit it is added
            # to and their distance from the row's maximum all stay finite: one
            # inf makes the row NaN.
            distance = (2**31 - 1 if max_seq_len is None else max_seq_len) - 1
            limit = float(np.finfo(np.float32).max) / 4
            steepest = float(np.abs(alibi_slopes).max(initial=0.0))
            if steepest * distance > limit:
                raise ValueError(f"alibi_slopes: a slope of magnitude {steepest:.6g} gives a bias "
                                 f"of {steepest * distance:.6g} at a distance of {distance} "
                                 f"positions (max_seq_len="
                                 f"{max_seq_len}), past float32's range (at most "
                                 f"{limit / max(distance, 1):.6g} is accepted)")
        return cls(scale, sliding_window, logits_soft_cap, sinks, attention_chunk_size,
                   alibi_slopes)

    @staticmethod
    def _check_per_head(name, values, num_heads):
        """``values`` [num_heads] as read-only float32, or ValueError naming ``name``."""
        values = np.asarray(values)
        if values.shape != (num_heads,):
            raise ValueError(f"{name}: expected shape [{num_heads}] (one per query head), "
                             f"got {list(values.shape)}")
        if values.dtype.kind not in "iu" and values.dtype not in FLOAT_DTYPES:
            raise ArgumentTypeError(f"{name}: expected float16, float32, float64 or int values, "
                                    f"got dtype {values.dtype}")
        with np.errstate(over="ignore", invalid="ignore"):
            single = values.astype(np.float32)
        if not np.isfinite(single).all():
            bad = values[~np.isfinite(single)][0]
            raise ValueError(f"{name}: expected finite float32 values, got {bad!r}")
        single.setflags(write=False)
        return single

    @property
    def band(self):
        """The spec's :class:`Band`, or None for plain causal attention."""
        if self.sliding_window is None and self.attention_chunk_size is None:
            return None
        return Band(self.sliding_window, self.attention_chunk_size)

    def without_band(self) -> "AttentionSpec":
        """This spec with every key up to the query visible: no field of the band
        (the one place that knows which fields make it)."""
        return replace(self, sliding_window=None, attention_chunk_size=None)

    def with_window(self, window):
        """This spec with ``sliding_window`` narrowed to ``window`` (None: unchanged)."""
        if window is None or (self.sliding_window is not None and self.sliding_window <= window):
            return self
        return AttentionSpec(self.scale, window, self.logits_soft_cap, self.sinks,
                             self.attention_chunk_size, self.alibi_slopes)
