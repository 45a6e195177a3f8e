/* Shared by every pagedkv kernel: storage type, vector loads, pool addressing.
 *
 * Build options (set by pagedkv/backends/opencl.py):
 *   PKV_STORAGE   the pools' format, a number of pkv_storage.h (which defines
 *                 its element type, loads and stores)
 *   PKV_ROTATION_BLOCK, PKV_ROTATION_SCALE   int8 only (pkv_storage.h): the
 *                 Hadamard block rows are rotated by, and 1 / sqrt(block) as an
 *                 exact hex float
 *   PKV_HEAD_DIM  D, floats per K/V/Q row
 *   PKV_V_HEAD_DIM  floats per V row and output row, where V rows have their own
 *                 width (the separate layout's v_head_dim; default PKV_HEAD_DIM);
 *                 only the attention kernel reads it: the other kernels move one
 *                 pool's rows, and are built once per width
 *   PKV_VW        floats per vector: 1, 2, 4 or 8, dividing PKV_HEAD_DIM (and
 *                 PKV_V_HEAD_DIM)
 *
 * Pools are [num_pages, num_kv_heads, page_size, D]; element offsets are
 * computed in ulong because a pool may hold more than 2**31 elements.
 *
 * Loads are plain (aligned) vector dereferences and half -> float is done
 * with integer arithmetic below rather than with vload / vload_half: some
 * drivers (PoCL's CPU device among them) do not inline those builtins, and
 * a call per vector costs several times the memory traffic it serves.  Half
 * stores, which need round-to-nearest-even, use vstore_half_rte.  Neither
 * needs cl_khr_fp16.
 */
#ifndef PKV_COMMON_H
#define PKV_COMMON_H

#include "pkv_tanh.h"

#if !defined(PKV_STORAGE) || !defined(PKV_HEAD_DIM) || !defined(PKV_VW)
#error "build with -DPKV_STORAGE=<pkv_storage.h number> -DPKV_HEAD_DIM=D -DPKV_VW=1|2|4|8"
#endif
#if PKV_HEAD_DIM % PKV_VW != 0
#error "PKV_VW must divide PKV_HEAD_DIM"
#endif

#ifndef PKV_V_HEAD_DIM
#define PKV_V_HEAD_DIM PKV_HEAD_DIM
#endif
#if PKV_V_HEAD_DIM % PKV_VW != 0
#error "PKV_VW must divide PKV_V_HEAD_DIM"
#endif

#define PKV_D PKV_HEAD_DIM
#define PKV_DV (PKV_HEAD_DIM / PKV_VW)     /* vectors per row */
#define PKV_VD PKV_V_HEAD_DIM              /* floats per V (and output) row */
#define PKV_VDV (PKV_V_HEAD_DIM / PKV_VW)  /* vectors per V (and output) row */
#define PKV_CEIL(a, b) (((a) + (b) - 1) / (b))

#define PKV_CAT_(a, b) a##b
#define PKV_CAT(a, b) PKV_CAT_(a, b)

