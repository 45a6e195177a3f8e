/* The storage formats of the K/V pools: the one list that the host kernels
 * (pagedkv/pkv_simd.h, pagedkv/_kernels.pyx), the OpenCL kernels (pkv_common.h,
 * built with -DPKV_STORAGE=<number>) and Python (pagedkv/storage.py, which
 * reads the lines below) share.  Macros, not an enum, so that the OpenCL
 * sources can choose types with #if.
 *
 *   FLOAT32  float values
 *   FLOAT16  IEEE binary16 bits
 *   INT8     int8 values and one float32 scale per row (a token's head_dim
 *            values of one KV head): value * scale, in a basis rotated by
 *            blocks of an orthonormal Hadamard transform (pagedkv/storage.py)
 *   BFLOAT16 bfloat16 bits: the high 16 bits of a float32, rounded to
 *            nearest even (NaN kept NaN)
 *
 * For OpenCL this header also holds each format's elements (pkv_common.h
 * includes it after its vector types), so that a format is written down in
 * one place:
 *   pkv_storage          the pools' element type
 *   pkv_bits             an integer type of the element's size, for raw copies
 *   PKV_VECTOR_ROWS      1 where rows are stored and loaded vector by vector
 *                        (the three below): any work-item may store a vector
 *                        of a new row (scatter_kv, the attention kernel's
 *                        fused store); 0 where a row is stored whole, with a
 *                        float32 scale (int8: pkv_quantize, pkv_dequantize,
 *                        the row kernels of kv_pages.cl), and the attention
 *                        kernel reads rows only through its staged tiles
 *   PKV_VLOAD_S(i, p)    vector i of a stored row as floats (int8: unscaled)
 *   PKV_VSTORE_S(x, i, p)  a float vector into a row (PKV_VECTOR_ROWS formats)
 *   PKV_ROUND_S(x)       a float vector rounded as the format stores it (what
 *                        a store then a load gives; PKV_VECTOR_ROWS formats)
 *   PKV_ROW_SCALE(scales, row)  what vector loads of the row at element offset
 *                        `row` are multiplied by: its scale (int8), else 1
 */
#ifndef PKV_STORAGE_H
#define PKV_STORAGE_H

#define PKV_STORAGE_FLOAT32 0
#define PKV_STORAGE_FLOAT16 1
#define PKV_STORAGE_INT8 2
#define PKV_STORAGE_BFLOAT16 3

#ifdef __OPENCL_VERSION__
#if PKV_STORAGE == PKV_STORAGE_FLOAT16
typedef ushort pkv_storage;   /* IEEE half bits */
typedef ushort pkv_bits;
#define PKV_VLOAD_S(i, p) pkv_half_to_float(((const __global pkv_hvec*)(p))[i])
#define PKV_VSTORE_S(x, i, p) PKV_CAT(PKV_VSTORE_HALF, _rte)((x), (i), (__global half*)(p))
/* stored and loaded through the same half*: PoCL 3.0 reads the bits back as
   zeros when they are loaded as a ushort vector instead */
inline pkv_vec pkv_round_half(const pkv_vec x) {
    ushort bits[PKV_VW];
    PKV_CAT(PKV_VSTORE_HALF, _rte)(x, 0, (__private half*)bits);
    return PKV_VLOAD_HALF(0, (__private const half*)bits);
}
#define PKV_ROUND_S(x) pkv_round_half(x)
#elif PKV_STORAGE == PKV_STORAGE_BFLOAT16
typedef ushort pkv_storage;   /* the high 16 bits of a float */
typedef ushort pkv_bits;
#if PKV_VW == 1
#define PKV_NARROW_BF16 convert_ushort
#else
#define PKV_NARROW_BF16 PKV_CAT(convert_ushort, PKV_VW)
#endif
/* float -> bfloat16 bits, round to nearest even (pagedkv/pkv_simd.h's
   pkv_float_to_bf16, lane by lane); NaN quieted, not rounded into inf */
