/* The inner loops of the host recurrences (pagedkv/_kernels_recurrent.pxi):
 * the gated delta rule (Qwen3-Next / Qwen3.5 gated DeltaNet) and the causal
 * depthwise convolution (its short convolution, LFM2's).
 *
 * Gated delta rule, per v-head with state S [dk, dv] and token t:
 *     S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (scale q)
 * (q and k optionally L2-normalised first), token by token: the recurrent
 * form, for decode rows and prefill alike.  A work item is one (sequence,
 * v-head).  Every column of S evolves on its own (column j needs only k, q,
 * g, beta and v[j]), so the item holds S in scratch as blocks of
 * PKV_DR_COLS columns, [dk][32] each (16 KiB at dk = 128, in L1), and runs
 * each block over a segment of up to PKV_DR_SEGMENT tokens whose inputs it
 * first packs contiguous (pkv_dr_pack: normalised once per token, not once
 * per block).  Per state element and token that is 4 vector operations from
 * L1 (2 FMA for S^T k and S^T q, a multiply and an FMA for the update): the
 * arithmetic bound, which the chunked (WY) form cannot beat on a CPU, whose
 * three matrix products cost the same 3 multiply-adds per element and token
 * plus its L x L terms.  The output needs no third pass:
 *     S_new^T q = exp(g) S^T q + (k . q) delta.
 *
 * Convolution, per channel c: y[t] = act(bias + sum_j w[j] u[t + j - K + 1]),
 * u the channel's earlier inputs (the last K - 1 of them in the state) then
 * the new rows: see pkv_conv_rows.
 */
#ifndef PKV_RECURRENT_H
#define PKV_RECURRENT_H
#include <math.h>
#include <string.h>
#include "pkv_simd.h"

#define PKV_DR_COLS 32      /* state columns of one delta-rule block */
#define PKV_CONV_COLS 64    /* channels of one convolution accumulator block */
#define PKV_L2NORM_EPS 1e-6f /* transformers' l2norm: x * rsqrt(sum(x^2) + 1e-6) */

/* out[i] = mul * x[i], times 1 / sqrt(sum(x^2) + eps) when `l2norm`. */
static inline void pkv_dr_prepare(const float *restrict x, int n, int l2norm, float mul,
                                  float *restrict out) {
    if (l2norm) {
        float ss = 0.0f;
        for (int i = 0; i < n; i++) ss += x[i] * x[i];
        mul /= sqrtf(ss + PKV_L2NORM_EPS);
    }
    for (int i = 0; i < n; i++) out[i] = x[i] * mul;
}

/* A segment's inputs of one v-head, packed contiguous for the blocks (each
 * block walks them again): qn, kn [n][dk] (normalised; qn times scale), vc
 * [n][ld] (v, zero-padded to ld = blocks * PKV_DR_COLS columns), a [n] =
 * exp(g), bt [n] = beta, kq [n] = kn . qn.  In the step the rows lie a whole
 * step row apart (q and k Hk * dk floats, v Hv * dv), out of the hardware
 * prefetchers' reach: walking them once per block, strided, took about a
 * third of a long run's time. */
static void pkv_dr_pack(int n, int dk, int dv, int ld, const float *q, const float *k,
                        long qk_stride, const float *v, long v_stride, const float *g,
                        const float *beta, long gb_stride, float scale, int l2norm,
                        float *restrict qn, float *restrict kn, float *restrict vc,
                        float *restrict a, float *restrict bt, float *restrict kq) {
    for (int t = 0; t < n; t++) {
        float *qt = qn + (long)t * dk, *kt = kn + (long)t * dk, *vt = vc + (long)t * ld;
        pkv_dr_prepare(q + t * qk_stride, dk, l2norm, scale, qt);
        pkv_dr_prepare(k + t * qk_stride, dk, l2norm, 1.0f, kt);
        float dot = 0.0f;
        for (int i = 0; i < dk; i++) dot += kt[i] * qt[i];
        kq[t] = dot;
        memcpy(vt, v + t * v_stride, dv * sizeof(float));
        memset(vt + dv, 0, (ld - dv) * sizeof(float));
        a[t] = expf(g[t * gb_stride]);
        bt[t] = beta[t * gb_stride];
    }
}

