"""The protocol every backend implements, and the step tables they share.

``PagedKVCache`` validates every argument before it calls a backend, so a
backend may assume well-formed input:

* pools: per layer, K and V, ``[layer_pages[layer], num_kv_heads, page_size, head_dim]``
  (full-attention and windowed layers draw on pools of different sizes);
* ``k``, ``v``: ``[total_new, num_kv_heads, head_dim]``, ``q``:
  ``[total_new, num_heads, head_dim]`` with ``num_heads % num_kv_heads == 0``,
  each a float numpy array (any strides) or one of ``array_types``;
* ``spec``: a validated :class:`pagedkv.attention_spec.AttentionSpec`;
* page ids, slots and tables: produced by :class:`pagedkv._page_table.PageTables`.
"""
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


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
    """
    query_start: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    device: Any = None
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self):
        return len(self.slot_mapping)

    def plan(self, make_plan, num_heads, sliding_window):
        """The attention plan of this step for a query-head count and window.

        ``make_plan(self, num_heads, sliding_window)`` runs once per distinct
        pair; every layer of the step then reuses its plan (work list,
        uploads, thread count).
        """
        key = (num_heads, sliding_window)
        if key not in self._plans:
            self._plans[key] = make_plan(self, num_heads, sliding_window)
        return self._plans[key]


class Backend:
    """What a backend provides.  Subclasses implement every method below."""

    name: Optional[str] = None

    #: The backend's own array types that ``store`` and ``attention`` take as they are.
    array_types: tuple = ()

    @classmethod
    def unavailable_reason(cls):
        """None if this backend can run here; else why not and how to fix it."""
        raise NotImplementedError

    @classmethod
    def suits_auto(cls):
        """Whether ``backend="auto"`` should take this backend when it can run."""
        return True

    def __init__(self, *, num_kv_heads, head_dim, layer_pages, page_size, storage, device=None,
                 options=None):
        """Pools for ``len(layer_pages)`` layers (layer ``l`` has ``layer_pages[l]``
        pages) in the :class:`pagedkv.storage.StorageFormat` ``storage``."""
        raise NotImplementedError

    @property
    def memory_bytes(self):
        """Bytes of K/V page storage (all layers, K and V)."""
        raise NotImplementedError

    def prepare_step(self, tables):
        """Called once per ``append`` with its :class:`StepTables`; may set ``tables.device``."""
        raise NotImplementedError

    def copy_pages(self, src, dst, layers):
        """Copy pages ``src[i] -> dst[i]`` (int32 arrays) in each of ``layers``, K and V."""
        raise NotImplementedError

    def store(self, layer, tables, k, v):
        """Write ``k``, ``v`` [total_new, num_kv_heads, head_dim] at the step's slots (-1 skips)."""
        raise NotImplementedError

    def attention(self, layer, tables, q, spec, out=None):
        """Paged attention of the variant ``spec``; ``q`` [total_new, num_heads, head_dim]
        -> float32, same shape and same kind (numpy or native) as ``q``.

        ``out`` (numpy, float32, C-contiguous, ``q``'s shape; only with numpy
        ``q``) receives the result and is returned."""
        raise NotImplementedError

    def gather(self, layer, slots):
        """K and V at ``slots`` (int64 [n]) as float32 numpy arrays [n, num_kv_heads, head_dim]."""
        raise NotImplementedError
