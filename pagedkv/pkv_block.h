/* Micro-kernels of the host attention kernel for items with many queries
 * (prefill, chunked prefill, wide GQA groups): a block of keys at a time.
 *
 * The page path of pkv_simd.h pays, for every page of 16 keys, one softmax
 * pass per query, a rescale and a full load and store of the accumulators
 * (64 queries x 128 floats: more than L1 with the K/V pages).  With many
 * queries that overhead, not the multiply-adds, bounds it.  Here an item's
 * keys go by blocks of PKV_BLOCK_KEYS (several pages): the scores of the
 * whole block, one online-softmax step per block, then P V with each
 * accumulator tile in registers across every key of the block.
 *
 * Everything per query is transposed, for one KV head of an item with nq
 * queries padded to nqp (a multiple of PKV_QUERY_TILE) with zero queries:
 *   qt  [n][ld]     the scaled queries
 *   s   [keys][ld]  scores, then weights
 *   acc [n][ld]     the unnormalised outputs
 * so that a vector holds PKV_LANES queries: the softmax runs down columns
 * with no horizontal reductions, the rescale multiplies whole vectors, and
 * both products are one kind of tile, PKV_TILE_VECS query vectors x
 * PKV_TILE_COLS keys (scores) or output columns (P V), whose loop loads the
 * query side as vectors and broadcasts the key or value side: 12
 * accumulators with AVX2's 16 registers (the FMA latency needs 8 in flight)
 * and 8 loads per 12 multiply-adds, 16 with AVX-512's 32, fewer where a
 * vector is a pair of SSE registers.  Queries outermost: a query tile's rows
 * of qt or s stay in L1 while its tiles pass along them.
 *
 * A block's keys and values are copied (float16 and int8: converted) into
 * k [keys][ks] and v [keys][ks], one pass over the block against nqp
 * multiply-adds per element.  In the pool, a KV head's rows lie at strides
 * of 512 bytes (head_dim 128) within a page and of a multiple of 4 KiB
 * between pages, so that the value rows P V walks at one column map onto an
 * eighth of L1's sets, and every page of a head onto the same eighth of
 * L2's: read in place they thrashed both.  Every row stride here (ld, ks) is
 * an odd number of cache lines (pkv_block_stride), which spreads rows over
 * all the sets.
 */
#ifndef PKV_BLOCK_H
#define PKV_BLOCK_H
#include <math.h>
#include <stdint.h>
#include "pkv_simd.h"

#if PKV_VECTOR && PKV_LANES == 16
#define PKV_TILE_VECS 2
#define PKV_TILE_COLS 8
#elif PKV_VECTOR && (defined(__AVX__) || defined(__aarch64__))
#define PKV_TILE_VECS 2
#define PKV_TILE_COLS 6
#elif PKV_VECTOR
#define PKV_TILE_VECS 1
#define PKV_TILE_COLS 4
#endif

/* M(w) for each width w of a short last tile, 1 .. PKV_TILE_COLS - 1: the
 * case labels of the switches that give every tile a constant width. */
#if PKV_VECTOR && PKV_TILE_COLS == 8
#define PKV_TAIL_WIDTHS(M) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#elif PKV_VECTOR && PKV_TILE_COLS == 6
#define PKV_TAIL_WIDTHS(M) M(1) M(2) M(3) M(4) M(5)
#elif PKV_VECTOR
#define PKV_TAIL_WIDTHS(M) M(1) M(2) M(3)
#endif

/* Unrolling the scores tile's loop four times took a tenth off its time
 * (the loop's own increments and branch are a fifth of its instructions). */
#if defined(__clang__)
#define PKV_UNROLL_4 _Pragma("unroll 4")
#elif defined(__GNUC__)
#define PKV_UNROLL_4 _Pragma("GCC unroll 4")
#else
#define PKV_UNROLL_4
#endif

#if PKV_VECTOR
#define PKV_QUERY_TILE (PKV_TILE_VECS * PKV_LANES)
/* Keys per block: a whole number of score tiles, so that only an item's
 * last block has a short tile. */
#define PKV_BLOCK_KEYS (8 * PKV_TILE_COLS)
#else
#define PKV_QUERY_TILE 1
#define PKV_BLOCK_KEYS 64
#endif

/* Queries per head from which an item takes the block path: below it (decode:
 * one row of `group` queries) the page path streams K/V faster. */
#define PKV_BLOCK_MIN_QUERIES 16

/* Rows to prefetch into L2 while a kernel computes: the ones the next kernel
 * reads.  A key block's rows come from L3 (one KV head's keys serve every
 * query block of the sequence), and the first pass over them, read from
 * there as it goes, ran at half the speed of the later passes; fetched a
 * kernel ahead, a few rows per tile, all passes run from L2. */