/* n packed tokens (pkv_dr_pack) on one block of columns.
 *
 * S : [dk][PKV_DR_COLS] rows ls floats apart, the block (padding columns are
 *     zero and stay zero)
 * vc, oc : the block's first column of token 0, tokens `ld` floats apart
 */
static void pkv_delta_rule_block(float *restrict S, long ls, int dk, int n, const float *qn,
                                 const float *kn, const float *vc, const float *a,
                                 const float *bt, const float *kq, float *oc, int ld) {
    for (int t = 0; t < n; t++) {
        const float *qt = qn + (long)t * dk, *kt = kn + (long)t * dk, *vt = vc + (long)t * ld;
        float *ot = oc + (long)t * ld;
        const float at = a[t], b = bt[t], dot = kq[t];
#if PKV_VECTOR
#define PKV_DR_VECS (PKV_DR_COLS / PKV_LANES)
        /* km = S^T k and qm = S^T q stay in registers across the rows */
        pkv_vec km[PKV_DR_VECS], qm[PKV_DR_VECS], delta[PKV_DR_VECS];
        for (int x = 0; x < PKV_DR_VECS; x++) km[x] = qm[x] = (pkv_vec){0};
        for (int i = 0; i < dk; i++) {
            const pkv_vec *row = (const pkv_vec *)(S + i * ls);
            for (int x = 0; x < PKV_DR_VECS; x++) {
                pkv_vec s = row[x];
                PKV_IN_REGISTER(s);
                km[x] += s * kt[i];
                qm[x] += s * qt[i];
            }
        }
        for (int x = 0; x < PKV_DR_VECS; x++) {
            delta[x] = b * (((const pkv_vec *)vt)[x] - at * km[x]);
            ((pkv_vec *)ot)[x] = at * qm[x] + dot * delta[x];
        }
        for (int i = 0; i < dk; i++) {
            pkv_vec *row = (pkv_vec *)(S + i * ls);
            for (int x = 0; x < PKV_DR_VECS; x++) row[x] = at * row[x] + kt[i] * delta[x];
        }
#else
        float km[PKV_DR_COLS] = {0}, qm[PKV_DR_COLS] = {0}, delta[PKV_DR_COLS];
        for (int i = 0; i < dk; i++) {
            const float *row = S + i * ls;
            for (int j = 0; j < PKV_DR_COLS; j++) {
                km[j] += row[j] * kt[i];
                qm[j] += row[j] * qt[i];
            }
        }
        for (int j = 0; j < PKV_DR_COLS; j++) {
            delta[j] = b * (vt[j] - at * km[j]);
            ot[j] = at * qm[j] + dot * delta[j];
        }
        for (int i = 0; i < dk; i++) {
            float *row = S + i * ls;
            for (int j = 0; j < PKV_DR_COLS; j++) row[j] = at * row[j] + kt[i] * delta[j];
        }
#endif
    }
}

/* One head's state in a slot, [dk][dv], to or from (`to_pool`) the scratch
 * copy S [blocks][dk][PKV_DR_COLS] (padding columns zero). */
static void pkv_dr_move(float *restrict pool, float *restrict S, int dk, int dv, int to_pool) {
    const int blocks = (dv + PKV_DR_COLS - 1) / PKV_DR_COLS;
    for (int blk = 0; blk < blocks; blk++) {
        const int c0 = blk * PKV_DR_COLS, ncols = dv - c0 < PKV_DR_COLS ? dv - c0 : PKV_DR_COLS;
        float *Sb = S + (long)blk * dk * PKV_DR_COLS;
        for (int i = 0; i < dk; i++) {
            float *p = pool + (long)i * dv + c0, *r = Sb + i * PKV_DR_COLS;
            if (to_pool) {
                memcpy(p, r, ncols * sizeof(float));
            } else {
                memcpy(r, p, ncols * sizeof(float));
                memset(r + ncols, 0, (PKV_DR_COLS - ncols) * sizeof(float));
            }
        }
    }
}

