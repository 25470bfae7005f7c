"""Triton kernels: varlen causal GQA prefill (flash attention, online softmax) and paged split-KV GQA attention
(paged_kernel): decode, and extend (ragged queries over the paged cache) on tiles of several query tokens, of which
decode is the one-token instance (constexpr BLOCK_Q 1: decode compiles to the code it had alone).

Features (constexpr switches, no cost when off): a left sliding window (the loops visit only the blocks inside the
window, decode reads only the window's pages), logit softcap ``c * tanh(s / c)``, per-head sink logits that join the
softmax denominator, and (paged) an fp8 e4m3 cache dequantised with per-tensor k/v scales: k_scale folds into the
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
def _paged_block(acc, m_i, l_i, q, K, V, PT, start_n, end, pos, offs_n, offs_d, d_mask, scale_in,
                 stride_kp, stride_ks, stride_vp, stride_vs,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BOUND: tl.constexpr,
                 ROWS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One BLOCK_N block of keys from start_n, read through the page table (PT: the row's entries).

    BOUND: keys at or past ``end`` are neither read nor counted (their slots and page entries may hold anything);
    without it every key of the block is below ``end``. ROWS: each row's own limits (pos: its query's position;
    keys j <= pos, and j > pos - WINDOW); without it every row sees every key the block reads."""
    t = start_n + offs_n
    if BOUND:
        t_mask = t < end
        page = tl.load(PT + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = t % PAGE_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(K + page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(V + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask,
                    other=0.0)
    else:
        page = tl.load(PT + t // PAGE_SIZE).to(tl.int64)
        slot = t % PAGE_SIZE
        k_ptrs = K + page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = V + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :]
        if BLOCK_D == HEAD_DIM:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    elif FP8:
        k = k.to(tl.float16)
        # a no-op select (masked rows loaded as 0 already; unbounded blocks: the columns' mask) keeps V's cast
        # ahead of its change to the dot's layout: otherwise Triton changes the layout of the 8-bit tile, reading
        # it from shared memory one byte at a time (slower; tests/fixtures/triton_compile_check.py fails on it)
        if BOUND:
            v = tl.where(t_mask[:, None], v.to(tl.float16), 0.0)
        else:
            v = tl.where(d_mask[None, :], v.to(tl.float16), 0.0)
    qk = _scores(tl.dot(q, tl.trans(k)), scale_in, SOFTCAP)
    if BOUND:
        keep = t_mask[None, :]
        if ROWS:
            keep = keep & (t[None, :] <= pos[:, None])
            if WINDOW > 0:
                keep = keep & (t[None, :] > pos[:, None] - WINDOW)
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if BOUND:  # a row may see no key of the block (all masked): keep m -inf, exponentiate against 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _extend_rows(n_q, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The rows of an extend tile, token-major: (query token in the tile, head in the group, valid) of each."""
    offs_r = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = offs_r // BLOCK_G
    offs_g = offs_r % BLOCK_G
    return tok, offs_g, (offs_g < GROUP) & (tok < n_q)


@triton.jit
def _row_offset(row, tok, stride, BLOCK_Q: tl.constexpr):
    """The offset of a tile's rows in a [rows, heads, ...] tensor: ``row`` (BLOCK_Q 1: scalar), or row + tok per
    row of an extend tile (a column, to add the heads' offsets to)."""
    if BLOCK_Q == 1:
        off = row * stride
    else:
        off = (row + tok)[:, None] * stride
    return off


@triton.jit
def paged_kernel(Q, K, V, PT, LENS, O, O_part, LSE_part, ARRIVED, SINKS, K_SCALE, V_SCALE, scale_in, num_splits,
                 target, min_chunk, batch, num_heads, kv_heads, ORDER,
                 stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                 stride_ptb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, CU_Q, q_tiles,
                 GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_S: tl.constexpr, MERGE: tl.constexpr, WINDOW: tl.constexpr,
                 SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_Q: tl.constexpr, ORDERED: tl.constexpr):
    """Paged attention of decode and extend. Grid (batch x q_tiles, num_kv_heads, num_splits): a program takes
    BLOCK_Q query tokens of one row and the query heads of one KV head (rows of the tile: token-major, BLOCK_G rows
    per token), so every K/V tile it reads serves all of them.

    Decode (CU_Q None, q_tiles 1, BLOCK_Q 1): row b's one query is q's row b and sees the row's every key (of the
    window). Extend (CU_Q: cu_seqlens_q): row b's queries are q's rows CU_Q[b] .. CU_Q[b + 1], the row's last
    tokens; its program number q_tile takes the tile's queries from q_tile x BLOCK_Q; each query sees the keys up to
    its own position (and inside its window): BLOCK_Q 1 (one query per row) is decode's code; larger tiles read
    the keys that every row of the tile sees without a mask, and mask each row on the blocks at its limits.

    Splits: the batch's tokens (every row's span summed, read from LENS by each program: a CUDA graph replayed at
    other lengths re-plans itself) are cut into chunks of max(min_chunk, total x kv_heads / target) tokens, so
    that the programs that read come to about ``target``; a tile uses n = round(span / chunk) splits, at least 1
    and at most num_splits (span: the tokens it reads), each cdiv(span, n) tokens rounded up to BLOCK_N. A program
    of a split its tile does not use writes only lse = -inf (the merge reads no partial output there). So in a
    ragged batch a long row gets more splits than a short one. Partials are indexed by program x BLOCK_Q + token.

    MERGE (with SPLIT): no second kernel. Each program of a (tile, KV head) counts itself in ARRIVED (int32
    [batch x q_tiles, kv_heads], zero between runs) after its partial is stored; the one that arrives last merges
    the tile's heads (reading the others' partials past L1, which is not coherent across SMs) and takes num_splits
    off the count (0 again for the next eager run; a captured run never merges here). Without MERGE
    paged_reduce_kernel merges. Like the split buffers, the count belongs to the plan: one plan runs on one stream
    at a time.

    ORDERED (decode only): a 1-D grid of batch x kv_heads x num_splits programs, program i taking rank
    i // (kv_heads x num_splits), KV head (i // num_splits) % kv_heads and split i % num_splits, and row
    ORDER[rank] (ORDER: the rows sorted longest first): the GPU starts programs in program-number order, so the
    longest rows' programs, all of one row's next to each other, start first and short rows fill in behind them
    (longest-first list scheduling) instead of a long row's programs starting late, one per KV head, in a ragged
    batch. Everything after the row is chosen (partials, arrival counts, output) is indexed by the row itself.
    ``kv_heads``: the number of KV heads (the grid's second axis when not ORDERED).
    """
    if ORDERED:
        tl.static_assert(BLOCK_Q == 1, "ORDERED is decode's launch")
        prog = tl.program_id(0)
        split = prog % num_splits
        kv_head = prog // num_splits % kv_heads
        pid = tl.load(ORDER + prog // (num_splits * kv_heads)).to(tl.int32)
    else:
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
    if CU_Q is None:  # decode: row pid's query is q's row pid
        b = pid
        q_row = pid
    else:
        b = pid // q_tiles
        i0 = pid % q_tiles * BLOCK_Q  # the tile's first query, counted in its row
        q_row = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_row
        if i0 >= q_len:
            return
        q_row += i0  # q's row of the tile's first query
    seq_len = tl.load(LENS + b)
    if BLOCK_Q == 1:  # the row's last token: it sees every key (of its window)
        hi = seq_len
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(seq_len - WINDOW, 0)
    else:
        n_q = tl.minimum(q_len - i0, BLOCK_Q)
        first = seq_len - q_len + i0  # the position of the tile's first query; below 0 when seq_len < q_len
        hi = tl.maximum(first + n_q, 0)  # the keys its last query sees end here
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(first - WINDOW + 1, 0)
    span = hi - lo
    used = 1
    if SPLIT:
        spans = tl.zeros([BLOCK_B], tl.int64)  # the batch's lengths summed BLOCK_B at a time: one compile
        for start in range(0, batch, BLOCK_B):  # serves every batch size
            offs_b = start + tl.arange(0, BLOCK_B)
            more = tl.load(LENS + offs_b, mask=offs_b < batch, other=0).to(tl.int64)
            if WINDOW > 0:
                more = tl.minimum(more, WINDOW)
            spans += more
        chunk = tl.maximum(tl.sum(spans, 0) * kv_heads // target, min_chunk)
        used = tl.maximum(tl.minimum((span + chunk // 2) // chunk, num_splits), 1).to(tl.int32)
        if not MERGE:
            if split >= used:  # nothing to read: an empty partial (the reduce skips it)
                if BLOCK_Q == 1:
                    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
                    tl.store(LSE_part + (pid * num_heads + heads) * num_splits + split,
                             tl.full([BLOCK_G], float("-inf"), tl.float32), mask=tl.arange(0, BLOCK_G) < GROUP)
                else:
                    tok, offs_g, g_mask = _extend_rows(n_q, GROUP, BLOCK_G, BLOCK_Q)
                    heads = kv_head * GROUP + offs_g
                    tl.store(LSE_part + ((pid * BLOCK_Q + tok) * num_heads + heads) * num_splits + split,
                             tl.full(heads.shape, float("-inf"), tl.float32), mask=g_mask)
                return
        # with MERGE a split the tile does not use runs on (it must be counted): its range below is empty
        # (start >= lo + used * per_split >= hi), so it stores lse = -inf and no partial output
    per_split = tl.cdiv(tl.cdiv(span, used), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, hi)
    if BLOCK_Q == 1:
        offs_g = tl.arange(0, BLOCK_G)
    else:
        tok, offs_g, row_mask = _extend_rows(n_q, GROUP, BLOCK_G, BLOCK_Q)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_Q == 1:
        g_mask = offs_g < GROUP
        tok = None
        pos = None
    else:
        g_mask = row_mask
        pos = first + tok  # each row's query position
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(Q + _row_offset(q_row, tok, stride_qb, BLOCK_Q) + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif FP8:  # e4m3 -> fp16 is one cvt per pair on Hopper (-> bf16 costs a second one): dots in fp16
        q = q.to(tl.float16)
    if FP8:
        scale_in = scale_in * tl.load(K_SCALE)  # real k = stored k * k_scale
    m_i = tl.full(heads.shape, float("-inf"), tl.float32)
    l_i = tl.zeros(heads.shape, tl.float32)
    acc = tl.zeros([heads.shape[0], BLOCK_D], tl.float32)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    PT += b * stride_ptb
    if BLOCK_Q == 1:
        for start_n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _paged_block(acc, m_i, l_i, q, K, V, PT, start_n, end, pos, offs_n, offs_d, d_mask,
                                         scale_in, stride_kp, stride_ks, stride_vp, stride_vs, HEAD_DIM, BLOCK_D,
                                         PAGE_SIZE, True, False, WINDOW, SOFTCAP, FP8, UPCAST)
    else:
        # the keys every query of the tile sees: [first - WINDOW + n_q, first] (the last query's window start,
        # the first query's position); the blocks inside it (and below end) need no mask
        mid_lo = start
        if WINDOW > 0:
            full_lo = first + n_q - WINDOW
            mid_lo = tl.minimum(start + tl.cdiv(tl.maximum(full_lo - start, 0), BLOCK_N) * BLOCK_N, end)
        mid_hi = mid_lo + tl.maximum(tl.minimum(first + 1, end) - mid_lo, 0) // BLOCK_N * BLOCK_N
        for start_n in range(start, mid_lo, BLOCK_N):
            acc, m_i, l_i = _paged_block(acc, m_i, l_i, q, K, V, PT, start_n, end, pos, offs_n, offs_d, d_mask,
                                         scale_in, stride_kp, stride_ks, stride_vp, stride_vs, HEAD_DIM, BLOCK_D,
                                         PAGE_SIZE, True, True, WINDOW, SOFTCAP, FP8, UPCAST)
        for start_n in range(mid_lo, mid_hi, BLOCK_N):
            acc, m_i, l_i = _paged_block(acc, m_i, l_i, q, K, V, PT, start_n, end, pos, offs_n, offs_d, d_mask,
                                         scale_in, stride_kp, stride_ks, stride_vp, stride_vs, HEAD_DIM, BLOCK_D,
                                         PAGE_SIZE, False, False, WINDOW, SOFTCAP, FP8, UPCAST)
        for start_n in range(mid_hi, end, BLOCK_N):
            acc, m_i, l_i = _paged_block(acc, m_i, l_i, q, K, V, PT, start_n, end, pos, offs_n, offs_d, d_mask,
                                         scale_in, stride_kp, stride_ks, stride_vp, stride_vs, HEAD_DIM, BLOCK_D,
                                         PAGE_SIZE, True, True, WINDOW, SOFTCAP, FP8, UPCAST)
    if FP8:
        acc = acc * tl.load(V_SCALE)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(O_part + _row_offset(pid * BLOCK_Q, tok, stride_pb, BLOCK_Q) + heads[:, None] * stride_ph
                 + split * stride_ps + offs_d[None, :],
                 acc / l_safe[:, None], mask=out_mask & (offs_g * 0 + split < used)[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = pid if BLOCK_Q == 1 else pid * BLOCK_Q + tok  # the partials' row
        tl.store(LSE_part + (part * num_heads + heads) * num_splits + split, lse, mask=g_mask)
        if MERGE:
            tl.debug_barrier()  # every thread's stores of this program come before its release below
            count = ARRIVED + pid * kv_heads + kv_head
            # the last one of the group: its arrival takes the count to a multiple of num_splits. Modulo, not
            # equality: while runs of one plan overlap (two streams) the count passes multiples of num_splits
            # other than 0 (one run's last program subtracts after the other's programs counted on); with the
            # modulo each run's last arrival still merges and the count returns to 0, where equality would leave
            # it at num_splits for good (no merge, garbage, in every later run)
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") % num_splits == num_splits - 1:
                if BLOCK_Q == 1:
                    for g in tl.static_range(GROUP):
                        _merge_head(O, O_part, LSE_part, SINKS, part, q_row, kv_head * GROUP + g, num_splits,
                                    num_heads, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, HEAD_DIM,
                                    BLOCK_D, BLOCK_S, HAS_SINKS)
                else:
                    for i in range(0, n_q):
                        for g in tl.static_range(GROUP):
                            _merge_head(O, O_part, LSE_part, SINKS, pid * BLOCK_Q + i, q_row + i,
                                        kv_head * GROUP + g, num_splits, num_heads, stride_ob, stride_oh,
                                        stride_pb, stride_ph, stride_ps, HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS)
                # down by num_splits, not a store of 0: a store could drop an overlapping run's arrivals; the
                # count never goes below 0 (each subtraction follows num_splits arrivals) and stays bounded
                tl.atomic_add(count, -num_splits, sem="relaxed", scope="gpu")
    else:
        if HAS_SINKS:
            acc, l_i = _add_sinks(acc, m_i, l_i, SINKS, heads, g_mask)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a query that sees no key (a zero-length row): acc is 0, out 0
        tl.store(O + _row_offset(q_row, tok, stride_ob, BLOCK_Q) + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=out_mask)


@triton.jit
def paged_reduce_kernel(O, O_part, LSE_part, SINKS, num_splits, num_heads, stride_ob, stride_oh, stride_pb,
                        stride_ph, stride_ps, CU_Q, q_pad,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                        HAS_SINKS: tl.constexpr):
    """Grid (partial rows, num_q_heads): merge the splits' partial outputs weighted by their sum-exp (and the
    sink's). Decode (CU_Q None): partial row b is q's row b. Extend: partial row r is query r % q_pad of row
    r // q_pad (q_pad: q_tiles x BLOCK_Q of paged_kernel), q's row CU_Q[b] + r % q_pad; rows past q_len skip."""
    row = tl.program_id(0)
    if CU_Q is None:
        out_row = row
    else:
        b = row // q_pad
        i = row % q_pad
        out_row = tl.load(CU_Q + b)
        if i >= tl.load(CU_Q + b + 1) - out_row:
            return
        out_row += i
    _merge_head(O, O_part, LSE_part, SINKS, row, out_row, tl.program_id(1), num_splits, num_heads, stride_ob,
                stride_oh, stride_pb, stride_ph, stride_ps, HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS)


@triton.jit
def _merge_head(O, O_part, LSE_part, SINKS, part, out_row, h, num_splits, num_heads, stride_ob, stride_oh,
                stride_pb, stride_ph, stride_ps, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Partial row ``part``, query head h: merge the splits' partial outputs weighted by their sum-exp (and the
    sink's) into O's row ``out_row``. Loads bypass L1 (.cg): inside paged_kernel the partials were written by
    programs on other SMs."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = part * stride_pb + h * stride_ph
    lse = tl.load(LSE_part + (part * num_heads + h) * num_splits + offs_s, mask=s_mask, other=float("-inf"),
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
    part_out = tl.load(O_part + base + offs_s[:, None] * stride_ps + offs_d[None, :],
                       mask=used[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0, cache_modifier=".cg")
    out = tl.sum(part_out * w[:, None], 0)
    tl.store(O + out_row * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
