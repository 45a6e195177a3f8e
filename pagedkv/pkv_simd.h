/* The vector micro-kernels of the host attention kernel.
 *
 * Written in C rather than Cython for what Cython cannot say: `restrict`,
 * vector types (GCC/Clang vector extensions, so one source serves AVX-512,
 * AVX2 and NEON), lane shuffles, F16C conversions and prefetch hints.  All
 * arithmetic is float32; K/V rows are float32 or IEEE float16 bits, converted
 * as they are loaded.
 *
 * Both kernels stream one page's K or V slice straight from the pool, and
 * while they compute they prefetch a later slice (the caller's choice: about
 * 32 KiB ahead in its reading order) into L2 a few cache lines per inner
 * iteration (`pkv_prefetch`).  Spreading the prefetches over
 * the compute, instead of issuing them in a burst or relying on the hardware
 * prefetcher, is what lets the DRAM stream and the arithmetic overlap in the
 * benchmark's decode, where copying each page before computing, or no
 * prefetch at all, is slower.  Bursts of prefetches, or prefetching into L1
 * (T0), gained nothing (bursts were slower: prefetches past a full memory
 * queue seem to be dropped).  CHANGELOG.md has the measured figures of each
 * step.
 */
#ifndef PKV_SIMD_H
#define PKV_SIMD_H
#include <stdint.h>
#include "pkv_half.h"
#include "pkv_storage.h"
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
/* vectors passed between static inline functions in a build without AVX */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

/* PKV_NO_VECTOR: build the plain-loop fallback (what a compiler without
 * vector extensions gets), for testing it. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(PKV_NO_VECTOR)
#define PKV_VECTOR 1
#define PKV_INLINE static inline __attribute__((always_inline))
#define PKV_NOINLINE static __attribute__((noinline))
#else
#define PKV_VECTOR 0
#define PKV_INLINE static inline
#define PKV_NOINLINE static
#endif

/* -- prefetching the next page ------------------------------------------------ */

/* The not-yet-prefetched rest of the next page's slice: [next, end). */
typedef struct { const char *next, *end; } pkv_prefetch;

#define PKV_PREFETCH_STEP 256   /* bytes (four cache lines) per inner iteration */

static inline pkv_prefetch pkv_prefetch_range(const void *start, long nbytes) {
    pkv_prefetch pf = {(const char *)start, (const char *)start + (start ? nbytes : 0)};
    return pf;
}

/* Prefetch the next four lines, into L2 (locality 1: prefetcht2 on x86). */
PKV_INLINE void pkv_prefetch_step(pkv_prefetch *pf) {
    if (pf->next < pf->end) {
#if PKV_VECTOR
        __builtin_prefetch(pf->next, 0, 1);
        __builtin_prefetch(pf->next + 64, 0, 1);
        __builtin_prefetch(pf->next + 128, 0, 1);
        __builtin_prefetch(pf->next + 192, 0, 1);
#endif
        pf->next += PKV_PREFETCH_STEP;
    }
}

/* Whatever a short computation left unprefetched. */
static inline void pkv_prefetch_rest(pkv_prefetch *pf) {
    while (pf->next < pf->end) pkv_prefetch_step(pf);
}

/* -- loading float32, float16 or bfloat16 rows ------------------------------- */