/* Tokens packed per segment: qn, kn, vc and the output stay in L2 beside the
 * head's state while each block walks them. */
#define PKV_DR_SEGMENT 64

/* Runs of at most this many rows update the state where it lies in the pool
 * (when dv is a multiple of PKV_DR_COLS): two passes per token over a block
 * whose rows are dv floats apart cost less than copying the head to scratch
 * and back, which made a decode step 1.6 times a copy of its states.  Longer
 * runs copy it: the pool's rows, a power of two apart, share a few L1 sets. */
#define PKV_DR_IN_PLACE_ROWS 4

/* Floats of scratch pkv_delta_rule_head needs. */
static inline long pkv_dr_scratch(int dk, int dv) {
    const long ld = (dv + PKV_DR_COLS - 1) / PKV_DR_COLS * PKV_DR_COLS;
    return (long)dk * ld + PKV_DR_SEGMENT * (2L * dk + 2 * ld + 3);
}

/* One sequence's n rows for one v-head, its state advanced in place.
 *
 * state : the pool, slots slot_floats apart; the head's [dk][dv] at
 *     head_offset in a slot; the sequence's in slot `slot`
 * save_rows, save_slots : num_saves step rows (ascending; the sequence's rows
 *     start at step row row0) after which the head's state is copied into
 *     that slot
 * q, k, v, g, beta, o : row 0's vectors of this head (its k-head for q, k),
 *     rows qk_stride / v_stride / gb_stride floats apart (o as v)
 * scratch : pkv_dr_scratch(dk, dv) floats
 */
static void pkv_delta_rule_head(float *state, long slot_floats, long head_offset, int slot,
                                int num_saves, const int *save_rows, const int *save_slots,
                                int row0, int n, int dk, int dv, const float *q, const float *k,
                                long qk_stride, const float *v, long v_stride, const float *g,
                                const float *beta, long gb_stride, float scale, int l2norm,
                                float *o, float *scratch) {
    const int blocks = (dv + PKV_DR_COLS - 1) / PKV_DR_COLS, ld = blocks * PKV_DR_COLS;
    float *own = state + slot * slot_floats + head_offset;
    const int in_place = n <= PKV_DR_IN_PLACE_ROWS && dv % PKV_DR_COLS == 0;
    /* the state: the pool's rows (dv apart), or scratch blocks [blocks][dk][32] */
    float *S = in_place ? own : scratch;
    const long ls = in_place ? dv : PKV_DR_COLS, block_floats = in_place ? PKV_DR_COLS
                                                                        : (long)dk * PKV_DR_COLS;
    float *qn = scratch + (long)dk * ld, *kn = qn + PKV_DR_SEGMENT * dk;
    float *vc = kn + PKV_DR_SEGMENT * dk, *oc = vc + PKV_DR_SEGMENT * ld;
    float *a = oc + PKV_DR_SEGMENT * ld, *bt = a + PKV_DR_SEGMENT, *kq = bt + PKV_DR_SEGMENT;
    int m = 0;
    if (!in_place) pkv_dr_move(own, S, dk, dv, 0);
    for (int t = 0; t < n;) {
        /* segments end at save rows, so that the saved state is the state after them */
        int end = t + PKV_DR_SEGMENT < n ? t + PKV_DR_SEGMENT : n;
        if (m < num_saves && save_rows[m] - row0 + 1 < end) end = save_rows[m] - row0 + 1;
        const int len = end - t;
        pkv_dr_pack(len, dk, dv, ld, q + t * qk_stride, k + t * qk_stride, qk_stride,
                    v + t * v_stride, v_stride, g + t * gb_stride, beta + t * gb_stride,
                    gb_stride, scale, l2norm, qn, kn, vc, a, bt, kq);
        for (int blk = 0; blk < blocks; blk++)
            pkv_delta_rule_block(S + blk * block_floats, ls, dk, len, qn, kn,
                                 vc + blk * PKV_DR_COLS, a, bt, kq, oc + blk * PKV_DR_COLS, ld);
        for (int r = 0; r < len; r++)
            memcpy(o + (t + r) * v_stride, oc + (long)r * ld, dv * sizeof(float));
        for (; m < num_saves && save_rows[m] - row0 + 1 == end; m++) {
            float *dst = state + save_slots[m] * slot_floats + head_offset;
            if (in_place) memcpy(dst, own, (size_t)dk * dv * sizeof(float));
            else pkv_dr_move(dst, S, dk, dv, 1);
        }
        t = end;
    }
    if (!in_place) pkv_dr_move(own, S, dk, dv, 1);
}

