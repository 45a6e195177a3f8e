"""Argument checks with exact messages: name, what was expected, what was given."""
import numbers

import numpy as np

from pagedkv._arrays import FLOAT_DTYPES, to_numpy
from pagedkv._ints import int64_from_list
from pagedkv.errors import ArgumentTypeError, UnknownSequenceError


def check_int(name, value, *, minimum=None, maximum=None):
    """``value`` as an int in ``[minimum, maximum]`` (either bound optional)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        lo = "-inf" if minimum is None else minimum
        hi = "inf" if maximum is None else maximum
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")
    return value


_BOOL_TYPES = frozenset((bool, np.bool_))
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def check_int_vector(name, value, *, length=None, minimum=None):
    """``value`` (int or sequence of ints) as a new int64 ndarray of shape [length].

    The result is always a private copy: later changes to the caller's array
    (from a callback, or another thread) cannot reach what was validated.
    """
    if type(value) is int and length is not None and _INT64_MIN <= value <= _INT64_MAX:
        if minimum is not None and value < minimum:
            raise ValueError(f"{name}: expected every entry >= {minimum}, got {value}")
        return np.full(length, value, dtype=np.int64)
    # a list of plain ints (what engines pass every step) in one C pass
    arr = int64_from_list(value) if type(value) is list else None
    if arr is not None:
        value = arr
    # numpy would take a bool in a list of ints as 0 or 1; map(type, ...) runs in
    # C, where a generator of isinstance calls would run in Python per entry
    elif isinstance(value, (list, tuple)) and not _BOOL_TYPES.isdisjoint(map(type, value)):
        raise ArgumentTypeError(f"{name}: expected ints, got a bool in {value!r}"[:200])
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:   # ragged nesting, objects numpy cannot hold
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got {value!r}"[:200]
                         + f" ({exc})") from None
    if arr.ndim == 0 and length is not None:
        arr = np.full(length, arr)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or arr.dtype == np.bool_):
        raise ArgumentTypeError(f"{name}: expected ints, got dtype {arr.dtype}")
    if length is not None and len(arr) != length:
        raise ValueError(f"{name}: expected {length} entries, got {len(arr)}")
    if arr.size and minimum is not None and arr.min() < minimum:
        raise ValueError(f"{name}: expected every entry >= {minimum}, got {int(arr.min())}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: entry {int(arr.max())} does not fit in int64")
    return np.array(arr, dtype=np.int64, order="C")


def check_seq_id(name, value):
    """A sequence id as an int; anything else is an UnknownSequenceError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UnknownSequenceError(f"{name}: expected an int sequence id, got "
                                   f"{type(value).__name__} {value!r}"[:200])
    return int(value)


def check_tensor(name, x, shape, *, native_types=()):
    """``x`` as the array the kernels will read, checked to be floats of exactly ``shape``.

    ``x`` may be one of ``native_types`` (the backend's device arrays, kept as
    they are) or anything :func:`pagedkv._arrays.to_numpy` takes (numpy,
    torch CPU tensors, CPU ``__dlpack__`` objects), which becomes an ndarray
    first: the checks apply to that buffer, not to the object's own claims.
    ``shape`` entries are ints, or ``None`` for "any size".
    """
    if type(x) is not np.ndarray and not isinstance(x, native_types):
        x = to_numpy(name, x)
    got = tuple(x.shape)
    if None in shape:
        fits = len(got) == len(shape) and all(e is None or e == g for e, g in zip(shape, got))
    else:
        fits = got == tuple(shape)
    if not fits:
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(got)}")
    if np.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ArgumentTypeError(f"{name}: expected a float dtype (float16, bfloat16, float32 "
                                f"or float64), got {x.dtype}")
    return x
