"""How the pools store K/V: one description per format, used by both backends.

A :class:`StorageFormat` says what a pool element is, whether rows carry a
scale, how rows are rotated, how many bytes a page takes and how the kernels
are built for it.  Adding a format means an entry in ``opencl/pkv_storage.h``,
one here, and its load/store helpers in the kernels; callers only read the
description.

int8: each row (one token, one KV head, ``head_dim`` values) is first rotated
by an orthonormal Hadamard transform in blocks of ``rotation_block`` values
(the largest power of two dividing ``head_dim``, at most 256: 128 for 128,
16 for 80, 32 for 96), so that an outlier channel spreads over the block
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
from dataclasses import dataclass

import numpy as np

from pagedkv.backends.kernel_source import storage_kinds

#: The formats' kernel indices, from ``opencl/pkv_storage.h`` (e.g. ``KINDS.INT8``).
KINDS = storage_kinds()
_MAX_ROTATION_BLOCK = 256


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
    """
    name: str
    element: np.dtype
    kernel_element: np.dtype
    kind: int
    scaled: bool = False
    rotation_block: int = 0

    @property
    def rotation_scale(self):
        """``1 / sqrt(rotation_block)`` as float32: what makes the transform orthonormal."""
        return float(np.float32(1.0) / np.sqrt(np.float32(self.rotation_block))) \
            if self.rotation_block else 1.0

    def row_bytes(self, head_dim):
        """Bytes of one stored row: values, plus its scale."""
        return head_dim * self.element.itemsize + (4 if self.scaled else 0)

    def page_bytes(self, num_kv_heads, page_size, head_dim):
        """Bytes of one page of one pool (K or V) of one layer."""
        return num_kv_heads * page_size * self.row_bytes(head_dim)

    def opencl_options(self):
        """Build options of ``opencl/pkv_common.h`` for this format."""
        options = [f"-DPKV_STORAGE={self.kind}"]
        if self.rotation_block:
            # as a hex float, so that the device rounds nothing: the host's exact constant
            options += [f"-DPKV_ROTATION_BLOCK={self.rotation_block}",
                        f"-DPKV_ROTATION_SCALE={float(self.rotation_scale).hex()}f"]
        return tuple(options)


def rotation_block(head_dim):
    """The Hadamard block of int8 rows: the largest power of two dividing ``head_dim``
    (at most 256); 1 (no rotation) for an odd ``head_dim``."""
    block = 1
    while head_dim % (block * 2) == 0 and block * 2 <= _MAX_ROTATION_BLOCK:
        block *= 2
    return block


def storage_format(name, head_dim, rotate=True):
    """The :class:`StorageFormat` called ``name`` for rows of ``head_dim`` values.

    Raises
    ------
    ValueError
        An unknown ``name``; the message names the accepted ones.
    """
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
        block = rotation_block(head_dim) if rotate else 0
        return StorageFormat("int8", np.dtype(np.int8), np.dtype(np.int8), KINDS.INT8,
                             scaled=True, rotation_block=block if block > 1 else 0)
    raise ValueError(f"dtype: expected one of {NAMES}, got {name!r}")


#: The accepted storage dtype names.
NAMES = ("float32", "float16", "bfloat16", "int8")
