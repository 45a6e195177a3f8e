# The host recurrences of hybrid models' recurrent layers (included by
# _kernels.pyx, so each instruction-set level compiles them): the gated delta
# rule and the causal depthwise convolution over a ragged step, reading and
# advancing each sequence's state in its slot of the state store in place
# (pagedkv/backends/state_store.py), copying it into save slots after the
# save rows.  The inner loops are C (pkv_recurrent.h, which says why they
# are cut as they are); here are the work items, one per (sequence, head,
# block of state columns) or (sequence, block of channels), spread by OpenMP.

cdef extern from "pkv_recurrent.h" nogil:
    enum:
        PKV_DR_COLS, PKV_CONV_COLS
    void pkv_delta_rule_block(float* S, int dk, int ncols, int t0, int t1, const float* q,
                              const float* k, long qk_stride, const float* v, long v_stride,
                              const float* g, const float* beta, long gb_stride, float scale,
                              int l2norm, float* o, long o_stride, float* qn, float* kn)
    void pkv_dr_move(float* pool, long stride, float* S, int dk, int ncols, int to_pool)
    void pkv_conv_block(const float* x, long x_stride, const float* wt, const float* bias,
                        const float* hist, int K, int cols, int t0, int t1, int silu, float* y,
                        long y_stride)
    void pkv_conv_state(const float* x, long x_stride, const float* hist, int K, int cols,
                        int t_next, float* dst)


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
    int Hk, Hv, dk, dv, blocks, l2norm
    float scale


