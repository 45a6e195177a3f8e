/* The benchmarks' streaming read: the memory bandwidth that decode attention,
 * which reads every K/V byte once, is measured against.
 *
 * A float sum over a buffer much larger than the last-level cache, split over
 * OpenMP threads (static schedule: each thread one contiguous range) and
 * vectorised (`simd`: the compiler may reassociate the sum), so that memory,
 * not the adds, is the limit.  benchmarks/_common.py compiles it with the
 * flags of this CPU and calls it through ctypes.
 */
#include <omp.h>

float stream_read(const float *x, long n, int num_threads) {
    float total = 0.0f;
    #pragma omp parallel for simd reduction(+:total) schedule(static) num_threads(num_threads)
    for (long i = 0; i < n; i++) total += x[i];
    return total;
}
