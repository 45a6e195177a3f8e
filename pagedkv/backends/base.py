"""The protocol every backend implements, and the step plan they share.

``PagedKVCache`` validates every argument before it calls a backend, so a
backend may assume well-formed input:

* pools: per layer, K and V, ``[num_pages, num_kv_heads, page_size, head_dim]``;
* ``k``, ``v``: ``[total_new, num_kv_heads, head_dim]``, ``q``:
  ``[total_new, num_heads, head_dim]`` with ``num_heads % num_kv_heads == 0``,
  each a float numpy array or an array native to the backend;
* page ids, slots and tables: produced by :class:`pagedkv._page_table.PageTables`.
"""
from dataclasses import dataclass, field
from typing import Optional

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
    cache : dict
        Per-backend memo (uploaded buffers, work lists), filled lazily and
        reused by every layer of the step.
    """
    query_start: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    cache: dict = field(default_factory=dict)

    @property
    def num_tokens(self):
        return len(self.slot_mapping)


class Backend:
    """What a backend provides.  Subclasses implement every method below."""

    name: Optional[str] = None

    @classmethod
    def unavailable_reason(cls):
        """None if this backend can run here; else why not and how to fix it."""
        raise NotImplementedError

    @classmethod
    def suits_auto(cls):
        """Whether ``backend="auto"`` should take this backend when it can run."""
        return True

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_pages, page_size,
                 dtype, device=None):
        raise NotImplementedError

    @property
    def memory_bytes(self):
        """Bytes of K/V page storage (all layers, K and V)."""
        raise NotImplementedError

    #: Array types besides numpy that ``store`` and ``attention`` accept.
    array_types: tuple = ()

    def prepare_step(self, tables):
        """Called once per ``append`` with its :class:`StepTables` (e.g. to upload them)."""
        raise NotImplementedError

    def copy_pages(self, src, dst):
        """Copy pages ``src[i] -> dst[i]`` (int32 arrays) in every layer, K and V."""
        raise NotImplementedError

    def store(self, layer, tables, k, v):
        """Write ``k``, ``v`` [total_new, num_kv_heads, head_dim] at the step's slots (-1 skips)."""
        raise NotImplementedError

    def attention(self, layer, tables, q, scale):
        """Causal paged attention; ``q`` [total_new, num_heads, head_dim] -> float32, same shape
        and same kind (numpy or native) as ``q``."""
        raise NotImplementedError

    def gather(self, layer, slots):
        """K and V at ``slots`` (int64 [n]) as float32 numpy arrays [n, num_kv_heads, head_dim]."""
        raise NotImplementedError
