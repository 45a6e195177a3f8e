/* Recurrent layers' states and recurrences (pagedkv/backends/state_store.py,
 * pagedkv/backends/_opencl_recurrent.py).
 *
 * A state store keeps, per recurrent layer and state array, one buffer of
 * float32 [num_slots, *shape]: `slot_floats` floats per slot.  The slot moves
 * (copy, zero, read, write) take one work-item per float, so consecutive
 * work-items touch consecutive memory.
 *
 * The recurrences walk each sequence's rows of a ragged step in order,
 * reading its state from its slot and advancing it in place; after a save
 * row (save_rows, ascending; sequence b's are [save_start[b], save_start[b+1]))
 * the state is also copied into that row's save slot:
 *
 * - the causal convolution: one work-item per (row, PKV_W channels)
 *   (conv_rows: rows are independent given the inputs), then one per
 *   (sequence, PKV_W channels) for the saves and states (conv_states);
 * - gated_delta_rule (built with -DPKV_DK=<k_dim>): one work-item per
 *   (sequence, v-head, PKV_W state columns), which holds those columns of S
 *   (k_dim x PKV_W floats) in private memory for the whole run: a column
 *   evolves on its own (it needs only q, k, g, beta and v[j]), so the
 *   work-items share nothing and need no barrier; the work-items of a
 *   work-group read the same q and k rows.
 *
 * PKV_W (build option, default 1) is the columns or channels of a work-item,
 * as one OpenCL vector: 1 on GPUs, where work-items are the SIMD lanes; 8 on
 * CPU devices, where PoCL runs a work-group's items one after another and
 * vectorises only loops within an item (with one column per item the delta
 * rule ran as scalar code, 1.5 GFLOP/s).
 *
 * Every slot is checked against num_slots before it is used: a bad table can
 * only skip work, never touch memory out of bounds.
 */

#define PKV_L2NORM_EPS 1e-6f   /* transformers' l2norm: x * rsqrt(sum(x^2) + 1e-6) */

#ifndef PKV_W
#define PKV_W 1
#endif
#if PKV_W == 1
#define pkv_vec float
#define PKV_LOAD(p) (*(p))
#define PKV_STORE(x, p) (*(p) = (x))
#else
#define PKV_CAT(a, b) a##b
#define PKV_XCAT(a, b) PKV_CAT(a, b)
#define pkv_vec PKV_XCAT(float, PKV_W)
#define PKV_LOAD(p) PKV_XCAT(vload, PKV_W)(0, p)
#define PKV_STORE(x, p) PKV_XCAT(vstore, PKV_W)(x, 0, p)
#endif

/* -- slot moves ------------------------------------------------------------------ */

/* Slot src[c] -> dst[c] of one array (dst slots distinct from every src). */
__kernel void state_copy(__global float* states, __global const int* src,
                         __global const int* dst, const int num_copies,
                         const long slot_floats, const int num_slots) {
    const ulong gid = get_global_id(0);
    const ulong c = gid / (ulong)slot_floats;
    if (c >= (ulong)num_copies) return;
    const ulong e = gid - c * (ulong)slot_floats;
    const int s = src[c], d = dst[c];
    if (s < 0 || s >= num_slots || d < 0 || d >= num_slots) return;
    states[(ulong)d * slot_floats + e] = states[(ulong)s * slot_floats + e];
}

/* Zero slots[i] of one array. */
__kernel void state_zero(__global float* states, __global const int* slots,
                         const int num_wanted, const long slot_floats, const int num_slots) {
    const ulong gid = get_global_id(0);
    const ulong i = gid / (ulong)slot_floats;
    if (i >= (ulong)num_wanted) return;
    const int s = slots[i];
    if (s < 0 || s >= num_slots) return;
    states[(ulong)s * slot_floats + gid - i * (ulong)slot_floats] = 0.0f;
}

