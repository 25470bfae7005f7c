"""How fast: timing workloads derived from the spec, the one timing function (eager launches or CUDA-graph replays),
and the bandwidth probes that decode speeds are compared with. Used by the worker (policy "measure"), `attnsel bench`
and scripts/gpu_tune.py.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import torch

from ..spec import AttentionSpec
from .cases import cumulative


@dataclasses.dataclass
class Workload:
    label: str
    plan_args: tuple
    inputs: tuple


def prefill_workloads(spec: AttentionSpec, device: torch.device) -> list[tuple[str, list[int]]]:
    """(label, sequence lengths): one long prompt, a few medium, many short, a ragged mix."""
    if device.type != "cuda":
        return [("2x64", [64, 64])]
    return [("1x8192", [8192]), ("4x2048", [2048] * 4), ("32x256", [256] * 32),
            ("ragged 13..3000", [13, 3000, 777, 1500, 100, 1])]


def decode_workloads(spec: AttentionSpec, device: torch.device) -> list[tuple[str, int, int]]:
    """(label, batch, context length)."""
    if device.type != "cuda":
        return [("4x128", 4, 128)]
    return [("1x4096", 1, 4096), ("16x2048", 16, 2048), ("64x4096", 64, 4096), ("256x1024", 256, 1024)]


def make_prefill_workload(spec: AttentionSpec, device: torch.device, label: str, lens: list[int]) -> Workload:
    cu = cumulative(lens, device)
    total, dt = sum(lens), spec.torch_dtype
    q = torch.randn(total, spec.num_q_heads, spec.head_dim, device=device, dtype=dt)
    k = torch.randn(total, spec.num_kv_heads, spec.head_dim, device=device, dtype=dt)
    v = torch.randn_like(k)
    return Workload(label, (cu, cu, max(lens), max(lens)), (q, k, v))


def make_decode_workload(spec: AttentionSpec, device: torch.device, label: str, batch: int, ctx: int) -> Workload:
    ps, dt = spec.page_size, spec.torch_dtype
    pages = math.ceil(ctx / ps)
    k_cache = torch.randn(batch * pages, ps, spec.num_kv_heads, spec.head_dim, device=device, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(batch * pages, device=device).to(torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, device=device, dtype=dt)
    return Workload(label, (page_table, seq_lens), (q, k_cache, v_cache))


def prefill_flops(spec: AttentionSpec, lens: list[int]) -> float:
    """FLOPs of causal attention (half the square per sequence), 4 per multiply-add pair of the two matmuls."""
    return sum(4 * spec.num_q_heads * spec.head_dim * n * n / (2 if spec.causal else 1) for n in lens)


def decode_bytes(spec: AttentionSpec, batch: int, ctx: int) -> float:
    item = torch.finfo(spec.torch_dtype).bits // 8
    return 2 * batch * ctx * spec.num_kv_heads * spec.head_dim * item

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def bench(fn, device: torch.device, target_s: float = 0.02, reps: int = 5) -> float:
    """Median seconds per call of fn, timed with CUDA events (host clock on CPU), after a warm-up."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    n = max(1, min(1000, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / n)
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)

def as_graph(run, inputs, device: torch.device):
    """A CUDA graph replay of run(*inputs): what an engine running under CUDA graphs pays per call."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run(*inputs)  # warm-up outside capture (lazy init, autotuning)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*inputs)
    return graph.replay

def measure(backend, spec: AttentionSpec, phase: str, device: torch.device, mode: str) -> dict:
    """Time the backend on the spec's workloads; score = geometric mean of the per-workload times."""
    os.environ.pop("ATTNSEL_FLASHINFER_WORKSPACE_MB", None)  # runtime-sized workspace for real batches
    timings = {}
    if phase == "prefill":
        loads = [make_prefill_workload(spec, device, label, lens)
                 for label, lens in prefill_workloads(spec, device)]
        plan = backend.plan_prefill
    else:
        loads = [make_decode_workload(spec, device, label, b, ctx)
                 for label, b, ctx in decode_workloads(spec, device)]
        plan = backend.plan_decode
    for load in loads:
        run = plan(spec, *load.plan_args)
        fn = as_graph(run, load.inputs, device) if mode == "graph" else (lambda r=run, i=load.inputs: r(*i))
        timings[load.label] = bench(fn, device) * 1e6
        del run, fn
    score = math.exp(sum(math.log(t) for t in timings.values()) / len(timings))
    return {"timings_us": timings, "score_us": score}


def probes(device: torch.device) -> dict:
    """Copy (bytes read + written) and read-only bandwidth in TB/s on 2 GiB."""
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    copy = 2 * x.nbytes / bench(lambda: y.copy_(x), device) / 1e12
    read = x.nbytes / bench(lambda: x.sum(dtype=torch.float32), device) / 1e12
    return {"copy_tbps": copy, "read_tbps": read}  # x and y are freed on return