/* bfloat16 bits (the high half of a float32) -> float32: exact. */
static inline float pkv_bf16_to_float(uint16_t bits) {
    const uint32_t u = (uint32_t)bits << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* float32 -> bfloat16 bits, round to nearest even: adding 0x7FFF plus the
 * lowest kept bit carries into the kept half exactly when the dropped half
 * is above a tie, or a tie next to an odd kept half (overflow gives inf).
 * NaN is kept apart (quieted, sign kept): rounding a NaN with a small
 * payload would carry it into inf. */
static inline uint16_t pkv_float_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a row of storage `kind` (pkv_storage.h; int8: unscaled). */
PKV_INLINE float pkv_load1(const void *x, long i, int kind) {
    if (kind == PKV_STORAGE_INT8) return (float)((const int8_t *)x)[i];
    if (kind == PKV_STORAGE_BFLOAT16) return pkv_bf16_to_float(((const uint16_t *)x)[i]);
    return kind == PKV_STORAGE_FLOAT16 ? pkv_half_to_float(((const uint16_t *)x)[i])
                                       : ((const float *)x)[i];
}

#if PKV_VECTOR
/* PKV_LANES floats at any 4-byte alignment: 16 where AVX-512 gives 32 vector
 * registers to hold a 4 x 4 tile, else 8 (AVX2, NEON as two registers). */
#if defined(__AVX512F__)
#define PKV_LANES 16
#else
#define PKV_LANES 8
#endif
typedef float pkv_vec __attribute__((vector_size(PKV_LANES * 4), aligned(4)));

typedef int8_t pkv_bvec __attribute__((vector_size(PKV_LANES), aligned(1)));
typedef uint16_t pkv_wvec __attribute__((vector_size(PKV_LANES * 2), aligned(2)));
typedef uint32_t pkv_uvec __attribute__((vector_size(PKV_LANES * 4), aligned(4)));

PKV_INLINE pkv_vec pkv_load(const void *x, long i, int kind) {
    if (kind == PKV_STORAGE_FLOAT32) return *(const pkv_vec *)((const float *)x + i);
    if (kind == PKV_STORAGE_INT8) {
        /* GCC turns the generic conversion into a scalar convert per lane */
        const int8_t *b = (const int8_t *)x + i;
#if PKV_LANES == 16
        return (pkv_vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)));
#elif defined(__AVX2__)
        return (pkv_vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)b)));
#else
        return __builtin_convertvector(*(const pkv_bvec *)b, pkv_vec);
#endif
    }
    const uint16_t *h = (const uint16_t *)x + i;
    if (kind == PKV_STORAGE_BFLOAT16) {
        /* widen each 16-bit word to 32 and shift it into the high half */
#if PKV_LANES == 16
        return (pkv_vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16);
#elif defined(__AVX2__)
        return (pkv_vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16);
#else
        return (pkv_vec)(__builtin_convertvector(*(const pkv_wvec *)h, pkv_uvec) << 16);
#endif
    }
