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

/* Rows whose largest magnitude reaches PKV_ROTATE_BIG are rotated scaled by
 * 1 / PKV_ROTATE_BIG: a block's butterflies add up to `block` values, which
 * overflows float32 from about FLT_MAX / block (rows of 1e38 became inf,
 * then NaN).  Scaling by a power of two is exact, so a row that did not
 * overflow rotates to the same bits either way (only elements under
 * 2**-62 of a row over 2**64 lose bits, far below its int8 rounding). */
#define PKV_ROTATE_BIG 0x1p64f
#define PKV_ROTATE_SMALL 0x1p-64f

/* x[0:n] <- blocks of `block` values each multiplied by the Hadamard matrix
 * of that order, times `scale`, with no precaution against overflow. */
static void pkv_rotate_raw(float *x, int n, int block, float scale) {
    PKV_EXACT_FP
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

/* max |x[i]|, i < n (NaN ignored). */
static float pkv_row_amax(const float *x, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* x[0:n] <- blocks of `block` values each multiplied by the Hadamard matrix
 * of that order, times `scale` (1/sqrt(block): orthonormal, its own inverse).
 * block 0 leaves x as it is.  Overflows only where the result does. */
static void pkv_rotate(float *x, int n, int block, float scale) {
    PKV_EXACT_FP
    if (block <= 1) return;
    if (!(pkv_row_amax(x, n) >= PKV_ROTATE_BIG)) {
        pkv_rotate_raw(x, n, block, scale);
        return;
    }
    for (int i = 0; i < n; i++) x[i] *= PKV_ROTATE_SMALL;
    pkv_rotate_raw(x, n, block, scale);
    for (int i = 0; i < n; i++) x[i] *= PKV_ROTATE_BIG;
}

/* One row: x[0:n] rotated (in tmp), then q = round(y / s) in [-127, 127]
 * with s = max |y| / 127; returns s.  An all-zero row gives s = 0 and zeros;
 * NaN values quantize to 0.  A row of finite values gives a finite s even
 * where y itself exceeds float32 (a row of 3e38s rotates to 3.4e39): such a
 * row is rotated and divided scaled by 1 / PKV_ROTATE_BIG, which changes no
 * bit of q, and s scaled back. */
static float pkv_quantize(const float *x, int n, int block, float scale, int8_t *q, float *tmp) {
    PKV_EXACT_FP
    const int big = block > 1 && pkv_row_amax(x, n) >= PKV_ROTATE_BIG;
    for (int i = 0; i < n; i++) tmp[i] = big ? x[i] * PKV_ROTATE_SMALL : x[i];
    if (block > 1) pkv_rotate_raw(tmp, n, block, scale);
    const float s = pkv_row_amax(tmp, n) / 127.0f;
    for (int i = 0; i < n; i++) {
        float v = s > 0.0f ? tmp[i] / s : 0.0f;
        v = v != v ? 0.0f : (v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v));
        q[i] = (int8_t)nearbyintf(v);
    }
    return big ? s * PKV_ROTATE_BIG : s;
}

/* out[0:n] = the row q * s rotated back.  Where q * s could overflow in the
 * rotation (s from 2**56), the row goes scaled by 1 / PKV_ROTATE_BIG, and
 * values the rounding took past float32's range come back as +-FLT_MAX: a
 * row of finite values reads back finite. */
static void pkv_dequantize(const int8_t *q, float s, int n, int block, float scale, float *out) {
    PKV_EXACT_FP
    if (block <= 1 || !(s >= 0x1p56f)) {
        for (int i = 0; i < n; i++) out[i] = (float)q[i] * s;
        if (block > 1) pkv_rotate_raw(out, n, block, scale);
        return;
    }
    const float s_small = s * PKV_ROTATE_SMALL;
    for (int i = 0; i < n; i++) out[i] = (float)q[i] * s_small;
    pkv_rotate_raw(out, n, block, scale);
    for (int i = 0; i < n; i++) {
        const float x = out[i] * PKV_ROTATE_BIG;
        out[i] = x > 3.40282347e38f ? 3.40282347e38f : (x < -3.40282347e38f ? -3.40282347e38f : x);
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#endif