inline pkv_hvec pkv_float_to_bf16(const pkv_vec x) {
    const pkv_uvec u = PKV_AS_UVEC(x);
    const pkv_uvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const pkv_uvec quiet = (u >> 16) | 0x0040u;
    return PKV_NARROW_BF16((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}
#define PKV_BF16_TO_FLOAT(h) PKV_AS_VEC(PKV_WIDEN(h) << 16)
#define PKV_VLOAD_S(i, p) PKV_BF16_TO_FLOAT(((const __global pkv_hvec*)(p))[i])
#define PKV_VSTORE_S(x, i, p) (((__global pkv_hvec*)(p))[i] = pkv_float_to_bf16(x))
#define PKV_ROUND_S(x) PKV_BF16_TO_FLOAT(pkv_float_to_bf16(x))
#elif PKV_STORAGE == PKV_STORAGE_INT8
typedef char pkv_storage;
typedef char pkv_bits;
#define PKV_VECTOR_ROWS 0
#define PKV_VLOAD_S(i, p) PKV_CONVERT_VEC(((const __global pkv_cvec*)(p))[i])
#define PKV_ROW_SCALE(scales, row) ((scales)[(row) / PKV_D])
#ifndef PKV_ROTATION_BLOCK
#define PKV_ROTATION_BLOCK 0
#define PKV_ROTATION_SCALE 1.0f
#endif

/* The blocked Hadamard rotation and quantizing of int8 rows.
 * Operation for operation the host's pagedkv/pkv_quant.h (same butterfly
 * order, the same float32 constant, no fused multiply-adds, IEEE division:
 * the program is built with -cl-fp32-correctly-rounded-divide-sqrt where
 * the device has it, round to nearest even), so that both backends store
 * the same bits. */

/* Rows whose largest magnitude reaches 2**64 are rotated scaled by 2**-64
 * (exact), as pkv_quant.h explains: a block's butterflies would overflow. */
#define PKV_ROTATE_BIG 0x1p64f
#define PKV_ROTATE_SMALL 0x1p-64f

/* max |x[i]|, i < PKV_D (NaN ignored). */
inline float pkv_row_amax(const float* x) {
    float amax = 0.0f;
    for (int i = 0; i < PKV_D; ++i) {
        const float a = fabs(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* x[0:PKV_D] <- its blocks times the orthonormal Hadamard matrix, with no
 * precaution against overflow. */
inline void pkv_rotate_raw(float* x) {
#pragma OPENCL FP_CONTRACT OFF
#if PKV_ROTATION_BLOCK > 1
    for (int b0 = 0; b0 < PKV_D; b0 += PKV_ROTATION_BLOCK)
        for (int h = 1; h < PKV_ROTATION_BLOCK; h *= 2)
            for (int i = b0; i < b0 + PKV_ROTATION_BLOCK; i += 2 * h)
                for (int j = i; j < i + h; ++j) {
                    const float a = x[j], c = x[j + h];
                    x[j] = a + c;
                    x[j + h] = a - c;
                }
    for (int i = 0; i < PKV_D; ++i) x[i] *= PKV_ROTATION_SCALE;
#endif
}

/* x[0:PKV_D] <- its blocks times the orthonormal Hadamard matrix (its own
 * inverse); overflows only where the result does. */
inline void pkv_rotate(float* x) {
#pragma OPENCL FP_CONTRACT OFF
#if PKV_ROTATION_BLOCK > 1
    const bool big = pkv_row_amax(x) >= PKV_ROTATE_BIG;
    if (big)
        for (int i = 0; i < PKV_D; ++i) x[i] *= PKV_ROTATE_SMALL;
    pkv_rotate_raw(x);
    if (big)
        for (int i = 0; i < PKV_D; ++i) x[i] *= PKV_ROTATE_BIG;
#endif
}

/* The rotated row y = x (in place) as int8 q = round(y / s), s = max |y| / 127;
 * returns s (finite for a finite row: a row from 2**64 goes scaled, as in
 * pkv_quant.h, and x is left scaled). */
inline float pkv_quantize(float* x, __global char* q) {
#pragma OPENCL FP_CONTRACT OFF
#if PKV_ROTATION_BLOCK > 1
    const bool big = pkv_row_amax(x) >= PKV_ROTATE_BIG;
    if (big)
        for (int i = 0; i < PKV_D; ++i) x[i] *= PKV_ROTATE_SMALL;
#else
    const bool big = false;
#endif
    pkv_rotate_raw(x);
    const float s = pkv_row_amax(x) / 127.0f;
    for (int i = 0; i < PKV_D; ++i) {
        float v = s > 0.0f ? x[i] / s : 0.0f;
        v = v != v ? 0.0f : (v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v));
        q[i] = (char)rint(v);
    }
    return big ? s * PKV_ROTATE_BIG : s;
}

/* row[0:PKV_D] = the int8 row q * s rotated back (pkv_dequantize of
 * pkv_quant.h: scaled from s = 2**56, clamped to +-FLT_MAX). */
inline void pkv_dequantize(__global const char* q, const float s, float* row) {
#pragma OPENCL FP_CONTRACT OFF
#if PKV_ROTATION_BLOCK > 1
    const bool big = s >= 0x1p56f;
#else
    const bool big = false;
#endif
    const float s_row = big ? s * PKV_ROTATE_SMALL : s;
    for (int d = 0; d < PKV_D; ++d) row[d] = (float)q[d] * s_row;
    pkv_rotate_raw(row);
    if (big)
        for (int d = 0; d < PKV_D; ++d) {
            const float x = row[d] * PKV_ROTATE_BIG;
            row[d] = x > FLT_MAX ? FLT_MAX : (x < -FLT_MAX ? -FLT_MAX : x);
        }
}
#elif PKV_STORAGE == PKV_STORAGE_FLOAT32
typedef float pkv_storage;
typedef uint pkv_bits;
#define PKV_VLOAD_S(i, p) (((const __global pkv_vec*)(p))[i])
#define PKV_VSTORE_S(x, i, p) (((__global pkv_vec*)(p))[i] = (x))
#define PKV_ROUND_S(x) (x)
#else
#error "PKV_STORAGE: not a format of pkv_storage.h"
#endif
#ifndef PKV_VECTOR_ROWS
#define PKV_VECTOR_ROWS 1
#define PKV_ROW_SCALE(scales, row) 1.0f
#endif
#endif

#endif