/* out[i] = slot slots[i] of one array ([n, slot_floats]; -1 reads zeros). */
__kernel void state_read(__global const float* states, __global const int* slots,
                         __global float* out, const int num_wanted, const long slot_floats,
                         const int num_slots) {
    const ulong gid = get_global_id(0);
    const ulong i = gid / (ulong)slot_floats;
    if (i >= (ulong)num_wanted) return;
    const int s = slots[i];
    const ulong e = gid - i * (ulong)slot_floats;
    out[gid] = s >= 0 && s < num_slots ? states[(ulong)s * slot_floats + e] : 0.0f;
}

/* Slot slots[i] of one array = values[i] ([n, slot_floats]). */
__kernel void state_write(__global float* states, __global const int* slots,
                          __global const float* values, const int num_wanted,
                          const long slot_floats, const int num_slots) {
    const ulong gid = get_global_id(0);
    const ulong i = gid / (ulong)slot_floats;
    if (i >= (ulong)num_wanted) return;
    const int s = slots[i];
    if (s < 0 || s >= num_slots) return;
    states[(ulong)s * slot_floats + gid - i * (ulong)slot_floats] = values[gid];
}

/* -- causal depthwise convolution --------------------------------------------------- */

/* wt [K, channels] = weight [channels, K] transposed: a tap's weights as a
 * row, which the row kernel loads as vectors. */
__kernel void conv_weights_t(__global const float* weight, __global float* wt,
                             const int channels, const int kernel_size) {
    const ulong gid = get_global_id(0);
    if (gid >= (ulong)channels * (ulong)kernel_size) return;
    const ulong c = gid / (ulong)kernel_size, j = gid - c * (ulong)kernel_size;
    wt[j * (ulong)channels + c] = weight[gid];
}

/* Input u[i] of PKV_W channels c0.. of a sequence whose rows start at x row
 * r0: i >= 0 a new row, i < 0 the history hist ([channels][K - 1] from
 * channel c0 on: the channels' entries K - 1 floats apart, gathered). */
inline pkv_vec pkv_conv_input(__global const float* x, __global const float* hist, int r0,
                              int channels, int c0, int history, int i) {
    if (i >= 0) return PKV_LOAD(x + ((ulong)r0 + i) * (ulong)channels + c0);
    float lanes[PKV_W];
    for (int l = 0; l < PKV_W; ++l) lanes[l] = hist[(ulong)l * (ulong)history + i + history];
    return PKV_LOAD(lanes);
}

/* u into entry j of PKV_W channels' states dst ([channels][K - 1] from the first). */
inline void pkv_conv_put(__global float* dst, int history, int j, pkv_vec u) {
    float lanes[PKV_W];
    PKV_STORE(u, lanes);
    for (int l = 0; l < PKV_W; ++l) dst[(ulong)l * (ulong)history + j] = lanes[l];
}

/* The sequence of step row `row`: the last b with query_start[b] <= row
 * (sequences without rows share their start with the next one). */
inline int pkv_sequence_of(__global const int* query_start, int num_seqs, int row) {
    int lo = 0, hi = num_seqs;      /* query_start[lo] <= row < query_start[hi] */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (query_start[mid] <= row) lo = mid; else hi = mid;
    }
    return lo;
}

/* y[row, c] = act(bias[c] + sum_j wt[j, c] * u[t + j - K + 1]) for PKV_W
 * channels of one row (t: the row's place in its sequence; u: the
 * sequence's history in its slot, then its rows).  Rows are independent
 * given the inputs, so each is a work-item of its own; the states change
 * only afterwards (conv_states).  x, y [T, channels]; wt [K, channels]
 * (conv_weights_t); bias [channels] (read when has_bias); state
 * [num_slots, channels, K - 1].  channels is a multiple of PKV_W. */
