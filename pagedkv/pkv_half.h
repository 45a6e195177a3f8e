/* float16 <-> float32 for the host kernels.
 *
 * Pools of dtype float16 are handed to Cython as uint16 memoryviews (IEEE
 * binary16 bits, numpy's float16 layout).  Where the compiler has _Float16
 * (GCC >= 12 / Clang >= 15 on x86-64 and AArch64) the conversion is a native,
 * vectorisable instruction (F16C, FCVT).  Elsewhere numpy's own npymath
 * routines do it: slower, but the same round-to-nearest-even results.
 */
#ifndef PKV_HALF_H
#define PKV_HALF_H
#include <stdint.h>
#include <string.h>

#if defined(__FLT16_MAX__) && !defined(PKV_NO_FLOAT16)
static inline float pkv_half_to_float(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}
static inline uint16_t pkv_float_to_half(float x) {
    _Float16 h = (_Float16)x;
    uint16_t bits;
    memcpy(&bits, &h, sizeof bits);
    return bits;
}
#else
#include <numpy/halffloat.h>
static inline float pkv_half_to_float(uint16_t bits) { return npy_half_to_float(bits); }
static inline uint16_t pkv_float_to_half(float x) { return npy_float_to_half(x); }
#endif

#endif
