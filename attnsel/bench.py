"""`attnsel bench`: every valid backend over a grid of shapes, as ratios measured in one run.

Prefill: TFLOP/s and time relative to the fastest backend of the cell. Decode: TB/s of KV read, relative to the
fastest backend and to two bandwidth probes measured in the same run (a device copy, which reads and writes, and a
read-only reduction). Writes bench.json, bench.md and bench.png (matplotlib) to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from . import backends
from .selection import select
from .spec import AttentionSpec
from .validate import cases, timing
from .validate.cases import check_output
from .validate.timing import as_graph, bench, probes

log = logging.getLogger(__name__)

PREFILL_GRID = [("1x1", [1]), ("1x512", [512]), ("1x2048", [2048]), ("1x8192", [8192]), ("1x16384", [16384]),
                ("4x2048", [2048] * 4), ("16x512", [512] * 16), ("64x128", [128] * 64),
                ("ragged x6", [1, 13, 3000, 777, 1500, 100])]
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CTX = (128, 1024, 4096, 32768)
QUICK_DECODE = [(1, 4096), (8, 2048), (64, 4096), (256, 1024)]
MAX_KV_BYTES = 16 << 30


@dataclasses.dataclass
class Cell:
    spec: dict
    phase: str
    shape: str
    mode: str
    backend: str
    us: float | None
    rate: float | None  # TFLOP/s (prefill) or TB/s (decode)
    error: str = ""
    vs_best: float | None = None  # time / fastest time in the cell
    vs_copy: float | None = None  # decode: achieved bandwidth / copy probe
    vs_read: float | None = None  # decode: achieved bandwidth / read-only probe




def valid_backends(spec: AttentionSpec, phase: str, names: list[str], device: torch.device) -> dict[str, str]:
    """name -> "" for backends that pass the validation case, else the reason. Runs in this process: bench is a
    developer's tool, not a server start, so a crashing library ends the bench instead of being isolated."""
    status = {}
    case = cases.make_case(spec, phase, device)
    for name in names:
        backend = backends.get(name)
        reason = backend.unsupported(spec, phase)
        if not reason:
            t0 = time.perf_counter()
            try:
                reason = check_output(spec, cases.run_case(backend, spec, case), case)["reason"]
            except Exception as exc:
                log.exception("%s %s failed its check", name, phase)
                reason = f"raised {type(exc).__name__}: {exc}"
            log.info("checked %s %s in %.1f s: %s", name, phase, time.perf_counter() - t0, reason or "valid")
        status[name] = reason or ""
    return status


def time_cell(backend, spec: AttentionSpec, phase: str, load: timing.Workload, mode: str,
              device: torch.device) -> float:
    plan = backend.plan_prefill if phase == "prefill" else backend.plan_decode
    run = plan(spec, *load.plan_args)
    fn = as_graph(run, load.inputs, device) if mode == "graph" else (lambda: run(*load.inputs))
    return bench(fn, device)


def grid_specs(args: argparse.Namespace, base: AttentionSpec | None) -> list[AttentionSpec]:
    if base is not None:
        return [base]
    if args.quick:
        return [AttentionSpec(32, 8, 128, "bf16", 16)]
    # head_dim 128 at GQA ratios 4, 1, 8; head_dim 64 at GQA 4 (each FlashInfer head_dim is a ~2 min JIT build)
    return [AttentionSpec(32, kv, 128, "bf16", 16) for kv in (8, 32, 4)] + [AttentionSpec(32, 8, 64, "bf16", 16)]


def decode_grid(quick: bool) -> list[tuple[int, int]]:
    return QUICK_DECODE if quick else [(b, c) for b in DECODE_BATCHES for c in DECODE_CTX]