/* -- vectors of PKV_VW floats (and of their storage) -------------------------------- */
#if PKV_VW == 1
typedef float pkv_vec;
typedef uint pkv_uvec;
typedef ushort pkv_hvec;
typedef char pkv_cvec;
#define PKV_CONVERT_VEC convert_float
#define PKV_WIDEN(h) ((uint)(h))
#define PKV_AS_VEC as_float
#define PKV_AS_UVEC as_uint
#define PKV_VSTORE_HALF vstore_half
#define PKV_VLOAD_HALF vload_half
#define PKV_HSUM(x) (x)
#elif PKV_VW == 2
typedef float2 pkv_vec;
typedef uint2 pkv_uvec;
typedef ushort2 pkv_hvec;
typedef char2 pkv_cvec;
#define PKV_CONVERT_VEC convert_float2
#define PKV_AS_VEC as_float2
#define PKV_AS_UVEC as_uint2
#define PKV_VSTORE_HALF vstore_half2
#define PKV_VLOAD_HALF vload_half2
#define PKV_WIDEN(h) ((uint2)((h).s0, (h).s1))
#define PKV_HSUM(x) ((x).s0 + (x).s1)
#elif PKV_VW == 4
typedef float4 pkv_vec;
typedef uint4 pkv_uvec;
typedef ushort4 pkv_hvec;
typedef char4 pkv_cvec;
#define PKV_CONVERT_VEC convert_float4
#define PKV_AS_VEC as_float4
#define PKV_AS_UVEC as_uint4
#define PKV_VSTORE_HALF vstore_half4
#define PKV_VLOAD_HALF vload_half4
#define PKV_WIDEN(h) ((uint4)((h).s0, (h).s1, (h).s2, (h).s3))
#define PKV_HSUM(x) (((x).s0 + (x).s1) + ((x).s2 + (x).s3))
#elif PKV_VW == 8
typedef float8 pkv_vec;
typedef uint8 pkv_uvec;
typedef ushort8 pkv_hvec;
typedef char8 pkv_cvec;
#define PKV_CONVERT_VEC convert_float8
#define PKV_AS_VEC as_float8
#define PKV_AS_UVEC as_uint8
#define PKV_VSTORE_HALF vstore_half8
#define PKV_VLOAD_HALF vload_half8
#define PKV_WIDEN(h) ((uint8)((h).s0, (h).s1, (h).s2, (h).s3, (h).s4, (h).s5, (h).s6, (h).s7))
#define PKV_HSUM(x) ((((x).s0 + (x).s1) + ((x).s2 + (x).s3)) + \
                     (((x).s4 + (x).s5) + ((x).s6 + (x).s7)))
#else
#error "PKV_VW must be 1, 2, 4 or 8"
#endif

/* IEEE half bits -> float, exactly (subnormals, infinities and NaN included).
 * Shift exponent and mantissa into place and rebias the exponent by 112
 * (by 224 for inf/NaN, so they stay all-ones); a subnormal half comes out
 * as 2**-14 * (1 + m/1024) and loses the 2**-14 in one exact subtraction,
 * so no float subnormal is ever formed (nothing for flush-to-zero to eat). */
inline pkv_vec pkv_half_to_float(pkv_hvec bits) {
    const pkv_uvec h = PKV_WIDEN(bits);
    const pkv_uvec shifted = (h & 0x7fffu) << 13;
    const pkv_uvec exponent = shifted & 0x0f800000u;
    const pkv_uvec zero = (pkv_uvec)(0u);
    pkv_uvec biased = shifted + 0x38000000u;
    biased += exponent == 0x0f800000u ? (pkv_uvec)(0x38000000u) : zero;
    biased += exponent == 0u ? (pkv_uvec)(0x00800000u) : zero;
    pkv_vec magnitude = PKV_AS_VEC(biased);
    magnitude -= exponent == 0u ? (pkv_vec)(0x1p-14f) : (pkv_vec)(0.0f);
    return PKV_AS_VEC(PKV_AS_UVEC(magnitude) | ((h & 0x8000u) << 16));
}

/* -- storage: the element type and loads/stores of the format, pkv_storage.h -- */
#include "pkv_storage.h"

/* float data (q, k, v inputs, outputs): aligned vector access */
#define PKV_VLOAD_F(i, p) (((const __global pkv_vec*)(p))[i])
#define PKV_VSTORE_F(x, i, p) (((__global pkv_vec*)(p))[i] = (x))

/* exp(x) for the softmax, where x <= 0 (or NaN): Cody-Waite reduction to
 * x = n ln2 + r, |r| <= ln2/2, and Cephes' degree-6 polynomial for e**r
 * (about 1 ulp).  Inline arithmetic, unlike a library call that a driver
 * may not inline.  Results below FLT_MIN (x < -87.3) come out as 0, which
 * next to the softmax's largest weight of 1 changes nothing.
 *
 * PKV_DEFINE_EXP(name, T, IT, AS_T, AS_IT) defines it for a float type T
 * (float or a vector) with the int type IT of the same shape and their bit
 * casts: pkv_exp below, and attention.cl's vector pkv_exp_s. */