__kernel void conv_rows(__global const float* x, __global const float* wt,
                        __global const float* bias, const int has_bias,
                        __global const float* state, __global const int* query_start,
                        __global const int* slots, __global float* y, const int num_rows,
                        const int num_seqs, const int channels, const int kernel_size,
                        const int silu, const int num_slots) {
    const ulong gid = get_global_id(0);
    const int groups = channels / PKV_W;
    const ulong row = gid / (ulong)groups;
    if (row >= (ulong)num_rows) return;
    const int c0 = (int)(gid - row * (ulong)groups) * PKV_W;
    const int b = pkv_sequence_of(query_start, num_seqs, (int)row);
    const int r0 = query_start[b], t = (int)row - r0, history = kernel_size - 1;
    const int slot = slots[b];
    const bool early = t < history;   /* reads the history */
    if (early && (slot < 0 || slot >= num_slots)) return;
    __global const float* hist = state + ((ulong)(early ? slot : 0) * (ulong)channels + c0)
                                         * (ulong)history;
    pkv_vec acc = has_bias ? PKV_LOAD(bias + c0) : (pkv_vec)(0.0f);
    for (int j = 0; j < kernel_size; ++j)
        acc += PKV_LOAD(wt + (ulong)j * (ulong)channels + c0) *
               pkv_conv_input(x, hist, r0, channels, c0, history, t + j - history);
    PKV_STORE(silu ? acc / (1.0f + exp(-acc)) : acc, y + row * (ulong)channels + c0);
}

/* Sequence b's saves and new state, PKV_W channels per work-item, after
 * conv_rows: the state after a row holds its last K - 1 inputs, oldest
 * first.  The sequence's own state is rewritten in place, oldest first:
 * entry j reads history entry n + j > j, which is not written yet. */
__kernel void conv_states(__global const float* x, __global float* state,
                          __global const int* query_start, __global const int* slots,
                          __global const int* save_start, __global const int* save_rows,
                          __global const int* save_slots, const int num_seqs,
                          const int channels, const int kernel_size, const int num_slots) {
    const ulong gid = get_global_id(0);
    const int groups = channels / PKV_W;
    const ulong b = gid / (ulong)groups;
    if (b >= (ulong)num_seqs) return;
    const int c0 = (int)(gid - b * (ulong)groups) * PKV_W;
    const int r0 = query_start[b], n = query_start[b + 1] - r0, history = kernel_size - 1;
    const int slot = slots[b];
    if (n <= 0 || history == 0 || slot < 0 || slot >= num_slots) return;
    __global float* hist = state + ((ulong)slot * (ulong)channels + c0) * (ulong)history;
    for (int m = save_start[b]; m < save_start[b + 1]; ++m) {
        const int s = save_slots[m], t_next = save_rows[m] - r0 + 1;
        if (s < 0 || s >= num_slots) continue;
        __global float* dst = state + ((ulong)s * (ulong)channels + c0) * (ulong)history;
        for (int j = 0; j < history; ++j)
            pkv_conv_put(dst, history, j, pkv_conv_input(x, hist, r0, channels, c0, history,
                                                         t_next - history + j));
    }
    for (int j = 0; j < history; ++j)
        pkv_conv_put(hist, history, j, pkv_conv_input(x, hist, r0, channels, c0, history,
                                                      n - history + j));
}

/* -- gated delta rule ----------------------------------------------------------------- */

/* stats[row, h] = (1 / |k|, 1 / |q|, k . q) of row `row`, k-head h: the norms
 * 1 / sqrt(sum(x^2) + eps) when l2norm (else 1), once per row and k-head
 * rather than once per state column (and k . q, which the per-head form's
 * output takes, out of its inner loop, where the sum's chain of dependent
 * multiply-adds set the pace).  q, k [T, num_k_heads, k_dim]; stats
 * [T, num_k_heads, 3]. */