typedef struct {
    const void *const *rows;    /* NULL: none */
    int num_rows;
    long row_bytes;
} pkv_block_prefetch;

/* Part `part` of `parts` of the rows of pf. */
PKV_INLINE void pkv_block_prefetch_part(const pkv_block_prefetch *pf, int part, int parts) {
#if PKV_VECTOR
    if (!pf->rows) return;
    const int r1 = (int)((long)(part + 1) * pf->num_rows / parts);
    for (int r = (int)((long)part * pf->num_rows / parts); r < r1; r++)
        for (long b = 0; b < pf->row_bytes; b += 64)
            __builtin_prefetch((const char *)pf->rows[r] + b, 0, 1);
#else
    (void)pf; (void)part; (void)parts;
#endif
}

/* nqp: the queries an item's nq round up to. */
static inline int pkv_block_queries(int nq) {
    return (nq + PKV_QUERY_TILE - 1) / PKV_QUERY_TILE * PKV_QUERY_TILE;
}

/* The row stride, in floats, of rows of n floats: whole cache lines, an odd
 * number of them (see the top of this file). */
static inline int pkv_block_stride(int n) {
    return ((n + 15) / 16 | 1) * 16;
}

/* -- scores: s[t][q] = dot(query q, key t) ---------------------------------- */

#if PKV_VECTOR
/* One tile: PKV_TILE_VECS query vectors x `keys` keys (keys constant at each
 * call, so that the accumulators are registers), over the n dimensions. */
PKV_INLINE void pkv_block_scores_tile(const float *restrict qt, int ld,
                                      const float *const *restrict krows, int n,
                                      float *restrict s, int keys) {
    pkv_vec c[PKV_TILE_COLS][PKV_TILE_VECS];
    const float *k[PKV_TILE_COLS];
    for (int j = 0; j < keys; j++) {
        k[j] = krows[j];
        for (int v = 0; v < PKV_TILE_VECS; v++) c[j][v] = (pkv_vec){0};
    }
    PKV_UNROLL_4
    for (int i = 0; i < n; i++) {
        pkv_vec qv[PKV_TILE_VECS];
        for (int v = 0; v < PKV_TILE_VECS; v++) {
            qv[v] = *(const pkv_vec *)(qt + (long)i * ld + v * PKV_LANES);
            PKV_IN_REGISTER(qv[v]);
        }
        for (int j = 0; j < keys; j++) {
            const float b = k[j][i];
            for (int v = 0; v < PKV_TILE_VECS; v++) c[j][v] += b * qv[v];
        }
    }
    for (int j = 0; j < keys; j++)
        for (int v = 0; v < PKV_TILE_VECS; v++)
            *(pkv_vec *)(s + (long)j * ld + v * PKV_LANES) = c[j][v];
}
#endif

/* s[t * ld + q] = dot(qt[. * ld + q], krows[t]) for t < nt, q < nqp.  The
 * prefetches go with the first query tile's key tiles. */
PKV_INLINE void pkv_block_scores_any(const float *restrict qt, int ld, int nqp,
                                     const float *const *restrict krows, int nt, int n,
                                     float *restrict s, const pkv_block_prefetch *pf) {
#if PKV_VECTOR
    const int tiles = (nt + PKV_TILE_COLS - 1) / PKV_TILE_COLS;
    for (int q0 = 0; q0 < nqp; q0 += PKV_QUERY_TILE) {
        int t = 0;
        for (; t + PKV_TILE_COLS <= nt; t += PKV_TILE_COLS) {
            if (q0 == 0) pkv_block_prefetch_part(pf, t / PKV_TILE_COLS, tiles);
            pkv_block_scores_tile(qt + q0, ld, krows + t, n, s + (long)t * ld + q0,
                                  PKV_TILE_COLS);
        }
        if (q0 == 0 && t < nt) pkv_block_prefetch_part(pf, tiles - 1, tiles);
        /* a short last tile, its width a constant too */
        switch (nt - t) {
#define PKV_SCORE_TAIL(w) case w: pkv_block_scores_tile(qt + q0, ld, krows + t, n, \
                                      s + (long)t * ld + q0, w); break;
        PKV_TAIL_WIDTHS(PKV_SCORE_TAIL)
#undef PKV_SCORE_TAIL
        default: break;
        }
    }