#if PKV_LANES == 16
    return (pkv_vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif defined(__F16C__)
    return (pkv_vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    pkv_vec v;
    for (int l = 0; l < PKV_LANES; l++) v[l] = pkv_half_to_float(h[l]);
    return v;
#endif
}

/* Keep a loaded vector in a register.  Left to itself, GCC folds the load
 * into every multiply-add that uses it (four loads instead of one), which
 * made the kernels load-bound: pinning halved their time.  An empty asm needs
 * the vector to fit one register, so this applies where AVX is on (32-byte
 * vectors in ymm, 64-byte in zmm with AVX-512). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
#define PKV_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define PKV_IN_REGISTER(v) ((void)0)
#endif

PKV_INLINE float pkv_hsum(pkv_vec v) {
    float s = 0.0f;
    for (int l = 0; l < PKV_LANES; l++) s += v[l];
    return s;
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define PKV_HAVE_SHUFFLE 1
#endif
#endif

#if defined(PKV_HAVE_SHUFFLE)
/* Transposing sum: one vector whose lane a is the sum of the lanes of c[a].
 * Each level adds pairs of half-vectors, halving the vector count; after
 * log2(PKV_LANES) levels lane order is bit-reversed, so the inputs are taken
 * in bit-reversed order.  PKV_SRC(i, h): the lane of (x, y) that lane i takes
 * at the level that adds halves of width h. */
#define PKV_SRC(i, h) ((((i) / (h)) & 1 ? PKV_LANES : 0) + (i) / (2 * (h)) * 2 * (h) + (i) % (h))
#if PKV_LANES == 16
#define PKV_LANE_LIST(h, o)                                                              \
    PKV_SRC(0, h) + o, PKV_SRC(1, h) + o, PKV_SRC(2, h) + o, PKV_SRC(3, h) + o,          \
    PKV_SRC(4, h) + o, PKV_SRC(5, h) + o, PKV_SRC(6, h) + o, PKV_SRC(7, h) + o,          \
    PKV_SRC(8, h) + o, PKV_SRC(9, h) + o, PKV_SRC(10, h) + o, PKV_SRC(11, h) + o,        \
    PKV_SRC(12, h) + o, PKV_SRC(13, h) + o, PKV_SRC(14, h) + o, PKV_SRC(15, h) + o
static const int pkv_bitrev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
#define PKV_LANE_LIST(h, o)                                                              \
    PKV_SRC(0, h) + o, PKV_SRC(1, h) + o, PKV_SRC(2, h) + o, PKV_SRC(3, h) + o,          \
    PKV_SRC(4, h) + o, PKV_SRC(5, h) + o, PKV_SRC(6, h) + o, PKV_SRC(7, h) + o
static const int pkv_bitrev[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#endif
#define PKV_ADD_HALVES(x, y, h) \
    (__builtin_shufflevector(x, y, PKV_LANE_LIST(h, 0)) + __builtin_shufflevector(x, y, PKV_LANE_LIST(h, h)))

PKV_INLINE pkv_vec pkv_transpose_sum(const pkv_vec *c) {
    pkv_vec b[4], d[2];
#if PKV_LANES == 16
    pkv_vec a[8];
    for (int i = 0; i < 8; i++) a[i] = PKV_ADD_HALVES(c[pkv_bitrev[2 * i]], c[pkv_bitrev[2 * i + 1]], 8);
    for (int i = 0; i < 4; i++) b[i] = PKV_ADD_HALVES(a[2 * i], a[2 * i + 1], 4);
#else
    for (int i = 0; i < 4; i++) b[i] = PKV_ADD_HALVES(c[pkv_bitrev[2 * i]], c[pkv_bitrev[2 * i + 1]], 4);
#endif
    for (int i = 0; i < 2; i++) d[i] = PKV_ADD_HALVES(b[2 * i], b[2 * i + 1], 2);
    return PKV_ADD_HALVES(d[0], d[1], 1);
}
#endif /* PKV_HAVE_SHUFFLE */
#endif /* PKV_VECTOR */

/* -- attention micro-kernels --------------------------------------------------- */

/* scores[qi * ld + t] = dot(q[qi], k[t]) for qi < nq and t < nt.
 *
 * q: [nq, n] float32, nq a multiple of qt; k: [nt, n] rows of storage `kind`.
 * Tiles of qt queries x PKV_LANES / qt keys keep their PKV_LANES partial sums
 * in registers, so each load of q or k feeds several multiply-adds; one
 * transposing sum then finishes the whole tile.  qt is 4, or 1 for a lone
 * query (decode without GQA), which padding to 4 would make do 4 times the
 * arithmetic.  Columns past the last full vector, and keys past the last
 * full tile, take the plain paths. */
PKV_INLINE void pkv_scores_any(const float *restrict q, int nq, const void *restrict k, int kind,
                               int nt, int n, float *restrict scores, int ld, pkv_prefetch *pf_io,
                               const int qt) {
    pkv_prefetch cursor = *pf_io, *pf = &cursor;  /* a local the compiler keeps in registers */
#if PKV_VECTOR
    const int nv = n / PKV_LANES * PKV_LANES;
    const int keys = PKV_LANES / qt;                /* keys per tile */
    for (int qi = 0; qi < nq; qi += qt) {
        const float *qr[4];
        for (int qq = 0; qq < qt; qq++) qr[qq] = q + (qi + qq) * n;
        int t = 0;
#if defined(PKV_HAVE_SHUFFLE)
        for (; t + keys <= nt; t += keys) {
            pkv_vec c[PKV_LANES];                   /* c[qq * keys + kk] */
            for (int a = 0; a < PKV_LANES; a++) c[a] = (pkv_vec){0};
            for (int i = 0; i < nv; i += PKV_LANES) {
                pkv_vec x[PKV_LANES];
                for (int kk = 0; kk < keys; kk++) {
                    x[kk] = pkv_load(k, (long)(t + kk) * n + i, kind);
                    PKV_IN_REGISTER(x[kk]);
                }
                for (int qq = 0; qq < qt; qq++) {
                    pkv_vec qv = pkv_load(qr[qq], i, 0);
                    PKV_IN_REGISTER(qv);
                    for (int kk = 0; kk < keys; kk++) c[qq * keys + kk] += qv * x[kk];
                }
                pkv_prefetch_step(pf);
            }
            float sums[PKV_LANES];
            *(pkv_vec *)sums = pkv_transpose_sum(c);
            for (int a = 0; a < PKV_LANES; a++) {
                const int qq = a / keys, kk = a % keys;
                float s = sums[a];
                for (int i = nv; i < n; i++) s += qr[qq][i] * pkv_load1(k, (long)(t + kk) * n + i, kind);
                scores[(qi + qq) * ld + t + kk] = s;
            }
        }
#endif
        for (; t < nt; t++) {
            pkv_vec c[4] = {{0}};
            for (int i = 0; i < nv; i += PKV_LANES) {
                const pkv_vec x = pkv_load(k, (long)t * n + i, kind);
                for (int qq = 0; qq < qt; qq++) c[qq] += pkv_load(qr[qq], i, 0) * x;
            }
            for (int qq = 0; qq < qt; qq++) {
                float s = pkv_hsum(c[qq]);
                for (int i = nv; i < n; i++) s += qr[qq][i] * pkv_load1(k, (long)t * n + i, kind);
                scores[(qi + qq) * ld + t] = s;
            }
        }
    }
#else
    (void)pf;
    (void)qt;
    for (int qi = 0; qi < nq; qi++)
        for (int t = 0; t < nt; t++) {
            float s = 0.0f;
            for (int i = 0; i < n; i++) s += q[qi * n + i] * pkv_load1(k, (long)t * n + i, kind);
            scores[qi * ld + t] = s;
        }
#endif
    *pf_io = cursor;
}

/* Accumulator vectors per query in one column block of pkv_accumulate_any:
 * 4 x 4 = 16 registers of the 32 AVX-512 has, 4 x 2 of AVX2's 16 (a lone
 * query takes four times as many columns). */
#if PKV_VECTOR && PKV_LANES == 16
#define PKV_BLOCK_VECS 4
#else
#define PKV_BLOCK_VECS 2
#endif

#if PKV_VECTOR
/* Columns i0 : i0 + width * PKV_LANES of pkv_accumulate_any for its qt
 * queries (qt and width constant at each call, so that the accumulators are
 * registers). */
PKV_INLINE void pkv_accumulate_block(float *restrict acc, const float *restrict alpha,
                                     const float *restrict p, int ld, const void *restrict x,
                                     int kind, int nt, int n, int i0, const int qt,
                                     const int width, pkv_prefetch *pf) {
    pkv_vec a[4 * PKV_BLOCK_VECS];              /* a[qq * width + c] */
    for (int qq = 0; qq < qt; qq++)
        for (int c = 0; c < width; c++)
            a[qq * width + c] = pkv_load(acc + qq * n, i0 + c * PKV_LANES, 0) * alpha[qq];
    for (int t = 0; t < nt; t++) {
        pkv_vec xv[4 * PKV_BLOCK_VECS];
        for (int c = 0; c < width; c++) {
            xv[c] = pkv_load(x, (long)t * n + i0 + c * PKV_LANES, kind);
            PKV_IN_REGISTER(xv[c]);
        }
        for (int qq = 0; qq < qt; qq++) {
            const float w = p[qq * ld + t];
            for (int c = 0; c < width; c++) a[qq * width + c] += w * xv[c];
        }
        pkv_prefetch_step(pf);
    }
    for (int qq = 0; qq < qt; qq++)
        for (int c = 0; c < width; c++)
            *(pkv_vec *)(acc + qq * n + i0 + c * PKV_LANES) = a[qq * width + c];
}
#endif

/* For query qq < qt (4, or 1 for a lone query):
 *     acc[qq * n : +n] = alpha[qq] * acc[qq * n : +n] + sum over t < nt of p[qq * ld + t] * x[t].
 *
 * x: [nt, n] rows of storage `kind`.  Each column block of the
 * accumulators stays in registers across all nt rows, and each load of
 * x feeds qt multiply-adds. */
PKV_INLINE void pkv_accumulate_any(float *restrict acc, const float *restrict alpha,
                                   const float *restrict p, int ld, const void *restrict x,
                                   int kind, int nt, int n, pkv_prefetch *pf_io, const int qt) {
    pkv_prefetch cursor = *pf_io, *pf = &cursor;  /* a local the compiler keeps in registers */
    int i0 = 0;
#if PKV_VECTOR
    const int wide = PKV_BLOCK_VECS * 4 / qt;
    for (; i0 + wide * PKV_LANES <= n; i0 += wide * PKV_LANES)
        pkv_accumulate_block(acc, alpha, p, ld, x, kind, nt, n, i0, qt, wide, pf);
    for (; i0 + PKV_BLOCK_VECS * PKV_LANES <= n; i0 += PKV_BLOCK_VECS * PKV_LANES)
        pkv_accumulate_block(acc, alpha, p, ld, x, kind, nt, n, i0, qt, PKV_BLOCK_VECS, pf);
    for (; i0 + PKV_LANES <= n; i0 += PKV_LANES)
        pkv_accumulate_block(acc, alpha, p, ld, x, kind, nt, n, i0, qt, 1, pf);
#else
    (void)pf;
#endif
    for (int qq = 0; qq < qt; qq++)
        for (int i = i0; i < n; i++) {
            float a = acc[qq * n + i] * alpha[qq];
            for (int t = 0; t < nt; t++) a += p[qq * ld + t] * pkv_load1(x, (long)t * n + i, kind);
            acc[qq * n + i] = a;
        }
    *pf_io = cursor;
}

/* The entry points for Cython, one per storage type.  Each instantiates the
 * always-inline kernel with a constant `kind`, and with a constant row length
 * for the head sizes of common models: the compiler then unrolls the column
 * loop and addresses rows at fixed offsets, which frees the registers that a
 * run-time stride ties up (float16 decode gained most; see CHANGELOG.md).
 * They are kept out of line: inlined into the Cython caller, they shared its
 * registers and spilled the accumulators. */
#define PKV_WITH_HEAD_DIM(call)                                        \
    switch (n) {                                                      \
    case 64: call(64); break;                                         \
    case 80: call(80); break;                                         \
    case 96: call(96); break;                                         \
    case 128: call(128); break;                                       \
    case 256: call(256); break;                                       \
    default: call(n);                                                 \
    }

/* One pair of entry points per storage format: pkv_scores_<suffix> and
 * pkv_accumulate_<suffix>, over rows of element type T, in tiles of
 * `queries` queries: 4, or 1 for a lone query. */
#define PKV_SCORES_CALL(N) pkv_scores_any(q, nq, k, kind, nt, N, scores, ld, pf, QT)
#define PKV_ACCUMULATE_CALL(N) pkv_accumulate_any(acc, alpha, p, ld, x, kind, nt, N, pf, QT)
#define PKV_WITH_QUERIES(call)                                                             \
    if (queries == 1) {                                                                   \
        enum { QT = 1 };                                                                  \
        PKV_WITH_HEAD_DIM(call)                                                           \
    } else {                                                                              \
        enum { QT = 4 };                                                                  \
        PKV_WITH_HEAD_DIM(call)                                                           \
    }
#define PKV_DEFINE_ENTRY_POINTS(suffix, T, storage)                                        \
    PKV_NOINLINE void pkv_scores_##suffix(const float *q, int nq, const T *k, int nt, int n, \
                                          float *scores, int ld, pkv_prefetch *pf,         \
                                          int queries) {                                   \
        const int kind = storage;                                                         \
        PKV_WITH_QUERIES(PKV_SCORES_CALL)                                                  \
    }                                                                                     \
    PKV_NOINLINE void pkv_accumulate_##suffix(float *acc, const float *alpha, const float *p, \
                                              int ld, const T *x, int nt, int n,           \
                                              pkv_prefetch *pf, int queries) {             \
        const int kind = storage;                                                         \
        PKV_WITH_QUERIES(PKV_ACCUMULATE_CALL)                                              \
    }

