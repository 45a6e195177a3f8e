/* The inner loops of the host recurrences (pagedkv/_kernels_recurrent.pxi):
 * the gated delta rule (Qwen3-Next / Qwen3.5 gated DeltaNet) and the causal
 * depthwise convolution (its short convolution, LFM2's).
 *
 * Gated delta rule, per v-head with state S [dk, dv] and token t:
 *     S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (scale q)
 * (q and k optionally L2-normalised first).  Every column of S evolves on its
 * own: column j needs only k, q, g, beta and v[j].  So the host kernel splits
 * S into blocks of PKV_DR_COLS columns: a block of dk x 32 floats (16 KiB at
 * dk = 128) lives in L1 in a contiguous scratch copy (a strip of the pool
 * itself, rows dv floats apart, would alias a few cache sets), every token of
 * the run passes over it twice, and it goes back to the pool at the end.
 * Per element and token that is 4 vector operations (2 FMA for S^T k and
 * S^T q, a multiply and an FMA for the update) from L1: the arithmetic bound,
 * which the chunked (WY) form of the same recurrence cannot beat on a CPU
 * (its three matrix products cost the same 3 multiply-adds per element and
 * token, plus its L x L terms).  The output needs no third pass:
 *     S_new^T q = exp(g) S^T q + (k . q) delta.
 *
 * Convolution, per channel c: y[t] = act(bias + sum_j w[j] u[t + j - K + 1]),
 * u the channel's earlier inputs (the last K - 1 of them in the state) then
 * the new rows.  The kernel runs a block of up to PKV_CONV_COLS channels,
 * vectorised across channels (x rows are contiguous in c), with the state
 * and the weights transposed to [K - 1][cols] and [K][cols] in scratch.
 */
#ifndef PKV_RECURRENT_H
#define PKV_RECURRENT_H
#include <math.h>
#include <string.h>
#include "pkv_simd.h"

#define PKV_DR_COLS 32      /* state columns of one delta-rule block */
#define PKV_CONV_COLS 64    /* channels of one convolution block */
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

/* Rows [t0, t1) of one sequence for one v-head and one block of columns.
 *
 * S : [dk][PKV_DR_COLS], the block (columns >= ncols are zero and stay zero)
 * q, k : row 0's vector of this v-head's k-head, rows `qk_stride` floats apart
 * v, o : row 0's first column of the block, rows `v_stride` / `o_stride` apart
 * g, beta : row 0's value of this v-head, rows `gb_stride` apart
 * qn, kn : dk floats of scratch each
 */
static void pkv_delta_rule_block(float *restrict S, int dk, int ncols, int t0, int t1,
                                 const float *q, const float *k, long qk_stride,
                                 const float *v, long v_stride, const float *g,
                                 const float *beta, long gb_stride, float scale, int l2norm,
                                 float *o, long o_stride, float *restrict qn,
                                 float *restrict kn) {
    for (int t = t0; t < t1; t++) {
        pkv_dr_prepare(q + t * qk_stride, dk, l2norm, scale, qn);
        pkv_dr_prepare(k + t * qk_stride, dk, l2norm, 1.0f, kn);
        const float a = expf(g[t * gb_stride]), b = beta[t * gb_stride];
        const float *vt = v + t * v_stride;
        float *ot = o + t * o_stride;
        float kq = 0.0f;
        for (int i = 0; i < dk; i++) kq += kn[i] * qn[i];
#if PKV_VECTOR
#define PKV_DR_VECS (PKV_DR_COLS / PKV_LANES)
        /* km = S^T k and qm = S^T q stay in registers across the rows */
        pkv_vec km[PKV_DR_VECS], qm[PKV_DR_VECS], delta[PKV_DR_VECS];
        for (int x = 0; x < PKV_DR_VECS; x++) km[x] = qm[x] = (pkv_vec){0};
        for (int i = 0; i < dk; i++) {
            const pkv_vec *row = (const pkv_vec *)(S + i * PKV_DR_COLS);
            for (int x = 0; x < PKV_DR_VECS; x++) {
                pkv_vec s = row[x];
                PKV_IN_REGISTER(s);
                km[x] += s * kn[i];
                qm[x] += s * qn[i];
            }
        }
        float vbuf[PKV_DR_COLS];
        memset(vbuf, 0, sizeof vbuf);
        memcpy(vbuf, vt, ncols * sizeof(float));
        for (int x = 0; x < PKV_DR_VECS; x++) {
            pkv_vec vx;
            memcpy(&vx, vbuf + x * PKV_LANES, sizeof vx);
            delta[x] = b * (vx - a * km[x]);
            pkv_vec ox = a * qm[x] + kq * delta[x];
            memcpy(vbuf + x * PKV_LANES, &ox, sizeof ox);
        }
        memcpy(ot, vbuf, ncols * sizeof(float));
        for (int i = 0; i < dk; i++) {
            pkv_vec *row = (pkv_vec *)(S + i * PKV_DR_COLS);
            for (int x = 0; x < PKV_DR_VECS; x++) row[x] = a * row[x] + kn[i] * delta[x];
        }
#else
        float km[PKV_DR_COLS] = {0}, qm[PKV_DR_COLS] = {0}, delta[PKV_DR_COLS];
        for (int i = 0; i < dk; i++) {
            const float *row = S + i * PKV_DR_COLS;
            for (int j = 0; j < PKV_DR_COLS; j++) {
                km[j] += row[j] * kn[i];
                qm[j] += row[j] * qn[i];
            }
        }
        for (int j = 0; j < PKV_DR_COLS; j++) {
            delta[j] = b * ((j < ncols ? vt[j] : 0.0f) - a * km[j]);
            if (j < ncols) ot[j] = a * qm[j] + kq * delta[j];
        }
        for (int i = 0; i < dk; i++) {
            float *row = S + i * PKV_DR_COLS;
            for (int j = 0; j < PKV_DR_COLS; j++) row[j] = a * row[j] + kn[i] * delta[j];
        }
#endif
    }
}

