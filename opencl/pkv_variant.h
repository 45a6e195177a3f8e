/* The attention variant contract: what the math of a variant changes, written
 * once for the host kernels (pagedkv/pkv_simd.h, pkv_block.h, _kernels.pyx)
 * and the OpenCL kernel (attention.cl), in C that is also OpenCL C.
 *
 *   band     which key positions a query row sees (pkv_band, pkv_band_lo/hi);
 *   logit    what becomes of a scaled logit x = scale * q.k before the
 *            softmax (pkv_logit: the soft cap; then pkv_bias: a bias of
 *            query head h that grows with the distance j - p of the key at
 *            position j from the query at position p, slope[h] * (j - p));
 *   softmax  one online-softmax update: running max, the factor that
 *            rescales what was accumulated, weights, running sum
 *            (pkv_max_step, pkv_rescale, pkv_weight);
 *   merge    parts of one query combined (split-K), and the output scale
 *            with a sink in the denominator (pkv_part_weight,
 *            pkv_output_scale);
 *   scalars  what a call of a variant takes besides its arrays, one struct
 *            (pkv_variant) that both backends' attention calls take.
 *
 * The kernels differ in how they lay out and walk scores (a page of keys per
 * query, a block of queries per key, a work-group's chunk), not in these.
 * Keys a query does not see never enter the softmax: their weight is
 * selected as 0, never computed from their logit.
 *
 * The band needs nothing (pkv_work_item.h includes it for the field list);
 * the rest is compiled where the includer has defined, before including this
 * file, a scalar e**x for x <= 0 (-inf: 0) as PKV_VARIANT_EXP and a float
 * tanh as PKV_VARIANT_TANH.  PKV_DEFINE_LOGIT instantiates pkv_logit for
 * vector types as well.
 */
#ifndef PKV_VARIANT_BAND_H
#define PKV_VARIANT_BAND_H

#ifdef __OPENCL_VERSION__
#define PKV_VARIANT_FN inline
typedef long pkv_pos;
#else
#include <math.h>
#include <stdint.h>
#define PKV_VARIANT_FN static inline
typedef int64_t pkv_pos;
#endif

/* -- band ----------------------------------------------------------------------
 * The band fields of a work item, which the planner
 * (pagedkv/backends/schedule.py) fills and pkv_work_item.h appends to the
 * item's columns (one line, X(NAME) per field, so that Python can read it):
 * row ROW0 + i of the item sits at position p = BAND_HI + i - 1 and sees the
 * key positions [BAND_LO + i, BAND_HI + i), and with BAND_CHUNK = C > 0
 * (attention_chunk_size) none before C * floor(p / C), its chunk's start.
 * The item's key range [KEY0, KEY1) covers the bands of all its rows. */
#define PKV_BAND_FIELDS(X) X(BAND_LO) X(BAND_HI) X(BAND_CHUNK)

typedef struct {
    pkv_pos lo, hi, chunk;
} pkv_band;

PKV_VARIANT_FN pkv_band pkv_make_band(pkv_pos lo, pkv_pos hi, pkv_pos chunk) {
    pkv_band band;
    band.lo = lo;
    band.hi = hi;
    band.chunk = chunk;
    return band;
}

/* The band of work item `item` (a pointer to its columns, any address space). */
#define PKV_ITEM_BAND(item) \
    pkv_make_band((item)[PKV_W_BAND_LO], (item)[PKV_W_BAND_HI], (item)[PKV_W_BAND_CHUNK])

/* The position of the item's row `row` (0 for ROW0). */
PKV_VARIANT_FN pkv_pos pkv_band_position(pkv_band band, int row) {
    return band.hi + row - 1;
}

/* The first key position row `row` sees (positions are >= 0, so that p % C
 * is p's offset in its chunk). */
PKV_VARIANT_FN pkv_pos pkv_band_lo(pkv_band band, int row) {
    const pkv_pos lo = band.lo + row;
    if (band.chunk <= 0) return lo;
    const pkv_pos p = band.hi + row - 1, start = p - p % band.chunk;
    return start > lo ? start : lo;
}

/* One past the last key position row `row` sees. */
PKV_VARIANT_FN pkv_pos pkv_band_hi(pkv_band band, int row) {
    return band.hi + row;
}

/* -- the variant's scalars -------------------------------------------------------
 * One struct, passed whole to the host's paged_attention (_kernels.pyx, in its
 * AttentionParams) and by value to attention.cl's kernels.  Python fills it by
 * field name from this list (pagedkv.backends.kernel_source.variant_scalars
 * reads it: X(type, name) per field).  Every field is 4 bytes, so its layout
 * is the same on the host and on any device. */