PKV_DEFINE_ENTRY_POINTS(f32, float, PKV_STORAGE_FLOAT32)
PKV_DEFINE_ENTRY_POINTS(f16, uint16_t, PKV_STORAGE_FLOAT16)
PKV_DEFINE_ENTRY_POINTS(i8, int8_t, PKV_STORAGE_INT8)
/* bfloat16 bits come from Cython as int16_t, a C type of their own beside
 * float16's uint16_t (see pagedkv/_kernels.pyx) */
PKV_DEFINE_ENTRY_POINTS(bf16, int16_t, PKV_STORAGE_BFLOAT16)

/* e**x for x <= 0.
 *
 * libm's expf is a scalar call (vectorising it needs -ffast-math, which this
 * build avoids), and it was a quarter of the decode kernel's time.  This is
 * the usual vectorisable form: exp(x) = 2^k * exp(r), k = round(x / ln 2),
 * r = x - k ln 2 in [-ln2/2, ln2/2] (ln 2 split in two for exactness), and a
 * degree-6 Taylor polynomial for exp(r): relative error below 2e-7.  Inputs
 * below -87 (including -inf) give 0. */
PKV_INLINE float pkv_exp_nonpositive(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float k = __builtin_floorf(xc * 1.44269504f + 0.5f);
    const float r = (xc - k * 0.693145752f) - k * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)k + 127) << 23;
    return x < -87.0f ? 0.0f : p * scale.f;
}

