"""How the pools store K/V: one description per format, used by both backends.

A :class:`StorageFormat` says what a pool element is, whether rows carry a
scale, how rows are rotated, how many bytes a page takes and how the kernels
are built for it.  Adding a format means an entry in ``opencl/pkv_storage.h``,
one here, and its load/store helpers in the kernels; callers only read the
description: which pools a layer has (:meth:`StorageFormat.copy_set`), the
rotation the kernels apply (:attr:`StorageFormat.rotation`), which OpenCL
kernels move its rows (:attr:`StorageFormat.opencl_kernels`) and how they
are built (:meth:`StorageFormat.opencl_options`).  Nothing outside this
module and the kernels' load/store helpers asks which format it is.

int8: each row (one token, one KV head, ``head_dim`` values) is first rotated
by an orthonormal Hadamard transform in blocks of ``rotation_block`` values
(the largest power of two dividing ``head_dim``, at most 256: 128 for 128,
16 for 80, 32 for 96; with V rows of another width, ``v_head_dim``, the
largest dividing both: 64 for 192 and 128, since one block rotates the
queries, the K and V rows and the output, and the kernels take one), so that an outlier channel spreads over the block
instead of stretching the whole row's scale; then it is kept as int8 values
and one float32 scale, ``amax / 127`` (symmetric, round to nearest even).
Scales are float32, not float16, so that no row's scale overflows (amax above
65504 * 127) or flushes to zero (tiny rows); they cost 4 bytes a row, 3% of
a float32 row at head_dim 128.  ``attention`` rotates the queries the same
way (so q.k is unchanged) and rotates the output back; ``gather`` returns
rows rotated back.

bfloat16: the high 16 bits of the float32, rounded to nearest even (a tie to
the even neighbour, overflow to inf); NaN stays NaN (quieted, sign kept).
float32's range with 8 bits of mantissa, at float16's two bytes a value.
"""
import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Tuple

import numpy as np

from pagedkv.backends.kernel_source import storage_kinds

#: The formats' kernel indices, from ``opencl/pkv_storage.h`` (e.g. ``KINDS.INT8``).
KINDS = storage_kinds()
_MAX_ROTATION_BLOCK = 256
_SCALE = np.dtype(np.float32)