#define PKV_VARIANT_FIELDS(X) \
    X(float, soft_cap)    /* c of c * tanh(x / c); 0: none */ \
    X(int, has_sinks)     /* a sink logit per query head (the call's sinks array) */ \
    X(int, has_bias)      /* an ALiBi slope per query head (the call's bias_slopes) */

#define PKV_VARIANT_MEMBER(type, name) type name;
typedef struct {
    PKV_VARIANT_FIELDS(PKV_VARIANT_MEMBER)
} pkv_variant;
#undef PKV_VARIANT_MEMBER

#endif /* PKV_VARIANT_BAND_H */

/* The rest needs the includer's exp and tanh. */
#if defined(PKV_VARIANT_EXP) && defined(PKV_VARIANT_TANH) && !defined(PKV_VARIANT_MATH_H)
#define PKV_VARIANT_MATH_H

/* -- logit ---------------------------------------------------------------------
 * x = scale * q.k, the kernels folding scale into the queries before the
 * products: q.k may be past float32's range where scale * q.k is not.
 * cap > 0: cap * tanh(x / cap), inverse_cap = 1 / cap; cap 0: x. */
#define PKV_DEFINE_LOGIT(QUALIFIERS, name, T, TANH)                                    \
QUALIFIERS T name(T x, float cap, float inverse_cap) {                                \
    return cap > 0.0f ? cap * TANH(x * inverse_cap) : x;                              \
}
PKV_DEFINE_LOGIT(PKV_VARIANT_FN, pkv_logit, float, PKV_VARIANT_TANH)

/* After pkv_logit, query head h at position p adds pkv_bias(slope[h], j - p)
 * to the logit of the key at position j (each kernel takes the per-query-head
 * slopes, or none: no bias).  The distance is an int (positions are int32,
 * so j - p fits), made a float only to be multiplied, so that a long context
 * loses no precision before the product. */
PKV_VARIANT_FN float pkv_bias(float slope, int distance) {
    return slope * (float)distance;
}

/* -- online softmax ------------------------------------------------------------
 * Per query: running max m (-inf before its first visible key) and running
 * sum l of weights.  A step over some keys: m_new = the max of m and their
 * visible logits (pkv_max_step); what was accumulated is rescaled by
 * pkv_rescale(m, m_new); each key weighs pkv_weight(x, m_new, visible), 0
 * unless visible; l = l * rescale + the sum of the step's weights.
 *
 * PKV_DEFINE_SOFTMAX(QUALIFIERS, suffix, T, V, EXP) defines pkv_max_step and
 * pkv_weight (with `suffix` appended) for a float type T (float, or an
 * OpenCL vector) and a visibility V of its shape (int, or an int vector of
 * lane masks), given EXP(x), e**x for x <= 0, for T.  While m is -inf (no
 * finite visible logit yet) weights are taken against 0, since exp(-inf -
 * -inf) would be NaN. */
#define PKV_DEFINE_SOFTMAX(QUALIFIERS, suffix, T, V, EXP)                              \
QUALIFIERS T pkv_max_step##suffix(T m, T x, V visible) {                              \
    return visible && x > m ? x : m;                                                  \
}                                                                                     \
QUALIFIERS T pkv_weight##suffix(T x, T m, V visible) {                                \
    return visible ? EXP(x - (m == -INFINITY ? (T)(0.0f) : m)) : (T)(0.0f);           \
}
PKV_DEFINE_SOFTMAX(PKV_VARIANT_FN, , float, int, PKV_VARIANT_EXP)

/* exp(m_old - m_new), and 1 while the query has seen no key (m_new -inf:
 * -inf - -inf would be NaN). */
PKV_VARIANT_FN float pkv_rescale(float m_old, float m_new) {
    return m_new == -INFINITY ? 1.0f : PKV_VARIANT_EXP(m_old - m_new);
}