#include "pkv_tanh.h"
PKV_DEFINE_TANH(PKV_INLINE, pkv_tanh, float, pkv_exp_nonpositive, __builtin_fabsf,
                __builtin_copysignf)

/* The variant contract (opencl/pkv_variant.h), over this file's exp and tanh. */
#define PKV_VARIANT_EXP pkv_exp_nonpositive
#define PKV_VARIANT_TANH pkv_tanh
#include "pkv_variant.h"

/* The contract's row step (pkv_variant.h) on rows of floats, vectorised by
 * OpenMP simd. */
#define PKV_PRAGMA(x) _Pragma(#x)
#define PKV_VARIANT_SIMD(clause) PKV_PRAGMA(omp simd clause)
#define PKV_SCALAR(x) (x)
PKV_DEFINE_SOFTMAX_ROW(static inline, pkv_row, , float, int, 0, 1, , PKV_SCALAR, PKV_SCALAR)


/* One step of online softmax for queries 0 : nq_padded over the keys of a
 * page, or of a span of consecutive pages (see attend_item).
 *
 * s[qi * ld + t], t < nt: the logits of the keys at positions first_key + t
 * in, the weights out.  Query qi < nq (row qi / group of the item whose band
 * is `band`) sees the keys of its band (pkv_band_lo/hi) within the page;
 * padding queries qi >= nq see none.  soft_cap > 0 caps the logits first;
 * then, with slopes (the slopes of the group's query heads, slopes[qi %
 * group]; NULL: none), the visible logits gain pkv_bias(slope, j - p).
 * Weights of keys a query does not see are zero, so that queries can share
 * one accumulation.  run_max and run_sum [nq_padded] are the running max and
 * sum; alpha[qi] receives pkv_rescale, the factor that rescales query qi's
 * accumulator. */
