"""Triton kernels: varlen causal GQA prefill (flash attention, online softmax) and paged split-KV GQA decode.

UPCAST turns the dot operands into float32. It is set only under TRITON_INTERPRET=1, where Triton's interpreter
computes bf16 dots wrongly (DESIGN.md); compiled kernels keep bf16/fp16 operands and float32 accumulators.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_block(acc, m_i, l_i, q, K, V, k_row0, start_n, offs_m, offs_n, offs_d, len_k, shift, qk_scale,
                   stride_kt, stride_vt, d_mask, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   UPCAST: tl.constexpr):
    cols = start_n + offs_n
    if MASKED:
        n_mask = cols < len_k
        k = tl.load(K + (k_row0 + cols)[None, :] * stride_kt + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(V + (k_row0 + cols)[:, None] * stride_vt + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        k = tl.load(K + (k_row0 + cols)[None, :] * stride_kt + offs_d[:, None], mask=d_mask[:, None], other=0.0)
        v = tl.load(V + (k_row0 + cols)[:, None] * stride_vt + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    qk = tl.dot(q, k) * qk_scale
    if MASKED:
        keep = n_mask[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + shift)
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
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
def prefill_kernel(Q, K, V, O, cu_q, cu_k, qk_scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (cdiv(max_q, BLOCK_M), num_q_heads, batch). qk_scale = softmax_scale * log2(e)."""
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
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        end_n = tl.minimum(len_k, (pid_m + 1) * BLOCK_M + shift)
        full_n = ((pid_m * BLOCK_M + shift + 1) // BLOCK_N) * BLOCK_N  # every row of the tile sees these keys
    else:
        end_n = len_k
        full_n = (len_k // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_n, BLOCK_N):
        acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, K, V, k_start, start_n, offs_m, offs_n, offs_d, len_k,
                                       shift, qk_scale, stride_kt, stride_vt, d_mask, False, CAUSAL, UPCAST)
    for start_n in range(full_n, end_n, BLOCK_N):
        acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, K, V, k_start, start_n, offs_m, offs_n, offs_d, len_k,
                                       shift, qk_scale, stride_kt, stride_vt, d_mask, True, CAUSAL, UPCAST)
    out = acc / l_i[:, None]
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def decode_kernel(Q, K, V, PT, LENS, O, O_part, LSE_part, qk_scale, num_splits, num_heads,
                  stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                  stride_ptb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (batch, num_kv_heads, num_splits): the query heads of one KV head read each K/V tile once.

    Without SPLIT the result goes to O; with it, normalised partial outputs and their log2-sum-exp go to
    O_part [B, H, S, BLOCK_D] / LSE_part [B, H, S] (both contiguous) for decode_reduce_kernel.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
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
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        qk = tl.where(t_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(O_part + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
                 acc / l_safe[:, None], mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(LSE_part + (b * num_heads + heads) * num_splits + split, lse, mask=g_mask)
    else:
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(O.dtype.element_ty), mask=out_mask)


@triton.jit
def decode_reduce_kernel(O, O_part, LSE_part, num_splits, num_heads, stride_ob, stride_oh, stride_pb, stride_ph,
                         stride_ps,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (batch, num_q_heads): merge the splits' partial outputs weighted by their sum-exp."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = b * stride_pb + h * stride_ph
    lse = tl.load(LSE_part + (b * num_heads + h) * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)
    w = w / tl.sum(w, 0)
    part = tl.load(O_part + base + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
