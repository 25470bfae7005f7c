"""`attnsel bench`: every valid backend over a grid of shapes that the selection does not time, and how the
selection's choice compares with the fastest backend of each cell.

Each cell times all valid backends interleaved, inputs rotated so that every call reads from HBM
(``timing.time_bucket``: the same rules as the selection's timing). Per cell it reports the fastest backend and, as
time over the fastest: "selected" (what ``Selection.plan_prefill``/``plan_decode`` dispatch to for this shape), "one
backend" (the selection's headline backend of the phase for every shape) and "static" (LightLLM's fixed priority
FA3 > FlashInfer > Triton, the first valid). Decode also reports TB/s of KV read against two bandwidth probes of the
same run (a device copy, which reads and writes, and a read-only reduction). Writes bench.json, bench.md and
bench.png (matplotlib) to --out.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from . import backends
from .priority import DEFAULT_PRIORITY
from .selection import select
from .spec import AttentionSpec
from .validate import cases, timing
from .validate.cases import check_output
from .validate.grid import decode_bytes, prefill_flops, prefill_key, prefill_label, ragged_key
from .validate.timing import probes

log = logging.getLogger(__name__)

# Shapes between and beyond the selection's timed buckets (validate.grid's PREFILL_* / DECODE_*), never on them.
PREFILL_GRID = [[100], [400], [1500], [5000], [12000], [700] * 3, [300] * 10, [100] * 40,
                [13, 3000, 777, 1500, 100, 1], [2500] + [50] * 20]
DECODE_BATCHES = (1, 3, 12, 48, 100, 200)
DECODE_CTX = (200, 700, 3000, 9000)
RAGGED_DECODE = [100, 3000, 500, 9000, 20, 1500, 700, 4000]
# ragged batches of 48 and 100 rows too: near the timed ragged buckets of 32 and 128 rows, where the ragged and the
# uniform tables disagree most (see the results file); neither is a timed shape nor of the timed profile (log-normal
# quantiles, grid.ragged_decode_lens)
RAGGED_DECODES = [RAGGED_DECODE, RAGGED_DECODE * 6, [50, 200, 800, 2500, 6000] * 20]
QUICK_PREFILL = [[400], [5000], [300] * 10, [13, 3000, 777, 1500, 100, 1]]
QUICK_DECODE = [(1, 700), (12, 3000), (100, 700), RAGGED_DECODE]
STATIC_PRIORITY = ("fa3", "flashinfer", "triton")  # LightLLM's fixed order
STRATEGIES = ("selected", "one_backend", "static", "repeat")  # compare()'s verdicts (repeat: with repeats > 1)
WITHIN = 0.03  # the bench's verdict: a strategy is "within 3%" of a cell's fastest (the dispatch's target)
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
    spread: float | None = None  # (max - min) / median of the interleaved samples (the largest over the passes)
    passes: list | None = None  # with --repeats > 1: each pass's time (None: an error in that pass); us is their median
    host_us: list | None = None  # eager on CUDA: each pass's host probe for the cell (validate.host_probe), as the
    # selection records per bucket: which passes ran on a slow host


def valid_backends(spec: AttentionSpec, phase: str, names: list[str], device: torch.device) -> dict[str, str]:
    """name -> "" for backends that pass the validation case, else the reason. Runs in this process: bench is a
    developer's tool, not a server start, so a crashing library ends the bench instead of being isolated."""
    status = {}
    phase_cases = [cases.make_case(spec, phase, device), cases.single_case(spec, phase, device)]
    for name in names:
        backend = backends.get(name)
        reason = backend.unsupported(spec, phase)
        if not reason:
            t0 = time.perf_counter()
            try:
                for case in phase_cases:
                    reason = check_output(spec, cases.run_case(backend, spec, case), case)["reason"]
                    if reason:
                        break
            except Exception as exc:
                log.exception("%s %s failed its check", name, phase)
                reason = f"raised {type(exc).__name__}: {exc}"
            log.info("checked %s %s in %.1f s: %s", name, phase, time.perf_counter() - t0, reason or "valid")
        status[name] = reason or ""
    return status


