/* The vector primitives of the host attention kernel.
 *
 * Written in C rather than Cython for what Cython cannot say: `restrict`
 * (without it the compiler guards each loop with a run-time alias check),
 * `omp simd reduction` (vectorised dot products; needs -fopenmp or
 * -fopenmp-simd, and is ignored, still correct, without them), prefetch
 * hints, and F16C conversions.  All arithmetic is float32.
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

/* scores[qi * ld + t] = dot(q[qi], k[t]) for nq queries (rows of q) and nt
 * keys (rows of k), all rows n floats.  Four queries share each key load. */
static inline void pkv_scores(const float *restrict q, int nq, const float *restrict k, int nt,
                              int n, float *restrict scores, int ld) {
    int qi = 0;
    for (; qi + 4 <= nq; qi += 4) {
        const float *q0 = q + qi * n, *q1 = q0 + n, *q2 = q1 + n, *q3 = q2 + n;
        for (int t = 0; t < nt; t++) {
            const float *kt = k + t * n;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            #pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int i = 0; i < n; i++) {
                const float kv = kt[i];
                s0 += q0[i] * kv; s1 += q1[i] * kv; s2 += q2[i] * kv; s3 += q3[i] * kv;
            }
            scores[qi * ld + t] = s0; scores[(qi + 1) * ld + t] = s1;
            scores[(qi + 2) * ld + t] = s2; scores[(qi + 3) * ld + t] = s3;
        }
    }
    for (; qi < nq; qi++) {
        for (int t = 0; t < nt; t++) {
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int i = 0; i < n; i++) s += q[qi * n + i] * k[t * n + i];
            scores[qi * ld + t] = s;
        }
    }
}

/* y[0:n] = alpha * y[0:n] + sum over t < nt of p[t] * x[t*n : t*n+n] */
static inline void pkv_rescale_accumulate(float *restrict y, float alpha, const float *restrict p,
                                          const float *restrict x, int nt, int n) {
    #pragma omp simd
    for (int i = 0; i < n; i++) y[i] *= alpha;
    for (int t = 0; t < nt; t++) {
        const float pt = p[t];
        const float *restrict xt = x + t * n;
        #pragma omp simd
        for (int i = 0; i < n; i++) y[i] += pt * xt[i];
    }
}

/* Ask for `bytes` at `p` ahead of use: pages are scattered, so the hardware
 * prefetcher loses the stream at every page boundary. */
static inline void pkv_prefetch(const void *p, long bytes) {
#if defined(__GNUC__) || defined(__clang__)
    const char *c = (const char *)p;
    for (long off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 0);
#else
    (void)p; (void)bytes;
#endif
}
#endif
