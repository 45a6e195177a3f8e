/* Moving K/V in and out of the page pools: scatter by slot, gather by slot,
 * whole-page copies (copy-on-write), stored rows as raw bits (export, import,
 * swap), half -> float conversion of inputs, and the rotation of int8
 * formats' queries and outputs.
 *
 * Float formats: one work-item per vector of PKV_VW elements; consecutive
 * work-items touch consecutive memory, so accesses coalesce on GPUs and
 * vectorise on CPUs.  int8 (!PKV_VECTOR_ROWS): one work-item per row, which it
 * rotates and quantizes (or dequantizes and rotates back) whole.  Every slot
 * and page id is checked against the pool before it is used: a bad table can
 * only skip work, never write out of bounds.
 */
#include "pkv_common.h"

#if !PKV_VECTOR_ROWS
/* int8 formats: quantize row (t, h) of k and v ([T, H, D] float) into
   slot_mapping[t]; -1 skips. */
__kernel void scatter_kv_int8(__global const float* k, __global const float* v,
                              __global const long* slot_mapping,
                              __global char* k_pool, __global char* v_pool,
                              __global float* k_scales, __global float* v_scales,
                              const int num_tokens, const int num_kv_heads, const int page_size,
                              const long num_slots) {
    const ulong gid = get_global_id(0);
    const ulong t = gid / (ulong)num_kv_heads;
    if (t >= (ulong)num_tokens) return;
    const int h = (int)(gid - t * (ulong)num_kv_heads);
    const long slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    const ulong dst = pkv_row((int)(slot / page_size), h, (int)(slot % page_size),
                              num_kv_heads, page_size);
    float row[PKV_D];
    for (int i = 0; i < PKV_D; ++i) row[i] = k[gid * PKV_D + i];
    k_scales[dst / PKV_D] = pkv_quantize(row, k_pool + dst);
    if (v_pool == k_pool) return;   /* latent rows: the values are the row just stored */
    for (int i = 0; i < PKV_D; ++i) row[i] = v[gid * PKV_D + i];
    v_scales[dst / PKV_D] = pkv_quantize(row, v_pool + dst);
}

/* int8 formats: k_out[i, h, :] / v_out[i, h, :] ([n, H, D] float) = the rows at
   slots[i], dequantized and rotated back. */
__kernel void gather_kv_int8(__global const char* k_pool, __global const char* v_pool,
                             __global const float* k_scales, __global const float* v_scales,
                             __global const long* slots,
                             __global float* k_out, __global float* v_out,
                             const int num_slots_wanted, const int num_kv_heads,
                             const int page_size, const long num_slots) {
#pragma OPENCL FP_CONTRACT OFF
    const ulong gid = get_global_id(0);
    const ulong i = gid / (ulong)num_kv_heads;
    if (i >= (ulong)num_slots_wanted) return;
    const int h = (int)(gid - i * (ulong)num_kv_heads);
    const long slot = slots[i];
    const bool ok = slot >= 0 && slot < num_slots;
    const ulong src = ok ? pkv_row((int)(slot / page_size), h, (int)(slot % page_size),
                                   num_kv_heads, page_size) : 0;
    float row[PKV_D];
    for (int pool = 0; pool < 2; ++pool) {
        __global const char* values = pool ? v_pool : k_pool;
        const float s = ok ? (pool ? v_scales : k_scales)[src / PKV_D] : 0.0f;
        pkv_dequantize(values + src, s, row);
        __global float* out = pool ? v_out : k_out;
        for (int d = 0; d < PKV_D; ++d) out[gid * PKV_D + d] = row[d];
    }
}

/* Rows of x ([n, D] float) rotated in place (queries before attention, its output after). */
__kernel void rotate_rows(__global float* x, const long n) {
    const ulong r = get_global_id(0);
    if (r >= (ulong)n) return;
    float row[PKV_D];
    for (int d = 0; d < PKV_D; ++d) row[d] = x[r * PKV_D + d];
    pkv_rotate(row);
    for (int d = 0; d < PKV_D; ++d) x[r * PKV_D + d] = row[d];
}
#else
/* Float formats: write row (t, h) of k and v ([T, H, D] float) at slot_mapping[t]; -1 skips. */
__kernel void scatter_kv(__global const float* k, __global const float* v,
                         __global const long* slot_mapping,
                         __global pkv_storage* k_pool, __global pkv_storage* v_pool,
                         const int num_tokens, const int num_kv_heads, const int page_size,
                         const long num_slots) {
    pkv_scatter_vector(get_global_id(0), k, v, slot_mapping, k_pool, v_pool, num_tokens,
                       num_kv_heads, page_size, num_slots);
}

/* k_out[i, h, :] / v_out[i, h, :] ([n, H, D] float) = the pools' rows at slots[i]. */
__kernel void gather_kv(__global const pkv_storage* k_pool, __global const pkv_storage* v_pool,
                        __global const long* slots,
                        __global float* k_out, __global float* v_out,
                        const int num_slots_wanted, const int num_kv_heads, const int page_size,
                        const long num_slots) {
    const ulong gid = get_global_id(0);
    int h, vec;
    const ulong i = pkv_split_vector(gid, num_kv_heads, &h, &vec);
    if (i >= (ulong)num_slots_wanted) return;
    const long slot = slots[i];
    pkv_vec kv = 0.0f, vv = 0.0f;
    if (slot >= 0 && slot < num_slots) {
        const ulong src = pkv_row((int)(slot / page_size), h, (int)(slot % page_size),
                                  num_kv_heads, page_size) / PKV_VW + vec;
        kv = PKV_VLOAD_S(src, k_pool);
        vv = PKV_VLOAD_S(src, v_pool);
    }
    PKV_VSTORE_F(kv, gid, k_out);
    PKV_VSTORE_F(vv, gid, v_out);
}
#endif

