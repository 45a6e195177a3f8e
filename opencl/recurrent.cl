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
 * - causal_conv1d: one work-item per (sequence, channel), which keeps the
 *   channel's K - 1 inputs of history where they are (in the slot) and
 *   overwrites them only at the end;
 * - gated_delta_rule (built with -DPKV_DK=<k_dim>): one work-item per
 *   (sequence, v-head, state column j), which holds S[:, j] (k_dim floats) in
 *   private memory for the whole run: a column evolves on its own (it needs
 *   only q, k, g, beta and v[j]), so the work-items share nothing and need no
 *   barrier; the work-items of a work-group read the same q and k rows.
 *
 * Every slot is checked against num_slots before it is used: a bad table can
 * only skip work, never touch memory out of bounds.
 */

#define PKV_L2NORM_EPS 1e-6f   /* transformers' l2norm: x * rsqrt(sum(x^2) + 1e-6) */

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

/* Input u[i] of channel c of a sequence whose rows start at x row r0: i >= 0
 * a new row, i < 0 the history hist (K - 1 floats, oldest first). */
#define PKV_CONV_INPUT(i) \
    ((i) >= 0 ? x[((ulong)r0 + (i)) * (ulong)channels + c] : hist[(i) + history])

/* y[t, c] = act(bias[c] + sum_j weight[c, j] * u[t + j - K + 1]) over the rows
 * of sequence b; its state (slot slots[b], [channels, K - 1]) then holds the
 * last K - 1 inputs.  x, y [T, channels]; weight [channels, K]; bias
 * [channels] (read when has_bias). */
__kernel void causal_conv1d(__global const float* x, __global const float* weight,
                            __global const float* bias, const int has_bias,
                            __global float* state, __global const int* query_start,
                            __global const int* slots, __global const int* save_start,
                            __global const int* save_rows, __global const int* save_slots,
                            __global float* y, const int num_seqs, const int channels,
                            const int kernel_size, const int silu, const int num_slots) {
    const ulong gid = get_global_id(0);
    const ulong b = gid / (ulong)channels;
    if (b >= (ulong)num_seqs) return;
    const int c = (int)(gid - b * (ulong)channels);
    const int r0 = query_start[b], n = query_start[b + 1] - r0;
    const int history = kernel_size - 1;
    if (n <= 0) return;
    const int slot = slots[b];
    if (history > 0 && (slot < 0 || slot >= num_slots)) return;
    __global float* hist = state + ((ulong)(history > 0 ? slot : 0) * (ulong)channels + c)
                                   * (ulong)history;
    __global const float* w = weight + (ulong)c * (ulong)kernel_size;
    const float b0 = has_bias ? bias[c] : 0.0f;
    int m = save_start[b];
    const int m_end = save_start[b + 1];
    for (int t = 0; t < n; ++t) {
        float acc = b0;
        for (int j = 0; j < kernel_size; ++j) acc += w[j] * PKV_CONV_INPUT(t + j - history);
        y[((ulong)r0 + t) * (ulong)channels + c] = silu ? acc / (1.0f + exp(-acc)) : acc;
        if (m < m_end && save_rows[m] == r0 + t) {
            const int s = save_slots[m++];
            if (history > 0 && s >= 0 && s < num_slots) {
                __global float* dst = state + ((ulong)s * (ulong)channels + c) * (ulong)history;
                for (int j = 0; j < history; ++j) dst[j] = PKV_CONV_INPUT(t + 1 - history + j);
            }
        }
    }
    /* in place, oldest first: entry j reads history entry n + j > j, not yet written */
    for (int j = 0; j < history; ++j) hist[j] = PKV_CONV_INPUT(n - history + j);
}

/* -- gated delta rule ----------------------------------------------------------------- */

#ifdef PKV_DK
/* Per token of sequence b, for v-head h and state column j (S: the
 * sequence's state [num_v_heads, PKV_DK, v_dim] in slot slots[b]):
 *   q, k optionally L2-normalised (their k-head h / (num_v_heads / num_k_heads));
 *   S *= exp(g); delta = beta * (v - S^T k); S += k delta^T; o = S^T (scale q).
 * q, k [T, num_k_heads, PKV_DK]; v, out [T, num_v_heads, v_dim]; g, beta
 * [T, num_v_heads].  The norms scale the column's sums instead of q and k. */
__kernel void gated_delta_rule(__global const float* q, __global const float* k,
                               __global const float* v, __global const float* g,
                               __global const float* beta, __global float* state,
                               __global const int* query_start, __global const int* slots,
                               __global const int* save_start, __global const int* save_rows,
                               __global const int* save_slots, __global float* out,
                               const int num_seqs, const int num_k_heads,
                               const int num_v_heads, const int v_dim, const float scale,
                               const int l2norm, const int num_slots) {
    const ulong gid = get_global_id(0);
    const ulong column = gid / (ulong)v_dim;
    const ulong b = column / (ulong)num_v_heads;
    if (b >= (ulong)num_seqs) return;
    const int j = (int)(gid - column * (ulong)v_dim);
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
    float s[PKV_DK];
    for (int i = 0; i < PKV_DK; ++i) s[i] = own[(ulong)i * (ulong)v_dim];
    int m = save_start[b];
    const int m_end = save_start[b + 1];
    for (int t = 0; t < n; ++t) {
        const ulong row = (ulong)(r0 + t);
        __global const float* qt = q + (row * (ulong)num_k_heads + kh) * PKV_DK;
        __global const float* kt = k + (row * (ulong)num_k_heads + kh) * PKV_DK;
        float k_mul = 1.0f, q_mul = scale;
        if (l2norm) {
            float kk = 0.0f, qq = 0.0f;
            for (int i = 0; i < PKV_DK; ++i) {
                kk += kt[i] * kt[i];
                qq += qt[i] * qt[i];
            }
            k_mul = rsqrt(kk + PKV_L2NORM_EPS);
            q_mul *= rsqrt(qq + PKV_L2NORM_EPS);
        }
        const ulong vh = row * (ulong)num_v_heads + h;
        const float a = exp(g[vh]);
        float km = 0.0f;
        for (int i = 0; i < PKV_DK; ++i) km += s[i] * kt[i];
        /* k's scale folded into delta: S += (k_mul k) delta = k (k_mul delta) */
        const float delta = beta[vh] * (v[vh * (ulong)v_dim + j] - a * k_mul * km) * k_mul;
        float o = 0.0f;
        for (int i = 0; i < PKV_DK; ++i) {
            s[i] = a * s[i] + kt[i] * delta;
            o += s[i] * qt[i];
        }
        out[vh * (ulong)v_dim + j] = o * q_mul;
        if (m < m_end && save_rows[m] == r0 + t) {
            const int sv = save_slots[m++];
            if (sv >= 0 && sv < num_slots) {
                __global float* dst = state + (ulong)sv * slot_floats + column_offset;
                for (int i = 0; i < PKV_DK; ++i) dst[(ulong)i * (ulong)v_dim] = s[i];
            }
        }
    }
    for (int i = 0; i < PKV_DK; ++i) own[(ulong)i * (ulong)v_dim] = s[i];
}
#endif