/* -- causal depthwise convolution ------------------------------------------- */

/* y / (1 + exp(-y)), from exp(-|y|) <= 1 alone: pkv_exp_nonpositive
 * vectorises, where a call of libm's expf per channel took 5/6 of a
 * prefill's time. */
PKV_INLINE float pkv_silu(float y) {
    const float e = pkv_exp_nonpositive(-__builtin_fabsf(y));
    return y * (y >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* Rows [t0, t1) of one sequence, every channel.
 *
 * x, y : the sequence's row 0, [n][C]
 * hist : the sequence's state in its slot, [C][K - 1] (inputs before row 0,
 *     oldest first); read only by rows t < K - 1
 * wt : [K][C] the weights, transposed so that a tap is a row like x's
 * bias : [C] or NULL
 *
 * Rows are independent given the inputs, so a work item is a run of rows
 * with all channels: x, y and wt stream contiguously (per channel, a run of
 * rows strided by C was out of the prefetchers' reach and 30 times slower).
 */
static void pkv_conv_rows(const float *x, const float *hist, const float *wt, const float *bias,
                          int C, int K, int t0, int t1, int silu, float *y) {
    const int H = K - 1;
    float acc[PKV_CONV_COLS];
    for (int t = t0; t < t1; t++) {
        for (int c0 = 0; c0 < C; c0 += PKV_CONV_COLS) {
            const int cols = C - c0 < PKV_CONV_COLS ? C - c0 : PKV_CONV_COLS;
            for (int c = 0; c < cols; c++) acc[c] = bias ? bias[c0 + c] : 0.0f;
            for (int j = 0; j < K; j++) {
                const int idx = t + j - H;
                const float *w = wt + (long)j * C + c0;
                if (idx >= 0) {
                    const float *u = x + (long)idx * C + c0;
                    for (int c = 0; c < cols; c++) acc[c] += w[c] * u[c];
                } else {    /* the history, [C][H]: the first H rows only */
                    const float *u = hist + (long)c0 * H + idx + H;
                    for (int c = 0; c < cols; c++) acc[c] += w[c] * u[(long)c * H];
                }
            }
            float *yt = y + (long)t * C + c0;
            if (silu) {
#pragma omp simd
                for (int c = 0; c < cols; c++) yt[c] = pkv_silu(acc[c]);
            } else {
                for (int c = 0; c < cols; c++) yt[c] = acc[c];
            }
        }
    }
}

/* The state after row t_next - 1 (its last K - 1 inputs, oldest first) into
 * dst [C][K - 1], which may be hist itself: entry j of a channel reads
 * history entry t_next + j > j, and entries are written in ascending j.
 * Entry by entry over the channels, so that the loops have no branch. */
static void pkv_conv_state(const float *x, const float *hist, int C, int K, int t_next,
                           float *dst) {
    const int H = K - 1;
    for (int j = 0; j < H; j++) {
        const int idx = t_next - H + j;
        if (idx >= 0) {
            const float *u = x + (long)idx * C;
            for (int c = 0; c < C; c++) dst[(long)c * H + j] = u[c];
        } else {
            const float *u = hist + idx + H;
            for (int c = 0; c < C; c++) dst[(long)c * H + j] = u[(long)c * H];
        }
    }
}

#endif
