"""Host kernels over typed memoryviews: scatter, gather (``_kernels_rows.pxi``) and paged attention.

Pools are ``[num_pages, num_kv_heads, page_size, head_dim]`` arrays in one
of the storage formats of ``pagedkv/storage.py``: float32, float16 passed as
its uint16 bits (``pkv_half.h`` converts), bfloat16 passed as its bits in
int16 (``pkv_simd.h`` converts), or int8 with a float32 scale per
row in ``[num_pages, num_kv_heads, page_size]`` scale pools and rows rotated
by blocks of ``rotation_block`` (``pkv_quant.h``; 0: none).  Float formats
take 1x1x1 placeholder scale pools.  All arithmetic is float32.  Callers
(``pagedkv.backends.host``) validate every shape and index; these loops
trust them and run without the GIL.
"""
import numpy as np
cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.math cimport INFINITY
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint16_t

cnp.import_array()

cdef extern from "pkv_half.h" nogil:
    float pkv_half_to_float(uint16_t bits)
    uint16_t pkv_float_to_half(float x)

cdef extern from "pkv_variant.h" nogil:
    # the variant contract (opencl/pkv_variant.h; pkv_simd.h defines its exp and tanh)
    ctypedef struct pkv_variant:    # the variant's scalars (PKV_VARIANT_FIELDS)
        float soft_cap
        int has_sinks
        int has_bias
    ctypedef struct pkv_band:   # the C struct may have more fields; Cython reads none
        int64_t lo
        int64_t hi
    pkv_band PKV_ITEM_BAND(const int32_t* item)
    int64_t pkv_band_lo(pkv_band band, int row)
    int64_t pkv_band_hi(pkv_band band, int row)
    int64_t pkv_band_position(pkv_band band, int row)
    float pkv_part_weight(float part_max, float m)
    float pkv_output_scale(float m, float sum, float sink)
    float pkv_log_sum(float m, float sum)

cdef extern from "pkv_simd.h" nogil:
    ctypedef struct pkv_prefetch:
        pass
    pkv_prefetch pkv_prefetch_range(const void* start, long nbytes)
    void pkv_prefetch_rest(pkv_prefetch* pf)
    void pkv_scores_f32(const float* q, int nq, const float* k, int nt, int n,
                        float* scores, int ld, pkv_prefetch* pf, int queries)
    void pkv_scores_f16(const float* q, int nq, const uint16_t* k, int nt, int n,
                        float* scores, int ld, pkv_prefetch* pf, int queries)
    void pkv_scores_i8(const float* q, int nq, const int8_t* k, int nt, int n,
                       float* scores, int ld, pkv_prefetch* pf, int queries)
    void pkv_scores_bf16(const float* q, int nq, const int16_t* k, int nt, int n,
                         float* scores, int ld, pkv_prefetch* pf, int queries)
    void pkv_accumulate_f32(float* acc, const float* alpha, const float* p, int ld,
                            const float* x, int nt, int n, pkv_prefetch* pf, int queries)
    void pkv_accumulate_f16(float* acc, const float* alpha, const float* p, int ld,
                            const uint16_t* x, int nt, int n, pkv_prefetch* pf, int queries)
    void pkv_accumulate_i8(float* acc, const float* alpha, const float* p, int ld,
                           const int8_t* x, int nt, int n, pkv_prefetch* pf, int queries)
    void pkv_accumulate_bf16(float* acc, const float* alpha, const float* p, int ld,
                             const int16_t* x, int nt, int n, pkv_prefetch* pf, int queries)
    float pkv_bf16_to_float(uint16_t bits)
    uint16_t pkv_float_to_bf16(float x)
    void pkv_softmax_page(float* s, int ld, int nq, int nq_padded, int nt, pkv_band band,
                          int64_t first_key, int group, float soft_cap, const float* slopes,
                          float* run_max, float* run_sum, float* alpha)

cdef extern from "pkv_block.h" nogil:
    enum:
        PKV_BLOCK_KEYS, PKV_BLOCK_MIN_QUERIES
    ctypedef struct pkv_block_prefetch:
        const void* const* rows
        int num_rows
        long row_bytes
    int pkv_block_queries(int nq)
    int pkv_block_stride(int n)
    void pkv_block_scores(const float* qt, int ld, int nqp, const float* const* krows, int nt,
                          int n, float* s, const pkv_block_prefetch* pf)
    void pkv_block_softmax(float* s, int ld, int nqp, int nt, int nq, const int32_t* lo,
                           const int32_t* hi, float soft_cap, const float* slope,
                           const int32_t* dist, float* run_max, float* run_sum,
                           float* alpha, float* tmp)
    void pkv_block_accumulate(float* acc, int ld, int nqp, int nq, const float* alpha,
                              const float* p, const float* v, int vs, const int32_t* lo,
                              const int32_t* hi, int nt, int n, const pkv_block_prefetch* pf)
    void pkv_block_rows(const void* x, int kind, int nrows, int n, const float* scales,
                        float* out, int stride)

cdef extern from "pkv_storage.h" nogil:
    enum:
        PKV_STORAGE_FLOAT32, PKV_STORAGE_FLOAT16, PKV_STORAGE_INT8, PKV_STORAGE_BFLOAT16

cdef extern from "pkv_quant.h" nogil:
    void pkv_rotate(float* x, int n, int block, float scale)
    float pkv_quantize(const float* x, int n, int block, float scale, int8_t* q, float* tmp)
    void pkv_dequantize(const int8_t* q, float s, int n, int block, float scale, float* out)