class PoolPart(NamedTuple):
    """One pool of a layer's copy set: what ``copy_pages`` copies, ``read_rows``
    reads and ``write_rows`` writes, and what a backend allocates.

    Attributes
    ----------
    field : str
        Its :class:`pagedkv.backends.base.StoredRows` field (``"k"``, ``"v"``,
        ``"k_scales"``, ``"v_scales"``), which is also the kernels' argument
        name for it, less the values' ``_pool``: see :attr:`argument`.
    dtype : numpy.dtype
        What a stored row holds (the bits ``read_rows`` returns).
    kernel_dtype : numpy.dtype
        What the host kernels are handed (``StorageFormat.kernel_element``
        for values).
    row_shape : tuple of int
        The shape of one row: ``(head_dim,)`` values, or ``()`` (one scale).
    """
    field: str
    dtype: np.dtype
    kernel_dtype: np.dtype
    row_shape: Tuple[int, ...]

    @property
    def argument(self) -> str:
        """The kernels' argument name of this pool (``k_pool``, ``k_scales``, ...)."""
        return self.field + "_pool" if self.field in ("k", "v") else self.field

    @property
    def row_elements(self) -> int:
        """Elements of one row."""
        return int(np.prod(self.row_shape, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.row_elements * self.dtype.itemsize


class OpenCLKernels(NamedTuple):
    """The ``kv_pages.cl`` kernels that move one format's rows.

    Attributes
    ----------
    scatter, gather : str
        The kernels that store float rows into the pools and load them back
        as floats; they take the copy set's pools (:attr:`PoolPart.argument`).
    rotations : tuple of str
        Kernels ``(x, n)`` that turn ``n`` float rows in place into the
        stored rows' basis and back (their own inverse): run on the queries
        before attention and on its output after; none for a format whose
        rows are stored unrotated.
    whole_rows : bool
        Whether ``scatter`` and ``gather`` take one work-item per row (a row
        quantized whole) instead of one per vector.
    fused_store : bool
        Whether the attention kernel may store a step's new rows itself
        (vector by vector, as ``scatter`` does).
    staged_only : bool
        Whether the attention kernel must stage K and V rows (convert them
        into local tiles): ``stage_k`` and ``stage_v`` must stay on.
    exact_division : bool
        Whether storing divides, so that the program must be built with
        correctly rounded division (where the device has it) to store the
        host's bits.
    """
    scatter: str
    gather: str
    rotations: Tuple[str, ...]
    whole_rows: bool
    fused_store: bool
    staged_only: bool
    exact_division: bool

    def items_per_row(self, head_dim: int, vector_width: int) -> int:
        """Work-items of ``scatter`` and ``gather`` per stored row."""
        return 1 if self.whole_rows else head_dim // vector_width


@dataclass(frozen=True)
class StorageFormat:
    """One storage format of the K/V pools, for one head size.

    Attributes
    ----------
    name : str
        ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"int8"``.
    element : numpy.dtype
        What a pool holds per value (bfloat16, which numpy lacks, as its
        uint16 bits: the high half of the float32's).
    kernel_element : numpy.dtype
        What the host kernels are handed (float16 as its uint16 bits,
        bfloat16 as its bits in int16: a type of its own, which selects the
        kernels' bfloat16 specialisation).
    kind : int
        The kernels' index of the format (``opencl/pkv_storage.h``).
    scaled : bool
        Whether each row has a float32 scale beside its values.
    rotation_block : int
        Size of the Hadamard blocks rows are rotated by (0: not rotated).
    latent : bool
        The rows are latent rows (``kv_layout="latent"``): a layer keeps one
        pool of rows (and, int8, their scales) and reads its values from
        them, so there is no V pool to allocate, copy, export or save.
    v_head_dim : int
        Values per V row where they differ from ``head_dim`` (the separate
        layout's ``v_head_dim``); 0: V rows are ``head_dim`` wide (and latent
        rows have no V pool).
    """
    name: str
    element: np.dtype
    kernel_element: np.dtype
    kind: int
    scaled: bool = False
    rotation_block: int = 0
    latent: bool = False
    v_head_dim: int = 0

    @property
    def rotation_scale(self) -> float:
        """``1 / sqrt(rotation_block)`` as float32: what makes the transform orthonormal."""
        return float(np.float32(1.0) / np.sqrt(np.float32(self.rotation_block))) \
            if self.rotation_block else 1.0

    @property
    def rotation(self) -> Tuple[int, float]:
        """The host kernels' ``(rotation_block, rotation_scale)``: ``(0, 1.0)`` for rows
        stored unrotated, which the kernels then leave as they are."""
        return self.rotation_block, self.rotation_scale

    def copy_set(self, head_dim: int) -> Tuple[PoolPart, ...]:
        """The pools of one layer, as :class:`PoolPart` in :class:`StoredRows` order:
        K values (``head_dim`` wide) and V values (``v_head_dim`` wide), then
        (int8) K and V row scales; latent rows only K's."""
        widths = {"k": head_dim, "v": self.v_width(head_dim)}
        sides = ("k",) if self.latent else ("k", "v")
        parts = [PoolPart(side, self.element, self.kernel_element, (widths[side],))
                 for side in sides]
        if self.scaled:
            parts += [PoolPart(side + "_scales", _SCALE, _SCALE, ()) for side in sides]
        return tuple(parts)

    def v_width(self, head_dim: int) -> int:
        """Values per V row, which the kernels sum and ``attention`` returns per head:
        ``v_head_dim`` where set, else ``head_dim`` (latent rows: the whole row,
        whose leading columns the cache keeps)."""
        return self.v_head_dim or head_dim

    @property
    def num_pools(self) -> int:
        """Pools of rows per layer: 2 (K and V), 1 for latent rows."""
        return 1 if self.latent else 2

    @property
    def fields(self) -> Tuple[str, ...]:
        """The :class:`StoredRows` fields of the copy set, in its order."""
        return tuple(part.field for part in self.copy_set(1))

    @property
    def opencl_kernels(self) -> OpenCLKernels:
        """The :class:`OpenCLKernels` of this format."""
        if self.scaled:
            return OpenCLKernels("scatter_kv_int8", "gather_kv_int8",
                                 ("rotate_rows",) if self.rotation_block else (),
                                 whole_rows=True, fused_store=False, staged_only=True,
                                 exact_division=True)
        return OpenCLKernels("scatter_kv", "gather_kv", (), whole_rows=False,
                             fused_store=True, staged_only=False, exact_division=False)

    def position_bytes(self, head_dim: int) -> int:
        """Bytes one token keeps of one KV head in one layer: every pool's row
        (K's ``head_dim`` values, V's ``v_head_dim``), scales included."""
        return sum(part.row_bytes for part in self.copy_set(head_dim))

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one stored row, values plus its scale (the mean of K's and V's
        where their widths differ)."""
        return self.position_bytes(head_dim) // self.num_pools

    def page_bytes(self, num_kv_heads: int, page_size: int, head_dim: int) -> int:
        """Bytes of one page of every pool of one layer (K and V, or the latent rows)."""
        return num_kv_heads * page_size * self.position_bytes(head_dim)

    def opencl_options(self, exact_division: bool = False) -> Tuple[str, ...]:
        """Build options of ``opencl/pkv_common.h`` for this format; ``exact_division``:
        the device divides correctly rounded when asked (``OpenCLKernels.exact_division``)."""
        options = [f"-DPKV_STORAGE={self.kind}"]
        if self.rotation_block:
            # as a hex float, so that the device rounds nothing: the host's exact constant
            options += [f"-DPKV_ROTATION_BLOCK={self.rotation_block}",
                        f"-DPKV_ROTATION_SCALE={float(self.rotation_scale).hex()}f"]
        if exact_division and self.opencl_kernels.exact_division:
            options.append("-cl-fp32-correctly-rounded-divide-sqrt")
        return tuple(options)


def rotation_block(head_dim: int, v_head_dim: int = 0) -> int:
    """The Hadamard block of int8 rows: the largest power of two dividing ``head_dim``
    (and ``v_head_dim``, where given: one block serves K, V and the output) (at
    most 256); 1 (no rotation) where one of them is odd."""
    block = 1
    width = math.gcd(head_dim, v_head_dim)
    while width % (block * 2) == 0 and block * 2 <= _MAX_ROTATION_BLOCK:
        block *= 2
    return block


def storage_format(name: str, head_dim: int, rotate: bool = True,
                   latent: bool = False, v_head_dim: Optional[int] = None) -> StorageFormat:
    """The :class:`StorageFormat` called ``name`` for rows of ``head_dim`` values
    (``latent``: latent rows, one pool per layer; see ``StorageFormat.latent``;
    ``v_head_dim``: the V rows' width in the separate layout, default ``head_dim``).

    Raises
    ------
    ValueError
        An unknown ``name``; the message names the accepted ones.
    """
    v_width = 0 if latent or v_head_dim is None or v_head_dim == head_dim else v_head_dim
    return replace(_format(name, head_dim, rotate, v_width), latent=latent, v_head_dim=v_width)


def _format(name: str, head_dim: int, rotate: bool, v_head_dim: int = 0) -> StorageFormat:
    if name == "float32":
        return StorageFormat("float32", np.dtype(np.float32), np.dtype(np.float32),
                             KINDS.FLOAT32)
    if name == "float16":
        return StorageFormat("float16", np.dtype(np.float16), np.dtype(np.uint16),
                             KINDS.FLOAT16)
    if name == "bfloat16":
        return StorageFormat("bfloat16", np.dtype(np.uint16), np.dtype(np.int16),
                             KINDS.BFLOAT16)
    if name == "int8":
        block = rotation_block(head_dim, v_head_dim) if rotate else 0
        return StorageFormat("int8", np.dtype(np.int8), np.dtype(np.int8), KINDS.INT8,
                             scaled=True, rotation_block=block if block > 1 else 0)
    raise ValueError(f"dtype: expected one of {NAMES}, got {name!r}")


#: The accepted storage dtype names.
NAMES = ("float32", "float16", "bfloat16", "int8")