__kernel void qk_row_stats(__global const float* q, __global const float* k,
                           __global float* stats, const int num_rows, const int num_k_heads,
                           const int k_dim, const int l2norm) {
    const ulong gid = get_global_id(0);
    if (gid >= (ulong)num_rows * (ulong)num_k_heads) return;
    __global const float* qr = q + gid * (ulong)k_dim;
    __global const float* kr = k + gid * (ulong)k_dim;
    /* by float4: three chains of k_dim dependent multiply-adds per row were a
     * twentieth of a PoCL prefill's time */
    float4 qq4 = (float4)(0.0f), kk4 = qq4, kq4 = qq4;
    int i = 0;
    for (; i + 4 <= k_dim; i += 4) {
        const float4 qv = vload4(0, qr + i), kv = vload4(0, kr + i);
        qq4 += qv * qv;
        kk4 += kv * kv;
        kq4 += kv * qv;
    }
    float qq = (qq4.s0 + qq4.s1) + (qq4.s2 + qq4.s3);
    float kk = (kk4.s0 + kk4.s1) + (kk4.s2 + kk4.s3);
    float kq = (kq4.s0 + kq4.s1) + (kq4.s2 + kq4.s3);
    for (; i < k_dim; ++i) {
        qq += qr[i] * qr[i];
        kk += kr[i] * kr[i];
        kq += kr[i] * qr[i];
    }
    stats[3 * gid] = l2norm ? rsqrt(kk + PKV_L2NORM_EPS) : 1.0f;
    stats[3 * gid + 1] = l2norm ? rsqrt(qq + PKV_L2NORM_EPS) : 1.0f;
    stats[3 * gid + 2] = kq;
}

#ifdef PKV_DK
/* Per token of sequence b, for v-head h and the item's PKV_W state columns j
 * (S: the sequence's state [num_v_heads, PKV_DK, v_dim] in slot slots[b]):
 *   q, k optionally L2-normalised (their k-head h / (num_v_heads / num_k_heads));
 *   S *= exp(g); delta = beta * (v - S^T k); S += k delta^T; o = S^T (scale q).
 * q, k [T, num_k_heads, PKV_DK]; v, out [T, num_v_heads, v_dim]; g, beta
 * [T, num_v_heads]; stats [T, num_k_heads, 3] (qk_row_stats), whose norms
 * scale the columns' sums instead of q and k.  v_dim is a
 * multiple of PKV_W. */