cdef extern from "pkv_work_item.h" nogil:
    enum:
        PKV_W_SEQ, PKV_W_KV_HEAD, PKV_W_ROW0, PKV_W_ROW1, PKV_W_KEY0, PKV_W_KEY1,
        PKV_W_BAND_LO, PKV_W_BAND_HI, PKV_W_PART, PKV_W_FIELDS

# The pools' element types, one per format: float16 bits are uint16_t and
# bfloat16 bits int16_t, so that each has its own specialisation (the bits are
# the same either way; only the type tells the formats apart).
ctypedef fused storage_t:
    float
    uint16_t
    int8_t
    int16_t


cdef inline float load(storage_t x) noexcept nogil:
    """A float format's element as float (int8 rows go through pkv_dequantize)."""
    if storage_t is float:
        return x
    elif storage_t is uint16_t:
        return pkv_half_to_float(x)
    elif storage_t is int16_t:
        return pkv_bf16_to_float(<uint16_t>x)
    else:
        return x


cdef inline void page_scores(const float* q, int nq, const storage_t* k, int nt, int n,
                             float* out, int ld, pkv_prefetch* pf, int queries) noexcept nogil:
    """out[qi * ld + t] = q[qi] . k[t]; nq a multiple of ``queries`` (1 or 4)."""
    if storage_t is float:
        pkv_scores_f32(q, nq, k, nt, n, out, ld, pf, queries)
    elif storage_t is uint16_t:
        pkv_scores_f16(q, nq, k, nt, n, out, ld, pf, queries)
    elif storage_t is int16_t:
        pkv_scores_bf16(q, nq, k, nt, n, out, ld, pf, queries)
    else:
        pkv_scores_i8(q, nq, k, nt, n, out, ld, pf, queries)


cdef inline void page_accumulate(float* acc, const float* alpha, const float* p, int ld,
                                 const storage_t* x, int nt, int n, pkv_prefetch* pf,
                                 int queries) noexcept nogil:
    """acc = alpha * acc + p x for ``queries`` (1 or 4) queries."""
    if storage_t is float:
        pkv_accumulate_f32(acc, alpha, p, ld, x, nt, n, pf, queries)
    elif storage_t is uint16_t:
        pkv_accumulate_f16(acc, alpha, p, ld, x, nt, n, pf, queries)
    elif storage_t is int16_t:
        pkv_accumulate_bf16(acc, alpha, p, ld, x, nt, n, pf, queries)
    else:
        pkv_accumulate_i8(acc, alpha, p, ld, x, nt, n, pf, queries)


