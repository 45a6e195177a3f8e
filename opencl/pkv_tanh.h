/* tanh for logit soft-capping, in the host kernels (pagedkv/pkv_simd.h) and
 * in OpenCL C (pkv_common.h, attention.cl).
 *
 * Below |x| = 0.625 Cephes' odd polynomial (tanhf), above it (1 - e) / (1 + e)
 * with e = exp(-2|x|), which has no cancellation there; relative error about
 * 3e-7 either way.  Both are computed and one kept, so that a loop over it
 * vectorises; a library tanh is a scalar call (on PoCL it made a soft-capped
 * decode half as slow again).
 *
 * PKV_DEFINE_TANH(QUALIFIERS, name, T, EXP, FABS, COPYSIGN) defines
 * `QUALIFIERS T name(T x)` for a float type T (float, or an OpenCL vector),
 * given EXP(x), e**x for x <= 0, and FABS and COPYSIGN for T. */
#ifndef PKV_TANH_H
#define PKV_TANH_H

#define PKV_DEFINE_TANH(QUALIFIERS, name, T, EXP, FABS, COPYSIGN)                     \
QUALIFIERS T name(T x) {                                                              \
    const T a = FABS(x), z = x * x;                                                   \
    const T small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z               \
                       - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z              \
                     - 3.33332819422e-1f) * z * x + x;                                \
    const T e = EXP(-2.0f * a);                                                       \
    const T large = COPYSIGN((1.0f - e) / (1.0f + e), x);                             \
    return a < 0.625f ? small : large;                                                \
}

#endif