__kernel void gated_delta_rule(__global const float* q, __global const float* k,
                               __global const float* v, __global const float* g,
                               __global const float* beta, __global const float* stats,
                               __global float* state, __global const int* query_start,
                               __global const int* slots, __global const int* save_start,
                               __global const int* save_rows, __global const int* save_slots,
                               __global float* out, const int num_seqs, const int num_k_heads,
                               const int num_v_heads, const int v_dim, const float scale,
                               const int num_slots) {
    const ulong gid = get_global_id(0);
    const int groups = v_dim / PKV_W;
    const ulong column = gid / (ulong)groups;
    const ulong b = column / (ulong)num_v_heads;
    if (b >= (ulong)num_seqs) return;
    const int j = (int)(gid - column * (ulong)groups) * PKV_W;
    const int h = (int)(column - b * (ulong)num_v_heads);
    const int r0 = query_start[b], n = query_start[b + 1] - r0;
    if (n <= 0) return;
    const int slot = slots[b];
    if (slot < 0 || slot >= num_slots) return;
    const int kh = h / (num_v_heads / num_k_heads);
    const ulong head_floats = (ulong)PKV_DK * (ulong)v_dim;
    const ulong column_offset = (ulong)h * head_floats + j;   /* S[h, 0, j] in a slot */
    const ulong slot_floats = (ulong)num_v_heads * head_floats;
    __global float* own = state + (ulong)slot * slot_floats + column_offset;
    pkv_vec s[PKV_DK];
    for (int i = 0; i < PKV_DK; ++i) s[i] = PKV_LOAD(own + (ulong)i * (ulong)v_dim);
    int m = save_start[b];
    const int m_end = save_start[b + 1];
    for (int t = 0; t < n; ++t) {
        const ulong row = (ulong)(r0 + t);
        const ulong kr = row * (ulong)num_k_heads + kh;
        __global const float* qt = q + kr * PKV_DK;
        __global const float* kt = k + kr * PKV_DK;
        const float k_mul = stats[3 * kr], q_mul = scale * stats[3 * kr + 1];
        const ulong vh = row * (ulong)num_v_heads + h;
        const float a = exp(g[vh]);
        /* four partial sums: a single chain of PKV_DK dependent multiply-adds
         * waits on each one's latency (half the speed on a CPU device) */
        pkv_vec km0 = (pkv_vec)(0.0f), km1 = km0, km2 = km0, km3 = km0;
        int i = 0;
        for (; i + 4 <= PKV_DK; i += 4) {
            km0 += s[i] * kt[i];
            km1 += s[i + 1] * kt[i + 1];
            km2 += s[i + 2] * kt[i + 2];
            km3 += s[i + 3] * kt[i + 3];
        }
        for (; i < PKV_DK; ++i) km0 += s[i] * kt[i];
        const pkv_vec km = (km0 + km1) + (km2 + km3);
        /* k's scale folded into delta: S += (k_mul k) delta = k (k_mul delta) */
        const pkv_vec delta = beta[vh] * (PKV_LOAD(v + vh * (ulong)v_dim + j) - a * k_mul * km)
                              * k_mul;
        pkv_vec o0 = (pkv_vec)(0.0f), o1 = o0, o2 = o0, o3 = o0;
        for (i = 0; i + 4 <= PKV_DK; i += 4) {
            s[i] = a * s[i] + kt[i] * delta;
            s[i + 1] = a * s[i + 1] + kt[i + 1] * delta;
            s[i + 2] = a * s[i + 2] + kt[i + 2] * delta;
            s[i + 3] = a * s[i + 3] + kt[i + 3] * delta;
            o0 += s[i] * qt[i];
            o1 += s[i + 1] * qt[i + 1];
            o2 += s[i + 2] * qt[i + 2];
            o3 += s[i + 3] * qt[i + 3];
        }
        for (; i < PKV_DK; ++i) {
            s[i] = a * s[i] + kt[i] * delta;
            o0 += s[i] * qt[i];
        }
        const pkv_vec o = (o0 + o1) + (o2 + o3);
        PKV_STORE(o * q_mul, out + vh * (ulong)v_dim + j);
        if (m < m_end && save_rows[m] == r0 + t) {
            const int sv = save_slots[m++];
            if (sv >= 0 && sv < num_slots) {
                __global float* dst = state + (ulong)sv * slot_floats + column_offset;
                for (int i = 0; i < PKV_DK; ++i) PKV_STORE(s[i], dst + (ulong)i * (ulong)v_dim);
            }
        }
    }
    for (int i = 0; i < PKV_DK; ++i) PKV_STORE(s[i], own + (ulong)i * (ulong)v_dim);
}
#endif

#if defined(PKV_DK) && defined(PKV_DV)
/* The delta rule on a CPU device: the host kernel's form (pagedkv/pkv_recurrent.h)
 * in OpenCL C.  One work-item per (sequence, v-head) holds the head's state
 * as blocks of 32 columns, [PKV_DK][4] float8 each (16 KiB at k_dim 128, in
 * L1), and walks segments of up to PKV_DR_SEGMENT rows (cut at save rows):
 * it copies the segment's q, k and v rows and per-row scalars into private
 * arrays, then runs each block over the segment, so that a block stays in
 * cache for the segment and the segment's rows for the blocks.  The 32
 * columns are four float8 in registers (left to the compiler, a loop over
 * them kept its sums in memory).  PoCL 3.1, 2 cores, a 2,048-row prefill of
 * 32 heads of 128 x 128: 105 ms; the column form above, which goes through
 * every row once per vector of columns, 360 ms.  Arguments as
 * gated_delta_rule's. */
#define PKV_DR_BLOCKS ((PKV_DV + 31) / 32)
#define PKV_DR_SEGMENT 32

/* Columns c..c+7 of a row of PKV_DV floats, zero past its end; and back. */
inline float8 pkv_dr_load8(__global const float* row, int c) {
    if (c + 8 <= PKV_DV) return vload8(0, row + c);
    float lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = c + l < PKV_DV ? row[c + l] : 0.0f;
    return vload8(0, lanes);
}