def run_grid(spec: AttentionSpec, names: list[str], modes: list[str], quick: bool, device: torch.device,
             probe: dict, progress) -> tuple[list[Cell], dict]:
    cells: list[Cell] = []
    checks = {}
    for phase in ("prefill", "decode"):
        status = valid_backends(spec, phase, names, device)
        checks[phase] = status
        runnable = [n for n, why in status.items() if not why]
        if phase == "prefill":
            shapes = [(label, lens) for label, lens in PREFILL_GRID if not quick or label in ("1x512", "1x8192",
                                                                                                "16x512")]
        else:
            shapes = [(f"{b}x{c}", (b, c)) for b, c in decode_grid(quick)]
        for label, arg in shapes:
            if phase == "decode":
                batch, ctx = arg
                if timing.decode_bytes(spec, batch, ctx) > MAX_KV_BYTES:
                    continue
                load = timing.make_decode_workload(spec, device, label, batch, ctx)
                work = timing.decode_bytes(spec, batch, ctx)
            else:
                load = timing.make_prefill_workload(spec, device, label, arg)
                work = timing.prefill_flops(spec, arg)
            for mode in modes:
                row = []
                for name in runnable:
                    try:
                        t = time_cell(backends.get(name), spec, phase, load, mode, device)
                        row.append(Cell(spec.to_dict(), phase, label, mode, name, t * 1e6, work / t / 1e12))
                    except Exception as exc:
                        log.warning("%s %s %s (%s): %s", name, phase, label, mode, exc)
                        row.append(Cell(spec.to_dict(), phase, label, mode, name, None, None,
                                        error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                best = min((c.us for c in row if c.us), default=None)
                for c in row:
                    if c.us and best:
                        c.vs_best = c.us / best
                        if phase == "decode":
                            c.vs_copy, c.vs_read = c.rate / probe["copy_tbps"], c.rate / probe["read_tbps"]
                cells.extend(row)
                progress(f"{spec.num_q_heads}/{spec.num_kv_heads} d{spec.head_dim} {phase} {label} {mode}: " +
                         ", ".join(f"{c.backend} {c.us:.1f}us" if c.us else f"{c.backend} error" for c in row))
            del load
            torch.cuda.empty_cache()
    return cells, checks


def markdown(cells: list[Cell], probe: dict, selections: dict, header: str) -> str:
    lines = [header, "", f"Bandwidth probes in this run: copy {probe['copy_tbps']:.2f} TB/s (read + write), "
             f"read-only {probe['read_tbps']:.2f} TB/s.", ""]
    groups: dict = {}
    for c in cells:
        groups.setdefault((json.dumps(c.spec, sort_keys=True), c.phase, c.mode), []).append(c)
    for (spec_json, phase, mode), group in groups.items():
        spec = json.loads(spec_json)
        names = list(dict.fromkeys(c.backend for c in group))
        sel = selections.get((spec_json, mode), {}).get(phase)
        unit = "TFLOP/s" if phase == "prefill" else "TB/s"
        lines += [f"### {phase}, {mode}: {spec['num_q_heads']}/{spec['num_kv_heads']} heads, d{spec['head_dim']}, "
                  f"{spec['dtype']}, page {spec['page_size']}" + (f"; selected: **{sel}**" if sel else ""), "",
                  "| shape | " + " | ".join(names) + " | fastest |" + (" selected / fastest |" if sel else ""),
                  "|---" * (len(names) + 2 + bool(sel)) + "|"]
        for shape in dict.fromkeys(c.shape for c in group):
            row = {c.backend: c for c in group if c.shape == shape}
            cols = []
            for n in names:
                c = row.get(n)
                if c is None or c.us is None:
                    cols.append("error" if c is not None else "")
                    continue
                extra = f", {c.vs_read:.0%} of read probe" if phase == "decode" else ""
                cols.append(f"{c.us:.1f} us, {c.rate:.2f} {unit} ({c.vs_best:.2f}x{extra})")
            timed = [c for c in row.values() if c.us]
            fastest = min(timed, key=lambda c: c.us).backend if timed else ""
            tail = ""
            if sel:
                tail = f" {row[sel].vs_best:.2f}x |" if sel in row and row[sel].us else " n/a |"
            lines.append(f"| {shape} | " + " | ".join(cols) + f" | {fastest} |" + tail)
        lines.append("")
    return "\n".join(lines)


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [c for c in cells if c.spec["head_dim"] == 128 and c.spec["num_kv_heads"] == 8 and c.us]
    modes = sorted({c.mode for c in main})
    fig, axes = plt.subplots(2, len(modes), figsize=(8 * len(modes), 9), squeeze=False)
    for j, mode in enumerate(modes):
        for i, phase in enumerate(("prefill", "decode")):
            ax = axes[i][j]
            sub = [c for c in main if c.phase == phase and c.mode == mode]
            shapes = list(dict.fromkeys(c.shape for c in sub))
            names = list(dict.fromkeys(c.backend for c in sub))
            width = 0.8 / max(1, len(names))
            for k, name in enumerate(names):
                ys = [next((c.rate for c in sub if c.shape == s and c.backend == name), 0) for s in shapes]
                ax.bar([x + k * width for x in range(len(shapes))], ys, width, label=name)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=45, ha="right",
                          fontsize=8)
            ax.set_ylabel("TFLOP/s" if phase == "prefill" else "TB/s (KV read)")
            ax.set_title(f"{phase}, {mode} (32/8 heads, d128, bf16, page 16)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_bench(args: argparse.Namespace, out: Console) -> int:
    from .cli import UsageError, spec_from_args

    if not torch.cuda.is_available():
        raise UsageError("attnsel bench needs a CUDA device (none found)")
    device = torch.device("cuda", torch.cuda.current_device())
    given = any(getattr(args, f) is not None for f in ("config", "num_heads", "head_dim"))
    base = spec_from_args(args) if given else None
    names = args.backends or backends.names()
    for name in names:
        backends.get(name)
    modes = ["eager", "graph"] if args.mode == "both" else [args.mode]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    probe = probes(device)
    log.info("probes: copy %.2f TB/s, read %.2f TB/s", probe["copy_tbps"], probe["read_tbps"])
    cells, checks, selections = [], {}, {}
    t0 = time.perf_counter()
    for spec in grid_specs(args, base):
        spec_cells, spec_checks = run_grid(spec, names, modes, args.quick, device, probe, log.info)
        cells += spec_cells
        checks[json.dumps(spec.to_dict(), sort_keys=True)] = spec_checks
        for mode in modes:
            try:
                sel = select(spec, mode=mode, device=str(device))
                selections[(json.dumps(spec.to_dict(), sort_keys=True), mode)] = {"prefill": sel.prefill,
                                                                                   "decode": sel.decode}
            except Exception as exc:
                log.warning("selection for %s (%s) failed: %s", spec, mode, exc)
    props = torch.cuda.get_device_properties(device)
    header = (f"# attnsel bench on {props.name} ({time.strftime('%Y-%m-%d')}), torch {torch.__version__}; "
              f"times are medians of CUDA-event timings; ratios are within this run")
    (out_dir / "bench.md").write_text(markdown(cells, probe, selections, header))
    (out_dir / "bench.json").write_text(json.dumps(
        {"probe": probe, "checks": checks, "cells": [dataclasses.asdict(c) for c in cells],
         "selections": [{"spec": json.loads(k[0]), "mode": k[1], **v} for k, v in selections.items()],
         "wall_s": time.perf_counter() - t0}, indent=1))
    plot(cells, out_dir / "bench.png")
    table = Table(title=f"attnsel bench ({len(cells)} timings, {time.perf_counter() - t0:.0f} s); full table in "
                        f"{out_dir / 'bench.md'}")
    for col in ("spec", "phase", "mode", "shape", "fastest", "runner-up (x slower)", "selected (x slower)"):
        table.add_column(col)
    groups: dict = {}
    for c in cells:
        groups.setdefault((json.dumps(c.spec, sort_keys=True), c.phase, c.mode, c.shape), []).append(c)
    for (spec_json, phase, mode, shape), group in groups.items():
        timed = sorted((c for c in group if c.us), key=lambda c: c.us)
        if not timed:
            continue
        s = json.loads(spec_json)
        sel = selections.get((spec_json, mode), {}).get(phase)
        sel_cell = next((c for c in timed if c.backend == sel), None)
        table.add_row(f"{s['num_q_heads']}/{s['num_kv_heads']} d{s['head_dim']}", phase, mode, shape,
                      timed[0].backend, f"{timed[1].backend} {timed[1].vs_best:.2f}x" if len(timed) > 1 else "",
                      f"{sel} {sel_cell.vs_best:.2f}x" if sel_cell else "")
    out.print(table)
    return 0
