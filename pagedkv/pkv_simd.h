/* The vector primitives of the host attention kernel.
 *
 * Written in C rather than Cython for what Cython cannot say: `restrict`
 * (without it the compiler guards each loop with a run-time alias check),
 * `omp simd reduction` (vectorised dot products; needs -fopenmp or
 * -fopenmp-simd, and is ignored, still correct, without them), vector
 * types, and F16C conversions.  All arithmetic is float32.
 */
#ifndef PKV_SIMD_H
#define PKV_SIMD_H
#include <stdint.h>
#include "pkv_half.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* dst[0:n] = float(src[0:n]) for IEEE float16 bits; 8 at a time with F16C. */
static inline void pkv_halves_to_floats(const uint16_t *restrict src, float *restrict dst, int n) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = pkv_half_to_float(src[i]);
}

#if defined(__GNUC__) || defined(__clang__)
/* Eight floats at any 4-byte alignment (GCC/Clang vector extension). */
typedef float pkv_f32x8 __attribute__((vector_size(32), aligned(4)));

static inline float pkv_hsum8(pkv_f32x8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
#endif

/* scores[qi * ld + t] = dot(q[qi], k[t]) for nq queries (rows of q) and nt
 * keys (rows of k), all rows n floats.  Four queries share each key load and
 * keep their partial sums in registers. */
static inline void pkv_scores(const float *restrict q, int nq, const float *restrict k, int nt,
                              int n, float *restrict scores, int ld) {
    int qi = 0;
#if defined(__GNUC__) || defined(__clang__)
    const int n8 = n & ~7;
    for (; qi + 4 <= nq; qi += 4) {
        const float *q0 = q + qi * n, *q1 = q0 + n, *q2 = q1 + n, *q3 = q2 + n;
        for (int t = 0; t < nt; t++) {
            const float *kt = k + t * n;
            pkv_f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int i = 0; i < n8; i += 8) {
                const pkv_f32x8 kv = *(const pkv_f32x8 *)(kt + i);
                a0 += *(const pkv_f32x8 *)(q0 + i) * kv;
                a1 += *(const pkv_f32x8 *)(q1 + i) * kv;
                a2 += *(const pkv_f32x8 *)(q2 + i) * kv;
                a3 += *(const pkv_f32x8 *)(q3 + i) * kv;
            }
            float s0 = pkv_hsum8(a0), s1 = pkv_hsum8(a1), s2 = pkv_hsum8(a2), s3 = pkv_hsum8(a3);
            for (int i = n8; i < n; i++) {
                s0 += q0[i] * kt[i]; s1 += q1[i] * kt[i]; s2 += q2[i] * kt[i]; s3 += q3[i] * kt[i];
            }
            scores[qi * ld + t] = s0; scores[(qi + 1) * ld + t] = s1;
            scores[(qi + 2) * ld + t] = s2; scores[(qi + 3) * ld + t] = s3;
        }
    }
#endif
    for (; qi < nq; qi++) {
        for (int t = 0; t < nt; t++) {
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int i = 0; i < n; i++) s += q[qi * n + i] * k[t * n + i];
            scores[qi * ld + t] = s;
        }
    }
}

/* For q in 0..3: acc[q*n : q*n+n] = alpha[q] * acc[q*n : ...] + sum over t < nt
 * of p[q*ld + t] * x[t*n : t*n+n].  Four queries share each load of x, and
 * each 8-column block of the four accumulators stays in registers across all
 * nt rows (GCC/Clang vector extensions; plain loops elsewhere). */
static inline void pkv_rescale_accumulate4(float *restrict acc, const float *restrict alpha,
                                           const float *restrict p, int ld,
                                           const float *restrict x, int nt, int n) {
    int i0 = 0;
#if defined(__GNUC__) || defined(__clang__)
    for (; i0 + 8 <= n; i0 += 8) {
        pkv_f32x8 a0 = *(const pkv_f32x8 *)(acc + i0) * alpha[0];
        pkv_f32x8 a1 = *(const pkv_f32x8 *)(acc + n + i0) * alpha[1];
        pkv_f32x8 a2 = *(const pkv_f32x8 *)(acc + 2 * n + i0) * alpha[2];
        pkv_f32x8 a3 = *(const pkv_f32x8 *)(acc + 3 * n + i0) * alpha[3];
        for (int t = 0; t < nt; t++) {
            const pkv_f32x8 xv = *(const pkv_f32x8 *)(x + t * n + i0);
            a0 += p[t] * xv;
            a1 += p[ld + t] * xv;
            a2 += p[2 * ld + t] * xv;
            a3 += p[3 * ld + t] * xv;
        }
        *(pkv_f32x8 *)(acc + i0) = a0;
        *(pkv_f32x8 *)(acc + n + i0) = a1;
        *(pkv_f32x8 *)(acc + 2 * n + i0) = a2;
        *(pkv_f32x8 *)(acc + 3 * n + i0) = a3;
    }
#endif
    for (int q = 0; q < 4; q++)
        for (int i = i0; i < n; i++) {
            float a = acc[q * n + i] * alpha[q];
            for (int t = 0; t < nt; t++) a += p[q * ld + t] * x[t * n + i];
            acc[q * n + i] = a;
        }
}

/* s[i] = exp(s[i] - m) for s[i] <= m; returns the sum of the results.
 *
 * libm's expf is a scalar call (vectorising it needs -ffast-math, which this
 * build avoids), and it was a quarter of the decode kernel's time.  This is
 * the usual vectorisable form: exp(x) = 2^k * exp(r), k = round(x / ln 2),
 * r = x - k ln 2 in [-ln2/2, ln2/2] (ln 2 split in two for exactness), and a
 * degree-6 Taylor polynomial for exp(r): relative error below 2e-7.  Inputs
 * below -87 (including -inf) give 0. */
static inline float pkv_exp_shifted(float *restrict s, int n, float m) {
    float total = 0.0f;
    #pragma omp simd reduction(+:total)
    for (int i = 0; i < n; i++) {
        float x = s[i] - m;
        x = x < -87.0f ? -87.0f : x;
        const float k = __builtin_floorf(x * 1.44269504f + 0.5f);
        const float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
        float p = 1.0f / 720.0f;
        p = p * r + 1.0f / 120.0f;
        p = p * r + 1.0f / 24.0f;
        p = p * r + 1.0f / 6.0f;
        p = p * r + 0.5f;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        union { float f; int32_t i; } scale;
        scale.i = ((int32_t)k + 127) << 23;
        const float e = s[i] - m < -87.0f ? 0.0f : p * scale.f;
        s[i] = e;
        total += e;
    }
    return total;
}

#endif
