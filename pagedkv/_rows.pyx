"""Stored K/V rows between a page pool and a contiguous array, as raw bytes.

A pool is ``[num_pages, num_kv_heads, page_size, row_bytes]`` bytes (the
values or the scales of any storage format, viewed as ``uint8``); rows are
``[n, num_kv_heads, row_bytes]``: row ``(i, h)`` is head ``h`` of the token
at ``slots[i]``.  Export, import and swap move K/V this way, so the stored
bits travel unchanged, one ``memcpy`` per row, on one thread: a copy is
bound by memory bandwidth, which one core nearly saturates, and OpenMP
threads only add their start and the wait for the slowest (a loaded
machine's descheduled thread made a parallel copy ten times slower).
"""
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy


cdef int check(const uint8_t[:, :, :, ::1] pool, const int64_t[::1] slots, Py_ssize_t n,
               Py_ssize_t heads, Py_ssize_t nbytes, str name) except -1:
    """ValueError unless ``n`` rows of ``heads`` x ``nbytes`` fit ``pool`` and every slot
    is in it."""
    if heads != pool.shape[1] or nbytes != pool.shape[3]:
        raise ValueError(f"{name}: expected rows of [{pool.shape[1]}, {pool.shape[3]}] bytes, "
                         f"got [{heads}, {nbytes}]")
    if slots.shape[0] != n:
        raise ValueError(f"slots: expected {n} slots (one per row), got {slots.shape[0]}")
    cdef Py_ssize_t i
    cdef int64_t num_slots = pool.shape[0] * pool.shape[2]
    for i in range(n):
        if not 0 <= slots[i] < num_slots:
            raise ValueError(f"slots: slot {slots[i]} is outside the pool [0, {num_slots})")
    return 0


def read_rows(const uint8_t[:, :, :, ::1] pool, const int64_t[::1] slots,
              uint8_t[:, :, ::1] out):
    """``out[i, h]`` = the row of head ``h`` at ``slots[i]`` of ``pool``."""
    check(pool, slots, out.shape[0], out.shape[1], out.shape[2], "out")
    cdef Py_ssize_t i, h, ps = pool.shape[2]
    with nogil:
        for i in range(slots.shape[0]):
            for h in range(pool.shape[1]):
                memcpy(&out[i, h, 0], &pool[slots[i] // ps, h, slots[i] % ps, 0], pool.shape[3])


def write_rows(uint8_t[:, :, :, ::1] pool, const int64_t[::1] slots,
               const uint8_t[:, :, ::1] rows):
    """The row of head ``h`` at ``slots[i]`` of ``pool`` = ``rows[i, h]``."""
    check(pool, slots, rows.shape[0], rows.shape[1], rows.shape[2], "rows")
    cdef Py_ssize_t i, h, ps = pool.shape[2]
    with nogil:
        for i in range(slots.shape[0]):
            for h in range(pool.shape[1]):
                memcpy(&pool[slots[i] // ps, h, slots[i] % ps, 0], &rows[i, h, 0], pool.shape[3])
