# The host kernels' rows (included by _kernels.pyx: each instruction-set level
# compiles the kernels as one module): a row of K or V into a pool's storage
# format and back, and the scatter and gather of a step's or a range's rows.


cdef inline storage_t convert(float x, storage_t* dummy) noexcept nogil:
    """float -> a float format's element (int8 rows go through pkv_quantize)."""
    if storage_t is float:
        return x
    elif storage_t is uint16_t:
        return pkv_float_to_half(x)
    elif storage_t is int16_t:
        return <int16_t>pkv_float_to_bf16(x)
    else:
        return 0


cdef inline void store_row(storage_t[:, :, :, ::1] pool, float[:, :, ::1] scales, int64_t page,
                           Py_ssize_t h, int64_t offset, const float* x, int rotation_block,
                           float rotation_scale, float* tmp) noexcept nogil:
    """Row ``x`` (``head_dim`` floats) into the pool at (page, h, offset): int8 rotated
    and quantized, its scale into ``scales`` (``tmp``: ``head_dim`` floats of
    scratch); the float formats element by element."""
    cdef Py_ssize_t d, D = pool.shape[3]
    cdef storage_t* dummy = NULL
    if storage_t is int8_t:
        scales[page, h, offset] = pkv_quantize(x, D, rotation_block, rotation_scale,
                                               &pool[page, h, offset, 0], tmp)
    else:
        for d in range(D):
            pool[page, h, offset, d] = convert(x[d], dummy)


cdef inline void load_row(storage_t[:, :, :, ::1] pool, const float[:, :, ::1] scales,
                          int64_t page, Py_ssize_t h, int64_t offset, float* out,
                          int rotation_block, float rotation_scale) noexcept nogil:
    """The row at (page, h, offset) as ``head_dim`` floats in ``out``: int8
    dequantized and rotated back, the float formats element by element."""
    cdef Py_ssize_t d, D = pool.shape[3]
    if storage_t is int8_t:
        pkv_dequantize(&pool[page, h, offset, 0], scales[page, h, offset], D,
                       rotation_block, rotation_scale, out)
    else:
        for d in range(D):
            out[d] = load(pool[page, h, offset, d])


# -- scatter / gather ---------------------------------------------------------------

def scatter(storage_t[:, :, :, ::1] k_pool, storage_t[:, :, :, ::1] v_pool,
            float[:, :, ::1] k_scales, float[:, :, ::1] v_scales,
            const int64_t[::1] slot_mapping, const float[:, :, ::1] k, const float[:, :, ::1] v,
            int rotation_block, float rotation_scale, int num_threads):
    """Write token ``t`` of ``k`` ([T, H, D]) and ``v`` ([T, H, Dv]: the V pool's
    width), float32, at ``slot_mapping[t]``; -1 skips.

    int8: each row is rotated and quantized, its scale written to ``k_scales``
    / ``v_scales``.  Latent rows (``v_pool`` is ``k_pool``): each row once, from ``k``."""
    cdef Py_ssize_t t, h, H = k.shape[1]
    cdef int64_t slot, page, offset, ps = k_pool.shape[2]
    cdef bint latent = &v_pool[0, 0, 0, 0] == &k_pool[0, 0, 0, 0]
    # scratch of a K or a V row: V's may be the wider (v_head_dim)
    tmp_buf = np.empty((num_threads, max(k_pool.shape[3], v_pool.shape[3])), dtype=np.float32)
    cdef float[:, ::1] tmp = tmp_buf
    for t in prange(slot_mapping.shape[0], nogil=True, schedule="static",
                    num_threads=num_threads):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        page = slot // ps
        offset = slot % ps
        for h in range(H):
            store_row(k_pool, k_scales, page, h, offset, &k[t, h, 0], rotation_block,
                      rotation_scale, &tmp[threadid(), 0])
            if not latent:
                store_row(v_pool, v_scales, page, h, offset, &v[t, h, 0], rotation_block,
                          rotation_scale, &tmp[threadid(), 0])


def gather(storage_t[:, :, :, ::1] pool, const float[:, :, ::1] scales,
           const int64_t[::1] slots, float[:, :, ::1] out, int rotation_block,
           float rotation_scale, int num_threads):
    """``out[i]`` ([n, H, D] float32) = the token at ``slots[i]`` of ``pool`` (int8:
    dequantized and rotated back)."""
    cdef Py_ssize_t i, h, H = out.shape[1]
    cdef int64_t page, offset, ps = pool.shape[2]
    for i in prange(slots.shape[0], nogil=True, schedule="static", num_threads=num_threads):
        page = slots[i] // ps
        offset = slots[i] % ps
        for h in range(H):
            load_row(pool, scales, page, h, offset, &out[i, h, 0], rotation_block,
                     rotation_scale)
