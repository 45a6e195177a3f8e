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

/* Paged decode's reading pattern without its arithmetic: for each of
 * num_seqs sequences (threads take whole sequences), its pages_per_seq pages
 * pages[s * pages_per_seq + j] in order, `span` pages at a time: the span's K
 * pages, then its V pages, each page_floats contiguous floats of pool k or v
 * (page p at p * page_floats).  The host kernel reads a decode step's pages
 * in this order (pagedkv/_kernels.pyx, attend_item), so this is what the
 * step's bytes cost at this machine's bandwidth when the addresses, not the
 * reading, are the only difference from stream_read. */
float paged_read(const float *k, const float *v, const int *pages, long num_seqs,
                 long pages_per_seq, long page_floats, long span, int num_threads) {
    float total = 0.0f;
    #pragma omp parallel for reduction(+:total) schedule(static) num_threads(num_threads)
    for (long s = 0; s < num_seqs; s++) {
        const int *row = pages + s * pages_per_seq;
        for (long j0 = 0; j0 < pages_per_seq; j0 += span) {
            const long j1 = j0 + span < pages_per_seq ? j0 + span : pages_per_seq;
            for (int pool = 0; pool < 2; pool++)
                for (long j = j0; j < j1; j++) {
                    const float *x = (pool ? v : k) + (long)row[j] * page_floats;
                    float part = 0.0f;
                    #pragma omp simd reduction(+:part)
                    for (long i = 0; i < page_floats; i++) part += x[i];
                    total += part;
                }
        }
    }
    return total;
}
