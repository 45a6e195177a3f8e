# The host recurrences of hybrid models' recurrent layers (included by
# _kernels.pyx, so each instruction-set level compiles them): the gated delta
# rule and the causal depthwise convolution over a ragged step, reading and
# advancing each sequence's state in its slot of the state store in place
# (pagedkv/backends/state_store.py), copying it into save slots after the
# save rows.  The inner loops are C (pkv_recurrent.h, which says why they
# are cut as they are); here are the work items, one per (sequence, v-head)
# for the delta rule, and for the convolution one per run of a sequence's rows
# (then one per sequence for its states), spread by OpenMP.

cdef extern from "pkv_recurrent.h" nogil:
    long pkv_dr_scratch(int dk, int dv)
    void pkv_delta_rule_head(float* state, long slot_floats, long head_offset, int slot,
                             int num_saves, const int32_t* save_rows, const int32_t* save_slots,
                             int row0, int n, int dk, int dv, const float* q, const float* k,
                             long qk_stride, const float* v, long v_stride, const float* g,
                             const float* beta, long gb_stride, float scale, int l2norm,
                             float* o, float* scratch)
    void pkv_conv_rows(const float* x, const float* hist, const float* wt, const float* bias,
                       int C, int K, int t0, int t1, int silu, float* y)
    void pkv_conv_state(const float* x, const float* hist, int C, int K, int t_next,
                        float* dst)


cdef struct RaggedStep:
    # a step as the work items read it (StateStep in the backends)
    const int32_t* query_start     # [B + 1]
    const int32_t* slots           # [B]
    const int32_t* save_start      # [B + 1]: sequence b's saves are [save_start[b], save_start[b+1])
    const int32_t* save_rows       # [M] global rows, ascending
    const int32_t* save_slots      # [M]


cdef RaggedStep ragged_step(const int32_t[::1] query_start, const int32_t[::1] slots,
                            const int32_t[::1] save_start, const int32_t[::1] save_rows,
                            const int32_t[::1] save_slots):
    cdef RaggedStep step
    step.query_start = &query_start[0]
    step.slots = &slots[0] if slots.shape[0] else NULL
    step.save_start = &save_start[0]
    step.save_rows = &save_rows[0] if save_rows.shape[0] else NULL
    step.save_slots = &save_slots[0] if save_slots.shape[0] else NULL
    return step


cdef struct DeltaArgs:
    float* state            # [num_slots, Hv, dk, dv]
    const float* q          # [T, Hk, dk]
    const float* k          # [T, Hk, dk]
    const float* v          # [T, Hv, dv]
    const float* g          # [T, Hv]
    const float* beta       # [T, Hv]
    float* out              # [T, Hv, dv]
    int Hk, Hv, dk, dv, l2norm
    float scale


cdef void delta_rule_item(const RaggedStep* step, const DeltaArgs* a, Py_ssize_t item,
                          float* scratch) noexcept nogil:
    """One (sequence, v-head): its rows token by token (pkv_delta_rule_head)."""
    cdef int h = item % a.Hv, b = item // a.Hv
    cdef int r0 = step.query_start[b], n = step.query_start[b + 1] - r0
    if n == 0:
        return
    cdef int dk = a.dk, dv = a.dv, kh = h // (a.Hv // a.Hk)
    cdef int m0 = step.save_start[b], num_saves = step.save_start[b + 1] - m0
    pkv_delta_rule_head(
        a.state, <long>a.Hv * dk * dv, <long>h * dk * dv, step.slots[b], num_saves,
        step.save_rows + m0 if num_saves else NULL, step.save_slots + m0 if num_saves else NULL,
        r0, n, dk, dv, a.q + (<long>r0 * a.Hk + kh) * dk, a.k + (<long>r0 * a.Hk + kh) * dk,
        <long>a.Hk * dk, a.v + (<long>r0 * a.Hv + h) * dv, <long>a.Hv * dv,
        a.g + <long>r0 * a.Hv + h, a.beta + <long>r0 * a.Hv + h, a.Hv, a.scale, a.l2norm,
        a.out + (<long>r0 * a.Hv + h) * dv, scratch)


def gated_delta_rule(float[:, :, :, ::1] state, const int32_t[::1] query_start,
                     const int32_t[::1] slots, const int32_t[::1] save_start,
                     const int32_t[::1] save_rows, const int32_t[::1] save_slots,
                     const float[:, :, ::1] q, const float[:, :, ::1] k,
                     const float[:, :, ::1] v, const float[:, ::1] g,
                     const float[:, ::1] beta, float scale, bint l2norm,
                     float[:, :, ::1] out, int num_threads):
    """The gated delta rule over a ragged step, token by token, states advanced in place.

    ``state`` [num_slots, Hv, dk, dv]; ``query_start`` [B+1] (rows of sequence
    b: ``query_start[b]:query_start[b+1]``), ``slots`` [B] (its state's slot;
    unread when it has no rows), ``save_start`` [B+1] (its saves:
    ``save_rows[save_start[b]:save_start[b+1]]``), ``save_rows`` [M] (global
    rows, ascending), ``save_slots`` [M]: the state after that row is copied
    there.  ``q``, ``k`` [T, Hk, dk], ``v`` [T, Hv, dv], ``g``, ``beta``
    [T, Hv], ``out`` [T, Hv, dv] (written), all float32; T > 0."""
    cdef RaggedStep step = ragged_step(query_start, slots, save_start, save_rows, save_slots)
    cdef DeltaArgs a
    a.state, a.q, a.k, a.v = &state[0, 0, 0, 0], &q[0, 0, 0], &k[0, 0, 0], &v[0, 0, 0]
    a.g, a.beta, a.out = &g[0, 0], &beta[0, 0], &out[0, 0, 0]
    a.Hk, a.Hv, a.dk, a.dv = k.shape[1], v.shape[1], k.shape[2], v.shape[2]
    a.l2norm, a.scale = l2norm, scale
    cdef Py_ssize_t num_items = <Py_ssize_t>slots.shape[0] * a.Hv, item
    # per thread, in whole cache lines
    cdef Py_ssize_t per_thread = (pkv_dr_scratch(a.dk, a.dv) + 15) // 16 * 16
    cdef float[::1] scratch_view = aligned_empty(num_threads * per_thread)
    cdef float* scratch = &scratch_view[0]
    with nogil:
        for item in prange(num_items, schedule="dynamic", num_threads=num_threads):
            delta_rule_item(&step, &a, item, scratch + threadid() * per_thread)