#else
    (void)pf;
    for (int t = 0; t < nt; t++)
        for (int q = 0; q < nqp; q++) {
            float dot = 0.0f;
            for (int i = 0; i < n; i++) dot += qt[(long)i * ld + q] * krows[t][i];
            s[(long)t * ld + q] = dot;
        }
#endif
}

/* -- accumulate: acc[i][q] = alpha[q] * acc[i][q] + sum over t of s[t][q] * v[t][i] */

#if PKV_VECTOR
typedef int32_t pkv_ivec __attribute__((vector_size(PKV_LANES * 4), aligned(4)));

/* One tile: PKV_TILE_VECS query vectors x `cols` output columns i0 : i0 + cols
 * (cols constant at each call), over the keys t0 : t1.  Every query of the
 * tile sees the keys plain0 : plain1 (t0 <= plain0 <= plain1 <= t1); for the
 * others a product counts only where lo[q] <= t < hi[q]: a masked weight is
 * zero, but zero times a NaN or inf value is NaN, so the product is dropped
 * by a bit mask rather than multiplied by 0. */
PKV_INLINE void pkv_block_accumulate_tile(float *restrict acc, int ld,
                                          const float *restrict alpha,
                                          const float *restrict p,
                                          const float *restrict values, int vs,
                                          const int32_t *restrict lo, const int32_t *restrict hi,
                                          int t0, int plain0, int plain1, int t1, int i0,
                                          int cols) {
    pkv_vec a[PKV_TILE_COLS][PKV_TILE_VECS];
    for (int v = 0; v < PKV_TILE_VECS; v++) {
        const pkv_vec rescale = *(const pkv_vec *)(alpha + v * PKV_LANES);
        for (int j = 0; j < cols; j++)
            a[j][v] = *(const pkv_vec *)(acc + (long)(i0 + j) * ld + v * PKV_LANES) * rescale;
    }
#define PKV_ACC_MASKED(from, to)                                                       \
    for (int t = (from); t < (to); t++) {                                              \
        const float *x = values + (long)t * vs + i0;                                   \
        pkv_vec pv[PKV_TILE_VECS];                                                     \
        pkv_ivec seen[PKV_TILE_VECS];                                                  \
        for (int v = 0; v < PKV_TILE_VECS; v++) {                                      \
            const pkv_ivec tv = (pkv_ivec){0} + t;                                     \
            pv[v] = *(const pkv_vec *)(p + (long)t * ld + v * PKV_LANES);              \
            seen[v] = (tv >= *(const pkv_ivec *)(lo + v * PKV_LANES)) &                \
                      (tv < *(const pkv_ivec *)(hi + v * PKV_LANES));                  \
        }                                                                              \
        for (int j = 0; j < cols; j++) {                                               \
            const float b = x[j];                                                      \
            for (int v = 0; v < PKV_TILE_VECS; v++)                                    \
                a[j][v] += (pkv_vec)((pkv_ivec)(b * pv[v]) & seen[v]);                 \
        }                                                                              \
    }
    PKV_ACC_MASKED(t0, plain0)
    for (int t = plain0; t < plain1; t++) {
        const float *x = values + (long)t * vs + i0;
        pkv_vec pv[PKV_TILE_VECS];
        for (int v = 0; v < PKV_TILE_VECS; v++) {
            pv[v] = *(const pkv_vec *)(p + (long)t * ld + v * PKV_LANES);
            PKV_IN_REGISTER(pv[v]);
        }
        for (int j = 0; j < cols; j++) {
            const float b = x[j];
            for (int v = 0; v < PKV_TILE_VECS; v++) a[j][v] += b * pv[v];
        }
    }
    PKV_ACC_MASKED(plain1, t1)
#undef PKV_ACC_MASKED
    for (int j = 0; j < cols; j++)
        for (int v = 0; v < PKV_TILE_VECS; v++)
            *(pkv_vec *)(acc + (long)(i0 + j) * ld + v * PKV_LANES) = a[j][v];
}
#endif

/* acc[i * ld + q] = alpha[q] * acc[i * ld + q] + sum over the keys t that
 * query q sees, lo[q] <= t < hi[q] (0 <= lo <= hi <= nt), of
 * p[t * ld + q] * v[t * vs + i], for i < n and the nq real queries (those
 * past nq, up to nqp, are padding: any result).  A key a query does not see
 * never enters its sum, whatever its value row holds.  The prefetches go
 * with the first query tile's column tiles. */
