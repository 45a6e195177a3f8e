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
 *   PKV_SCALED           1 where each row has a float32 scale beside its values
 *   PKV_VLOAD_S(i, p)    vector i of a stored row as floats (int8: unscaled)
 *   PKV_VSTORE_S(x, i, p)  a float vector into a float format's row (int8 rows
 *                        are written whole by pkv_quantize)
 *   PKV_ROUND_S(x)       a float vector rounded as the format stores it (what
 *                        a store then a load gives)
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
#define PKV_SCALED 1
#define PKV_VLOAD_S(i, p) PKV_CONVERT_VEC(((const __global pkv_cvec*)(p))[i])
#elif PKV_STORAGE == PKV_STORAGE_FLOAT32
typedef float pkv_storage;
typedef uint pkv_bits;
#define PKV_VLOAD_S(i, p) (((const __global pkv_vec*)(p))[i])
#define PKV_VSTORE_S(x, i, p) (((__global pkv_vec*)(p))[i] = (x))
#define PKV_ROUND_S(x) (x)
#else
#error "PKV_STORAGE: not a format of pkv_storage.h"
#endif
#ifndef PKV_SCALED
#define PKV_SCALED 0
#endif
#endif

#endif
