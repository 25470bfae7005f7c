"""The extend phase's timed shapes (ragged queries over the paged cache), their keys, workloads and spot reference.

A bucket is (requests, query tokens per request, context per request, the queries included): the work of a chunk
over a long prefix is set by its context, not by its new tokens alone, so the context is an axis. The grid covers
multi-token decode and speculative verify (2-4 queries per request, up to 256 requests), prompt-cache hits (16-256
new tokens over a cached prefix) and chunked prefill (1024 new tokens over prefixes up to 16k), in factor-2 steps of
requests and context where the budget allows (level 2). Under CUDA graphs an engine captures per batch size: a
bucket is a batch size timed at 2 and 4 queries over a short and a long context (dispatch scores each batch size by
the geometric mean, as decode's graph table does).
"""
from __future__ import annotations

import math

import torch

from ..spec import AttentionSpec
from .grid import MAX_DECODE_KV_BYTES, _coarse_first, decode_bytes
from .inputs import _attention

EXTEND_AXES = ("requests", "q_len", "context")
EXTEND_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
EXTEND_QLENS = (2, 4, 16, 64, 256, 1024)
EXTEND_CTX = (1024, 2048, 4096, 8192, 16384)
COARSE = {"requests": (1, 16, 256), "q_len": (2, 64, 1024), "context": (1024, 16384)}
# level 1: the remaining values of a factor-4 grid; level 2 (timed as the budget allows): the factor-2 steps between
# them, where the winner turns with the number of programs per SM (FA3 and its split variant on prompt-cache hits,
# the split-KV kernels of multi-token decode); 2048 only for 2-4 queries (multi-token decode over short contexts)
FINE = {"requests": (2, 8, 32, 128), "context": (2048, 8192)}
SHORT_Q_ONLY = (2048,)
MAX_EXTEND_TOKENS = 16384  # query tokens of one bucket
GRAPH_EXTEND_QLENS = (2, 4)
GRAPH_EXTEND_CTX = (1024, 8192)
CPU_EXTEND = ((1, 2, 16), (2, 5, 24))  # the interpreter and CPU torch: tiny workloads only
SPOT_EXTEND_ROWS = 4  # requests spot-checked per timed output
SPOT_QUERIES = 2  # query rows at each end of a spot-checked request


def extend_grid(spec: AttentionSpec, device: torch.device, free_bytes: int | None = None,
                mode: str = "eager") -> list[tuple[int, tuple[int, int, int]]]:
    """(level, (requests, q_len, context)) of the timed extend buckets, coarse grid first; a bucket's query tokens
    at most MAX_EXTEND_TOKENS and its cache capped as decode_grid caps it (graph mode: every bucket of a batch size
    at that batch size's level)."""
    if device.type != "cuda":
        return [(0, shape) for shape in CPU_EXTEND]
    cap = MAX_DECODE_KV_BYTES if free_bytes is None else min(MAX_DECODE_KV_BYTES, free_bytes // 6)
    qlens, ctxs = (GRAPH_EXTEND_QLENS, GRAPH_EXTEND_CTX) if mode == "graph" else (EXTEND_QLENS, EXTEND_CTX)
    grid = []
    for r in EXTEND_REQUESTS:
        for q in qlens:
            for c in ctxs:
                if q > c or r * q > MAX_EXTEND_TOKENS or decode_bytes(spec, r, c) > cap:
                    continue
                if mode == "graph":
                    level = 0 if r in COARSE["requests"] else 1
                elif c in SHORT_Q_ONLY and q > 4:
                    continue
                elif r in FINE["requests"] or c in FINE["context"]:
                    level = 2
                else:
                    level = 0 if (r in COARSE["requests"] and q in COARSE["q_len"] and c in COARSE["context"]) else 1
                grid.append((level, (r, q, c)))
    return _coarse_first(grid, group=lambda item: item[1][0])


def extend_key(requests: int, total_q: int, context_tokens: int) -> tuple[int, int, int]:
    """The bucket coordinates of an extend batch: (requests, mean query tokens, mean context), means rounded up."""
    n = max(requests, 1)
    return (requests, -(-total_q // n), -(-context_tokens // n))


def extend_label(shape: tuple[int, int, int]) -> str:
    return f"{shape[0]}x{shape[1]} over {shape[2]}"


def _spread(n: int, k: int) -> list[int]:
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(min(n, k))}) if n else []


def extend_spot_rows(spec: AttentionSpec, plan_args: tuple, inputs: tuple, kwargs: dict
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(row indices, float32 references, yardsticks) of sampled query rows of an extend workload: SPOT_EXTEND_ROWS
    requests spread over the batch, SPOT_QUERIES queries at each end of each."""
    cu_q, page_table, seq_lens = (t.tolist() for t in plan_args[:3])
    q, k_cache, v_cache = inputs
    k_scale, v_scale, sinks = kwargs.get("k_scale"), kwargs.get("v_scale"), kwargs.get("sinks")
    rows, refs, lows = [], [], []
    for b in _spread(len(seq_lens), SPOT_EXTEND_ROWS):
        lq, n = cu_q[b + 1] - cu_q[b], seq_lens[b]
        picked = sorted(set(range(min(SPOT_QUERIES, lq))) | set(range(max(0, lq - SPOT_QUERIES), lq)))
        if not picked or n < lq:
            continue
        pages = torch.tensor(page_table[b][:math.ceil(n / spec.page_size)], dtype=torch.long, device=q.device)
        kk = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n].float()
        vv = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n].float()
        if k_scale is not None:
            kk, vv = kk * k_scale.float(), vv * v_scale.float()
        for i in picked:  # query i sees the keys up to its position n - lq + i
            end = n - lq + i + 1
            rows.append(torch.tensor([cu_q[b] + i]))
            ref, low = _attention(spec, q[cu_q[b] + i: cu_q[b] + i + 1], kk[:end], vv[:end], sinks, cache=True)
            refs.append(ref)
            lows.append(low)
    return rows, refs, lows