inline void pkv_dr_store8(__global float* row, int c, float8 x) {
    if (c + 8 <= PKV_DV) {
        vstore8(x, 0, row + c);
        return;
    }
    float lanes[8];
    vstore8(x, 0, lanes);
    for (int l = 0; l < 8 && c + l < PKV_DV; ++l) row[c + l] = lanes[l];
}

__kernel void gated_delta_rule_heads(__global const float* q, __global const float* k,
                                     __global const float* v, __global const float* g,
                                     __global const float* beta, __global const float* stats,
                                     __global float* state, __global const int* query_start,
                                     __global const int* slots, __global const int* save_start,
                                     __global const int* save_rows,
                                     __global const int* save_slots, __global float* out,
                                     const int num_seqs, const int num_k_heads,
                                     const int num_v_heads, const int v_dim, const float scale,
                                     const int num_slots) {
    const ulong gid = get_global_id(0);
    const ulong b = gid / (ulong)num_v_heads;
    if (b >= (ulong)num_seqs) return;
    const int h = (int)(gid - b * (ulong)num_v_heads);
    const int r0 = query_start[b], n = query_start[b + 1] - r0;
    if (n <= 0) return;
    const int slot = slots[b];
    if (slot < 0 || slot >= num_slots) return;
    const int kh = h / (num_v_heads / num_k_heads);
    const ulong head_floats = (ulong)PKV_DK * PKV_DV;
    const ulong slot_floats = (ulong)num_v_heads * head_floats;
    __global float* own = state + (ulong)slot * slot_floats + (ulong)h * head_floats;
    float8 S[PKV_DR_BLOCKS][PKV_DK][4];
    float qs[PKV_DR_SEGMENT][PKV_DK], ks[PKV_DR_SEGMENT][PKV_DK];
    float vs[PKV_DR_SEGMENT][PKV_DR_BLOCKS * 32], rs[PKV_DR_SEGMENT][5];
    for (int blk = 0; blk < PKV_DR_BLOCKS; ++blk)
        for (int i = 0; i < PKV_DK; ++i)
            for (int x = 0; x < 4; ++x)
                S[blk][i][x] = pkv_dr_load8(own + (ulong)i * PKV_DV, blk * 32 + 8 * x);
    int m = save_start[b];
    const int m_end = save_start[b + 1];
    for (int t0 = 0; t0 < n;) {
        /* segments end at save rows, so that the saved state is the state after them */
        int t1 = min(t0 + PKV_DR_SEGMENT, n);
        if (m < m_end) t1 = min(t1, save_rows[m] - r0 + 1);
        /* the segment's q, k and v rows, copied once for all blocks: in the step
         * they lie a whole step row apart, and the copy's independent loads
         * overlap where the blocks' loads, inside the arithmetic, waited */
        for (int t = t0; t < t1; ++t) {
            const ulong kr = (ulong)(r0 + t) * (ulong)num_k_heads + kh;
            const ulong vh = (ulong)(r0 + t) * (ulong)num_v_heads + h;
            for (int i = 0; i < PKV_DK; ++i) {
                qs[t - t0][i] = q[kr * PKV_DK + i];
                ks[t - t0][i] = k[kr * PKV_DK + i];
            }
            for (int c = 0; c < PKV_DR_BLOCKS * 32; ++c)
                vs[t - t0][c] = c < PKV_DV ? v[vh * (ulong)PKV_DV + c] : 0.0f;
            /* and the token's scalars: exp(g), beta, the norms (q's with the scale) and
             * the norms' k . q */
            const float k_mul = stats[3 * kr];
            rs[t - t0][0] = exp(g[vh]);
            rs[t - t0][1] = beta[vh];
            rs[t - t0][2] = k_mul;
            rs[t - t0][3] = scale * stats[3 * kr + 1];
            rs[t - t0][4] = k_mul * stats[3 * kr + 2];
        }
        for (int blk = 0; blk < PKV_DR_BLOCKS; ++blk) {
            for (int t = t0; t < t1; ++t) {
                const ulong vh = (ulong)(r0 + t) * (ulong)num_v_heads + h;
                const float* qt = qs[t - t0];
                const float* kt = ks[t - t0];
                const float a = rs[t - t0][0], bt = rs[t - t0][1], k_mul = rs[t - t0][2];
                const float q_mul = rs[t - t0][3], kqm = rs[t - t0][4];
                float8 km0 = (float8)(0.0f), km1 = km0, km2 = km0, km3 = km0;
                float8 qm0 = km0, qm1 = km0, qm2 = km0, qm3 = km0;
                for (int i = 0; i < PKV_DK; ++i) {
                    const float ki = kt[i], qi = qt[i];
                    const float8 s0 = S[blk][i][0], s1 = S[blk][i][1];
                    const float8 s2 = S[blk][i][2], s3 = S[blk][i][3];
                    km0 += s0 * ki;
                    km1 += s1 * ki;
                    km2 += s2 * ki;
                    km3 += s3 * ki;
                    qm0 += s0 * qi;
                    qm1 += s1 * qi;
                    qm2 += s2 * qi;
                    qm3 += s3 * qi;
                }
                /* o = S_new^T q = exp(g) S^T q + (k . q) delta, norms and scale applied;
                 * S += (k_mul k) delta^T = k (k_mul delta)^T */
                const float* vt = vs[t - t0] + blk * 32;
                __global float* ot = out + vh * (ulong)PKV_DV;
                const int c0 = blk * 32;
                const float8 d0 = bt * (vload8(0, vt) - a * k_mul * km0);
                const float8 d1 = bt * (vload8(1, vt) - a * k_mul * km1);
                const float8 d2 = bt * (vload8(2, vt) - a * k_mul * km2);
                const float8 d3 = bt * (vload8(3, vt) - a * k_mul * km3);
                pkv_dr_store8(ot, c0, q_mul * (a * qm0 + kqm * d0));
                pkv_dr_store8(ot, c0 + 8, q_mul * (a * qm1 + kqm * d1));
                pkv_dr_store8(ot, c0 + 16, q_mul * (a * qm2 + kqm * d2));
                pkv_dr_store8(ot, c0 + 24, q_mul * (a * qm3 + kqm * d3));
                const float8 kd0 = k_mul * d0, kd1 = k_mul * d1, kd2 = k_mul * d2;
                const float8 kd3 = k_mul * d3;
                for (int i = 0; i < PKV_DK; ++i) {
                    const float ki = kt[i];
                    S[blk][i][0] = a * S[blk][i][0] + ki * kd0;
                    S[blk][i][1] = a * S[blk][i][1] + ki * kd1;
                    S[blk][i][2] = a * S[blk][i][2] + ki * kd2;
                    S[blk][i][3] = a * S[blk][i][3] + ki * kd3;
                }
            }
        }
        for (; m < m_end && save_rows[m] - r0 + 1 == t1; ++m) {
            const int sv = save_slots[m];
            if (sv < 0 || sv >= num_slots) continue;
            __global float* dst = state + (ulong)sv * slot_floats + (ulong)h * head_floats;
            for (int blk = 0; blk < PKV_DR_BLOCKS; ++blk)
                for (int i = 0; i < PKV_DK; ++i)
                    for (int x = 0; x < 4; ++x)
                        pkv_dr_store8(dst + (ulong)i * PKV_DV, blk * 32 + 8 * x, S[blk][i][x]);
        }
        t0 = t1;
    }
    for (int blk = 0; blk < PKV_DR_BLOCKS; ++blk)
        for (int i = 0; i < PKV_DK; ++i)
            for (int x = 0; x < 4; ++x)
                pkv_dr_store8(own + (ulong)i * PKV_DV, blk * 32 + 8 * x, S[blk][i][x]);
}
#endif
