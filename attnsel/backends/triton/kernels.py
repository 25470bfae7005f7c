"""Triton kernels: varlen causal GQA prefill (flash attention, online softmax) and paged split-KV GQA decode.

Features (constexpr switches, no cost when off): a left sliding window (the loops visit only the blocks inside the
window, decode reads only the window's pages), logit softcap ``c * tanh(s / c)``, per-head sink logits that join the
softmax denominator, and (decode) an fp8 e4m3 cache dequantised with per-tensor k/v scales: k_scale folds into the
score scale, v_scale into the output; the dots run in fp16 (q is rounded from bf16 to fp16: exact in fp16's range).

Offsets: a sequence's first query and key rows are 64-bit scalar bases (computed once per program), offsets inside
one sequence are 32-bit (as fast as 32-bit offsets throughout): a ragged batch of 2^31 and more elements (e.g. 32 KV
heads x 128 dims x 524288 keys over many sequences) addresses correctly. Only a single sequence whose rows x stride
pass 2^31 needs 64-bit offsets inside it: the LONG variant, chosen on the host. Decode offsets are 32-bit except the
page's (a cache of 2^31 elements is common); the plan checks the rest stays below 2^31.
Switches are constexpr (WINDOW: the window in tokens, 0 = none; SOFTCAP: c * log2(e), 0 = none; HAS_SINKS; FP8):
with every feature off the kernels compile to the plain kernels. Unused pointers may be None.

UPCAST turns the dot operands into float32. It is set only under TRITON_INTERPRET=1, where Triton's interpreter
computes bf16 dots wrongly (docs/ARCHITECTURE.md); compiled kernels keep bf16/fp16 operands and float32 accumulators.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _scores(qk, scale_in, SOFTCAP: tl.constexpr):
    """Raw dot products -> log2-domain scores: s * log2(e), or with SOFTCAP (= c * log2(e)) c * tanh(s / c) * log2(e).

    Without SOFTCAP scale_in = softmax_scale * log2(e); with it scale_in = 2 * softmax_scale / c, using
    tanh(x) = 2 * sigmoid(2x) - 1.
    """
    if SOFTCAP > 0:
        return SOFTCAP * (2.0 * tl.sigmoid(qk * scale_in) - 1.0)
    return qk * scale_in


@triton.jit
def _prefill_block(acc, m_i, l_i, q, K, V, start_n, offs_m, offs_n, offs_d, len_k, shift, scale_in,
                   stride_kt, stride_vt, d_mask, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr, LONG: tl.constexpr, UPCAST: tl.constexpr):
    """One BLOCK_N block of keys starting at start_n; K/V point at the sequence's first key row."""
    cols = start_n + offs_n
    rows = cols.to(tl.int64) if LONG else cols
    if MASKED:
        n_mask = cols < len_k
        k = tl.load(K + rows[None, :] * stride_kt + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None],
                    other=0.0)
        v = tl.load(V + rows[:, None] * stride_vt + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0)
    else:
        k = tl.load(K + rows[None, :] * stride_kt + offs_d[:, None], mask=d_mask[:, None], other=0.0)
        v = tl.load(V + rows[:, None] * stride_vt + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    qk = _scores(tl.dot(q, k), scale_in, SOFTCAP)
    if MASKED:
        keep = n_mask[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + shift)
        if WINDOW > 0:
            keep = keep & (cols[None, :] > offs_m[:, None] + shift - WINDOW)
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if WINDOW > 0 or (CAUSAL and MASKED):  # a row may have no key yet in a block left of its window, or none at
        # all (causal with more queries than keys: the first queries see nothing): keep m -inf, exponentiate
        # against 0 (else -inf - -inf = NaN); one select per row of a masked block
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(qk - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc = tl.dot(p, v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _add_sinks(acc, m_i, l_i, SINKS, heads, h_mask):
    """Fold per-head sink logits (natural log units) into the denominator: l += exp(sink), rescaled."""
    s = tl.load(SINKS + heads, mask=h_mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    m_f = tl.maximum(m_i, s)
    m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
    alpha = tl.exp2(m_i - m_f)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(s - m_f)


@triton.jit
def prefill_kernel(Q, K, V, O, cu_q, cu_k, SINKS, scale_in,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, LONG: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (cdiv(max_q, BLOCK_M), num_q_heads, batch). See _scores for scale_in and SOFTCAP; WINDOW in tokens."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_q + seq)
    len_q = tl.load(cu_q + seq + 1) - q_start
    k_start = tl.load(cu_k + seq)
    len_k = tl.load(cu_k + seq + 1) - k_start
    if pid_m * BLOCK_M >= len_q:
        return
    shift = len_k - len_q  # query i sees keys j <= i + shift (bottom-right alignment)
    kv_head = head // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < len_q
    q_rows = offs_m.to(tl.int64) if LONG else offs_m
    Q += q_start.to(tl.int64) * stride_qt + head * stride_qh  # 64-bit: the batch's rows may pass 2^31 elements
    O += q_start.to(tl.int64) * stride_ot + head * stride_oh
    K += k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    V += k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    q = tl.load(Q + q_rows[:, None] * stride_qt + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row0 = pid_m * BLOCK_M + shift  # key position of the tile's first query
    if CAUSAL:
        end_n = tl.minimum(len_k, (pid_m + 1) * BLOCK_M + shift)
        # every row of the tile sees these keys; at least 0: with many more queries than keys row0 is far below 0,
        # and (row0 + 1) // BLOCK_N truncates towards 0 to a negative block (it would read keys before the sequence)
        full_n = tl.maximum(((row0 + 1) // BLOCK_N) * BLOCK_N, 0)
    else:
        end_n = len_k
        full_n = (len_k // BLOCK_N) * BLOCK_N
    mid = 0
    if WINDOW > 0:  # (CAUSAL too) keys j > row - WINDOW: skip the blocks left of the first row's window
        lo = (tl.maximum(row0 - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        mid = tl.cdiv(tl.maximum(row0 + BLOCK_M - WINDOW, 0), BLOCK_N) * BLOCK_N  # inside every row's window
        mid = tl.minimum(tl.maximum(mid, lo), full_n)
        for start_n in range(lo, mid, BLOCK_N):
            acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, K, V, start_n, offs_m, offs_n, offs_d, len_k, shift,
                                           scale_in, stride_kt, stride_vt, d_mask, True, CAUSAL, WINDOW, SOFTCAP,
                                           LONG, UPCAST)
    for start_n in range(mid, full_n, BLOCK_N):
        acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, K, V, start_n, offs_m, offs_n, offs_d, len_k, shift,
                                       scale_in, stride_kt, stride_vt, d_mask, False, CAUSAL, WINDOW, SOFTCAP, LONG,
                                       UPCAST)
    for start_n in range(full_n, end_n, BLOCK_N):
        acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, K, V, start_n, offs_m, offs_n, offs_d, len_k, shift,
                                       scale_in, stride_kt, stride_vt, d_mask, True, CAUSAL, WINDOW, SOFTCAP, LONG,
                                       UPCAST)
    if HAS_SINKS:
        acc, l_i = _add_sinks(acc, m_i, l_i, SINKS, head + offs_m * 0, m_mask)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query that sees no key (more queries than keys,
    # causal; or no keys): acc is 0, out 0 as in FlashAttention (not 0 / 0 = NaN)
    tl.store(O + q_rows[:, None] * stride_ot + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def decode_kernel(Q, K, V, PT, LENS, O, O_part, LSE_part, ARRIVED, SINKS, K_SCALE, V_SCALE, scale_in, num_splits,
                  target, min_chunk, batch, num_heads,
                  stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                  stride_ptb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, BLOCK_B: tl.constexpr,
                  BLOCK_S: tl.constexpr, MERGE: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (batch, num_kv_heads, num_splits): the query heads of one KV head read each K/V tile once.

    Splits: the batch's tokens (every row's span summed, read from LENS by each program: a CUDA graph replayed at
    other lengths re-plans itself) are cut into chunks of max(min_chunk, total x kv_heads / target) tokens, so
    that the programs that read come to about ``target``; row b uses n = round(span / chunk) splits, at least 1
    and at most num_splits (span: the tokens it reads), each cdiv(span, n) tokens rounded up to BLOCK_N. A program
    of a split its row does not use writes only lse = -inf (the merge reads no partial output there). So in a
    ragged batch a long row gets more splits than a short one.

    MERGE (with SPLIT): no second kernel. Each program of a (row, KV head) counts itself in ARRIVED (int32
    [batch, kv_heads], zero between runs) after its partial is stored; the one that arrives last merges the group's
    heads (reading the others' partials past L1, which is not coherent across SMs) and takes num_splits off the
    count (0 again for the next eager run; a captured run never merges here). Without MERGE decode_reduce_kernel
    merges. Like the split buffers, the count belongs to the plan: one plan runs on one stream at a time.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + b)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    span = seq_len - lo
    used = 1
    if SPLIT:
        offs_b = tl.arange(0, BLOCK_B)
        spans = tl.load(LENS + offs_b, mask=offs_b < batch, other=0).to(tl.int64)
        if WINDOW > 0:
            spans = tl.minimum(spans, WINDOW)
        chunk = tl.maximum(tl.sum(spans, 0) * tl.num_programs(1) // target, min_chunk)
        used = tl.maximum(tl.minimum((span + chunk // 2) // chunk, num_splits), 1).to(tl.int32)
        if not MERGE:
            if split >= used:  # nothing to read: an empty partial (the reduce skips it)
                heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
                tl.store(LSE_part + (b * num_heads + heads) * num_splits + split,
                         tl.full([BLOCK_G], float("-inf"), tl.float32), mask=tl.arange(0, BLOCK_G) < GROUP)
                return
        # with MERGE a split the row does not use runs on (it must be counted): its range below is empty
        # (start >= lo + used * per_split >= seq_len), so it stores lse = -inf and no partial output
    per_split = tl.cdiv(tl.cdiv(span, used), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif FP8:  # e4m3 -> fp16 is one cvt per pair on Hopper (-> bf16 costs a second one): dots in fp16
        q = q.to(tl.float16)
    if FP8:
        scale_in = scale_in * tl.load(K_SCALE)  # real k = stored k * k_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    PT += b * stride_ptb
    for start_n in range(start, end, BLOCK_N):
        t = start_n + offs_n
        t_mask = t < end
        page = tl.load(PT + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = t % PAGE_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(K + page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(V + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif FP8:
            k = k.to(tl.float16)
            # a no-op select (masked rows loaded as 0 already) keeps V's cast ahead of its change to the dot's
            # layout: otherwise Triton changes the layout of the 8-bit tile, reading it from shared memory one byte
            # at a time (slower; tests/fixtures/triton_compile_check.py fails on it)
            v = tl.where(t_mask[:, None], v.to(tl.float16), 0.0)
        qk = _scores(tl.dot(q, tl.trans(k)), scale_in, SOFTCAP)
        qk = tl.where(t_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if FP8:
        acc = acc * tl.load(V_SCALE)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(O_part + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
                 acc / l_safe[:, None], mask=out_mask & (offs_g * 0 + split < used)[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(LSE_part + (b * num_heads + heads) * num_splits + split, lse, mask=g_mask)
        if MERGE:
            tl.debug_barrier()  # every thread's stores of this program come before its release below
            count = ARRIVED + b * tl.num_programs(1) + kv_head
            # the last one of the group: its arrival takes the count to a multiple of num_splits. Modulo, not
            # equality: while runs of one plan overlap (two streams) the count passes multiples of num_splits
            # other than 0 (one run's last program subtracts after the other's programs counted on); with the
            # modulo each run's last arrival still merges and the count returns to 0, where equality would leave
            # it at num_splits for good (no merge, garbage, in every later run)
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") % num_splits == num_splits - 1:
                for g in tl.static_range(GROUP):
                    _merge_head(O, O_part, LSE_part, SINKS, b, kv_head * GROUP + g, num_splits, num_heads,
                                stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, HEAD_DIM, BLOCK_D, BLOCK_S,
                                HAS_SINKS)
                # down by num_splits, not a store of 0: a store could drop an overlapping run's arrivals; the
                # count never goes below 0 (each subtraction follows num_splits arrivals) and stays bounded
                tl.atomic_add(count, -num_splits, sem="relaxed", scope="gpu")
    else:
        if HAS_SINKS:
            acc, l_i = _add_sinks(acc, m_i, l_i, SINKS, heads, g_mask)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a zero-length row: acc is 0, out 0
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=out_mask)


@triton.jit
def decode_reduce_kernel(O, O_part, LSE_part, SINKS, num_splits, num_heads, stride_ob, stride_oh, stride_pb,
                         stride_ph, stride_ps,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         HAS_SINKS: tl.constexpr):
    """Grid (batch, num_q_heads): merge the splits' partial outputs weighted by their sum-exp (and the sink's)."""
    _merge_head(O, O_part, LSE_part, SINKS, tl.program_id(0), tl.program_id(1), num_splits, num_heads, stride_ob,
                stride_oh, stride_pb, stride_ph, stride_ps, HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS)


@triton.jit
def _merge_head(O, O_part, LSE_part, SINKS, b, h, num_splits, num_heads, stride_ob, stride_oh, stride_pb, stride_ph,
                stride_ps, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                HAS_SINKS: tl.constexpr):
    """Row b, query head h: merge the splits' partial outputs weighted by their sum-exp (and the sink's). Loads
    bypass L1 (.cg): inside decode_kernel the partials were written by programs on other SMs."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = b * stride_pb + h * stride_ph
    lse = tl.load(LSE_part + (b * num_heads + h) * num_splits + offs_s, mask=s_mask, other=float("-inf"),
                  cache_modifier=".cg")
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (a zero-length row)
    w = tl.exp2(lse - m)
    den = tl.sum(w, 0)
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    w = w / tl.where(den == 0.0, 1.0, den)
    used = s_mask & (lse > float("-inf"))  # empty splits wrote no partial output
    part = tl.load(O_part + base + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=used[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0, cache_modifier=".cg")
    out = tl.sum(part * w[:, None], 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
