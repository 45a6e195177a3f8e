/* The device's own ceilings, for benchmarks/device_check.py: what its memory
 * moves (copy, read) and what a plain tiled matrix product computes, so that
 * pagedkv's attention figures can be given as fractions of them, measured
 * on the same device in the same run.
 *
 * Build options: DC_TS (output tile edge), DC_WPT (outputs per work-item
 * along each edge; DC_TS / DC_WPT work-items per edge), DC_TK (keys of the
 * inner dimension staged per step).  device_check.py picks them from the
 * device's work-group and local-memory limits.
 */

/* dst[i] = value: the source of the measurements, written by a kernel (a fill
   command's pattern writes confuse Oclgrind's uninitialized-value checker). */
__kernel void fill_f4(__global float4* dst, const ulong n, const float value) {
    const ulong i = get_global_id(0);
    if (i < n) dst[i] = (float4)(value);
}

/* dst[i] = src[i], one float4 per work-item: consecutive work-items move
   consecutive memory (coalesced on a GPU, vectorised on a CPU). */
__kernel void copy_f4(__global const float4* src, __global float4* dst, const ulong n) {
    const ulong i = get_global_id(0);
    if (i < n) dst[i] = src[i];
}

/* Each work-item sums src[gid + k * stride], k < per_item (stride: the
   global size, so that a step of the work-items reads one contiguous
   block), and writes its sum, which keeps the reads from being optimised
   away.  The loop count is fixed by the host, not by the buffer. */
__kernel void read_f4(__global const float4* src, __global float* out, const ulong n,
                      const int per_item) {
    const ulong gid = get_global_id(0), stride = get_global_size(0);
    float4 sum = 0.0f;
    for (int k = 0; k < per_item; ++k) {
        const ulong i = gid + (ulong)k * stride;
        if (i < n) sum += src[i];
    }
    out[gid] = (sum.x + sum.y) + (sum.z + sum.w);
}

#if defined(DC_TS) && defined(DC_WPT) && defined(DC_TK)
#define DC_RTS (DC_TS / DC_WPT)                          /* work-items per tile edge */
#define DC_LOADS (DC_TS * DC_TK / (DC_RTS * DC_RTS))     /* tile elements each loads */
#if DC_TS % DC_WPT || (DC_TS * DC_TK) % (DC_RTS * DC_RTS)
#error "DC_WPT must divide DC_TS, and the work-group must divide a tile"
#endif

/* C = A B (row-major; M x K times K x N; M and N multiples of DC_TS, K of
   DC_TK).  A work-group computes a DC_TS x DC_TS tile of C, each work-item
   DC_WPT x DC_WPT of it (spread DC_RTS apart, so that neighbouring
   work-items write neighbouring columns), from DC_TK-deep slices of A and
   B staged in local memory. */
__kernel __attribute__((reqd_work_group_size(DC_RTS, DC_RTS, 1)))
void sgemm(const int M, const int N, const int K, __global const float* A,
           __global const float* B, __global float* C) {
    const int tc = get_local_id(0), tr = get_local_id(1);
    const int lid = tr * DC_RTS + tc;
    const int row0 = get_group_id(1) * DC_TS, col0 = get_group_id(0) * DC_TS;
    __local float a_tile[DC_TK][DC_TS];     /* a_tile[k][m] = A[row0 + m, k0 + k] */
    __local float b_tile[DC_TK][DC_TS];     /* b_tile[k][n] = B[k0 + k, col0 + n] */
    float acc[DC_WPT][DC_WPT];
    for (int i = 0; i < DC_WPT; ++i)
        for (int j = 0; j < DC_WPT; ++j) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += DC_TK) {
        for (int l = 0; l < DC_LOADS; ++l) {
            const int e = lid + l * DC_RTS * DC_RTS;
            a_tile[e % DC_TK][e / DC_TK] = A[(size_t)(row0 + e / DC_TK) * K + k0 + e % DC_TK];
            b_tile[e / DC_TS][e % DC_TS] = B[(size_t)(k0 + e / DC_TS) * N + col0 + e % DC_TS];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < DC_TK; ++k) {
            float a[DC_WPT], b[DC_WPT];
            for (int w = 0; w < DC_WPT; ++w) {
                a[w] = a_tile[k][tr + w * DC_RTS];
                b[w] = b_tile[k][tc + w * DC_RTS];
            }
            for (int i = 0; i < DC_WPT; ++i)
                for (int j = 0; j < DC_WPT; ++j) acc[i][j] = mad(a[i], b[j], acc[i][j]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int i = 0; i < DC_WPT; ++i)
        for (int j = 0; j < DC_WPT; ++j)
            C[(size_t)(row0 + tr + i * DC_RTS) * N + col0 + tc + j * DC_RTS] = acc[i][j];
}
#endif
