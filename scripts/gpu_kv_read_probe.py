"""Read-only probe of a paged KV cache: how fast can a kernel read it, per KV head or per token, bf16 vs fp8?

Usage (device): python3 scripts/gpu_kv_read_probe.py OUT.json [--batch 64] [--ctx 8192] [--pages 16,64]
Issue 11: every library's fp8 e4m3 decode stopped at ~2.5 TB/s of fp8 bytes at 64 x 8192, against ~4.4 TB/s for
bf16. The decode kernels read one KV head per program: in the NHD cache [pages, page_size, kv_heads, head_dim] that
is one row of head_dim elements per token (256 bytes in bf16, 128 in fp8) at a stride of kv_heads rows. This probe
reads the same cache, with the same random page table, in two ways that do no attention math:
  head:  a program per (sequence, KV head, split) reads its head's rows (what the decode kernels do);
  token: a program per (sequence, split) reads whole tokens (all KV heads: kv_heads x head_dim contiguous bytes).
and sums what it read (so the loads cannot be dropped). TB/s over the cache's bytes, CUDA events over 20 launches,
median of 5. If fp8 per head stays near 2.5 TB/s while fp8 per token reaches bf16's rate, the row width is the cap
and a faster fp8 decode needs kernels that read several heads per program (or an HND layout).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def read_kernel(K, V, PT, OUT, tokens_per_split, stride_kp, stride_ks, stride_kh, stride_ptb,
                KV_HEADS: tl.constexpr, PER_HEAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    b = tl.program_id(0)
    if PER_HEAD:
        h = tl.program_id(1)
        split = tl.program_id(2)
        cols = tl.arange(0, WIDTH)
        col_off = h * stride_kh + cols
    else:
        split = tl.program_id(1)
        cols = tl.arange(0, WIDTH)
        col_off = (cols // HEAD_DIM) * stride_kh + cols % HEAD_DIM
    acc = tl.zeros([WIDTH], tl.float32)
    start = split * tokens_per_split
    offs_n = tl.arange(0, BLOCK_N)
    for n in range(start, start + tokens_per_split, BLOCK_N):
        t = n + offs_n
        page = tl.load(PT + b * stride_ptb + t // PAGE_SIZE).to(tl.int64)
        off = page[:, None] * stride_kp + (t % PAGE_SIZE)[:, None] * stride_ks + col_off[None, :]
        acc += tl.sum(tl.load(K + off).to(tl.float32) + tl.load(V + off).to(tl.float32), 0)
    pid = (b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    tl.store(OUT + pid, tl.sum(acc, 0))


def time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 20)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--pages", default="16,64")
    args = ap.parse_args()
    batch, ctx, kvh, d = args.batch, args.ctx, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for page in map(int, args.pages.split(",")):
        n_pages = batch * ctx // page
        table = torch.randperm(n_pages, device="cuda").to(torch.int32).view(batch, ctx // page)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            k = torch.randn(n_pages, page, kvh, d, device="cuda").to(dtype)
            v = torch.randn(n_pages, page, kvh, d, device="cuda").to(dtype)
            nbytes = 2 * k.numel() * k.element_size()
            for per_head, block_n in ((True, 64), (True, 128), (False, 16), (False, 32)):
                programs = batch * (kvh if per_head else 1)
                splits = max(1, min(ctx // block_n, round(3 * sms / programs)))
                while ctx % (splits * block_n):
                    splits -= 1
                grid = (batch, kvh, splits) if per_head else (batch, splits, 1)
                out = torch.empty(batch * kvh * splits, device="cuda")
                launch = lambda: read_kernel[grid](  # noqa: E731
                    k, v, table, out, ctx // splits, k.stride(0), k.stride(1), k.stride(2), table.stride(0),
                    KV_HEADS=kvh, PER_HEAD=per_head, HEAD_DIM=d, PAGE_SIZE=page, BLOCK_N=block_n,
                    WIDTH=d if per_head else kvh * d, num_warps=4)
                us = time_us(launch)
                row = {"page": page, "dtype": str(dtype).split(".")[-1], "read": "head" if per_head else "token",
                       "block_n": block_n, "splits": splits, "us": round(us, 1),
                       "tbps": round(nbytes / (us * 1e-6) / 1e12, 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            del k, v
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