/* A block of the pool's state, [dk] rows `stride` floats apart, into S
 * [dk][PKV_DR_COLS] (zero-padded past ncols), or back (`to_pool`). */
static inline void pkv_dr_move(float *restrict pool, long stride, float *restrict S, int dk,
                               int ncols, int to_pool) {
    for (int i = 0; i < dk; i++) {
        if (to_pool) {
            memcpy(pool + i * stride, S + i * PKV_DR_COLS, ncols * sizeof(float));
        } else {
            memcpy(S + i * PKV_DR_COLS, pool + i * stride, ncols * sizeof(float));
            memset(S + i * PKV_DR_COLS + ncols, 0, (PKV_DR_COLS - ncols) * sizeof(float));
        }
    }
}

/* -- causal depthwise convolution ------------------------------------------- */

/* Input u[idx] of the block's channels (cols floats): idx >= 0 a new row of
 * x (rows x_stride apart), idx < 0 the history hist [K - 1][cols]. */
static inline const float *pkv_conv_input(const float *x, long x_stride, const float *hist,
                                          int K, int cols, int idx) {
    return idx >= 0 ? x + idx * x_stride : hist + (idx + K - 1) * cols;
}

/* Rows [t0, t1) of one sequence for one block of `cols` channels.
 *
 * x, y : row 0's first channel of the block, rows x_stride / y_stride apart
 * wt : [K][cols] the block's weights, transposed
 * bias : the block's cols biases, or NULL
 * hist : [K - 1][cols] the inputs before row 0 (oldest first)
 */
static void pkv_conv_block(const float *x, long x_stride, const float *restrict wt,
                           const float *bias, const float *restrict hist, int K, int cols,
                           int t0, int t1, int silu, float *y, long y_stride) {
    float acc[PKV_CONV_COLS];
    for (int t = t0; t < t1; t++) {
        for (int c = 0; c < cols; c++) acc[c] = bias ? bias[c] : 0.0f;
        for (int j = 0; j < K; j++) {
            const float *u = pkv_conv_input(x, x_stride, hist, K, cols, t + j - K + 1);
            const float *w = wt + j * cols;
            for (int c = 0; c < cols; c++) acc[c] += w[c] * u[c];
        }
        float *yt = y + t * y_stride;
        if (silu) {
            for (int c = 0; c < cols; c++) yt[c] = acc[c] / (1.0f + expf(-acc[c]));
        } else {
            for (int c = 0; c < cols; c++) yt[c] = acc[c];
        }
    }
}

/* The state after row `t_next - 1` (the last K - 1 inputs up to it, oldest
 * first) into dst, [cols][K - 1] as the pool keeps it. */
static void pkv_conv_state(const float *x, long x_stride, const float *hist, int K, int cols,
                           int t_next, float *restrict dst) {
    for (int j = 0; j < K - 1; j++) {
        const float *u = pkv_conv_input(x, x_stride, hist, K, cols, t_next - (K - 1) + j);
        for (int c = 0; c < cols; c++) dst[c * (K - 1) + j] = u[c];
    }
}

#endif