cdef void delta_rule_item(const RaggedStep* step, const DeltaArgs* a, Py_ssize_t item,
                          float* scratch) noexcept nogil:
    """One (sequence, v-head, block of PKV_DR_COLS state columns): its rows token by
    token, the block held in ``scratch`` ([dk][PKV_DR_COLS], then qn and kn)."""
    cdef int block = item % a.blocks
    cdef int h = (item // a.blocks) % a.Hv
    cdef int b = item // a.blocks // a.Hv
    cdef int r0 = step.query_start[b], n = step.query_start[b + 1] - r0
    if n == 0:
        return
    cdef int dk = a.dk, dv = a.dv, c0 = block * PKV_DR_COLS
    cdef int ncols = min(PKV_DR_COLS, dv - c0)
    cdef int kh = h // (a.Hv // a.Hk)
    cdef long slot_floats = <long>a.Hv * dk * dv
    cdef long head_offset = <long>h * dk * dv + c0
    cdef float* S = scratch
    cdef float* qn = scratch + dk * PKV_DR_COLS
    cdef float* kn = qn + dk
    cdef const float* q = a.q + (<long>r0 * a.Hk + kh) * dk
    cdef const float* k = a.k + (<long>r0 * a.Hk + kh) * dk
    cdef const float* v = a.v + (<long>r0 * a.Hv + h) * dv + c0
    cdef float* o = a.out + (<long>r0 * a.Hv + h) * dv + c0
    cdef const float* g = a.g + <long>r0 * a.Hv + h
    cdef const float* beta = a.beta + <long>r0 * a.Hv + h
    cdef float* own = a.state + step.slots[b] * slot_floats + head_offset
    cdef int t = 0, m, row
    pkv_dr_move(own, dv, S, dk, ncols, 0)
    for m in range(step.save_start[b], step.save_start[b + 1]):
        row = step.save_rows[m] - r0
        pkv_delta_rule_block(S, dk, ncols, t, row + 1, q, k, <long>a.Hk * dk, v,
                             <long>a.Hv * dv, g, beta, a.Hv, a.scale, a.l2norm, o,
                             <long>a.Hv * dv, qn, kn)
        t = row + 1
        pkv_dr_move(a.state + step.save_slots[m] * slot_floats + head_offset, dv, S, dk,
                    ncols, 1)
    pkv_delta_rule_block(S, dk, ncols, t, n, q, k, <long>a.Hk * dk, v, <long>a.Hv * dv, g,
                         beta, a.Hv, a.scale, a.l2norm, o, <long>a.Hv * dv, qn, kn)
    pkv_dr_move(own, dv, S, dk, ncols, 1)


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
    a.blocks = (a.dv + PKV_DR_COLS - 1) // PKV_DR_COLS
    a.l2norm, a.scale = l2norm, scale
    cdef Py_ssize_t num_items = <Py_ssize_t>slots.shape[0] * a.Hv * a.blocks, item
    # per thread: the block, qn and kn, in whole cache lines
    cdef Py_ssize_t per_thread = (a.dk * (PKV_DR_COLS + 2) + 15) // 16 * 16
    cdef float[::1] scratch_view = aligned_empty(num_threads * per_thread)
    cdef float* scratch = &scratch_view[0]
    with nogil:
        for item in prange(num_items, schedule="dynamic", num_threads=num_threads):
            delta_rule_item(&step, &a, item, scratch + threadid() * per_thread)


cdef struct ConvArgs:
    float* state            # [num_slots, C, K - 1] (unread when K == 1)
    const float* x          # [T, C]
    const float* weight     # [C, K]
    const float* bias       # [C] or NULL
    float* out              # [T, C]
    int C, K, blocks, silu


cdef void conv_item(const RaggedStep* step, const ConvArgs* a, Py_ssize_t item,
                    float* scratch) noexcept nogil:
    """One (sequence, block of PKV_CONV_COLS channels); ``scratch`` holds its
    history [K - 1][cols] and transposed weights [K][cols]."""
    cdef int block = item % a.blocks, b = item // a.blocks
    cdef int r0 = step.query_start[b], n = step.query_start[b + 1] - r0
    if n == 0:
        return
    cdef int C = a.C, K = a.K, c0 = block * PKV_CONV_COLS
    cdef int cols = min(PKV_CONV_COLS, C - c0), c, j, t = 0, m, row
    cdef float* hist = scratch
    cdef float* wt = scratch + (K - 1) * cols
    cdef long slot_floats = <long>C * (K - 1)
    cdef float* own = a.state + step.slots[b] * slot_floats + <long>c0 * (K - 1) \
        if K > 1 else NULL
    cdef const float* x = a.x + <long>r0 * C + c0
    cdef float* y = a.out + <long>r0 * C + c0
    cdef const float* bias = a.bias + c0 if a.bias != NULL else NULL
    for c in range(cols):
        for j in range(K):
            wt[j * cols + c] = a.weight[(<long>c0 + c) * K + j]
        for j in range(K - 1):
            hist[j * cols + c] = own[c * (K - 1) + j]
    for m in range(step.save_start[b], step.save_start[b + 1]):
        row = step.save_rows[m] - r0
        pkv_conv_block(x, C, wt, bias, hist, K, cols, t, row + 1, a.silu, y, C)
        t = row + 1
        if K > 1:
            pkv_conv_state(x, C, hist, K, cols, t, a.state + step.save_slots[m] * slot_floats
                           + <long>c0 * (K - 1))
    pkv_conv_block(x, C, wt, bias, hist, K, cols, t, n, a.silu, y, C)
    if K > 1:   # hist is a copy: writing the slot over it is safe
        pkv_conv_state(x, C, hist, K, cols, n, own)


def causal_conv1d(float[:, :, ::1] state, const int32_t[::1] query_start,
                  const int32_t[::1] slots, const int32_t[::1] save_start,
                  const int32_t[::1] save_rows, const int32_t[::1] save_slots,
                  const float[:, ::1] x, const float[:, ::1] weight, const float[::1] bias,
                  bint silu, float[:, ::1] out, int num_threads):
    """The causal depthwise convolution over a ragged step, states advanced in place.

    ``state`` [num_slots, C, K-1] (any placeholder when K == 1: there is no
    history); the step's arrays as ``gated_delta_rule`` takes them; ``x``
    [T, C], ``weight`` [C, K], ``bias`` [C] or None, ``out`` [T, C] (written),
    all float32; T > 0.  ``silu``: y / (1 + exp(-y)) on the result."""
    cdef RaggedStep step = ragged_step(query_start, slots, save_start, save_rows, save_slots)
    cdef ConvArgs a
    a.C, a.K = x.shape[1], weight.shape[1]
    a.state = &state[0, 0, 0] if a.K > 1 else NULL
    a.x, a.weight, a.out = &x[0, 0], &weight[0, 0], &out[0, 0]
    a.bias = &bias[0] if bias is not None else NULL
    a.blocks = (a.C + PKV_CONV_COLS - 1) // PKV_CONV_COLS
    a.silu = silu
    cdef Py_ssize_t num_items = <Py_ssize_t>slots.shape[0] * a.blocks, item
    cdef Py_ssize_t per_thread = ((2 * a.K - 1) * PKV_CONV_COLS + 15) // 16 * 16
    cdef float[::1] scratch_view = aligned_empty(num_threads * per_thread)
    cdef float* scratch = &scratch_view[0]
    with nogil:
        for item in prange(num_items, schedule="static", num_threads=num_threads):
            conv_item(&step, &a, item, scratch + threadid() * per_thread)
