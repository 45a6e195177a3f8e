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


cdef int check_slots(const int64_t[::1] slots, int64_t num_slots, Py_ssize_t n) except -1:
    if slots.shape[0] != n:
        raise ValueError(f"slots: expected {n} slots (one per row), got {slots.shape[0]}")
    cdef Py_ssize_t i
    for i in range(slots.shape[0]):
        if not 0 <= slots[i] < num_slots:
            raise ValueError(f"slots: slot {slots[i]} is outside the pool [0, {num_slots})")
    return 0


def read_rows(const uint8_t[:, :, :, ::1] pool, const int64_t[::1] slots,
              uint8_t[:, :, ::1] out):
    """``out[i, h]`` = the row of head ``h`` at ``slots[i]`` of ``pool``."""
    cdef Py_ssize_t H = pool.shape[1], ps = pool.shape[2], nbytes = pool.shape[3]
    if out.shape[1] != H or out.shape[2] != nbytes:
        raise ValueError(f"out: expected rows of [{H}, {nbytes}] bytes, got "
                         f"[{out.shape[1]}, {out.shape[2]}]")
    check_slots(slots, pool.shape[0] * ps, out.shape[0])
    cdef Py_ssize_t i, h
    with nogil:
        for i in range(slots.shape[0]):
            for h in range(H):
                memcpy(&out[i, h, 0], &pool[slots[i] // ps, h, slots[i] % ps, 0], nbytes)


def write_rows(uint8_t[:, :, :, ::1] pool, const int64_t[::1] slots,
               const uint8_t[:, :, ::1] rows):
    """The row of head ``h`` at ``slots[i]`` of ``pool`` = ``rows[i, h]``."""
    cdef Py_ssize_t H = pool.shape[1], ps = pool.shape[2], nbytes = pool.shape[3]
    if rows.shape[1] != H or rows.shape[2] != nbytes:
        raise ValueError(f"rows: expected rows of [{H}, {nbytes}] bytes, got "
                         f"[{rows.shape[1]}, {rows.shape[2]}]")
    check_slots(slots, pool.shape[0] * ps, rows.shape[0])
    cdef Py_ssize_t i, h
    with nogil:
        for i in range(slots.shape[0]):
            for h in range(H):
                memcpy(&pool[slots[i] // ps, h, slots[i] % ps, 0], &rows[i, h, 0], nbytes)