PKV_INLINE void pkv_block_accumulate_any(float *restrict acc, int ld, int nqp, int nq,
                                         const float *restrict alpha, const float *restrict p,
                                         const float *restrict v, int vs,
                                         const int32_t *restrict lo, const int32_t *restrict hi,
                                         int nt, int n, const pkv_block_prefetch *pf) {
#if PKV_VECTOR
    const int tiles = (n + PKV_TILE_COLS - 1) / PKV_TILE_COLS;
    /* A last tile of under half the width has too few accumulators to hide
     * the FMA latency: it and the full tile before it go as two halves
     * (128 columns: 20 tiles of 6, then 4 and 4). */
    const int rest = n % PKV_TILE_COLS;
    const int split = rest > 0 && rest < PKV_TILE_COLS / 2 && n > PKV_TILE_COLS;
    const int full_end = (n / PKV_TILE_COLS - split) * PKV_TILE_COLS;
    for (int q0 = 0; q0 < nqp; q0 += PKV_QUERY_TILE) {
        /* the keys some real query of the tile sees (t0 : t1) and those all
         * of them see (plain0 : plain1): only the rest need the mask */
        int t0 = nt, t1 = 0, plain0 = 0, plain1 = nt;
        for (int q = q0; q < q0 + PKV_QUERY_TILE && q < nq; q++) {
            if (lo[q] < hi[q]) {
                t0 = lo[q] < t0 ? lo[q] : t0;
                t1 = hi[q] > t1 ? hi[q] : t1;
            }
            plain0 = lo[q] > plain0 ? lo[q] : plain0;
            plain1 = hi[q] < plain1 ? hi[q] : plain1;
        }
        if (t1 < t0) t0 = t1 = 0;
        if (plain1 <= plain0) plain0 = plain1 = t1;
        const int32_t *tlo = lo + q0, *thi = hi + q0;
#define PKV_ACC_ARGS(w) acc + q0, ld, alpha + q0, p + q0, v, vs, tlo, thi, t0, plain0, \
                        plain1, t1, i, w
        int i = 0;
        for (; i < full_end; i += PKV_TILE_COLS) {
            if (q0 == 0) pkv_block_prefetch_part(pf, i / PKV_TILE_COLS, tiles);
            pkv_block_accumulate_tile(PKV_ACC_ARGS(PKV_TILE_COLS));
        }
        for (int part = full_end / PKV_TILE_COLS; q0 == 0 && part < tiles; part++)
            pkv_block_prefetch_part(pf, part, tiles);
        if (split) {
            const int half = (PKV_TILE_COLS + rest) / 2;
            switch (half) {
#define PKV_ACC_HALF(w) case w: pkv_block_accumulate_tile(PKV_ACC_ARGS(w)); break;
            PKV_ACC_HALF(2) PKV_ACC_HALF(3) PKV_ACC_HALF(4)
#if PKV_TILE_COLS > 4
            PKV_ACC_HALF(5)
#endif
#undef PKV_ACC_HALF
            default: break;
            }
            i += half;
        }
        switch (n - i) {
#define PKV_ACC_TAIL(w) case w: pkv_block_accumulate_tile(PKV_ACC_ARGS(w)); break;
        PKV_TAIL_WIDTHS(PKV_ACC_TAIL)
#undef PKV_ACC_TAIL
#undef PKV_ACC_ARGS
        default: break;
        }
    }
#else
    (void)pf;
    (void)nqp;
    (void)nt;
    for (int i = 0; i < n; i++)
        for (int q = 0; q < nq; q++) {
            float a = acc[(long)i * ld + q] * alpha[q];
            for (int t = lo[q]; t < hi[q]; t++) a += p[(long)t * ld + q] * v[(long)t * vs + i];
            acc[(long)i * ld + q] = a;
        }
#endif
}

/* Entry points, specialised for common head sizes (as in pkv_simd.h). */
#define PKV_BLOCK_SCORES_CALL(N) pkv_block_scores_any(qt, ld, nqp, krows, nt, N, s, pf)
PKV_NOINLINE void pkv_block_scores(const float *qt, int ld, int nqp, const float *const *krows,
                                   int nt, int n, float *s, const pkv_block_prefetch *pf) {
    PKV_WITH_HEAD_DIM(PKV_BLOCK_SCORES_CALL)
}
#define PKV_BLOCK_ACCUMULATE_CALL(N) \
    pkv_block_accumulate_any(acc, ld, nqp, nq, alpha, p, v, vs, lo, hi, nt, N, pf)
PKV_NOINLINE void pkv_block_accumulate(float *acc, int ld, int nqp, int nq, const float *alpha,
                                       const float *p, const float *v, int vs,
                                       const int32_t *lo, const int32_t *hi, int nt, int n,
                                       const pkv_block_prefetch *pf) {
    PKV_WITH_HEAD_DIM(PKV_BLOCK_ACCUMULATE_CALL)
}