#define PKV_DEFINE_EXP(name, T, IT, AS_T, AS_IT)                                     \
inline T name(T x) {                                                                \
    const T shifted = x * 1.44269504f + 12582912.0f;  /* low bits: round(x / ln 2) */ \
    const T n = shifted - 12582912.0f;                                               \
    const IT ni = AS_IT(shifted) - 0x4B400000;                                       \
    const T r = (x - n * 0.693359375f) + n * 2.12194440e-4f;                         \
    const T z = r * r;                                                               \
    T p = 1.9875691500e-4f;                                                          \
    p = p * r + 1.3981999507e-3f;                                                    \
    p = p * r + 8.3334519073e-3f;                                                    \
    p = p * r + 4.1665795894e-2f;                                                    \
    p = p * r + 1.6666665459e-1f;                                                    \
    p = p * r + 5.0000001201e-1f;                                                    \
    const T e = (p * z + r + 1.0f) * AS_T((ni + 127) << 23);                         \
    /* below -87.3 (and -inf): 0; NaN stays NaN */                                   \
    return x >= -87.3f ? e : (x != x ? x : (T)(0.0f));                               \
}

PKV_DEFINE_EXP(pkv_exp, float, int, as_float, as_int)

/* Element offset of row `offset` (token within page) of `head` in `page`. */
inline ulong pkv_row(int page, int head, int offset, int num_kv_heads, int page_size) {
    return (((ulong)page * (ulong)num_kv_heads + (ulong)head) * (ulong)page_size
            + (ulong)offset) * (ulong)PKV_D;
}

/* Vector `gid` of a [T, H, D] float array (PKV_DV vectors per row (t, h)):
 * returns its t, and its head and vector in *h, *vec. */
inline ulong pkv_split_vector(const ulong gid, const int num_kv_heads, int* h, int* vec) {
    const ulong per_token = (ulong)num_kv_heads * PKV_DV;
    const ulong t = gid / per_token;
    const int rest = (int)(gid - t * per_token);
    *h = rest / PKV_DV;
    *vec = rest % PKV_DV;
    return t;
}

#if PKV_VECTOR_ROWS
/* Formats stored vector by vector: vector `gid` of k and v ([T, H, D] float, PKV_DV vectors per
 * row (t, h)) into the pools at slot_mapping[t]; a slot outside the pool (-1:
 * none) skips.  The scatter kernel, and the scatter work-groups of the
 * attention kernel, run this per work-item. */
inline void pkv_scatter_vector(const ulong gid, __global const float* k, __global const float* v,
                               __global const long* slot_mapping, __global pkv_storage* k_pool,
                               __global pkv_storage* v_pool, const int num_tokens,
                               const int num_kv_heads, const int page_size, const long num_slots) {
    int h, vec;
    const ulong t = pkv_split_vector(gid, num_kv_heads, &h, &vec);
    if (t >= (ulong)num_tokens) return;
    const long slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    const ulong dst = pkv_row((int)(slot / page_size), h, (int)(slot % page_size),
                              num_kv_heads, page_size) / PKV_VW + vec;
    PKV_VSTORE_S(PKV_VLOAD_F(gid, k), dst, k_pool);
    if (v_pool != k_pool)   /* latent rows: the values are the row just stored */
        PKV_VSTORE_S(PKV_VLOAD_F(gid, v), dst, v_pool);
}

/* A float vector rounded as the pools store it (what a store then a load gives). */
inline pkv_vec pkv_round_to_storage(const pkv_vec x) {
    return PKV_ROUND_S(x);
}
#endif

#endif
