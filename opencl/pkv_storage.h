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
 */
#ifndef PKV_STORAGE_H
#define PKV_STORAGE_H

#define PKV_STORAGE_FLOAT32 0
#define PKV_STORAGE_FLOAT16 1
#define PKV_STORAGE_INT8 2

#endif
