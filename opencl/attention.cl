/* Paged attention over a ragged batch, with split-K.
 *
 * A work item (one work-group; its columns: pkv_work_item.h) is query rows
 * ROW0:ROW1 of one sequence, for the `group` query heads of one head group,
 * against that sequence's keys at positions KEY0:KEY1; row ROW0 + i sees the
 * keys of its band [BAND_LO + i, BAND_HI + i), which is where causality and
 * sliding windows are planned (pagedkv/backends/schedule.py).  A head
 * group is a KV head's whole GQA group (so the group's heads share every
 * K/V row the work-group reads), or 1/sub_groups of it when the group has
 * more heads than a work-group holds (PKV_NQ).  The work-group walks its key
 * range in chunks of PKV_CHUNK keys:
 *
 *   0. find each key's K/V row through the page table, and (PKV_STAGE_K/V)
 *      copy the rows into local memory as floats: whole rows, in order, so
 *      that the pools are read as sequential streams;
 *   1. scores: the work-items share out tiles of PKV_TB keys x PKV_QB queries,
 *      each a small register-blocked matrix product over D;
 *   2. online softmax, one work-item per query, PKV_SW keys at a time: new
 *      running max, the factor exp(old max - new max) that rescales what was
 *      accumulated, weights exp(score - max) in place of the scores, running
 *      sum (all float32);
 *   3. output: the work-items share out tiles of PKV_QB queries x PKV_CB
 *      vectors of D, each accumulating weight x V over the chunk's keys.
 *
 * A launch may also store the step's new K/V (the store fused into the
 * attention, so that a decode layer costs one launch): with num_new_tokens >
 * 0, the work-groups past num_items scatter new_k / new_v into the pools
 * (scatter_rows rows (token, head) each, pkv_scatter_vector), and the
 * attention work-groups read the step's new keys from new_k / new_v instead
 * of the pools (rounded as the pools store them), so that no work-group reads
 * what another writes.  Float formats and staged K/V only; the host runs
 * scatter_kv first otherwise.
 *
 * An item that covers its rows' whole key range (part < 0) writes the
 * normalised output.  Otherwise it leaves its unnormalised accumulator, max
 * and sum in slot `part` of the partial buffers, and merge_partials combines
 * the parts of each (row block, head group) by log-sum-exp (split-K).
 *
 * Every loop runs the same number of times on every work-item of the group
 * (a count fixed at compile time or derived from the item) and skips excess
 * work with an `if`: loops like `for (i = lid; i < n; i += WG)` next to a
 * barrier are miscompiled by some CPU drivers (PoCL 3.0 among them).
 *
 * Build options (besides pkv_common.h's):
 *   PKV_WG      work-group size
 *   PKV_NQ      most queries (rows x heads of the group) per item; PKV_QB divides it
 *   PKV_CHUNK   keys per iteration; PKV_TB and PKV_SW divide it
 *   PKV_QB, PKV_TB, PKV_CB   register tiles: queries, keys, vectors of D
 *   PKV_SPLIT   work-items per K/V row when staging (divides D / PKV_VW)
 *   PKV_STAGE_K, PKV_STAGE_V  1: read K (V) rows from a local copy
 *   PKV_SW      softmax vector width, 1 or 8
 *   PKV_MERGE_WG  work-group size of merge_partials
 *   PKV_COUNT_LOOPS  1: each work-item writes the loop iterations it ran
 *                 (those of loops that are not unrolled) to loop_counts, for
 *                 tests of the bound below; 0 (default): loop_counts is unread
 *
 * No loop's trip count grows with the context length: the planner cuts key
 * ranges into parts of at most KernelLayout.max_item_keys keys, so that a
 * work-item runs a bounded number of loop iterations (llvmpipe ends any
 * work-item after 65,535; a GPU watchdog ends long ones); the
 * merge loops over a bounded number of parts.
 */
#include "pkv_common.h"
/* the variant contract (band, logit, online softmax, merge), over pkv_common.h's exp */
PKV_DEFINE_TANH(inline, pkv_tanh, float, pkv_exp, fabs, copysign)
#define PKV_VARIANT_EXP pkv_exp
#define PKV_VARIANT_TANH pkv_tanh
#include "pkv_variant.h"
#include "pkv_work_item.h"

#if PKV_NQ % PKV_QB || PKV_CHUNK % PKV_TB || PKV_VDV % PKV_CB || PKV_DV % PKV_SPLIT \
    || PKV_VDV % PKV_SPLIT || PKV_CHUNK % PKV_SW
