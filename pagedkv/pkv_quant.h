/* int8 rows of the host kernels: the blocked Hadamard rotation, quantizing and
 * dequantizing (see pagedkv/storage.py for the format).
 *
 * The arithmetic is the same, operation for operation, as pkv_rotate and
 * pkv_quantize in opencl/pkv_common.h (the same butterfly order, a final
 * multiply by the same float32 constant, IEEE division, round to nearest
 * even, no fused multiply-adds), so that both backends store the same
 * bits.  Reassociation and contraction are off here for that reason: the
 * build's -fassociative-math would let the compiler regroup the
 * butterflies' sums, and FMA levels would fuse a scale into a sum.
 */
#ifndef PKV_QUANT_H
#define PKV_QUANT_H
#include <math.h>
#include <stdint.h>

#if defined(__clang__)
#define PKV_EXACT_FP _Pragma("clang fp reassociate(off) contract(off)")
#elif defined(__GNUC__)
#define PKV_EXACT_FP
#pragma GCC push_options
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#else
#define PKV_EXACT_FP
#endif

/* x[0:n] <- blocks of `block` values each multiplied by the Hadamard matrix
 * of that order, times `scale` (1/sqrt(block): orthonormal, its own inverse).
 * block 0 leaves x as it is. */
static void pkv_rotate(float *x, int n, int block, float scale) {
    PKV_EXACT_FP
    if (block <= 1) return;
    for (int b0 = 0; b0 < n; b0 += block)
        for (int h = 1; h < block; h *= 2)
            for (int i = b0; i < b0 + block; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float a = x[j], c = x[j + h];
                    x[j] = a + c;
                    x[j + h] = a - c;
                }
    for (int i = 0; i < n; i++) x[i] *= scale;
}

/* One row: x[0:n] rotated (in tmp), then q = round(y / s) in [-127, 127]
 * with s = max |y| / 127; returns s.  An all-zero row gives s = 0 and zeros;
 * NaN values quantize to 0. */
static float pkv_quantize(const float *x, int n, int block, float scale, int8_t *q, float *tmp) {
    PKV_EXACT_FP
    float amax = 0.0f;
    for (int i = 0; i < n; i++) tmp[i] = x[i];
    pkv_rotate(tmp, n, block, scale);
    for (int i = 0; i < n; i++) {
        const float a = fabsf(tmp[i]);
        amax = a > amax ? a : amax;
    }
    const float s = amax / 127.0f;
    for (int i = 0; i < n; i++) {
        float v = s > 0.0f ? tmp[i] / s : 0.0f;
        v = v != v ? 0.0f : (v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v));
        q[i] = (int8_t)nearbyintf(v);
    }
    return s;
}

/* out[0:n] = the row q * s rotated back. */
static void pkv_dequantize(const int8_t *q, float s, int n, int block, float scale, float *out) {
    PKV_EXACT_FP
    for (int i = 0; i < n; i++) out[i] = (float)q[i] * s;
    pkv_rotate(out, n, block, scale);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#endif
