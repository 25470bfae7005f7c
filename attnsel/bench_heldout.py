"""`attnsel bench --heldout SEED`: the dispatch table judged on cells drawn at random (bench_cells) for specs it was
not tuned on, with bootstrap confidence intervals (bench_stats). Per spec: the cells of each phase and mode timed
on every valid backend (bench.run_grid, the fixed bench's timing), then a selection per mode (bench.select_modes),
then each cell's comparison (bench.compare: the dispatch's choice, one backend per phase, LightLLM's static order);
under CUDA graphs also the per-batch-size bound. Writes heldout.json (seed, command line, device, date, the
sampler's settings, every cell's times) and heldout.md to --out after every spec, and prints a short table.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import shlex
import time
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from . import bench, bench_cells, bench_stats
from .device import fingerprint
from .spec import AttentionSpec
from .validate import grid

log = logging.getLogger(__name__)

# Specs for the held-out run: the three the grid and lookup were tuned on, two GQA ratios they were not (5, 6),
# head_dim 64 (Llama-3.2-1B's heads) and 256 (Gemma-2's), and fp16
HELDOUT_SPECS = [AttentionSpec(q, kv, d, dtype, 16) for q, kv, d, dtype in (
    (32, 8, 128, "bf16"), (28, 4, 128, "bf16"), (8, 1, 128, "bf16"), (40, 8, 128, "bf16"), (48, 8, 128, "bf16"),
    (32, 8, 64, "bf16"), (16, 8, 256, "bf16"), (32, 8, 128, "fp16"))]
DEFAULT_CELLS = {"prefill": 12, "decode": 24, "extend": 16}  # per spec, phase and launch mode
PHASES = ("prefill", "decode")  # by default; extend on request (--phases)


def _work(spec: AttentionSpec, cell: bench_cells.HeldoutCell) -> float:
    """FLOPs (prefill) or KV bytes read (decode, extend) of a cell."""
    if cell.phase == "prefill":
        return grid.prefill_flops(spec, list(cell.lens))
    item = torch.finfo(spec.kv_torch_dtype).bits // 8
    return 2 * sum(cell.lens) * spec.num_kv_heads * spec.head_dim * item


def draw(spec: AttentionSpec, modes: list[str], seed: int, counts: dict, sms: int | None,
         phases: tuple[str, ...] = PHASES) -> dict:
    """(phase, mode) -> [(label, cell)] of ``spec``'s held-out cells."""
    cap = bench_cells.decode_token_cap(spec, bench.MAX_KV_BYTES)
    return {(phase, mode): [(cell.label(i + 1), cell) for i, cell in enumerate(
        bench_cells.sample_cells(spec, phase, mode, seed, counts[phase], sms, cap))]
        for phase in phases for mode in modes}


def evaluate_spec(spec: AttentionSpec, names: list[str], modes: list[str], seed: int, counts: dict,
                  device: torch.device, probe: dict, sms: int | None, repeats: int,
                  selections: list[dict], phases: tuple[str, ...] = PHASES, priority: dict | None = None,
                  timed: Callable[[list[bench.Cell], dict], None] | None = None
                  ) -> tuple[list[bench.Cell], dict, list[dict]]:
    """Time ``spec``'s held-out cells, select per mode (records appended to ``selections``) and compare: returns the
    timed cells, the validity checks and one comparison row per cell with a time (bench.compare's, plus the
    cell's lengths, batch size, each backend's time over the fastest, and under CUDA graphs whether its decode batch
    size is a timed one)."""
    drawn = draw(spec, modes, seed, counts, sms, phases)
    cells, checks, groups = bench.run_grid(
        spec, names, modes, False, device, probe, log.info, repeats,
        grid=lambda phase, mode: [(label, c.key, c.shape, _work(spec, c)) for label, c in drawn[(phase, mode)]],
        phases=phases)
    if timed is not None:  # the cells' times before the selection (minutes): a run cut short there keeps them
        timed(cells, checks)
    choices = bench.select_modes(spec, modes, device, selections, phases, priority)
    by_label = {(phase, mode, label): c for (phase, mode), items in drawn.items() for label, c in items}
    graph_batches = bench_cells.timed_batches(spec, "graph", sms)
    rows = []
    for phase, mode, label, key, row, runnable in groups:
        r = bench.compare(spec, phase, mode, label, key, row, runnable, choices.get(mode))
        cell = by_label[(phase, mode, label)]
        r.update(lens=list(cell.lens), batch=cell.batch, ragged=cell.ragged, q_lens=list(cell.q_lens),
                 ratios={c.backend: c.vs_best for c in row if c.vs_best})
        if phase == "decode" and mode == "graph":
            r["timed_batch"] = cell.batch in graph_batches
        rows.append(r)
    untimed = sum(map(len, drawn.values())) - len(groups)
    if untimed:
        log.warning("%s: %d held-out cell(s) without a time on any backend (left out)", spec.describe(), untimed)
    return cells, checks, rows