cdef inline void page_accumulate_band(float* acc, const float* alpha, const float* p, int ld,
                                      const storage_t* x, int nt, int n, pkv_prefetch* pf,
                                      int q0, int tile, int nq, int group, pkv_band band,
                                      int64_t first_key) noexcept nogil:
    """``page_accumulate`` for the tile of queries ``q0 : q0 + tile`` of a page, each
    over the keys of its band only (``pkv_softmax_page``'s bands: the keys of the
    page start at position ``first_key``; queries past ``nq`` are padding, with
    any result).

    A weight outside a band is zero, but zero times a NaN or inf value is NaN:
    the keys every real query of the tile sees go through the tile at once,
    and each query's other keys alone, so that no masked row is read.
    ``acc`` [*, n], ``alpha`` [*] and ``p`` [*, ld] are the whole page's."""
    cdef int qi, last = min(q0 + tile, nq)
    cdef int64_t lo, hi, all_lo = 0, all_hi = nt
    cdef float one = 1.0
    for qi in range(q0, last):
        all_lo = max(all_lo, pkv_band_lo(band, qi // group) - first_key)
        all_hi = min(all_hi, pkv_band_hi(band, qi // group) - first_key)
    if all_hi <= all_lo:
        all_lo = 0      # no key all of them see: each query goes alone
        all_hi = 0
    # the shared keys, and the rescale of every query of the tile
    page_accumulate(acc + q0 * n, alpha + q0, p + q0 * ld + all_lo, ld, x + all_lo * n,
                    <int>(all_hi - all_lo), n, pf, tile)
    for qi in range(q0, last):
        lo = max(pkv_band_lo(band, qi // group) - first_key, 0)
        hi = min(pkv_band_hi(band, qi // group) - first_key, nt)
        if hi <= lo:
            continue
        if lo < all_lo:
            page_accumulate(acc + qi * n, &one, p + qi * ld + lo, ld, x + lo * n,
                            <int>(min(hi, all_lo) - lo), n, pf, 1)
        if all_hi < hi:
            lo = max(lo, all_hi)
            page_accumulate(acc + qi * n, &one, p + qi * ld + lo, ld, x + lo * n,
                            <int>(hi - lo), n, pf, 1)


cdef inline void rotate_query(float* x, int D, int rotation_block, float rotation_scale,
                              storage_t* dummy) noexcept nogil:
    """A query row (``D`` floats, in place) into the stored rows' basis: int8 rows
    are rotated (so that q.k is unchanged), the float formats' are not."""
    if storage_t is int8_t:
        pkv_rotate(x, D, rotation_block, rotation_scale)


cdef inline void times_row_scales(float* scores, int ld, int nq, int nt,
                                  const float[:, :, ::1] scales, int page, int h, int t0,
                                  storage_t* dummy) noexcept nogil:
    """``scores[qi * ld + t]`` (qi < nq, t < nt) times the scale of row ``t0 + t`` of
    (page, h): int8 logits take their key's scale, weights their value's; the
    float formats' rows have none."""
    cdef const float* row_scales
    cdef int qi, t
    if storage_t is int8_t:
        row_scales = &scales[page, h, t0]
        for qi in range(nq):
            for t in range(nt):
                scores[qi * ld + t] = scores[qi * ld + t] * row_scales[t]


# -- rows: store and load, scatter and gather (_kernels_rows.pxi) --------------------
include "_kernels_rows.pxi"


# -- paged attention ----------------------------------------------------------------
#
# A work item (its columns: pkv_work_item.h) is one (sequence, run of KV
# heads, block of query rows, key range).  It goes by spans of consecutive
# pages (SPAN_KEYS keys; one page when pages are larger): the K slices of the
# span page by page and head by head, one online-softmax step per head (a
# running max and sum per query over the keys of each row's band), then the V
# slices in the same order.  Each K/V slice is read once, straight from the
# pool, for all query rows and all query heads of the KV group (GQA), and the
# item leaves an unnormalised partial result.  While it computes on one slice
# (a page of one head) it prefetches the slice about 32 KiB later in its own
# reading order (see pkv_simd.h), so that reading memory and computing
# overlap.  Long key ranges are split over several items so that one long
# sequence still fills every core (split-K, as in FlashDecoding / vLLM v2);
# `merge_partials` combines the items of a query block by log-sum-exp, adds
# the sinks and normalises.


def aligned_empty(Py_ssize_t n):
    """An uninitialised float32 array of ``n`` values that starts on a 64-byte boundary."""
    buf = np.empty(n + 16, dtype=np.float32)
    cdef Py_ssize_t skip = (-buf.ctypes.data % 64) // 4
    return buf[skip:skip + n]


# Bytes of each pool the page path prefetches ahead of what it reads.
cdef enum:
    PREFETCH_AHEAD_BYTES = 32768
    # Keys of consecutive pages whose logits take one softmax step in the page path.
    SPAN_KEYS = 128

#: Queries per KV head from which a work item takes the block path (pkv_block.h).
BLOCK_MIN_QUERIES = PKV_BLOCK_MIN_QUERIES
#: Keys per softmax step of the page path: it reads ``max(1, SPAN_KEYS // page_size)``
#: pages of K, then the same pages of V (what benchmarks/_common.PagedRead mirrors).
SPAN_KEYS_PER_STEP = SPAN_KEYS


cdef struct AttentionParams:
    # The scalars of one paged_attention call, filled by name (a dict whose keys
    # are these fields; pagedkv.backends.host) and passed down as one block.
    int heads_per_item          # KV heads per work item (its KV_HEAD is the first)
    int max_rows_per_item       # the most query rows of any item
    float scale                 # the logits' scale, folded into the queries
    pkv_variant variant         # the variant's scalars, as the OpenCL kernels take them
    int rotation_block          # int8: the Hadamard block of the rows (0: none)
    float rotation_scale        # 1 / sqrt(rotation_block)
    int num_threads             # OpenMP threads (ignored in a build without OpenMP)


cdef inline int padded_queries(int nq) noexcept nogil:
    return (nq + 3) // 4 * 4


cdef void attend_item(const float[:, :, ::1] q,
                      storage_t[:, :, :, ::1] k_pool, storage_t[:, :, :, ::1] v_pool,
                      const float[:, :, ::1] k_scales, const float[:, :, ::1] v_scales,
                      const int32_t[::1] page_indptr, const int32_t[::1] page_indices,
                      const int32_t* item, const AttentionParams* params,
                      const float* bias_slopes,
                      float* acc, float* run_max, float* run_sum, float* scratch,
                      const void** rows) noexcept nogil:
    """One work item over KV heads ``h0 : h0 + heads_per_item`` (``params``).

    ``bias_slopes`` [num_heads] (NULL: none): query head h's logit of the key
    at position j gains ``pkv_bias(bias_slopes[h], j - p)`` after the soft cap.

    Leaves unnormalised ``acc`` [heads_per_item * nq4, Dv] (Dv: the V rows' width) and ``run_max``,
    ``run_sum`` [heads_per_item * nq4], head-major, where nq = rows * group
    queries per head are padded to nq4, a multiple of 4, with zero queries:
    the vector primitives then work on four queries at once (a lone query,
    nq = 1, in tiles of one: its padding is never computed).
    ``scratch`` holds ``scratch_floats`` floats and ``rows`` 2 * PKV_BLOCK_KEYS
    pointers.  Items of PKV_BLOCK_MIN_QUERIES queries per head or more take
    the block path (``attend_item_blocks``); the others go page by page.
    int8: the queries are rotated like the stored rows (so q.k is unchanged),
    the logits take each key's scale and the weights each value's scale.
    """
    cdef int b = item[PKV_W_SEQ], h0 = item[PKV_W_KV_HEAD]
    cdef int row0 = item[PKV_W_ROW0], row1 = item[PKV_W_ROW1]
    cdef int key0 = item[PKV_W_KEY0], key1 = item[PKV_W_KEY1]
    cdef pkv_band band = PKV_ITEM_BAND(item)
    cdef int heads_per_item = params.heads_per_item, rotation_block = params.rotation_block
    cdef float scale = params.scale, soft_cap = params.variant.soft_cap
    cdef float rotation_scale = params.rotation_scale
    # keys (and queries) are D wide, values Dv (the V pool's own width:
    # v_head_dim, which a separate layout may set apart from head_dim)
    cdef int D = q.shape[2], Dv = v_pool.shape[3], ps = k_pool.shape[2]
    cdef int group = q.shape[1] // k_pool.shape[1]
    cdef int nq = (row1 - row0) * group
    cdef int nq4 = padded_queries(nq)
    # a lone query (decode without GQA) in tiles of one, not padded to four
    cdef int tile = 1 if nq == 1 else 4
    cdef int tiled = 1 if nq == 1 else nq4
    cdef int qi, x, hh, d, j, j0, t0, t1, nt, page
    cdef storage_t* dummy = NULL
    cdef int last_page = (key1 + ps - 1) // ps
    cdef float* queries = scratch                            # [heads, nq4, D], pre-scaled
    # A span of pages shares one softmax step: with small pages the per-page
    # softmax, rescale and accumulator pass, not the multiply-adds, bound decode.
    cdef int span = max(1, SPAN_KEYS // ps)
    cdef int ld = span * ps, span_pages, column
    cdef int64_t span_key0
    cdef float* scores = queries + heads_per_item * nq4 * D  # [heads, nq4, ld]
    cdef float* alphas = scores + heads_per_item * nq4 * ld  # [heads, nq4]
    cdef float* ones = alphas + heads_per_item * nq4         # [nq4]
    cdef long slice_bytes = ps * D * sizeof(storage_t)
    # Prefetch distance, in slices (one head of one page of one pool): a
    # fixed number of bytes, not a page of every head, which at page 128
    # (1 MiB of K and V for 8 heads) was evicted before it was read
    # (docs/performance.md, "Against vLLM CPU").
    cdef int ahead = <int>((PREFETCH_AHEAD_BYTES + slice_bytes - 1) // slice_bytes)
    cdef pkv_prefetch next_slice
    cdef const float* qv
    cdef float* head_scores

    if nq >= PKV_BLOCK_MIN_QUERIES:
        attend_item_blocks(q, k_pool, v_pool, k_scales, v_scales, page_indptr, page_indices,
                           item, params, bias_slopes, acc, run_max, run_sum, scratch, rows)
        return

    for x in range(heads_per_item * nq4):
        run_max[x] = -INFINITY
        run_sum[x] = 0.0
        qi = x % nq4
        for d in range(Dv):
            acc[x * Dv + d] = 0.0
        for d in range(D):
            queries[x * D + d] = 0.0
        if qi < nq:
            qv = &q[row0 + qi // group, (h0 + x // nq4) * group + qi % group, 0]
            for d in range(D):
                queries[x * D + d] = qv[d] * scale
            rotate_query(queries + x * D, D, rotation_block, rotation_scale, dummy)

    for x in range(nq4):
        ones[x] = 1.0
    j0 = key0 // ps
    while j0 < last_page:
        span_pages = min(span, last_page - j0)
        span_key0 = max(key0, j0 * ps)
        nt = min(key1, (j0 + span_pages) * ps) - span_key0
        # logits of the span's keys, page by page and head by head (the pool's
        # order), into one row per query and head
        for j in range(j0, j0 + span_pages):
            page = page_indices[page_indptr[b] + j]
            page_keys(j, ps, key0, key1, span_key0, &t0, &t1, &column)
            for hh in range(heads_per_item):
                head_scores = scores + hh * nq4 * ld
                next_slice = slice_ahead(k_pool, v_pool, page_indices, page_indptr[b], h0, j0,
                                         span, last_page, heads_per_item, 0, j, hh, ahead)
                page_scores(queries + hh * nq4 * D, tiled, &k_pool[page, h0 + hh, t0, 0],
                            t1 - t0, D, head_scores + column, ld, &next_slice, tile)
                times_row_scales(head_scores + column, ld, nq, t1 - t0, k_scales, page,
                                 h0 + hh, t0, dummy)
                pkv_prefetch_rest(&next_slice)   # what a short page left
        # online softmax, one step a span: logits become weights, zero outside
        # each row's band, and alphas rescale the accumulators
        for hh in range(heads_per_item):
            pkv_softmax_page(scores + hh * nq4 * ld, ld, nq, nq4, nt, band, span_key0, group,
                             soft_cap,
                             bias_slopes + (h0 + hh) * group if bias_slopes != NULL else NULL,
                             run_max + hh * nq4, run_sum + hh * nq4, alphas + hh * nq4)
        # the weighted sum of the values, in the same order
        for j in range(j0, j0 + span_pages):
            page = page_indices[page_indptr[b] + j]
            page_keys(j, ps, key0, key1, span_key0, &t0, &t1, &column)
            for hh in range(heads_per_item):
                head_scores = scores + hh * nq4 * ld
                times_row_scales(head_scores + column, ld, nq, t1 - t0, v_scales, page,
                                 h0 + hh, t0, dummy)
                next_slice = slice_ahead(k_pool, v_pool, page_indices, page_indptr[b], h0, j0,
                                         span, last_page, heads_per_item, 1, j, hh, ahead)
                for x in range(tiled // tile):
                    page_accumulate_band(acc + hh * nq4 * Dv,
                                         alphas + hh * nq4 if j == j0 else ones,
                                         head_scores + column, ld,
                                         &v_pool[page, h0 + hh, t0, 0], t1 - t0, Dv,
                                         &next_slice, x * tile, tile, nq, group, band,
                                         <int64_t>j * ps + t0)
                pkv_prefetch_rest(&next_slice)
        j0 += span


cdef inline void page_keys(int j, int ps, int key0, int key1, int64_t span_key0, int* t0,
                           int* t1, int* column) noexcept nogil:
    """The keys ``t0 : t1`` of page ``j`` in the item's range ``key0 : key1``, and the
    column of key ``t0`` in the rows of logits of a span that starts at key
    position ``span_key0``."""
    t0[0] = max(key0, j * ps) - j * ps
    t1[0] = min(key1, (j + 1) * ps) - j * ps
    column[0] = <int>(j * ps + t0[0] - span_key0)


cdef inline pkv_prefetch slice_ahead(storage_t[:, :, :, ::1] k_pool,
                                     storage_t[:, :, :, ::1] v_pool,
                                     const int32_t[::1] page_indices, int first_index, int h0,
                                     int j0, int span, int last_page, int heads, int pool,
                                     int j, int hh, int ahead) noexcept nogil:
    """The slice (one head of one page of K or V) ``ahead`` slices after head ``hh``
    of page ``j`` of pool ``pool`` (0: K, 1: V) in the page path's reading order:
    span by span (``span`` pages from ``j0``; the item's last span may be
    shorter), in each the K slices, then the V slices, page by page and head by
    head; empty past the item's last page."""
    cdef int span_pages = min(span, last_page - j0)
    cdef int slices = span_pages * heads
    cdef int index = pool * slices + (j - j0) * heads + hh + ahead
    if index >= 2 * slices:     # in the next span
        index -= 2 * slices
        j0 += span
        span_pages = min(span, last_page - j0)
        slices = span_pages * heads
        if span_pages <= 0 or index >= 2 * slices:
            return pkv_prefetch_range(NULL, 0)
    cdef int page = page_indices[first_index + j0 + index % slices // heads]
    cdef int h = h0 + index % slices % heads
    if index < slices:
        return pkv_prefetch_range(&k_pool[page, h, 0, 0],
                                  k_pool.shape[2] * k_pool.shape[3] * sizeof(storage_t))
    return pkv_prefetch_range(&v_pool[page, h, 0, 0],
                              v_pool.shape[2] * v_pool.shape[3] * sizeof(storage_t))


cdef inline int storage_kind(storage_t* dummy) noexcept nogil:
    if storage_t is float:
        return PKV_STORAGE_FLOAT32
    elif storage_t is uint16_t:
        return PKV_STORAGE_FLOAT16
    elif storage_t is int16_t:
        return PKV_STORAGE_BFLOAT16
    else:
        return PKV_STORAGE_INT8


cdef inline Py_ssize_t scratch_floats(int nq_max, int heads_per_item, int D, int Dv,
                                      int ps) noexcept nogil:
    """Floats of one thread's scratch for items of up to ``nq_max`` queries per head
    (keys ``D`` wide, values ``Dv``)."""
    cdef int nq4 = padded_queries(nq_max)
    cdef int nqp = pkv_block_queries(nq_max), ld = pkv_block_stride(nqp)
    cdef Py_ssize_t pages = (heads_per_item * nq4 * (D + max(SPAN_KEYS // ps, 1) * ps + 1)
                             + nq4)
    # qt, acc, s (ld floats a row), the softmax's five arrays, lo/hi and the
    # bias's slope/dist (nqp each), the block's K and V rows, and a query row
    cdef Py_ssize_t blocks = ((D + Dv + PKV_BLOCK_KEYS) * ld + 9 * nqp
                              + PKV_BLOCK_KEYS * (pkv_block_stride(D) + pkv_block_stride(Dv))
                              + D)
    return max(pages, blocks) if nq_max >= PKV_BLOCK_MIN_QUERIES else pages


cdef void block_rows(storage_t[:, :, :, ::1] pool, const float[:, :, ::1] scales,
                     const int32_t* pages, int h, int64_t key0, int nt, const void** raw,
                     float* out, const float** rows) noexcept nogil:
    """Keys ``key0 + t`` (t < nt) of KV head ``h``: ``raw[t]`` = the row in the pool
    (unless ``raw`` is NULL), and, unless ``out`` is NULL, the rows as float32 in
    ``out`` [nt, pkv_block_stride(D)] (int8: times the row scales)."""
    cdef int D = pool.shape[3], ps = pool.shape[2], t = 0, nrun, off, x
    cdef int stride = pkv_block_stride(D)
    cdef int32_t page
    cdef storage_t* dummy = NULL
    while t < nt:
        page = pages[(key0 + t) // ps]
        off = (key0 + t) % ps
        nrun = min(ps - off, nt - t)
        if raw != NULL:
            for x in range(nrun):
                raw[t + x] = &pool[page, h, off + x, 0]
        if out != NULL and rows != NULL:
            for x in range(nrun):
                rows[t + x] = <const float*>raw[t + x] if storage_t is float else out + (t + x) * stride
        if out != NULL and (rows == NULL or storage_t is not float):
            pkv_block_rows(&pool[page, h, off, 0], storage_kind(dummy), nrun, D,
                           &scales[page, h, off] if storage_t is int8_t else NULL,
                           out + t * stride, stride)
        t = t + nrun


cdef void attend_item_blocks(const float[:, :, ::1] q,
                             storage_t[:, :, :, ::1] k_pool, storage_t[:, :, :, ::1] v_pool,
                             const float[:, :, ::1] k_scales, const float[:, :, ::1] v_scales,
                             const int32_t[::1] page_indptr, const int32_t[::1] page_indices,
                             const int32_t* item, const AttentionParams* params,
                             const float* bias_slopes,
                             float* acc, float* run_max, float* run_sum, float* scratch,
                             const void** rows) noexcept nogil:
    """``attend_item`` for items of many queries: keys by blocks of PKV_BLOCK_KEYS.

    Per KV head: the queries transposed and scaled (int8: rotated), then per
    block the keys copied out of the pool, the scores, the values copied
    out, one online-softmax step and the weighted sum of the values
    (``pkv_block.h``), into transposed accumulators copied out at the end.
    The scores prefetch the block's values, the weighted sum the next
    block's keys.  Leaves what ``attend_item`` leaves.
    """
    cdef int b = item[PKV_W_SEQ], h0 = item[PKV_W_KV_HEAD]
    cdef int row0 = item[PKV_W_ROW0], row1 = item[PKV_W_ROW1]
    cdef int key0 = item[PKV_W_KEY0], key1 = item[PKV_W_KEY1]
    cdef pkv_band band = PKV_ITEM_BAND(item)
    cdef int heads_per_item = params.heads_per_item, rotation_block = params.rotation_block
    cdef float scale = params.scale, soft_cap = params.variant.soft_cap
    cdef float rotation_scale = params.rotation_scale
    cdef int D = q.shape[2], Dv = v_pool.shape[3], group = q.shape[1] // k_pool.shape[1]
    cdef storage_t* dummy = NULL
    cdef int nq = (row1 - row0) * group
    cdef int nq4 = padded_queries(nq), nqp = pkv_block_queries(nq)
    cdef int ld = pkv_block_stride(nqp), ks = pkv_block_stride(D), vs = pkv_block_stride(Dv)
    cdef int qi, x, hh, d, nt, next_nt, next_head, blk0, next0
    cdef int64_t lo, hi
    cdef const int32_t* pages = &page_indices[page_indptr[b]]
    cdef float* qt = scratch                          # [D, ld]
    cdef float* acc_t = qt + D * ld                   # [Dv, ld]
    cdef float* s = acc_t + Dv * ld                   # [PKV_BLOCK_KEYS, ld]
    cdef float* m = s + PKV_BLOCK_KEYS * ld           # [nqp] running max
    cdef float* l = m + nqp                           # [nqp] running sum
    cdef float* alpha = l + nqp                       # [nqp]
    cdef float* tmp = alpha + nqp                     # [2 * nqp]
    cdef int32_t* lo_t = <int32_t*>(tmp + 2 * nqp)    # [nqp] band within the block
    cdef int32_t* hi_t = lo_t + nqp                   # [nqp]
    cdef float* slope_t = <float*>(hi_t + nqp)        # [nqp] bias slope of each query
    cdef int32_t* dist_t = <int32_t*>(slope_t + nqp)  # [nqp] block start - query position
    cdef float* k_buf = <float*>(dist_t + nqp)        # [PKV_BLOCK_KEYS, ks]
    cdef float* v_buf = k_buf + PKV_BLOCK_KEYS * ks   # [PKV_BLOCK_KEYS, vs]
    cdef float* q_row = v_buf + PKV_BLOCK_KEYS * vs   # [D]
    # pool rows to prefetch: this block's values, the next block's keys
    cdef const void** v_rows = rows
    cdef const void** k_next = rows + PKV_BLOCK_KEYS
    cdef const void** k_raw = rows + 2 * PKV_BLOCK_KEYS
    cdef const float** krows = <const float**>(rows + 3 * PKV_BLOCK_KEYS)
    cdef pkv_block_prefetch during_scores, during_sum
    cdef long row_bytes = D * sizeof(storage_t), v_row_bytes = Dv * sizeof(storage_t)
    cdef const float* qv
    cdef float* head_acc

    for hh in range(heads_per_item):
        head_acc = acc + hh * nq4 * Dv
        for qi in range(nqp):
            if qi < nq:
                qv = &q[row0 + qi // group, (h0 + hh) * group + qi % group, 0]
                for d in range(D):
                    q_row[d] = qv[d] * scale
                rotate_query(q_row, D, rotation_block, rotation_scale, dummy)
                for d in range(D):
                    qt[d * ld + qi] = q_row[d]
            else:
                for d in range(D):
                    qt[d * ld + qi] = 0.0
            m[qi] = -INFINITY
            l[qi] = 0.0
            slope_t[qi] = 0.0
            dist_t[qi] = 0
            if bias_slopes != NULL and qi < nq:
                slope_t[qi] = bias_slopes[(h0 + hh) * group + qi % group]
        for d in range(Dv):
            for qi in range(nqp):
                acc_t[d * ld + qi] = 0.0

        blk0 = key0
        while blk0 < key1:
            nt = min(PKV_BLOCK_KEYS, key1 - blk0)
            # the block after this one: of this head, else the next head's first
            next0 = blk0 + nt
            next_head = h0 + hh
            if next0 >= key1:
                next0 = key0
                next_head = next_head + 1 if hh + 1 < heads_per_item else -1
            next_nt = min(PKV_BLOCK_KEYS, key1 - next0) if next_head >= 0 else 0
            block_rows(k_pool, k_scales, pages, h0 + hh, blk0, nt, k_raw, k_buf, krows)
            block_rows(v_pool, v_scales, pages, h0 + hh, blk0, nt, v_rows, NULL, NULL)
            block_rows(k_pool, k_scales, pages, next_head, next0, next_nt, k_next, NULL, NULL)
            during_scores = pkv_block_prefetch(v_rows, nt, v_row_bytes)
            during_sum = pkv_block_prefetch(k_next, next_nt, row_bytes)
            # the band of each query (row r's queries: r * group : (r + 1) * group)
            for x in range(row1 - row0):
                lo = min(max(pkv_band_lo(band, x) - blk0, 0), nt)
                hi = min(max(pkv_band_hi(band, x) - blk0, lo), nt)
                for qi in range(x * group, (x + 1) * group):
                    lo_t[qi] = <int32_t>lo
                    hi_t[qi] = <int32_t>hi
                    dist_t[qi] = <int32_t>(blk0 - pkv_band_position(band, x))
            for qi in range(nq, nqp):
                lo_t[qi] = 0
                hi_t[qi] = 0
            pkv_block_scores(qt, ld, nqp, krows, nt, D, s, &during_scores)
            block_rows(v_pool, v_scales, pages, h0 + hh, blk0, nt, NULL, v_buf, NULL)
            pkv_block_softmax(s, ld, nqp, nt, nq, lo_t, hi_t, soft_cap,
                              slope_t if bias_slopes != NULL else NULL, dist_t, m, l, alpha,
                              tmp)
            pkv_block_accumulate(acc_t, ld, nqp, nq, alpha, s, v_buf, vs, lo_t, hi_t, nt, Dv,
                                 &during_sum)
            blk0 = blk0 + nt

        for qi in range(nq4):
            for d in range(Dv):
                head_acc[qi * Dv + d] = acc_t[d * ld + qi] if qi < nq else 0.0
            run_max[hh * nq4 + qi] = m[qi] if qi < nq else -INFINITY
            run_sum[hh * nq4 + qi] = l[qi] if qi < nq else 0.0

def paged_attention(const float[:, :, ::1] q,
                    storage_t[:, :, :, ::1] k_pool, storage_t[:, :, :, ::1] v_pool,
                    const float[:, :, ::1] k_scales, const float[:, :, ::1] v_scales,
                    const int32_t[::1] page_indptr, const int32_t[::1] page_indices,
                    const int32_t[:, ::1] items, const int32_t[::1] item_offsets,
                    const float[::1] sinks, float[:, :, ::1] out, AttentionParams params,
                    const float[::1] bias_slopes=None, float[:, ::1] lse=None):
    """Paged attention of a ragged batch over planned work items; see ``pagedkv.backends.host``.

    Parameters
    ----------
    q : float32 [T, num_heads, D]
    k_pool : [num_pages, num_kv_heads, page_size, D], float32, float16 bits, bfloat16 bits or int8
    v_pool : [num_pages, num_kv_heads, page_size, Dv], the same type (Dv: v_head_dim)
    k_scales, v_scales : float32 [num_pages, num_kv_heads, page_size] (int8), else placeholders
    page_indptr : int32 [B + 1]
    page_indices : int32 [nnz]
        CSR page table of the step's sequences.
    items : int32 [num_items, PKV_W_FIELDS]
        The work items (pkv_work_item.h); an item covers KV heads
        ``KV_HEAD : KV_HEAD + params["heads_per_item"]``.
    item_offsets : int32 [M + 1]
        Query block ``m`` owns items ``item_offsets[m]:item_offsets[m+1]``
        (more than one when its key range is split).
    sinks : float32 [num_heads] or None
        Read with ``params["variant"]["has_sinks"]``.
    out : float32 [T, num_heads, Dv]
    bias_slopes : float32 [num_heads] or None
        With ``params["variant"]["has_bias"]``: per query head, the slope of
        ``pkv_bias`` (``opencl/pkv_variant.h``): the logit of the key at
        position j for the query at position p gains ``bias_slopes[h] * (j -
        p)`` after the soft cap.
    lse : float32 [T, num_heads] or None
        Receives each query's log-sum-exp of its logits (-inf: it saw no key).
    params : dict
        The fields of ``AttentionParams`` (above), each by name: the
        scale, the variant's scalars (``variant``: a dict of ``pkv_variant``'s
        fields, ``kernel_source.variant_scalars``), the int8 rotation
        (``rotation_block``: the queries are rotated like the stored rows,
        the output back), the plan's ``heads_per_item`` and
        ``max_rows_per_item``, and ``num_threads``.
    """
    cdef int heads_per_item = params.heads_per_item, num_threads = params.num_threads
    cdef int max_rows_per_item = params.max_rows_per_item
    cdef Py_ssize_t W = items.shape[0], M = item_offsets.shape[0] - 1
    cdef int D = q.shape[2], Dv = v_pool.shape[3], ps = k_pool.shape[2]
    cdef int group = q.shape[1] // k_pool.shape[1]
    cdef int nq_max = padded_queries(max_rows_per_item * group)
    cdef Py_ssize_t part_queries = heads_per_item * nq_max, num_parts = 0, w, m
    if W == 0:
        return
    for w in range(W):
        num_parts = max(num_parts, items[w, PKV_W_PART] + 1)
    # partial results: of the split items, by slot (PART); an item that covers
    # its rows' keys alone leaves its own in its thread's row and writes the
    # output itself
    acc_buf = np.empty((num_parts + num_threads, part_queries, Dv), dtype=np.float32)
    max_buf = np.empty((num_parts + num_threads, part_queries), dtype=np.float32)
    sum_buf = np.empty((num_parts + num_threads, part_queries), dtype=np.float32)
    cdef float[:, :, ::1] acc = acc_buf
    cdef float[:, ::1] run_max = max_buf, run_sum = sum_buf
    # one scratch row per thread: scaled queries, scores and softmax rescales
    # (and, on the block path, K/V row pointers), in whole cache lines from a
    # cache-line boundary, so that the block path's rows are whole lines
    cdef Py_ssize_t row_floats = (scratch_floats(max_rows_per_item * group, heads_per_item,
                                                 D, Dv, ps) + 15) // 16 * 16
    scratch_buf = aligned_empty(num_threads * row_floats).reshape(num_threads, row_floats)
    cdef float[:, ::1] scratch = scratch_buf
    rows_buf = np.empty((num_threads, 4 * PKV_BLOCK_KEYS), dtype=np.intp)
    cdef Py_ssize_t[:, ::1] rows = rows_buf
    if params.variant.has_sinks and (sinks is None or sinks.shape[0] < q.shape[1]) or \
            params.variant.has_bias and (bias_slopes is None or
                                         bias_slopes.shape[0] < q.shape[1]):
        raise ValueError(f"sinks, bias_slopes: expected [{q.shape[1]}] float32 each where "
                         f"params' variant has them")
    cdef const float* sink_ptr = &sinks[0] if params.variant.has_sinks else NULL
    cdef const float* slopes_ptr = &bias_slopes[0] if params.variant.has_bias else NULL
    cdef float* lse_ptr = &lse[0, 0] if lse is not None else NULL
    cdef Py_ssize_t slot, i
    with nogil:
        # last items first: those of a causal prefill's later rows, which see
        # the most keys, so that the short ones even out the threads at the end
        for i in prange(W, schedule="dynamic", num_threads=num_threads):
            w = W - 1 - i
            slot = items[w, PKV_W_PART]
            if slot < 0:
                slot = num_parts + threadid()
            attend_item(q, k_pool, v_pool, k_scales, v_scales, page_indptr, page_indices,
                        &items[w, 0], &params, slopes_ptr, &acc[slot, 0, 0], &run_max[slot, 0],
                        &run_sum[slot, 0], &scratch[threadid(), 0],
                        <const void**>&rows[threadid(), 0])
            if items[w, PKV_W_PART] < 0:
                merge_partials(&items[0, 0], w, w + 1, group, &params, sink_ptr,
                               &acc[slot, 0, 0], &run_max[slot, 0], &run_sum[slot, 0],
                               part_queries, Dv, out, lse_ptr)
        for m in prange(M, schedule="static", num_threads=num_threads):
            if items[item_offsets[m], PKV_W_PART] >= 0:
                merge_partials(&items[0, 0], item_offsets[m], item_offsets[m + 1], group,
                               &params, sink_ptr, &acc[0, 0, 0], &run_max[0, 0],
                               &run_sum[0, 0], part_queries, Dv, out, lse_ptr)


cdef void merge_partials(const int32_t* items, int first, int last, int group,
                         const AttentionParams* params, const float* sinks,
                         const float* acc, const float* run_max,
                         const float* run_sum, Py_ssize_t part_queries, int D,
                         float[:, :, ::1] out, float* lse) noexcept nogil:
    """Combine items ``first:last`` (one query block) into ``out``.

    Item ``w``'s partial results are those of slot ``max(PART, 0)``: ``acc``
    [slot, part_queries, D], ``run_max`` and ``run_sum`` [slot, part_queries]
    (an item that is not split passes its own as slot 0).  With ``sinks``
    (float32 [num_heads], else NULL), head ``h``'s denominator gains
    ``exp(sinks[h])`` (``pkv_output_scale`` of the variant contract).  With a
    ``rotation_block`` (int8 rows), the output is rotated back.  With ``lse``
    (float32 [T, num_heads], else NULL), each query's log-sum-exp goes there.
    """
    cdef int heads_per_item = params.heads_per_item
    cdef const int32_t* item = items + first * PKV_W_FIELDS
    cdef int h0 = item[PKV_W_KV_HEAD], row0 = item[PKV_W_ROW0], row1 = item[PKV_W_ROW1]
    cdef int nq = (row1 - row0) * group, nq4 = padded_queries(nq)
    cdef int x, qi, w, d, head
    cdef Py_ssize_t part
    cdef float m, total, weight, inv
    cdef float* dst
    cdef const float* src
    for x in range(heads_per_item * nq4):
        qi = x % nq4
        if qi >= nq:
            continue        # a padding query
        head = (h0 + x // nq4) * group + qi % group
        m = -INFINITY
        for w in range(first, last):
            part = max(items[w * PKV_W_FIELDS + PKV_W_PART], 0) * part_queries + x
            m = max(m, run_max[part])
        dst = &out[row0 + qi // group, head, 0]
        for d in range(D):
            dst[d] = 0.0
        total = 0.0
        for w in range(first, last):
            part = max(items[w * PKV_W_FIELDS + PKV_W_PART], 0) * part_queries + x
            weight = pkv_part_weight(run_max[part], m)
            total = total + run_sum[part] * weight
            src = acc + part * D
            for d in range(D):
                dst[d] = dst[d] + src[d] * weight
        inv = pkv_output_scale(m, total, sinks[head] if sinks != NULL else -INFINITY)
        if lse != NULL:
            lse[(row0 + qi // group) * out.shape[1] + head] = pkv_log_sum(m, total)
        for d in range(D):
            dst[d] = dst[d] * inv
        pkv_rotate(dst, D, params.rotation_block, params.rotation_scale)


include "_kernels_recurrent.pxi"
