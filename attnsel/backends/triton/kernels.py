"""Triton kernels: varlen causal GQA prefill (flash attention, online softmax) and paged split-KV GQA decode.

Features (constexpr switches, no cost when off): a left sliding window (the loops visit only the blocks inside the
window, decode reads only the window's pages), logit softcap ``c * tanh(s / c)``, per-head sink logits that join the
softmax denominator, and (decode) an fp8 e4m3 cache dequantised with per-tensor k/v scales.

Offsets: every offset that grows with the number of tokens (a sequence's first row, a tile's first row, a block's
first key, a batch row) is a 64-bit scalar base; only offsets inside one tile are 32-bit. A ragged batch of 2^31 and
more elements (e.g. 32 KV heads x 128 dims x 524288 keys) thus addresses correctly without 64-bit vector math.

UPCAST turns the dot operands into float32. It is set only under TRITON_INTERPRET=1, where Triton's interpreter
computes bf16 dots wrongly (docs/ARCHITECTURE.md); compiled kernels keep bf16/fp16 operands and float32 accumulators.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _scores(qk, scale_in, cap_out, SOFTCAP: tl.constexpr):
    """Raw dot products -> log2-domain scores: s * log2(e), or with SOFTCAP c * tanh(s / c) * log2(e).

    Without SOFTCAP scale_in = softmax_scale * log2(e); with it scale_in = 2 * softmax_scale / c and
    cap_out = c * log2(e), using tanh(x) = 2 * sigmoid(2x) - 1.
    """
    if SOFTCAP:
        return cap_out * (2.0 * tl.sigmoid(qk * scale_in) - 1.0)
    return qk * scale_in


@triton.jit
def _prefill_block(acc, m_i, l_i, q, K, V, k_row0, start_n, offs_m, offs_n, offs_d, len_k, shift, window, scale_in,
                   cap_out, stride_kt, stride_vt, d_mask, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr):
    """One BLOCK_N block of keys starting at start_n; k_row0 (int64) is the sequence's first key row."""
    cols = start_n + offs_n
    row = k_row0 + start_n  # int64: the block's first key row
    k_ptrs = K + row * stride_kt + offs_n[None, :] * stride_kt + offs_d[:, None]
    v_ptrs = V + row * stride_vt + offs_n[:, None] * stride_vt + offs_d[None, :]
    if MASKED:
        n_mask = cols < len_k
        k = tl.load(k_ptrs, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    qk = _scores(tl.dot(q, k), scale_in, cap_out, SOFTCAP)
    if MASKED:
        keep = n_mask[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + shift)
        if WINDOW:
            keep = keep & (cols[None, :] > offs_m[:, None] + shift - window)
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if WINDOW:  # a row may have no key in a block left of its window
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
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
def prefill_kernel(Q, K, V, O, cu_q, cu_k, SINKS, scale_in, cap_out, window,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (cdiv(max_q, BLOCK_M), num_q_heads, batch). See _scores for scale_in / cap_out; window in tokens."""
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
    offs_tile = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < len_q
    tile_row = (q_start + pid_m * BLOCK_M).to(tl.int64)  # first query row of this tile, 64-bit
    q = tl.load(Q + tile_row * stride_qt + head * stride_qh + offs_tile[:, None] * stride_qt + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_row0 = k_start.to(tl.int64)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row0 = pid_m * BLOCK_M + shift  # key position of the tile's first query
    if CAUSAL:
        end_n = tl.minimum(len_k, (pid_m + 1) * BLOCK_M + shift)
        full_n = ((row0 + 1) // BLOCK_N) * BLOCK_N  # every row of the tile sees these keys
    else:
        end_n = len_k
        full_n = (len_k // BLOCK_N) * BLOCK_N
    lo = 0
    mid = 0
    if WINDOW:  # (CAUSAL too) keys j > row - window: skip blocks left of the first row's window
        lo = (tl.maximum(row0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        mid = tl.cdiv(tl.maximum(row0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N  # inside every row's window
        mid = tl.minimum(tl.maximum(mid, lo), full_n)
        for start_n in range(lo, mid, BLOCK_N):
            acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, K, V, k_row0, start_n, offs_m, offs_n, offs_d, len_k, shift,
                                           window, scale_in, cap_out, stride_kt, stride_vt, d_mask, True, CAUSAL,
                                           WINDOW, SOFTCAP, UPCAST)
    for start_n in range(mid, full_n, BLOCK_N):
        acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, K, V, k_row0, start_n, offs_m, offs_n, offs_d, len_k, shift,
                                       window, scale_in, cap_out, stride_kt, stride_vt, d_mask, False, CAUSAL,
                                       WINDOW, SOFTCAP, UPCAST)
    for start_n in range(full_n, end_n, BLOCK_N):
        acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, K, V, k_row0, start_n, offs_m, offs_n, offs_d, len_k, shift,
                                       window, scale_in, cap_out, stride_kt, stride_vt, d_mask, True, CAUSAL,
                                       WINDOW, SOFTCAP, UPCAST)
    if HAS_SINKS:
        acc, l_i = _add_sinks(acc, m_i, l_i, SINKS, head + offs_tile * 0, m_mask)
    out = acc / l_i[:, None]
    tl.store(O + tile_row * stride_ot + head * stride_oh + offs_tile[:, None] * stride_ot + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def decode_kernel(Q, K, V, PT, LENS, O, O_part, LSE_part, SINKS, K_SCALE, V_SCALE, scale_in, cap_out, window,
                  num_splits, num_heads,
                  stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                  stride_ptb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (batch, num_kv_heads, num_splits): the query heads of one KV head read each K/V tile once.

    Reads only tokens [max(0, len - window), len) of row b: page-table entries and cache slots past a sequence's
    length are never loaded (engines leave garbage there). A row of length 0 outputs zeros.
    Without SPLIT the result goes to O; with it, normalised partial outputs and their log2-sum-exp go to
    O_part [B, H, S, BLOCK_D] / LSE_part [B, H, S] (both contiguous) for decode_reduce_kernel, which adds sinks.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_len = tl.load(LENS + b)
    lo = 0
    if WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if FP8:
        scale_in = scale_in * tl.load(K_SCALE)  # real k = stored k * k_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    PT += b64 * stride_ptb
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
            k = k.to(Q.dtype.element_ty)
            v = v.to(Q.dtype.element_ty)
        qk = _scores(tl.dot(q, tl.trans(k)), scale_in, cap_out, SOFTCAP)
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
        tl.store(O_part + b64 * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
                 acc / l_safe[:, None], mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(LSE_part + (b64 * num_heads + heads) * num_splits + split, lse, mask=g_mask)
    else:
        if HAS_SINKS:
            acc, l_i = _add_sinks(acc, m_i, l_i, SINKS, heads, g_mask)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a zero-length row: acc is 0, out 0
        tl.store(O + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=out_mask)


@triton.jit
def decode_reduce_kernel(O, O_part, LSE_part, SINKS, num_splits, num_heads, stride_ob, stride_oh, stride_pb,
                         stride_ph, stride_ps,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         HAS_SINKS: tl.constexpr):
    """Grid (batch, num_q_heads): merge the splits' partial outputs weighted by their sum-exp (and the sink's)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = b * stride_pb + h * stride_ph
    lse = tl.load(LSE_part + (b * num_heads + h) * num_splits + offs_s, mask=s_mask, other=float("-inf"))
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
    part = tl.load(O_part + base + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