def sampler_settings() -> dict:
    c = bench_cells
    return {"prefill": {"seqs": [1, c.PREFILL_SEQS_MAX], "len": [c.PREFILL_LEN_MIN, c.PREFILL_LEN_MAX],
                        "token_cap": c.PREFILL_TOKEN_CAP, "ragged_share": c.RAGGED_SHARE},
            "decode": {"batch": [1, c.DECODE_BATCH_MAX], "context": [c.DECODE_CTX_MIN, c.DECODE_CTX_MAX],
                       "token_cap": c.DECODE_TOKEN_CAP, "ctx_median": c.CTX_MEDIAN, "ctx_sigma": c.CTX_SIGMA,
                       "row_sigma": c.ROW_SIGMA, "ragged_share": c.RAGGED_SHARE,
                       "graph_capture_sizes": list(c.CAPTURE_SIZES)},
            "bootstrap": {"resamples": bench_stats.BOOTSTRAP, "level": bench_stats.LEVEL}}


def summary_table(summary: list[dict], title: str) -> Table:
    """Every strategy over all specs (or the one spec), and the dispatch's own rows per spec."""
    table = Table(title=title, title_justify="left")
    for col in ("spec", "phase", "mode", "strategy", "cells", "within 3% [95% CI]", "geomean [95% CI]",
                "worst [95% CI]"):
        table.add_column(col, no_wrap=True)
    specs = {s["spec"] for s in summary}
    for s in summary:
        if s["spec"] == "all" or len(specs) == 1 or s["strategy"] == "selected":
            table.add_row(s["spec"], s["phase"], s["mode"], s["strategy"].replace("_", " "), str(s["timed"]),
                          bench_stats.fmt_share(s), bench_stats.fmt_ratio(s, "geomean"),
                          bench_stats.fmt_ratio(s, "worst"))
    return table


def markdown(summary: list[dict], header: str) -> str:
    lines = [header, "", "| spec | phase | mode | strategy | cells | within 3% [95% CI] | geomean [95% CI] | "
             "worst [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['spec']} | {s['phase']} | {s['mode']} | {s['strategy'].replace('_', ' ')} | {s['timed']} | "
                     f"{bench_stats.fmt_share(s)} | {bench_stats.fmt_ratio(s, 'geomean')} | "
                     f"{bench_stats.fmt_ratio(s, 'worst')} |")
    return "\n".join(lines)


def run_heldout(specs: list[AttentionSpec], names: list[str] | None, mode: str, out: str, seed: int, counts: dict,
                console: Console, repeats: int = 1, command: list[str] | None = None,
                phases: tuple[str, ...] = PHASES, priority: dict | None = None) -> int:
    """The held-out bench of ``specs`` in ``mode`` ("eager", "graph" or "both") with ``counts`` cells per phase
    ({"prefill": n, "decode": n}), drawn with ``seed``; ``command``: the CLI arguments, recorded; ``priority``: the
    selections' auto candidates (bench.select_modes). Needs a CUDA device (RuntimeError)."""
    device, names, modes, out_dir, probe = bench.setup(names, mode, out)
    sms = grid.device_sms(device)
    started = datetime.datetime.now(datetime.timezone.utc)
    meta = {"seed": seed, "cells_per_phase": counts, "specs": [s.to_dict() for s in specs], "modes": modes,
            "command": "attnsel " + shlex.join(command or []), "device": fingerprint(str(device)),
            "date": started.isoformat(timespec="seconds"), "sampler": sampler_settings()}
    cells, checks, rows, selections, summary = [], {}, [], [], []
    t0 = time.perf_counter()
    header = (f"# attnsel bench --heldout {seed} on {meta['device'].get('gpu')} ({started:%Y-%m-%d}), "
              f"{repeats} pass(es), " + ", ".join(f"{counts[p]} {p}" for p in phases) + " cells per spec and "
              f"mode\n\n`{meta['command']}`. Within 3%: share of cells where the strategy's pick is at most 1.03x "
              "the cell's fastest valid backend; intervals: 95% bootstrap over the cells. batch bound (graph "
              "decode): the best single backend per batch size, chosen afterwards from these cells' times.")

    def write(all_cells: list[bench.Cell], all_checks: dict) -> None:
        """heldout.md and .json as they stand: rewritten after each spec's cells are timed and after its
        selection, so a run cut short keeps what it did (a spec's cells without rows: timed, not yet judged)."""
        bench._write(out_dir / "heldout.md", markdown(summary, header) + "\n\n" +
                     bench.markdown(all_cells, probe, rows, bench.summarise(rows), "## Cells"))
        bench._write(out_dir / "heldout.json", json.dumps(
            {"heldout": meta, "probe": probe, "checks": all_checks, "cells": [dataclasses.asdict(c) for c in all_cells],
             "comparison": rows, "summary": summary, "selections": selections, "repeats": repeats,
             "wall_s": time.perf_counter() - t0}, indent=1))

    for spec in specs:
        key = json.dumps(spec.to_dict(), sort_keys=True)
        spec_cells, spec_checks, spec_rows = evaluate_spec(
            spec, names, modes, seed, counts, device, probe, sms, repeats, selections, phases, priority,
            timed=lambda timed_cells, timed_checks: write(cells + timed_cells, {**checks, key: timed_checks}))
        cells += spec_cells
        checks[key] = spec_checks
        rows += spec_rows
        bench_stats.batch_bound(rows)
        summary = bench_stats.summarise(rows, seed)
        write(cells, checks)
    console.print(summary_table(summary, f"attnsel bench --heldout {seed}: {len(rows)} cells, {len(specs)} spec(s), "
                                         f"{time.perf_counter() - t0:.0f} s on {meta['device'].get('gpu')}; time over "
                                         f"the cell's fastest; all rows in {out_dir / 'heldout.md'}"))
    return 0