def grid_specs(quick: bool, base: AttentionSpec | list[AttentionSpec] | None) -> list[AttentionSpec]:
    if isinstance(base, list):
        return base
    if base is not None:
        return [base]
    if quick:
        return [AttentionSpec(32, 8, 128, "bf16", 16)]
    return [AttentionSpec(q, kv, 128, "bf16", 16) for q, kv in ((32, 8), (8, 1), (28, 4))]


def shapes(spec: AttentionSpec, phase: str, quick: bool) -> list[tuple[str, tuple[int, ...], list | tuple, float]]:
    """(label, dispatch key, shape for timing.time_bucket, work: FLOPs or KV bytes) of the bench grid."""
    out = []
    if phase == "prefill":
        for lens in (QUICK_PREFILL if quick else PREFILL_GRID):
            out.append((prefill_label(lens), prefill_key(lens), lens, prefill_flops(spec, lens)))
        return out
    grid = QUICK_DECODE if quick else [(b, c) for b in DECODE_BATCHES for c in DECODE_CTX] + RAGGED_DECODES
    item = torch.finfo(spec.torch_dtype).bits // 8
    for shape in grid:
        if isinstance(shape, list):
            # dispatched as an engine plans it: by the mean context and the longest row (Selection.plan_decode's
            # context_tokens and longest)
            label = f"ragged {len(shape)} (max {max(shape)})"
            key = (*ragged_key(shape), max(shape))
            work = 2 * sum(shape) * spec.num_kv_heads * spec.head_dim * item
        else:
            label, key, work = f"{shape[0]}x{shape[1]}", shape, decode_bytes(spec, *shape)
        if work <= MAX_KV_BYTES:
            out.append((label, tuple(key), shape, work))
    return out


def spec_label(spec: AttentionSpec | dict) -> str:
    """A spec in a bench table: "Q/KV" heads, with head_dim, dtype and page size where not 128, bf16 and 16."""
    d = spec.to_dict() if isinstance(spec, AttentionSpec) else spec
    parts = [f"{d['num_q_heads']}/{d['num_kv_heads']}"]
    parts += [f"d{d['head_dim']}"] if d["head_dim"] != 128 else []
    parts += [d["dtype"]] if d["dtype"] != "bf16" else []
    return " ".join(parts + ([f"page {d['page_size']}"] if d["page_size"] != 16 else []))


def static_choice(valid: list[str]) -> str | None:
    return next((n for n in STATIC_PRIORITY if n in valid), None)