cdef struct ConvArgs:
    float* state            # [num_slots, C, K - 1] (unread when K == 1)
    const float* x          # [T, C]
    const float* wt         # [K, C]: the weights transposed
    const float* bias       # [C] or NULL
    float* out              # [T, C]
    int C, K, silu


cdef void conv_states(const RaggedStep* step, const ConvArgs* a, int b) noexcept nogil:
    """Sequence b's saves, then its own state, once every row has read the history."""
    cdef int r0 = step.query_start[b], n = step.query_start[b + 1] - r0, m
    if n == 0 or a.K == 1:
        return
    cdef long slot_floats = <long>a.C * (a.K - 1)
    cdef float* own = a.state + step.slots[b] * slot_floats
    cdef const float* x = a.x + <long>r0 * a.C
    for m in range(step.save_start[b], step.save_start[b + 1]):
        pkv_conv_state(x, own, a.C, a.K, step.save_rows[m] - r0 + 1,
                       a.state + step.save_slots[m] * slot_floats)
    pkv_conv_state(x, own, a.C, a.K, n, own)


# Rows of a convolution work item: few enough that a prefill makes items for
# every thread, enough that one item's rows amortise reading the weights.
_CONV_ROWS_PER_ITEM = 16


def causal_conv1d(float[:, :, ::1] state, const int32_t[::1] query_start,
                  const int32_t[::1] slots, const int32_t[::1] save_start,
                  const int32_t[::1] save_rows, const int32_t[::1] save_slots,
                  const float[:, ::1] x, const float[:, ::1] weight, const float[::1] bias,
                  bint silu, float[:, ::1] out, int num_threads):
    """The causal depthwise convolution over a ragged step, states advanced in place.

    ``state`` [num_slots, C, K-1] (any placeholder when K == 1: there is no
    history); the step's arrays as ``gated_delta_rule`` takes them; ``x``
    [T, C], ``weight`` [C, K], ``bias`` [C] or None, ``out`` [T, C] (written),
    all float32; T > 0.  ``silu``: y / (1 + exp(-y)) on the result.

    Two passes: the rows, by runs of a sequence's rows with every channel
    (rows are independent given the inputs), then each sequence's saves and
    state (which the first pass's early rows read as history)."""
    cdef RaggedStep step = ragged_step(query_start, slots, save_start, save_rows, save_slots)
    cdef ConvArgs a
    a.C, a.K = x.shape[1], weight.shape[1]
    a.state = &state[0, 0, 0] if a.K > 1 else NULL
    wt_buf = np.ascontiguousarray(np.asarray(weight).T)
    cdef const float[:, ::1] wt = wt_buf
    a.x, a.wt, a.out = &x[0, 0], &wt[0, 0], &out[0, 0]
    a.bias = &bias[0] if bias is not None else NULL
    a.silu = silu
    # work items: (sequence, first row, end row), runs of _CONV_ROWS_PER_ITEM rows
    starts = np.asarray(query_start)
    rows = np.diff(starts)
    runs = -(-rows // _CONV_ROWS_PER_ITEM)
    seq = np.repeat(np.arange(len(rows), dtype=np.int32), runs)
    first = np.arange(len(seq)) - np.repeat(np.cumsum(runs) - runs, runs)
    row0 = starts[seq] + first * _CONV_ROWS_PER_ITEM
    items_buf = np.stack([seq, row0, np.minimum(row0 + _CONV_ROWS_PER_ITEM, starts[seq + 1])],
                         axis=1).astype(np.int32)
    cdef const int32_t[:, ::1] items = items_buf
    cdef Py_ssize_t i, b, seq_b
    cdef int r0
    with nogil:
        for i in prange(items.shape[0], schedule="static", num_threads=num_threads):
            b = items[i, 0]
            r0 = step.query_start[b]
            pkv_conv_rows(a.x + <long>r0 * a.C,
                          a.state + step.slots[b] * <long>a.C * (a.K - 1) if a.K > 1 else NULL,
                          a.wt, a.bias, a.C, a.K, items[i, 1] - r0, items[i, 2] - r0, a.silu,
                          a.out + <long>r0 * a.C)
        for seq_b in prange(slots.shape[0], schedule="static", num_threads=num_threads):
            conv_states(&step, &a, seq_b)