#error "tile sizes must divide PKV_NQ, PKV_CHUNK and PKV_(V_)HEAD_DIM / PKV_VW"
#endif


#ifndef PKV_COUNT_LOOPS
#define PKV_COUNT_LOOPS 0
#endif
/* one iteration of a loop that is not unrolled (PKV_COUNT_LOOPS builds) */
#if PKV_COUNT_LOOPS
#define PKV_LOOP() (++loops)
#else
#define PKV_LOOP() ((void)0)
#endif

#define PKV_COL_BLOCKS (PKV_VDV / PKV_CB)   /* output (V) vectors in column tiles */
#define PKV_OUT_TILES ((PKV_NQ / PKV_QB) * PKV_COL_BLOCKS)
#define PKV_OUT_PER_WI PKV_CEIL(PKV_OUT_TILES, PKV_WG)
#define PKV_SEGMENT (PKV_DV / PKV_SPLIT)     /* vectors one work-item copies per K row */
#define PKV_V_SEGMENT (PKV_VDV / PKV_SPLIT)  /* ... per V row */
/* The element offset of a V row from its K row's (key_row): the same slot in a
   pool of PKV_VD-wide rows (the same offset where V rows are as wide as K's,
   latent rows included). */
#if PKV_VD == PKV_D
#define PKV_V_OFFSET(row) (row)
#else
#define PKV_V_OFFSET(row) ((row) / PKV_D * PKV_VD)
#endif
/* Output tiles a work-item visits: with few, a fixed and unrolled loop keeps
   acc[][][] in registers (GPU); with many (CPU), stop after the real ones. */
#if PKV_OUT_PER_WI <= 8
#define PKV_OUT_LOOP PKV_OUT_PER_WI
#define PKV_OUT_UNROLL PKV_UNROLL
#define PKV_OUT_ITERATION() ((void)0)
#else
#define PKV_OUT_LOOP PKV_CEIL(out_tiles, PKV_WG)
#define PKV_OUT_UNROLL
#define PKV_OUT_ITERATION() PKV_LOOP()
#endif

/* full unrolling keeps register tiles in registers */
#define PKV_UNROLL _Pragma("unroll")
#define PKV_MIN(a, b) ((a) < (b) ? (a) : (b))
#define PKV_MAX(a, b) ((a) > (b) ? (a) : (b))

/* key_src[t] of a chunk's key: masked (no valid page, or past the chunk's
   keys), in the pool, or else the row of new_k / new_v that holds it */
#define PKV_KEY_MASKED (-2)
#define PKV_KEY_POOL (-1)

#if !PKV_VECTOR_ROWS && (!PKV_STAGE_K || !PKV_STAGE_V)
#error "rows stored whole (pkv_storage.h) are converted into the staged tiles: build with PKV_STAGE_K=PKV_STAGE_V=1"
#endif

/* Where phases 1 and 3 read key rows: a local float copy, or the pool itself. */
#if PKV_STAGE_K
#define PKV_K_ROW(t) (k_tile + (t) * PKV_DV)
#define PKV_K_VEC(row, d) ((row)[d])
typedef __local const pkv_vec* pkv_k_row;
#else
#define PKV_K_ROW(t) (k_pool + key_row[t])
#define PKV_K_VEC(row, d) PKV_VLOAD_S((d), (row))
typedef __global const pkv_storage* pkv_k_row;
#endif
#if PKV_STAGE_V
#define PKV_V_ROW(t) (v_tile + (t) * PKV_VDV)
#define PKV_V_VEC(row, d) ((row)[d])
typedef __local const pkv_vec* pkv_v_row;
#else
#define PKV_V_ROW(t) (v_pool + PKV_V_OFFSET(key_row[t]))
#define PKV_V_VEC(row, d) PKV_VLOAD_S((d), (row))
typedef __global const pkv_storage* pkv_v_row;
#endif

/* -- softmax vectors of PKV_SW floats --------------------------------------------- */
#if PKV_SW == 8
typedef float8 pkv_svec;
typedef int8 pkv_sivec;
#define PKV_AS_SVEC as_float8
#define PKV_AS_SIVEC as_int8
#define PKV_SLANES ((int8)(0, 1, 2, 3, 4, 5, 6, 7))
inline float pkv_hmax(float8 x) {
    const float4 a = x.lo > x.hi ? x.lo : x.hi;
    const float2 b = a.lo > a.hi ? a.lo : a.hi;
    return b.s0 > b.s1 ? b.s0 : b.s1;
}
#define PKV_SSUM(x) PKV_HSUM8(x)
#elif PKV_SW == 1
typedef float pkv_svec;
typedef int pkv_sivec;
#define PKV_AS_SVEC as_float
#define PKV_AS_SIVEC as_int
#define PKV_SLANES 0
#define pkv_hmax(x) (x)
#define PKV_SSUM(x) (x)
#else
#error "PKV_SW must be 1 or 8"
#endif
#define PKV_HSUM8(x) ((((x).s0 + (x).s1) + ((x).s2 + (x).s3)) + \
                      (((x).s4 + (x).s5) + ((x).s6 + (x).s7)))

