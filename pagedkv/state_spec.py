"""``StateSpec``: the state arrays one recurrent layer keeps per sequence (hybrid models).

A recurrent layer (gated DeltaNet, a short convolution, Mamba2) keeps a
fixed-size state per sequence instead of K/V.  Its ``StateSpec`` lists the
shapes of its state arrays, e.g. a Qwen3.5 linear-attention layer's
``[(conv_dim, kernel - 1), (num_v_heads, k_dim, v_dim)]``: its short
convolution's input history and its delta rule's matrix.  The cache keeps
one copy of every recurrent layer's arrays in a slot of its state pool
(:mod:`pagedkv.state_pool`).
"""
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

from pagedkv.errors import ArgumentTypeError

#: The storage dtypes a state array may have (the recurrences accumulate in float32).
STATE_DTYPES = ("float32",)


def _check_shape(name: str, shape: Any) -> Tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or any(
            isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        raise ArgumentTypeError(f"{name}: expected a tuple of ints >= 0 (an array's shape), "
                                f"got {shape!r}"[:200])
    return tuple(int(d) for d in shape)


@dataclass(frozen=True)
class StateSpec:
    """The state arrays of one recurrent layer.

    Parameters
    ----------
    shapes : sequence of tuple of int
        One shape per state array (at least one array); a sequence's state
        of array ``i`` is an array of ``shapes[i]``.  The built-in calls take
        the array by its index (``state=i``).
    dtype : str, default "float32"
        Storage dtype of the arrays; float32 only (a delta rule's state
        accumulates over the whole sequence, where float16 rounding compounds).

    Raises
    ------
    ValueError
        A shape that is not a tuple of ints >= 0, no shapes, or another dtype.
    """
    shapes: Tuple[Tuple[int, ...], ...]
    dtype: str = "float32"

    def __post_init__(self):
        shapes = self.shapes
        if not isinstance(shapes, (tuple, list)) or not shapes:
            raise ArgumentTypeError(f"shapes: expected a non-empty list of array shapes, "
                                    f"got {shapes!r}"[:200])
        object.__setattr__(self, "shapes", tuple(_check_shape(f"shapes[{i}]", shape)
                                                 for i, shape in enumerate(shapes)))
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"dtype: state arrays are stored as one of {STATE_DTYPES}, "
                             f"got {self.dtype!r}"[:200])

    @property
    def num_arrays(self) -> int:
        return len(self.shapes)

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state of this layer (all its arrays)."""
        return sum(int(np.prod(shape)) for shape in self.shapes) * 4