static inline void pkv_softmax_page(float *restrict s, int ld, int nq, int nq_padded, int nt,
                                    pkv_band band, int64_t first_key, int group,
                                    float soft_cap, const float *restrict slopes,
                                    float *restrict run_max, float *restrict run_sum,
                                    float *restrict alpha) {
    const float inverse_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;
    /* When the keys fill the rows (nt == ld), capping all rows in one loop
     * costs less than a short loop per query's band. */
    const int cap_rows = soft_cap > 0.0f && nt == ld;
    if (cap_rows) pkv_row_logits(s, nq * ld, soft_cap, inverse_cap);
    /* Queries go in chunks of 16, so that the rescale factors of a chunk are
     * exponentiated in one vector loop rather than one call per query. */
    for (int q0 = 0; q0 < nq_padded; q0 += 16) {
        const int q1 = q0 + 16 < nq_padded ? q0 + 16 : nq_padded;
        float page_sum[16], old_max[16];
        for (int qi = q0; qi < q1; qi++) {
            float *row = s + qi * ld;
            int64_t lo = 0, hi = 0;
            if (qi < nq) {
                lo = pkv_band_lo(band, qi / group) - first_key;
                hi = pkv_band_hi(band, qi / group) - first_key;
                lo = lo > 0 ? lo : 0;
                hi = hi < nt ? hi : nt;
            }
            if (hi > lo && soft_cap > 0.0f && !cap_rows)
                pkv_row_logits(row + lo, (int)(hi - lo), soft_cap, inverse_cap);
            if (hi > lo && slopes)
                pkv_row_bias(row, (int)lo, (int)hi, slopes[qi % group],
                             (int)(first_key - pkv_band_position(band, qi / group)));
            old_max[qi - q0] = run_max[qi];
            page_sum[qi - q0] = pkv_row_step(row, nt, (int)lo, (int)hi, &run_max[qi]);
        }
        #pragma omp simd
        for (int qi = q0; qi < q1; qi++) alpha[qi] = pkv_rescale(old_max[qi - q0], run_max[qi]);
        for (int qi = q0; qi < q1; qi++) run_sum[qi] = run_sum[qi] * alpha[qi] + page_sum[qi - q0];
    }
}

#endif