/* pkv_exp (pkv_common.h) on PKV_SW lanes at once; x <= 0, -inf or NaN */
PKV_DEFINE_EXP(pkv_exp_s, pkv_svec, pkv_sivec, PKV_AS_SVEC, PKV_AS_SIVEC)
/* tanh on PKV_SW lanes at once (pkv_tanh.h), for the soft cap */
PKV_DEFINE_TANH(inline, pkv_tanh_s, pkv_svec, pkv_exp_s, fabs, copysign)
/* the contract's logit and softmax steps on PKV_SW lanes at once */
PKV_DEFINE_LOGIT(inline, pkv_logit_s, pkv_svec, pkv_tanh_s)
PKV_DEFINE_SOFTMAX(inline, _s, pkv_svec, pkv_sivec, pkv_exp_s)
/* the contract's row step on a query's row of logits in local memory, PKV_SW
   keys a unit (the vectors are what PoCL vectorises, not the loops) */
#define PKV_VARIANT_SIMD(clause)
PKV_DEFINE_SOFTMAX_ROW(inline, pkv_row, __local, pkv_svec, pkv_sivec, PKV_SLANES, PKV_SW, _s,
                       pkv_hmax, PKV_SSUM)

__kernel __attribute__((reqd_work_group_size(PKV_WG, 1, 1)))
void paged_attention(__global const float* q,              /* [T, num_heads, D], scaled */
                     __global pkv_storage* k_pool,         /* [pages, H, page_size, D] */
                     __global pkv_storage* v_pool,         /* [pages, H, page_size, VD] */
                     __global const float* k_scales,       /* int8: [pages, H, page_size] */
                     __global const float* v_scales,
                     __global const int* page_indptr,      /* [B+1] */
                     __global const int* page_indices,     /* [nnz] */
                     __global const int* items,            /* [num_items, PKV_W_FIELDS] */
                     const int num_items,
                     /* the fused store (num_new_tokens > 0; else unread) */
                     __global const float* new_k,          /* [T, H, D] */
                     __global const float* new_v,          /* [T, H, VD] */
                     __global const long* slot_mapping,    /* [T] */
                     __global const int* query_start,      /* [B+1] */
                     __global const int* seq_lens,         /* [B] */
                     const int num_new_tokens, const int scatter_rows, const long num_slots,
                     const int group, const int num_groups, const int sub_groups,
                     const int page_size, const int num_pages, const int nnz,
                     const pkv_variant variant,            /* the variant's scalars */
                     __global const float* sinks,          /* has_sinks: [num_heads] */
                     __global const float* bias_slopes,    /* has_bias: [num_heads], pkv_bias's */
                     __global float* out,                  /* [T, num_heads, VD] */
                     __global float* lse,                  /* has_lse: [T, num_heads] */
                     const int has_lse,
                     __global float* part_acc,             /* [P, PKV_NQ, VD] */
                     __global float* part_max,             /* [P, PKV_NQ] */
                     __global float* part_sum,
                     __global int* loop_counts) {          /* PKV_COUNT_LOOPS: [work-items] */
    int loops = 0;
    /* scores, then softmax weights, per query */
    __local pkv_svec scores_v[PKV_NQ * PKV_CHUNK / PKV_SW];
    __local float* scores = (__local float*)scores_v;
    __local ulong key_row[PKV_CHUNK];           /* element offset of each key's K/V row */
    __local int key_src[PKV_CHUNK];             /* PKV_KEY_MASKED, PKV_KEY_POOL or a new_k row */
    __local float run_max[PKV_NQ], run_sum[PKV_NQ], rescale[PKV_NQ];
    __local int vis_lo[PKV_NQ], vis_hi[PKV_NQ]; /* the chunk's keys a query sees: vis_lo:vis_hi */
#if PKV_STAGE_K
    __local pkv_vec k_tile[PKV_CHUNK * PKV_DV];
#endif
#if PKV_STAGE_V
    __local pkv_vec v_tile[PKV_CHUNK * PKV_VDV];
#endif

    const int lid = get_local_id(0);
    const float soft_cap = variant.soft_cap;
    const int has_sinks = variant.has_sinks, has_bias = variant.has_bias;
    const float inverse_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;
#if PKV_VECTOR_ROWS && PKV_VD == PKV_D
    /* (V rows of their own width are scattered by the store itself, not here:
       pkv_scatter_vector moves rows of one width) */
    if (get_group_id(0) >= num_items) {
        /* a scatter work-group: rows (token, head) first_row.. of new_k / new_v */
        const ulong first_row = (ulong)(get_group_id(0) - num_items) * (ulong)scatter_rows;
        const ulong num_rows = (ulong)num_new_tokens * (ulong)(num_groups / sub_groups);
        for (int k = 0; k < PKV_CEIL(scatter_rows * PKV_DV, PKV_WG); ++k) {
            const int u = lid + k * PKV_WG;
            if (u < scatter_rows * PKV_DV && first_row + u / PKV_DV < num_rows)
                pkv_scatter_vector(first_row * PKV_DV + u, new_k, new_v, slot_mapping, k_pool,
                                   v_pool, num_new_tokens, num_groups / sub_groups, page_size,
                                   num_slots);
        }
        return;
    }
#endif
    __global const int* item = items + (size_t)get_group_id(0) * PKV_W_FIELDS;
    const int b = item[PKV_W_SEQ], h = item[PKV_W_KV_HEAD], kv_head = h / sub_groups;
    const int row0 = item[PKV_W_ROW0], row1 = item[PKV_W_ROW1];
    const int key0 = item[PKV_W_KEY0], key1 = item[PKV_W_KEY1], part = item[PKV_W_PART];
    const pkv_band band = PKV_ITEM_BAND(item);
    const int num_kv_heads = num_groups / sub_groups, num_heads = num_groups * group;
    const int nq = (row1 - row0) * group;       /* query qi: row row0 + qi / group, head h * group + qi % group */
    const int query_blocks = PKV_CEIL(nq, PKV_QB);
    const int out_tiles = query_blocks * PKV_COL_BLOCKS;   /* <= PKV_OUT_TILES */
    const int pages_begin = page_indptr[b], pages_end = PKV_MIN(page_indptr[b + 1], nnz);
    /* the step's new tokens of sequence b, when this launch stores them: rows
       new_row0..new_row1 of new_k / new_v, at positions new_pos0.. (never for
       rows stored whole, !PKV_VECTOR_ROWS: the format's scatter stores them) */
    const bool fused = PKV_VECTOR_ROWS && PKV_VD == PKV_D && num_new_tokens > 0;
    const int new_row0 = fused ? query_start[b] : 0;
    const int new_row1 = fused ? PKV_MIN(query_start[b + 1], num_new_tokens) : 0;
    const long new_pos0 = fused ? (long)seq_lens[b] - (new_row1 - new_row0) : 0;

    for (int k = 0; k < PKV_CEIL(nq, PKV_WG); ++k) {
        PKV_LOOP();
        const int qi = lid + k * PKV_WG;
        if (qi < nq) {
            run_max[qi] = -INFINITY;
            run_sum[qi] = 0.0f;
        }
    }
    pkv_vec acc[PKV_OUT_PER_WI][PKV_QB][PKV_CB];
    PKV_OUT_UNROLL
    for (int k = 0; k < PKV_OUT_PER_WI; ++k) {
        PKV_OUT_ITERATION();
        PKV_UNROLL
        for (int j = 0; j < PKV_QB; ++j)
            PKV_UNROLL
            for (int c = 0; c < PKV_CB; ++c) acc[k][j][c] = 0.0f;
    }

    for (int c0 = key0; c0 < key1; c0 += PKV_CHUNK) {
        PKV_LOOP();
        const int n_keys = PKV_MIN(PKV_CHUNK, key1 - c0);
        const int key_blocks = PKV_CEIL(n_keys, PKV_TB);
        const int n_rows = key_blocks * PKV_TB;     /* whole tiles: n_keys rounded up */
        const int score_tiles = query_blocks * key_blocks;

        /* 0. K/V rows of the chunk's keys.  A missing or out-of-range page id (a
              corrupt table) is masked; keys past n_keys point at row 0 so that
              whole tiles load in bounds. */
        for (int k = 0; k < PKV_CEIL(PKV_CHUNK, PKV_WG); ++k) {
            PKV_LOOP();
            const int t = lid + k * PKV_WG;
            if (t < PKV_CHUNK) {
                ulong row = 0;
                int src = PKV_KEY_MASKED;
                if (t < n_keys) {
                    const int pos = c0 + t, j = pages_begin + pos / page_size;
                    const int page = j < pages_end ? page_indices[j] : -1;
                    if (page >= 0 && page < num_pages) {
                        row = pkv_row(page, kv_head, pos % page_size, num_kv_heads, page_size);
                        const long new_row = new_row0 + (pos - new_pos0);
                        src = pos >= new_pos0 && new_row0 <= new_row && new_row < new_row1
                            ? (int)new_row : PKV_KEY_POOL;
                    }
                }
                key_row[t] = row;
                key_src[t] = src;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#if PKV_STAGE_K || PKV_STAGE_V
        /* copy the rows as floats; PKV_SPLIT work-items share a row */
        for (int k = 0; k < PKV_CEIL(n_rows * PKV_SPLIT, PKV_WG); ++k) {
            PKV_LOOP();
            const int u = lid + k * PKV_WG;
            if (u < n_rows * PKV_SPLIT) {
                const int t = u / PKV_SPLIT, d0 = (u % PKV_SPLIT) * PKV_SEGMENT;
                const int e0 = (u % PKV_SPLIT) * PKV_V_SEGMENT;   /* of the V row */
                const ulong row = key_row[t];
                const int src = key_src[t];
                if (src == PKV_KEY_POOL) {
#if PKV_STAGE_K
                    const float k_scale = PKV_ROW_SCALE(k_scales, row);
#endif
#if PKV_STAGE_V
                    const float v_scale = PKV_ROW_SCALE(v_scales, row);
#endif
#if PKV_VD == PKV_D
                    /* rows of one width: K's and V's vectors in one loop */
                    PKV_UNROLL
                    for (int d = d0; d < d0 + PKV_SEGMENT; ++d) {
#if PKV_STAGE_K
                        k_tile[t * PKV_DV + d] = PKV_VLOAD_S(d, k_pool + row) * k_scale;
#endif
#if PKV_STAGE_V
                        v_tile[t * PKV_DV + d] = PKV_VLOAD_S(d, v_pool + row) * v_scale;
#endif
                    }
#else
#if PKV_STAGE_K
                    PKV_UNROLL
                    for (int d = d0; d < d0 + PKV_SEGMENT; ++d)
                        k_tile[t * PKV_DV + d] = PKV_VLOAD_S(d, k_pool + row) * k_scale;
#endif
#if PKV_STAGE_V
                    PKV_UNROLL
                    for (int d = e0; d < e0 + PKV_V_SEGMENT; ++d)
                        v_tile[t * PKV_VDV + d] =
                            PKV_VLOAD_S(d, v_pool + PKV_V_OFFSET(row)) * v_scale;
#endif
#endif
                } else {
                    /* masked keys (and whole-tile padding) stage zeros, so that
                       no work-group reads a pool row the fused store may write */
#if PKV_VD == PKV_D
#if PKV_VECTOR_ROWS
                    const ulong in_row = src >= 0
                        ? ((ulong)src * num_kv_heads + kv_head) * PKV_DV : 0;
#endif
                    PKV_UNROLL
                    for (int d = d0; d < d0 + PKV_SEGMENT; ++d) {
#if !PKV_VECTOR_ROWS
                        const pkv_vec k_new = 0.0f, v_new = 0.0f;
#else
                        const pkv_vec k_new = src >= 0
                            ? pkv_round_to_storage(PKV_VLOAD_F(in_row + d, new_k)) : 0.0f;
                        const pkv_vec v_new = src >= 0
                            ? pkv_round_to_storage(PKV_VLOAD_F(in_row + d, new_v)) : 0.0f;
#endif
#if PKV_STAGE_K
                        k_tile[t * PKV_DV + d] = k_new;
#endif
#if PKV_STAGE_V
                        v_tile[t * PKV_DV + d] = v_new;
#endif
                    }
#else
                    /* V rows of their own width: the store is never fused
                       (src < 0), so these are the masked keys' zeros */
#if PKV_STAGE_K
                    PKV_UNROLL
                    for (int d = d0; d < d0 + PKV_SEGMENT; ++d) k_tile[t * PKV_DV + d] = 0.0f;
#endif
#if PKV_STAGE_V
                    PKV_UNROLL
                    for (int d = e0; d < e0 + PKV_V_SEGMENT; ++d) v_tile[t * PKV_VDV + d] = 0.0f;
#endif
#endif
                }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#endif

        /* 1. logits of tiles of PKV_TB keys x PKV_QB queries; keys outside a
              query's band get -inf.  Queries past nq repeat the last one. */
        for (int k = 0; k < PKV_CEIL(score_tiles, PKV_WG); ++k) {
            PKV_LOOP();
            const int tile = lid + k * PKV_WG;
            if (tile < score_tiles) {
                const int qb = tile / key_blocks, t0 = (tile % key_blocks) * PKV_TB;
                __global const pkv_vec* qv[PKV_QB];
                long q_lo[PKV_QB], q_hi[PKV_QB];
                PKV_UNROLL
                for (int j = 0; j < PKV_QB; ++j) {
                    const int qi = PKV_MIN(qb * PKV_QB + j, nq - 1), r = row0 + qi / group;
                    qv[j] = (__global const pkv_vec*)(
                        q + ((size_t)r * num_heads + h * group + qi % group) * PKV_D);
                    q_lo[j] = pkv_band_lo(band, qi / group);
                    q_hi[j] = pkv_band_hi(band, qi / group);
                }
                pkv_k_row kr[PKV_TB];
                PKV_UNROLL
                for (int i = 0; i < PKV_TB; ++i) kr[i] = PKV_K_ROW(t0 + i);
                pkv_vec dot[PKV_TB][PKV_QB];
                PKV_UNROLL
                for (int i = 0; i < PKV_TB; ++i)
                    PKV_UNROLL
                    for (int j = 0; j < PKV_QB; ++j) dot[i][j] = 0.0f;
                for (int d = 0; d < PKV_DV; ++d) {
                    PKV_LOOP();
                    pkv_vec kv[PKV_TB];
                    PKV_UNROLL
                    for (int i = 0; i < PKV_TB; ++i) kv[i] = PKV_K_VEC(kr[i], d);
                    PKV_UNROLL
                    for (int j = 0; j < PKV_QB; ++j) {
                        const pkv_vec qq = qv[j][d];
                        PKV_UNROLL
                        for (int i = 0; i < PKV_TB; ++i) dot[i][j] += qq * kv[i];
                    }
                }
                /* one horizontal sum per dot: an 8x8 transpose of shuffles instead
                   ran no faster on PoCL, and its vector concatenations crash
                   Oclgrind's uninitialized-value checker */
                float sums[PKV_TB][PKV_QB];
                PKV_UNROLL
                for (int i = 0; i < PKV_TB; ++i)
                    PKV_UNROLL
                    for (int j = 0; j < PKV_QB; ++j) sums[i][j] = PKV_HSUM(dot[i][j]);
                PKV_UNROLL
                for (int i = 0; i < PKV_TB; ++i) {
                    const int t = t0 + i;
                    PKV_UNROLL
                    for (int j = 0; j < PKV_QB; ++j) {
                        const int qi = qb * PKV_QB + j;
                        if (qi < nq && t < n_keys) {
                            const float x = sums[i][j];
                            const bool seen = key_src[t] != PKV_KEY_MASKED &&
                                q_lo[j] <= c0 + t && c0 + t < q_hi[j];
                            scores[qi * PKV_CHUNK + t] = seen ? x : -INFINITY;
                        }
                    }
                }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* 2. online softmax update, one work-item per query, PKV_SW keys at a time.
              Keys outside the query's band become weight 0 (step 3 reads whole
              tiles). */
        for (int k = 0; k < PKV_CEIL(nq, PKV_WG); ++k) {
            PKV_LOOP();
            const int qi = lid + k * PKV_WG;
            if (qi < nq) {
                __local pkv_svec* s = scores_v + qi * (PKV_CHUNK / PKV_SW);
                /* the band relative to the chunk, in long: c0 may be near INT_MAX */
                const long lo = pkv_band_lo(band, qi / group) - c0;
                const long hi = pkv_band_hi(band, qi / group) - c0;
                const int v_lo = (int)PKV_MAX(lo, 0L), v_hi = (int)PKV_MIN(hi, (long)n_keys);
                const int n_vec = PKV_CEIL(n_keys, PKV_SW);
                /* lanes past n_keys hold no logit: zero them, so that no lane the
                   vector loads below read is uninitialised */
                for (int t = n_keys; t < n_vec * PKV_SW; ++t) {
                    PKV_LOOP();
                    scores[qi * PKV_CHUNK + t] = 0.0f;
                }
                /* the row step's loops, for the counting build */
                if (PKV_COUNT_LOOPS)
                    loops += (soft_cap > 0.0f ? n_vec : 0) + (has_bias ? PKV_MAX(v_hi - v_lo, 0) : 0)
                             + 2 * n_vec;
                if (soft_cap > 0.0f) pkv_row_logits(s, n_vec, soft_cap, inverse_cap);
                if (has_bias)   /* the visible logits gain slope * (j - p) */
                    pkv_row_bias(scores + qi * PKV_CHUNK, v_lo, v_hi,
                                 bias_slopes[h * group + qi % group],
                                 (int)((long)c0 - pkv_band_position(band, qi / group)));
                const float m_old = run_max[qi];
                float m_new = m_old;
                const float total = pkv_row_step(s, n_vec, v_lo, v_hi, &m_new);
                const float alpha = pkv_rescale(m_old, m_new);
                rescale[qi] = alpha;
                run_max[qi] = m_new;
                run_sum[qi] = run_sum[qi] * alpha + total;
                /* an empty band widens no tile's key loop in step 3 */
                vis_lo[qi] = v_lo < v_hi ? v_lo : PKV_CHUNK;
                vis_hi[qi] = v_lo < v_hi ? v_hi : 0;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* 3. acc = acc * alpha + sum_t p_t V_t over tiles of PKV_QB queries x PKV_CB vectors */
        PKV_OUT_UNROLL
        for (int k = 0; k < PKV_OUT_LOOP; ++k) {
            PKV_OUT_ITERATION();
            const int tile = lid + k * PKV_WG;
            if (tile < out_tiles) {
                const int qb = tile / PKV_COL_BLOCKS, v0 = (tile % PKV_COL_BLOCKS) * PKV_CB;
                __local const float* p[PKV_QB];
                int q_lo[PKV_QB], q_hi[PKV_QB];
                /* the keys some query of the tile sees (t_begin:t_end), and
                   those all of them see (all_lo:all_hi) */
                int t_begin = PKV_CHUNK, t_end = 0, all_lo = 0, all_hi = PKV_CHUNK;
                pkv_vec a[PKV_QB][PKV_CB];
                PKV_UNROLL
                for (int j = 0; j < PKV_QB; ++j) {
                    const int qi = PKV_MIN(qb * PKV_QB + j, nq - 1);
                    p[j] = scores + qi * PKV_CHUNK;
                    q_lo[j] = vis_lo[qi];
                    q_hi[j] = vis_hi[qi];
                    t_begin = PKV_MIN(t_begin, q_lo[j]);
                    t_end = PKV_MAX(t_end, q_hi[j]);
                    all_lo = PKV_MAX(all_lo, q_lo[j]);
                    all_hi = PKV_MIN(all_hi, q_hi[j]);
                    const float alpha = rescale[qi];
                    PKV_UNROLL
                    for (int c = 0; c < PKV_CB; ++c) a[j][c] = acc[k][j][c] * alpha;
                }
                if (all_hi <= all_lo) all_lo = all_hi = t_end;
                /* A masked weight is 0, but 0 times a NaN or inf value is NaN:
                   outside all_lo:all_hi a product counts only for the queries
                   that see the key, chosen by select, not multiplied by 0. */
#define PKV_ACCUMULATE_KEYS(from, to, masked)                                        \
                for (int t = (from); t < (to); ++t) {                                \
                    PKV_LOOP();                                                      \
                    const pkv_v_row vr = PKV_V_ROW(t);                               \
                    pkv_vec vv[PKV_CB];                                              \
                    PKV_UNROLL                                                       \
                    for (int c = 0; c < PKV_CB; ++c) vv[c] = PKV_V_VEC(vr, v0 + c);  \
                    PKV_UNROLL                                                       \
                    for (int j = 0; j < PKV_QB; ++j) {                               \
                        const float pj = p[j][t];                                    \
                        const bool seen = !(masked) || (q_lo[j] <= t && t < q_hi[j]); \
                        PKV_UNROLL                                                   \
                        for (int c = 0; c < PKV_CB; ++c)                             \
                            a[j][c] += seen ? pj * vv[c] : (pkv_vec)(0.0f);          \
                    }                                                                \
                }
                PKV_ACCUMULATE_KEYS(t_begin, all_lo, 1)
                PKV_ACCUMULATE_KEYS(all_lo, all_hi, 0)
                PKV_ACCUMULATE_KEYS(all_hi, t_end, 1)
#undef PKV_ACCUMULATE_KEYS
                PKV_UNROLL
                for (int j = 0; j < PKV_QB; ++j)
                    PKV_UNROLL
                    for (int c = 0; c < PKV_CB; ++c) acc[k][j][c] = a[j][c];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    PKV_OUT_UNROLL
    for (int k = 0; k < PKV_OUT_LOOP; ++k) {
        PKV_OUT_ITERATION();
        const int tile = lid + k * PKV_WG;
        if (tile < out_tiles) {
            const int qb = tile / PKV_COL_BLOCKS, v0 = (tile % PKV_COL_BLOCKS) * PKV_CB;
            PKV_UNROLL
            for (int j = 0; j < PKV_QB; ++j) {
                const int qi = qb * PKV_QB + j;
                if (qi < nq) {
                    const int r = row0 + qi / group, head = h * group + qi % group;
                    const float inv = part >= 0 ? 1.0f : pkv_output_scale(
                        run_max[qi], run_sum[qi], has_sinks ? sinks[head] : -INFINITY);
                    __global float* dst = part < 0
                        ? out + ((size_t)r * num_heads + head) * PKV_VD
                        : part_acc + ((size_t)part * PKV_NQ + qi) * PKV_VD;
                    PKV_UNROLL
                    for (int c = 0; c < PKV_CB; ++c) PKV_VSTORE_F(acc[k][j][c] * inv, v0 + c, dst);
                    if (has_lse && part < 0 && v0 == 0)
                        lse[(size_t)r * num_heads + head] = pkv_log_sum(run_max[qi], run_sum[qi]);
                }
            }
        }
    }
    if (part >= 0)
        for (int k = 0; k < PKV_CEIL(nq, PKV_WG); ++k) {
            PKV_LOOP();
            const int qi = lid + k * PKV_WG;
            if (qi < nq) {
                part_max[(size_t)part * PKV_NQ + qi] = run_max[qi];
                part_sum[(size_t)part * PKV_NQ + qi] = run_sum[qi];
            }
        }
    if (PKV_COUNT_LOOPS) loop_counts[get_global_id(0)] = loops;
}

/* Combine the parts of each split (row block, head group), add the sinks and
 * normalise: segment s owns partial slots seg_parts[s]:seg_parts[s+1]; its
 * first item is seg_items[s]. */
__kernel __attribute__((reqd_work_group_size(PKV_MERGE_WG, 1, 1)))
void merge_partials(__global const int* items, __global const int* seg_items,
                    __global const int* seg_parts,
                    __global const float* part_acc,    /* [P, PKV_NQ, VD] */
                    __global const float* part_max,    /* [P, PKV_NQ] */
                    __global const float* part_sum,
                    const int group, const int num_groups,
                    const pkv_variant variant,         /* the variant's scalars */
                    __global const float* sinks,       /* has_sinks: [num_heads] */
                    __global float* out,               /* [T, num_heads, VD] */
                    __global float* lse,               /* has_lse: [T, num_heads] */
                    const int has_lse,
                    __global int* loop_counts) {       /* PKV_COUNT_LOOPS: [work-items] */
    int loops = 0;
    const int s = get_group_id(0), lid = get_local_id(0);
    __global const int* item = items + (size_t)seg_items[s] * PKV_W_FIELDS;
    const int h = item[PKV_W_KV_HEAD], row0 = item[PKV_W_ROW0], row1 = item[PKV_W_ROW1];
    const int nq = (row1 - row0) * group, num_heads = num_groups * group;
    const int first = seg_parts[s], last = seg_parts[s + 1];
    for (int k = 0; k < PKV_CEIL(nq * PKV_VDV, PKV_MERGE_WG); ++k) {
        PKV_LOOP();
        const int e = lid + k * PKV_MERGE_WG, qi = e / PKV_VDV, vec = e % PKV_VDV;
        if (qi < nq) {
            float m = -INFINITY;
            for (int w = first; w < last; ++w) {
                PKV_LOOP();
                m = PKV_MAX(m, part_max[(size_t)w * PKV_NQ + qi]);
            }
            pkv_vec acc = 0.0f;
            float total = 0.0f;
            for (int w = first; w < last; ++w) {
                PKV_LOOP();
                const float pm = part_max[(size_t)w * PKV_NQ + qi];
                const float weight = pkv_part_weight(pm, m);
                total += part_sum[(size_t)w * PKV_NQ + qi] * weight;
                acc += PKV_VLOAD_F(((size_t)w * PKV_NQ + qi) * PKV_VDV + vec, part_acc) * weight;
            }
            const int r = row0 + qi / group, head = h * group + qi % group;
            const float inv = pkv_output_scale(m, total,
                                               variant.has_sinks ? sinks[head] : -INFINITY);
            PKV_VSTORE_F(acc * inv, ((size_t)r * num_heads + head) * PKV_VDV + vec, out);
            if (has_lse && vec == 0) lse[(size_t)r * num_heads + head] = pkv_log_sum(m, total);
        }
    }
    if (PKV_COUNT_LOOPS) loop_counts[get_global_id(0)] = loops;
}