/* -- a query's row -------------------------------------------------------------
 * The kernels that hold each query's logits as a row of consecutive keys (the
 * host page path, pkv_softmax_page in pagedkv/pkv_simd.h, and step 2 of the
 * OpenCL kernel) take their online-softmax step on it with the functions
 * that PKV_DEFINE_SOFTMAX_ROW(QUALIFIERS, prefix, ADDR, T, V, LANES, W,
 * suffix, HMAX, HSUM) defines.  A row x (address space ADDR) is `units`
 * units of type T: floats (W 1, V int, LANES 0), or vectors of W floats
 * whose lanes hold the keys LANES + u * W of unit u (V: the int vector of
 * lane masks, LANES its lane numbers).  suffix names PKV_DEFINE_SOFTMAX's and
 * PKV_DEFINE_LOGIT's functions for T; HMAX and HSUM reduce a T to a float.
 * Every loop is marked PKV_VARIANT_SIMD(clause), which the includer defines
 * (OpenMP simd with that clause on the host, nothing in OpenCL C, whose
 * units are its vectors).
 *
 *   prefix##_logits(x, units, cap, inverse_cap): pkv_logit on every unit,
 *       but -inf stays -inf (a masked key must not become -cap);
 *   prefix##_bias(x, lo, hi, slope, d0), x the row as floats: key t in
 *       [lo, hi) gains pkv_bias(slope, d0 + t) (d0: the distance j - p of
 *       key 0);
 *   prefix##_step(x, units, lo, hi, &m): the step over the keys [lo, hi),
 *       the visible ones: the row's logits become weights, 0 outside
 *       [lo, hi), m the running max (in: the old, out: the new); returns the
 *       sum of the weights, which the caller adds to the rescaled sum. */
#define PKV_DEFINE_SOFTMAX_ROW(QUALIFIERS, prefix, ADDR, T, V, LANES, W, suffix, HMAX, HSUM) \
QUALIFIERS void prefix##_logits(ADDR T *x, int units, float cap, float inverse_cap) {      \
    PKV_VARIANT_SIMD()                                                                    \
    for (int u = 0; u < units; ++u)                                                       \
        x[u] = x[u] == (T)(-INFINITY) ? x[u] : pkv_logit##suffix(x[u], cap, inverse_cap); \
}                                                                                         \
QUALIFIERS void prefix##_bias(ADDR float *x, int lo, int hi, float slope, int d0) {       \
    PKV_VARIANT_SIMD()                                                                    \
    for (int t = lo; t < hi; ++t) x[t] += pkv_bias(slope, d0 + t);                        \
}                                                                                         \
QUALIFIERS float prefix##_step(ADDR T *x, int units, int lo, int hi, float *m_io) {       \
    T m = *m_io;                                                                          \
    PKV_VARIANT_SIMD(reduction(max:m))                                                    \
    for (int u = 0; u < units; ++u) {                                                     \
        const V lane = LANES + u * W;                                                     \
        m = pkv_max_step##suffix(m, x[u], (lane >= lo) & (lane < hi));                    \
    }                                                                                     \
    const float m_new = HMAX(m);                                                          \
    T total = 0.0f;                                                                       \
    PKV_VARIANT_SIMD(reduction(+:total))                                                  \
    for (int u = 0; u < units; ++u) {                                                     \
        const V lane = LANES + u * W;                                                     \
        const T w = pkv_weight##suffix(x[u], (T)(m_new), (lane >= lo) & (lane < hi));     \
        x[u] = w;                                                                         \
        total += w;                                                                       \
    }                                                                                     \
    *m_io = m_new;                                                                        \
    return HSUM(total);                                                                   \
}

/* -- merge ---------------------------------------------------------------------
 * Parts of one query's keys (split-K), each with its max, sum and
 * accumulator: with m the max of the parts' maxes, part w weighs
 * pkv_part_weight(max_w, m) (0 for a part that saw no key); sums and
 * accumulators add up with these weights. */
PKV_VARIANT_FN float pkv_part_weight(float part_max, float m) {
    return part_max == -INFINITY ? 0.0f : PKV_VARIANT_EXP(part_max - m);
}

/* What turns an accumulator (max m, sum of weights) into the output, with a
 * sink logit (-inf: none) in the denominator: f / (sum * f + exp(sink - top)),
 * f = exp(m - top), top = max(m, sink), so that no exponent is positive.  A
 * query that saw no key gets 0. */
PKV_VARIANT_FN float pkv_output_scale(float m, float sum, float sink) {
    const float top = m > sink ? m : sink;
    if (top == -INFINITY) return 0.0f;
    const float f = PKV_VARIANT_EXP(m - top);
    const float denominator = sum * f + PKV_VARIANT_EXP(sink - top);
    return denominator > 0.0f ? f / denominator : 0.0f;
}

/* A query's log-sum-exp of its logits, m + log(sum) for its max m and sum of
 * weights (-inf when it saw no key): what merges attentions over disjoint
 * keys (pagedkv/cascade.py). */
PKV_VARIANT_FN float pkv_log_sum(float m, float sum) {
    return sum > 0.0f ? m + log(sum) : -INFINITY;
}

#endif /* PKV_VARIANT_MATH_H */
