/* The attention work item: the one definition that the planner
 * (pagedkv/backends/schedule.py, which reads the field list below), the host
 * kernels (pagedkv/_kernels.pyx) and the OpenCL kernels (attention.cl) share.
 *
 * A work item is one row of an int32 table of PKV_W_FIELDS columns:
 *
 *   SEQ       the sequence (its index in the step: page table row)
 *   KV_HEAD   the first KV head (host) or head group (OpenCL) it covers
 *   ROW0      first query row (absolute row of q)
 *   ROW1      one past the last query row, all of sequence SEQ
 *   KEY0      first key position it reads
 *   KEY1      one past the last key position it reads
 *   PART      slot of its partial result when the rows' keys are split over
 *             several items (split-K), or -1 when it writes the output
 *
 * and then the band fields of pkv_variant.h (PKV_BAND_FIELDS): which keys
 * each row sees.  The planner derives the band from the attention variant
 * (causal, sliding window) once per step; kernels apply it through
 * pkv_variant.h and know no other mask.  Every value fits an int32, and
 * BAND_LO + i never underflows (the planner clamps it to no less than minus
 * the item's row count).
 *
 * The list is one line, `X(NAME)` per field, so that Python can read it
 * (pagedkv/backends/kernel_source.py, which expands PKV_BAND_FIELDS).
 */
#ifndef PKV_WORK_ITEM_H
#define PKV_WORK_ITEM_H
#include "pkv_variant.h"

#define PKV_WORK_ITEM(X) X(SEQ) X(KV_HEAD) X(ROW0) X(ROW1) X(KEY0) X(KEY1) X(PART) PKV_BAND_FIELDS(X)

#define PKV_W_ENUM_ENTRY(name) PKV_W_##name,
enum { PKV_WORK_ITEM(PKV_W_ENUM_ENTRY) PKV_W_FIELDS };
#undef PKV_W_ENUM_ENTRY

#endif
