"""Lists of Python ints as int64 arrays in one C pass: the fast path of argument checks.

An engine passes sequence ids as a list of ints every step; numpy's
conversion plus a scan for bools (which numpy would take as 0 or 1) would be
most of a decode step's argument checks.  Here every entry is checked to be
exactly an ``int`` and copied in the same loop.
"""
import numpy as np
from libc.stdint cimport int64_t
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE


def int64_from_list(list values):
    """``values`` as a new int64 ndarray of shape [len(values)], or None.

    None when an entry is not exactly an ``int`` (a bool, a numpy integer, a
    float, ...) or does not fit in int64: the caller's general path then
    decides, with its own message.
    """
    cdef Py_ssize_t n = PyList_GET_SIZE(values), i
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] view = out
    cdef object value
    for i in range(n):
        value = <object>PyList_GET_ITEM(values, i)
        if type(value) is not int:
            return None
        try:
            view[i] = value
        except OverflowError:
            return None
    return out