/* -- online softmax over a block ------------------------------------------- */

/* One block of online softmax for queries 0 : nqp (see the layouts above),
 * in the terms of the variant contract (opencl/pkv_variant.h).
 *
 * s[t * ld + q], t < nt: the block's logits in, the weights out.  Query q
 * sees the keys t in [lo[q], hi[q]) (0 <= lo <= hi <= nt; lo = hi = 0 for a
 * padding query); soft_cap > 0 caps the logits first; then, with slope
 * (NULL: none), key t's logit for query q gains pkv_bias(slope[q], dist[q] +
 * t): dist[q] is the block's first key position minus q's position (slope
 * and dist 0 for a padding query).  Weights of keys a
 * query does not see are zero.  run_max, run_sum [nqp]: the running max and
 * sum; alpha [nqp] receives pkv_rescale, the factor that rescales query q's
 * accumulator.  tmp: 2 * nqp floats.  The loops run along queries, in
 * vectors. */
static void pkv_block_softmax(float *restrict s, int ld, int nqp, int nt, int nq,
                              const int32_t *restrict lo, const int32_t *restrict hi,
                              float soft_cap, const float *restrict slope,
                              const int32_t *restrict dist, float *restrict run_max,
                              float *restrict run_sum, float *restrict alpha,
                              float *restrict tmp) {
    float *restrict m = tmp, *restrict sum = tmp + nqp;
    int banded = 0;
    for (int q = 0; q < nq; q++) banded |= lo[q] != 0 || hi[q] != nt;
    if (soft_cap > 0.0f)
        for (int t = 0; t < nt; t++) pkv_row_logits(s + (long)t * ld, nqp, soft_cap, 1.0f / soft_cap);
    if (slope)
        for (int t = 0; t < nt; t++) {
            float *row = s + (long)t * ld;
            #pragma omp simd
            for (int q = 0; q < nqp; q++) row[q] += pkv_bias(slope[q], dist[q] + t);
        }
    for (int q = 0; q < nqp; q++) {
        m[q] = run_max[q];
        sum[q] = 0.0f;
    }
    /* Padding queries (q >= nq) take every key unless the block is banded:
     * their zero scores are harmless, and no one reads their results. */
    if (!banded) {
        for (int t = 0; t < nt; t++) {
            const float *row = s + (long)t * ld;
            #pragma omp simd
            for (int q = 0; q < nqp; q++) m[q] = pkv_max_step(m[q], row[q], 1);
        }
    } else {
        for (int t = 0; t < nt; t++) {
            const float *row = s + (long)t * ld;
            #pragma omp simd
            for (int q = 0; q < nqp; q++)
                m[q] = pkv_max_step(m[q], row[q], t >= lo[q] && t < hi[q]);
        }
    }
    #pragma omp simd
    for (int q = 0; q < nqp; q++) {
        alpha[q] = pkv_rescale(run_max[q], m[q]);
        run_max[q] = m[q];
    }
    if (!banded) {
        for (int t = 0; t < nt; t++) {
            float *row = s + (long)t * ld;
            #pragma omp simd
            for (int q = 0; q < nqp; q++) {
                const float w = pkv_weight(row[q], m[q], 1);
                row[q] = w;
                sum[q] += w;
            }
        }
    } else {
        for (int t = 0; t < nt; t++) {
            float *row = s + (long)t * ld;
            #pragma omp simd
            for (int q = 0; q < nqp; q++) {
                const float w = pkv_weight(row[q], m[q], t >= lo[q] && t < hi[q]);
                row[q] = w;
                sum[q] += w;
            }
        }
    }
    for (int q = 0; q < nqp; q++) run_sum[q] = run_sum[q] * alpha[q] + sum[q];
}

/* -- a block's key or value rows as float32 --------------------------------- */

/* out[r * stride : +n] = row r of x (storage `kind`, rows of n), times
 * scales[r] when scales is not NULL (int8), for r < nrows. */
static void pkv_block_rows(const void *x, int kind, int nrows, int n, const float *scales,
                           float *restrict out, int stride) {
    for (int r = 0; r < nrows; r++) {
        const long base = (long)r * n;
        float *restrict row = out + (long)r * stride;
        const float scale = scales ? scales[r] : 1.0f;
        int i = 0;
#if PKV_VECTOR
        for (; i + PKV_LANES <= n; i += PKV_LANES)
            *(pkv_vec *)(row + i) = pkv_load(x, base + i, kind) * scale;
#endif
        for (; i < n; i++) row[i] = pkv_load1(x, base + i, kind) * scale;
    }
}

#endif
