"""The protocol every backend implements, and the step tables they share.

``PagedKVCache`` validates every argument before it calls a backend, so a
backend may assume well-formed input:

* pools: per layer, K and V, ``[layer_pages[layer], num_kv_heads, page_size, head_dim]``
  (full-attention and windowed layers draw on pools of different sizes); with
  latent rows (``storage.latent``) K only, and V is the K pool itself: ``store``
  gets ``v=None``, ``gather`` returns the rows twice, ``attention`` is
  ``head_dim`` wide (the cache keeps the values' columns);
* ``k``, ``v``: ``[total_new, num_kv_heads, head_dim]``, ``q``:
  ``[total_new, num_heads, head_dim]`` with ``num_heads % num_kv_heads == 0``,
  each a float numpy array (any strides) or one of ``array_types``;
* ``spec``: a validated :class:`pagedkv.attention_spec.AttentionSpec`;
* page ids, slots and tables: produced by :class:`pagedkv._page_table.PageTables`.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Hashable, NamedTuple, Optional, Sequence,
                    Tuple, TypeVar)

import numpy as np

if TYPE_CHECKING:   # annotations only: importing them here would be circular
    from pagedkv.attention_spec import AttentionSpec, Band
    from pagedkv.storage import StorageFormat

_Plan = TypeVar("_Plan")
_Heads = TypeVar("_Heads", bound=Optional[int])


@dataclass(eq=False)
class StepTables:
    """The tables of one ``append`` step, as the kernels read them (host numpy arrays).

    Attributes
    ----------
    query_start : ndarray, shape [B+1], int32
    seq_lens : ndarray, shape [B], int32
    slot_mapping : ndarray, shape [total_new], int64
    page_indptr : ndarray, shape [B+1], int32
    page_indices : ndarray, shape [nnz], int32
    device : object
        What the backend's ``prepare_step`` made of the tables (e.g. their
        device copies), shared by every layer of the step.
    key_cut : pagedkv.backends.schedule.KeyCut or None
        Keys each sequence's rows read only (or skip), besides their band:
        set on the tables that shared-prefix attention makes (``pagedkv.cascade``).
    may_share : bool
        False when no page of the pool had two holders as the step was made
        (no fork, no prefix-cache hit): no two sequences of the step share a
        page, and the shared-prefix planner skips its search.  True: unknown.
    plans : dict
        The plans made for this step (``Backend.plan``, the shared-prefix
        planner's), by kind, head count and band: made once, and every layer
        of the step reuses them (work list, uploads, thread count).
    """
    query_start: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    device: Any = None
    key_cut: Any = None
    may_share: bool = True
    plans: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    def kept(self, key: Hashable, make: "Callable[[], _Plan]") -> _Plan:
        """``plans[key]``, made by ``make()`` the first time it is asked for."""
        if key not in self.plans:
            self.plans[key] = make()
        return self.plans[key]


class StoredRows(NamedTuple):
    """K/V rows as a pool stores them: the bits of the storage format, unconverted.

    Attributes
    ----------
    k : ndarray, shape [n, num_kv_heads, head_dim], ``storage.element``
    v : ndarray, shape [n, num_kv_heads, head_dim], ``storage.element``, or None
        None for latent rows (``storage.latent``: the values are read from ``k``).
    k_scales, v_scales : ndarray, shape [n, num_kv_heads], float32, or None
        Each row's scale (the pools of ``storage.copy_set``); None otherwise.
    """
    k: np.ndarray
    v: Optional[np.ndarray] = None
    k_scales: Optional[np.ndarray] = None
    v_scales: Optional[np.ndarray] = None


def empty_rows(storage: "StorageFormat", num_rows: int, num_kv_heads: int,
               head_dim: int) -> StoredRows:
    """New :class:`StoredRows` of ``num_rows`` rows in ``storage`` (uninitialised)."""
    return StoredRows(**{part.field: np.empty((num_rows, num_kv_heads) + part.row_shape,
                                              part.dtype)
                         for part in storage.copy_set(head_dim)})


class Backend(ABC):
    """What a backend provides: every abstract method below.

    Attributes
    ----------
    name : str
        The name ``PagedKVCache(backend=...)`` takes.
    array_types : tuple of type
        The backend's own array types that ``store`` and ``attention`` take as
        they are (numpy arrays and CPU tensors are converted by the facade).
    storage : StorageFormat
    num_kv_heads, head_dim, page_size : int
        What the constructor was given.
    """

    name: Optional[str] = None
    array_types: tuple = ()
    storage: "StorageFormat"
    num_kv_heads: int
    head_dim: int
    page_size: int

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None if this backend can run here; else why not and how to fix it."""

    #: When ``cascade="auto"`` reads a shared run once
    #: (:class:`pagedkv.cascade.CascadePolicy`; measured per backend, docs/cascade.md).
    cascade_policy: Any = None

    def is_native(self, array: Any) -> bool:
        """Whether ``array`` is one of the backend's own ``array_types``."""
        return bool(self.array_types) and isinstance(array, self.array_types)

    @classmethod
    def suits_auto(cls) -> bool:
        """Whether ``backend="auto"`` should take this backend when it can run."""
        return True

    @abstractmethod
    def __init__(self, *, num_kv_heads: int, head_dim: int, layer_pages: Sequence[int],
                 page_size: int, storage: "StorageFormat", device: Any = None,
                 options: Optional[dict] = None):
        """Pools for ``len(layer_pages)`` layers (layer ``l`` has ``layer_pages[l]``
        pages) in the :class:`pagedkv.storage.StorageFormat` ``storage``."""

    @property
    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of K/V page storage (all layers, K and V, scales included)."""

    @abstractmethod
    def prepare_step(self, tables: StepTables) -> None:
        """Called once per ``append`` with its :class:`StepTables`; may set ``tables.device``."""

    def plan(self, tables: StepTables, num_heads: int, band: "Optional[Band]") -> Any:
        """The attention plan of the step ``tables`` for ``num_heads`` query heads and
        ``band`` (an :class:`pagedkv.attention_spec.Band`, or None: causal): made
        once per step, head count and band by ``make_plan``, kept in
        ``tables.plans`` for every layer."""
        return tables.kept(("kernels", num_heads, band),
                           lambda: self.make_plan(tables, num_heads, band))

    @abstractmethod
    def make_plan(self, tables: StepTables, num_heads: int, band: "Optional[Band]") -> Any:
        """A new attention plan (see ``plan``): the work list and what the kernels need."""

    @abstractmethod
    def copy_pages(self, src: np.ndarray, dst: np.ndarray, layers: Sequence[int]) -> None:
        """Copy pages ``src[i] -> dst[i]`` (int32 arrays) in each of ``layers``, K and V
        (and their scales)."""

    @abstractmethod
    def store(self, layer: int, tables: StepTables, k: Any, v: Any) -> None:
        """Write ``k``, ``v`` [total_new, num_kv_heads, head_dim] at the step's slots (-1 skips);
        ``v`` is None for latent rows."""

    @abstractmethod
    def attention(self, layer: int, tables: StepTables, q: Any, spec: "AttentionSpec",
                  out: Optional[np.ndarray] = None,
                  lse: Optional[np.ndarray] = None) -> Any:
        """Paged attention of the variant ``spec``; ``q`` [total_new, num_heads, head_dim]
        -> float32, same shape and same kind (numpy or native) as ``q``.

        ``out`` (numpy, float32, C-contiguous, ``q``'s shape; only with numpy
        ``q``) receives the result and is returned.  ``lse`` (numpy, float32,
        C-contiguous, [total_new, num_heads]; only with numpy ``q`` and a
        ``spec`` without sinks) receives each query's log-sum-exp of its
        logits, ``m + log(sum_j exp(x_j - m))`` (-inf for a query that sees no
        key): what merges two attentions over disjoint keys."""

    def leading_columns(self, x: Any, width: int) -> Any:
        """``x[..., :width]`` of an ``attention`` result ``x`` [total_new, num_heads,
        head_dim] (numpy, or one of ``array_types``), C-contiguous, of ``x``'s kind:
        latent rows' values are their first ``width`` columns."""
        return np.ascontiguousarray(x[..., :width])

    @abstractmethod
    def gather(self, layer: int, slots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """K and V at ``slots`` (int64 [n]) as float32 numpy arrays [n, num_kv_heads, head_dim]."""

    @abstractmethod
    def read_rows(self, layer: int, slots: np.ndarray,
                  out: Optional[StoredRows] = None) -> StoredRows:
        """The stored bits of K and V (and their scales) at ``slots`` (int64 [n]), as
        host numpy arrays (export, swap): what ``write_rows`` takes to restore them.

        ``out``: C-contiguous arrays of those shapes and dtypes to fill (and return)."""

    @abstractmethod
    def write_rows(self, layer: int, slots: np.ndarray, rows: StoredRows) -> None:
        """Write rows of stored bits (from ``read_rows`` of a pool in the same format)
        at ``slots`` (int64 [n]), unconverted (import, swap)."""

    # -- recurrent layers (layer_states) ----------------------------------------------
    #
    # A step of a recurrent layer (``step`` below) is any object with int32 numpy
    # attributes ``query_start`` [B+1] (sequence b's rows are
    # ``query_start[b]:query_start[b+1]``, contiguous and ascending), ``slots`` [B]
    # (the slot sequence b's state lives in: read and advanced in place; -1 only
    # for a sequence without rows, which is left alone), ``save_rows`` [M] and
    # ``save_slots`` [M] (ascending by row: after global row ``save_rows[m]``, that
    # sequence's state of the array is copied into slot ``save_slots[m]``, which
    # is no sequence's ``slots[b]``).  Inputs are float32 C-contiguous numpy
    # arrays, or one of ``array_types`` (then so is the result).

    @abstractmethod
    def state_store(self, shapes: Sequence[Optional[Sequence[Tuple[int, ...]]]],
                    num_slots: int) -> Any:
        """A new state store (:mod:`pagedkv.backends.state_store`) of ``num_slots``
        slots: per layer of ``shapes``, None (an attention layer) or the shapes of
        its state arrays; ``MemoryError`` naming ``num_state_slots`` if it cannot
        be had."""

    @abstractmethod
    def causal_conv1d(self, store: Any, layer: int, index: int, step: Any, x: Any,
                      weight: Any, bias: Any, silu: bool) -> Any:
        """The causal depthwise convolution of the step's rows, continuing each
        sequence's input history (state array ``index`` of ``layer``,
        ``[channels, kernel - 1]``: the last inputs, oldest first).

        Parameters
        ----------
        x : array, shape [total_new, channels], float32
        weight : array, shape [channels, kernel], float32 (kernel >= 1)
        bias : array, shape [channels], float32, or None
        silu : bool
            ``y / (1 + exp(-y))`` on the result.

        Returns
        -------
        array, shape [total_new, channels], float32:
        ``y[t, c] = act(bias[c] + sum_j weight[c, j] * u[t + j - kernel + 1, c])``.
        """

    @abstractmethod
    def gated_delta_rule(self, store: Any, layer: int, index: int, step: Any, q: Any, k: Any,
                         v: Any, g: Any, beta: Any, scale: float, l2norm: bool) -> Any:
        """The gated delta rule of the step's rows, token by token, on each
        sequence's state (array ``index`` of ``layer``, ``[num_v_heads, k_dim,
        v_dim]``): per v-head ``h`` (k-head ``h // (num_v_heads // num_k_heads)``),
        optionally L2-normalised q and k, then ``S *= exp(g)``;
        ``S += outer(k, beta * (v - S^T k))``; ``o = S^T (scale * q)``.

        Parameters
        ----------
        q, k : array, shape [total_new, num_k_heads, k_dim], float32
        v : array, shape [total_new, num_v_heads, v_dim], float32
        g, beta : array, shape [total_new, num_v_heads], float32
        scale : float
        l2norm : bool
            ``x / sqrt(sum(x^2) + 1e-6)`` of q and k per head first.

        Returns
        -------
        array, shape [total_new, num_v_heads, v_dim], float32
        """