def run_grid(spec: AttentionSpec, names: list[str], modes: list[str], quick: bool, device: torch.device,
             probe: dict, progress, repeats: int = 1, grid=None, phases: tuple[str, ...] = ("prefill", "decode")
             ) -> tuple[list[Cell], dict, list[tuple]]:
    """Time the grid ``repeats`` times (whole passes one after another, so that a cell's passes are tens of seconds
    apart); a cell's time per backend is the median over the passes (a backend with an error in any pass has no
    time). Graph-mode cells time only the valid backends that can serve CUDA-graph replays (not stale on replay:
    the selection's candidates under graphs). ``grid(phase, mode)``: the (label, key, shape, work) cells of that
    phase and mode instead of shapes()'s.
    Returns the cells, the validity checks and per (phase, mode, shape) what compare() needs."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    checks, plan = {}, []
    for phase in phases:
        status = valid_backends(spec, phase, names, device)
        checks[phase] = status
        valid = [n for n, why in status.items() if not why]
        by_mode = {}
        for mode in modes:  # under CUDA graphs only the backends that can serve replays (graph_stale_reason)
            runnable = [n for n in valid
                        if mode != "graph" or not backends.graph_stale_reason(backends.get(n), phase)]
            by_mode[mode] = (runnable, {n: backends.get(n) for n in runnable})
        if grid is None:
            plan += [(phase, mode, *cell, *by_mode[mode]) for cell in shapes(spec, phase, quick) for mode in modes
                     if by_mode[mode][0]]
        else:
            plan += [(phase, mode, *cell, *by_mode[mode]) for mode in modes if by_mode[mode][0]
                     for cell in grid(phase, mode)]
    passes: list[list[dict]] = []
    for p in range(repeats):
        timed_pass = []
        for phase, mode, label, key, shape, work, runnable, cands in plan:
            timed = timing.time_bucket(cands, spec, phase, shape, device, mode, timing.reps_for(mode, device))
            timed_pass.append(timed)
            progress(f"{spec_label(spec)} {phase} {label} {mode}"
                     f"{f' (pass {p + 1} of {repeats})' if repeats > 1 else ''}: " +
                     ", ".join(f"{n} {timed['us'][n]:.1f}us" if n in timed["us"] else f"{n} error" for n in runnable))
            torch.cuda.empty_cache()
        passes.append(timed_pass)
    cells: list[Cell] = []
    groups = []
    for i, (phase, mode, label, key, shape, work, runnable, cands) in enumerate(plan):
        row = []
        for n in runnable:
            times = [tp[i]["us"].get(n) for tp in passes]
            error = next((tp[i]["errors"][n] for tp in passes if tp[i]["errors"].get(n)), "")
            us = statistics.median(times) if all(times) and not error else None
            spreads = [tp[i]["spread"][n] for tp in passes if tp[i]["spread"].get(n) is not None]
            hosts = [tp[i].get("host_us") for tp in passes]
            row.append(Cell(spec.to_dict(), phase, label, mode, n, us, work / us / 1e6 if us else None,
                            error=error, spread=max(spreads, default=None),
                            passes=times if repeats > 1 else None,
                            host_us=hosts if any(h is not None for h in hosts) else None))
        best = min((c.us for c in row if c.us), default=None)
        for c in row:
            if c.us and best:
                c.vs_best = c.us / best
                if phase != "prefill":
                    c.vs_copy, c.vs_read = c.rate / probe["copy_tbps"], c.rate / probe["read_tbps"]
        cells.extend(row)
        if best:
            groups.append((phase, mode, label, key, row, runnable))
    return cells, checks, groups


def compare(spec: AttentionSpec, phase: str, mode: str, label: str, key: tuple, row: list[Cell],
            runnable: list[str], sel) -> dict:
    """One cell's comparison: the fastest backend and each strategy's choice with its time over the fastest."""
    by_name = {c.backend: c for c in row if c.us}
    fastest = min(by_name.values(), key=lambda c: c.us)
    out = {"spec": spec_label(spec), "phase": phase, "mode": mode, "shape": label,
           "fastest": fastest.backend, "fastest_us": fastest.us}
    picks = {"static": static_choice(runnable)}
    if sel is not None:
        if phase == "prefill":
            picks["selected"] = sel.prefill_backend_for(*key)
        elif phase == "extend":
            picks["selected"] = sel.extend_backend_for(*key)
        else:
            picks["selected"] = sel.decode_backend_for(*key)
        picks["one_backend"] = sel.phases[phase].backend
    for strategy, name in picks.items():
        cell = by_name.get(name)
        out[strategy] = name
        out[f"{strategy}_ratio"] = cell.vs_best if cell else None
    # the bench's own verdict checked by its later passes: pass 1's fastest (also one that fails later: then it has
    # no ratio, a miss) against the later passes' medians of the backends timed in all of them
    first_pass = [c for c in row if c.passes and len(c.passes) > 1 and c.passes[0]]
    if first_pass:
        first = min(first_pass, key=lambda c: c.passes[0])
        later = {c.backend: statistics.median(c.passes[1:]) for c in row
                 if c.passes and len(c.passes) > 1 and all(c.passes[1:])}
        out["repeat"] = first.backend
        out["repeat_ratio"] = later[first.backend] / min(later.values()) if first.backend in later else None
    return out


def summarise(rows: list[dict]) -> list[dict]:
    """Per (spec, phase, mode) and strategy: cells within WITHIN of the fastest, geometric mean, worst.

    "timed" counts the cells where the strategy names a backend; a named backend without a time in the cell (it
    failed there) is a miss ("no_time"), outside the geometric mean and the worst ratio."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["spec"], r["phase"], r["mode"]), []).append(r)
    out = []
    for (spec, phase, mode), group in groups.items():
        for strategy in STRATEGIES:
            named = [r.get(f"{strategy}_ratio") for r in group if r.get(strategy)]
            ratios = [x for x in named if x is not None]
            if not named:
                continue
            out.append({"spec": spec, "phase": phase, "mode": mode, "strategy": strategy, "cells": len(group),
                        "timed": len(named), "no_time": len(named) - len(ratios),
                        "within_tie": sum(x <= 1 + WITHIN for x in ratios),
                        "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                        "worst": max(ratios) if ratios else None})
    return out


def markdown(cells: list[Cell], probe: dict, rows: list[dict], summary: list[dict], header: str) -> str:
    strategies = _strategies(rows)
    lines = [header, "", f"Bandwidth probes in this run: copy {probe['copy_tbps']:.2f} TB/s (read + write), "
             f"read-only {probe['read_tbps']:.2f} TB/s.", "",
             "## Selection vs the fastest backend per cell", "",
             "selected: the dispatch table's choice for the cell; one backend: the selection's headline backend for "
             "every shape; static: FA3 > FlashInfer > Triton (LightLLM); repeat (with --repeats > 1): the first pass's "
             "fastest judged by the median of the later passes, i.e. how far the bench's own verdict moves between "
             "passes (a pass-1 fastest that fails later counts as a miss). Cell times are medians over the passes "
             "(of two: their mean). Within 3%: cells at most 1.03x the fastest; a pick without a time in its cell "
             "is a miss.",
             "", "| spec | phase | mode | strategy | within 3% | geomean | worst |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['spec']} | {s['phase']} | {s['mode']} | {s['strategy']} | " + " | ".join(_totals(s)) + " |")
    lines.append("")
    groups: dict = {}
    for c in cells:
        groups.setdefault((json.dumps(c.spec, sort_keys=True), c.phase, c.mode), []).append(c)
    for (spec_json, phase, mode), group in groups.items():
        spec = json.loads(spec_json)
        names = list(dict.fromkeys(c.backend for c in group))
        unit = "TFLOP/s" if phase == "prefill" else "TB/s"
        lines += [f"### {phase}, {mode}: {spec['num_q_heads']}/{spec['num_kv_heads']} heads, d{spec['head_dim']}, "
                  f"{spec['dtype']}, page {spec['page_size']}", "",
                  "| shape | " + " | ".join(names) + " | fastest | " +
                  " | ".join(x.replace("_", " ") for x in strategies) + " |",
                  "|---" * (len(names) + 2 + len(strategies)) + "|"]
        sname = spec_label(spec)
        for shape in dict.fromkeys(c.shape for c in group):
            row = {c.backend: c for c in group if c.shape == shape}
            cols = []
            for n in names:
                c = row.get(n)
                if c is None or c.us is None:
                    cols.append("error" if c is not None else "")
                    continue
                extra = f", {c.vs_read:.0%} of read probe" if phase == "decode" else ""
                passes = f" (passes: {' / '.join(f'{t:.1f}' if t else 'error' for t in c.passes)})" if c.passes else ""
                cols.append(f"{c.us:.1f} us ±{(c.spread or 0) * 50:.0f}%{passes}, {c.rate:.2f} {unit} "
                            f"({c.vs_best:.2f}x{extra})")
            cmp = next((r for r in rows if (r["spec"], r["phase"], r["mode"], r["shape"]) ==
                        (sname, phase, mode, shape)), {})
            tail = [_pick(cmp, s) for s in strategies]
            lines.append(f"| {shape} | " + " | ".join(cols) + f" | {cmp.get('fastest', '')} | " + " | ".join(tail)
                         + " |")
        lines.append("")
    return "\n".join(lines)


def _totals(s: dict) -> tuple[str, str, str]:
    """A summary row's "within 3%", geomean and worst columns; picks without a time in their cell are named."""
    missing = f" ({s['no_time']} without a time)" if s.get("no_time") else ""
    return (f"{s['within_tie']}/{s['timed']}{missing}", f"{s['geomean']:.3f}x" if s["geomean"] else "-",
            f"{s['worst']:.2f}x" if s["worst"] else "-")


def _strategies(rows: list[dict]) -> tuple[str, ...]:
    """The per-cell columns: repeat only where the bench ran more than one pass."""
    return STRATEGIES if any("repeat" in r for r in rows) else STRATEGIES[:3]


def _pick(row: dict, strategy: str) -> str:
    name, ratio = row.get(strategy), row.get(f"{strategy}_ratio")
    if not name:
        return ""
    return f"{name} {ratio:.2f}x" if ratio else f"{name} (no time)"


def untimed_extend(spec: AttentionSpec, mode: str) -> dict:
    """select()'s arguments for a selection that does not time extend: one candidate, {"extend_priority": [name]}
    (one valid candidate is not timed; one that fails validation leaves extend unserved, not the selection failed):
    torch in eager mode (the reference, quickest to validate); under CUDA graphs the first backend in extend's
    default order that can serve the spec and is not stale on replay (torch's extend plan gathers rows on the host).
    {} where none can (extend stays automatic)."""
    order = ["torch"] if mode == "eager" else DEFAULT_PRIORITY["extend"]
    name = next((n for n in order if backends.availability_in(backends.get(n), spec, "extend", mode)[0] is None),
                None)
    return {"extend_priority": [name]} if name else {}


def select_modes(spec: AttentionSpec, modes: list[str], device: torch.device, records: list[dict],
                 phases: tuple[str, ...] = ("prefill", "decode", "extend"), priority: dict | None = None) -> dict:
    """mode -> the Selection of ``spec`` (a mode whose selection failed is missing, with a warning); appends each
    selection's record (choices, cache, wall time, stats, dispatch tables) to ``records``. Without "extend" in
    ``phases`` the selection considers one extend candidate (validated, not timed: ``untimed_extend``): prefill's
    and decode's tables are the same (each phase's timing has its own share of the budget, and theirs end before it
    runs out; see the results file), and the selection takes about half the time. ``priority``: select()'s
    {"decode_priority": [...], ...} (the auto candidates per phase; default attnsel's)."""
    choices = {}
    for mode in modes:
        t_sel = time.perf_counter()
        fixed = {} if "extend" in phases else untimed_extend(spec, mode)
        try:
            choices[mode] = select(spec, mode=mode, device=str(device), **{**(priority or {}), **fixed})
        except Exception as exc:
            log.warning("selection for %s (%s) failed: %s", spec.describe(), mode, exc)
            continue
        sel = choices[mode]
        records.append({"spec": spec.to_dict(), "mode": mode, "prefill": sel.prefill, "decode": sel.decode,
                        "extend": sel.extend,
                        "cache": sel.cache, "wall_s": time.perf_counter() - t_sel, "stats": sel.stats,
                        "dispatch": {p: t.to_json() if t else None for p, t in sel.dispatch.items()}})
        log.info("selection (%s, %s, cache %s) in %.1f s: %s", spec.describe(), mode, sel.cache,
                 time.perf_counter() - t_sel, sel.summary())
    return choices


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = cells[0].spec if cells else None
    main = [c for c in cells if c.spec == first and c.us]
    modes = sorted({c.mode for c in main}) or ["eager"]
    fig, axes = plt.subplots(2, len(modes), figsize=(8 * len(modes), 9), squeeze=False)
    for j, mode in enumerate(modes):
        for i, phase in enumerate(("prefill", "decode")):
            ax = axes[i][j]
            sub = [c for c in main if c.phase == phase and c.mode == mode]
            labels = list(dict.fromkeys(c.shape for c in sub))
            names = list(dict.fromkeys(c.backend for c in sub))
            width = 0.8 / max(1, len(names))
            for k, name in enumerate(names):
                ys = [next((c.rate for c in sub if c.shape == s and c.backend == name), 0) for s in labels]
                ax.bar([x + k * width for x in range(len(labels))], ys, width, label=name)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=45, ha="right",
                          fontsize=8)
            ax.set_ylabel("TFLOP/s" if phase == "prefill" else "TB/s (KV read)")
            if first:
                ax.set_title(f"{phase}, {mode} ({first['num_q_heads']}/{first['num_kv_heads']} heads, "
                             f"d{first['head_dim']}, {first['dtype']}, page {first['page_size']})")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(path: Path, text: str) -> None:
    """Replace path's content at once (a bench killed mid-write leaves the previous spec's file, not half of one)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def setup(names: list[str] | None, mode: str, out: str) -> tuple[torch.device, list[str], list[str], Path, dict]:
    """(CUDA device, backend names checked: None means every one, modes, output folder made, bandwidth probes) of a
    bench run; RuntimeError without a CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError("attnsel bench times kernels on a CUDA device; none was found")
    device = torch.device("cuda", torch.cuda.current_device())
    names = names or backends.names()
    for name in names:
        backends.get(name)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return device, names, ["eager", "graph"] if mode == "both" else [mode], out_dir, probes(device)


def run_bench(base: AttentionSpec | list[AttentionSpec] | None, names: list[str] | None, mode: str, out: str,
              quick: bool, console: Console, repeats: int = 1, priority: dict | None = None) -> int:
    """Bench ``base`` (a spec, a list of specs, or None: the default specs) over the grid with ``names`` (None:
    every backend) in ``mode`` ("eager", "graph" or "both"), ``repeats`` passes, writing bench.md/json/png under
    ``out``; ``priority``: the selections' auto candidates (select_modes). Needs a CUDA device (RuntimeError)."""
    device, names, modes, out_dir, probe = setup(names, mode, out)
    log.info("probes: copy %.2f TB/s, read %.2f TB/s", probe["copy_tbps"], probe["read_tbps"])
    cells, checks, rows, selections = [], {}, [], []
    t0 = time.perf_counter()
    for spec in grid_specs(quick, base):
        # the grid first: its in-process checks build any JIT kernels, so the selections below time a cold
        # selection without JIT builds (with a fresh ATTNSEL_CACHE_DIR)
        spec_cells, spec_checks, groups = run_grid(spec, names, modes, quick, device, probe, log.info,
                                                    repeats)
        cells += spec_cells
        checks[json.dumps(spec.to_dict(), sort_keys=True)] = spec_checks
        choices = select_modes(spec, modes, device, selections, priority=priority)
        rows += [compare(spec, phase, mode, label, key, row, runnable, choices.get(mode))
                 for phase, mode, label, key, row, runnable in groups]
        summary = summarise(rows)  # written after every spec: a bench cut short keeps the specs it finished
        props = torch.cuda.get_device_properties(device)
        header = (f"# attnsel bench on {props.name} ({time.strftime('%Y-%m-%d')}), torch {torch.__version__}; times "
                  f"are medians of {timing.REPS_EAGER} (eager) or {timing.REPS} (graph) interleaved CUDA-event samples "
                  f"per cell and pass, {repeats} pass(es), a cell's time the median over its passes (inputs rotated "
                  "to read from "
                  "HBM; sampled rows of each timed plan's output checked against the float32 reference); ratios are "
                  "within this run")
        _write(out_dir / "bench.md", markdown(cells, probe, rows, summary, header))
        _write(out_dir / "bench.json", json.dumps(
            {"probe": probe, "checks": checks, "cells": [dataclasses.asdict(c) for c in cells], "comparison": rows,
             "summary": summary, "selections": selections, "repeats": repeats, "wall_s": time.perf_counter() - t0},
            indent=1))
        plot(cells, out_dir / "bench.png")
    table = Table(title=f"attnsel bench ({len(cells)} timings, {time.perf_counter() - t0:.0f} s); time over the "
                        f"cell's fastest; full table in {out_dir / 'bench.md'}", title_justify="left")
    strategies = _strategies(rows)
    for col in ("spec", "phase", "mode", "shape", "fastest", *(x.replace("_", " ") for x in strategies)):
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    for r in rows:
        table.add_row(r["spec"], r["phase"], r["mode"], r["shape"], r["fastest"],
                      *(_pick(r, s) for s in strategies))
    console.print(table)
    totals = Table(title="within 3% of the fastest / geometric mean / worst", title_justify="left")
    for col in ("spec", "phase", "mode", "strategy", "within 3%", "geomean", "worst"):
        totals.add_column(col, no_wrap=True)
    for s in summary:
        totals.add_row(s["spec"], s["phase"], s["mode"], s["strategy"], *_totals(s))
    console.print(totals)
    return 0