/* Page dst[c] = page src[c] in both pools, as raw bits; page_elems = H * page_size * D. */
__kernel void copy_pages(__global pkv_bits* k_pool, __global pkv_bits* v_pool,
                         __global const int* src, __global const int* dst,
                         const int num_copies, const long page_elems, const int num_pages) {
    const ulong gid = get_global_id(0);
    const ulong c = gid / (ulong)page_elems;
    if (c >= (ulong)num_copies) return;
    const ulong e = gid - c * (ulong)page_elems;
    const int s = src[c], d = dst[c];
    if (s < 0 || s >= num_pages || d < 0 || d >= num_pages) return;
    k_pool[(ulong)d * page_elems + e] = k_pool[(ulong)s * page_elems + e];
    v_pool[(ulong)d * page_elems + e] = v_pool[(ulong)s * page_elems + e];
}

/* dst[i] = scale * src[i]: the attention kernel's queries, which it takes
 * scaled (pkv_variant.h); dst may be src. */
__kernel void scale_floats(__global const float* src, __global float* dst, const long n,
                           const float scale) {
    const ulong i = get_global_id(0);
    if (i < (ulong)n) dst[i] = src[i] * scale;
}

/* dst[i] = float(src[i]) for IEEE half input (a float16 pyopencl array). */
__kernel void half_to_float(__global const half* src, __global float* dst, const long n) {
    const ulong i = get_global_id(0);
    if (i < (ulong)n) dst[i] = vload_half(i, src);
}

/* Stored rows as raw bits, in units of 4 bytes (_u32) or 1 byte (_u8): the pool
 * (values or scales of any format) is [num_pages, num_kv_heads, page_size,
 * row_units] units; rows are [num_rows, num_kv_heads, row_units], row (i, h)
 * being head h of the token at slots[i].  One work-item per row, which it
 * copies unit by unit (a work-item per unit spent most of its time on the
 * divisions that place it).  Returns the row's first unit in the pool, or -1
 * for a work-item past the rows or a slot outside the pool (read as zeros,
 * never written). */
inline long pkv_stored_row(const ulong gid, __global const long* slots, const int num_rows,
                           const int num_kv_heads, const int page_size, const int row_units,
                           const long num_slots) {
    const ulong i = gid / (ulong)num_kv_heads;
    if (i >= (ulong)num_rows) return -1;
    const long slot = slots[i];
    if (slot < 0 || slot >= num_slots) return -1;
    const ulong h = gid - i * (ulong)num_kv_heads;
    return (long)((((ulong)(slot / page_size) * (ulong)num_kv_heads + h) * (ulong)page_size
                   + (ulong)(slot % page_size)) * (ulong)row_units);
}

/* The kernels' bodies, for their unit type. */
#define PKV_READ_ROW(zero)                                                                 \
    const ulong gid = get_global_id(0);                                                    \
    if (gid >= (ulong)num_rows * (ulong)num_kv_heads) return;                              \
    const long at = pkv_stored_row(gid, slots, num_rows, num_kv_heads, page_size,         \
                                   row_units, num_slots);                                  \
    for (int u = 0; u < row_units; ++u)                                                    \
        rows[gid * (ulong)row_units + u] = at >= 0 ? pool[at + u] : (zero)
#define PKV_WRITE_ROW()                                                                    \
    const ulong gid = get_global_id(0);                                                    \
    const long at = pkv_stored_row(gid, slots, num_rows, num_kv_heads, page_size,         \
                                   row_units, num_slots);                                  \
    if (at >= 0)                                                                           \
        for (int u = 0; u < row_units; ++u) pool[at + u] = rows[gid * (ulong)row_units + u]

__kernel void read_rows_u32(__global const uint* pool, __global const long* slots,
                            __global uint* rows, const int num_rows, const int num_kv_heads,
                            const int page_size, const int row_units, const long num_slots) {
    PKV_READ_ROW(0u);
}

__kernel void write_rows_u32(__global uint* pool, __global const long* slots,
                             __global const uint* rows, const int num_rows,
                             const int num_kv_heads, const int page_size, const int row_units,
                             const long num_slots) {
    PKV_WRITE_ROW();
}

__kernel void read_rows_u8(__global const uchar* pool, __global const long* slots,
                           __global uchar* rows, const int num_rows, const int num_kv_heads,
                           const int page_size, const int row_units, const long num_slots) {
    PKV_READ_ROW((uchar)0);
}

__kernel void write_rows_u8(__global uchar* pool, __global const long* slots,
                            __global const uchar* rows, const int num_rows,
                            const int num_kv_heads, const int page_size, const int row_units,
                            const long num_slots) {
    PKV_WRITE_ROW();
}
