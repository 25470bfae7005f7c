"""What `attnsel report` and `attnsel select` print: the candidates table, the dispatch tables, the choice lines
and the JSON report."""
from __future__ import annotations

import argparse
import json
import math

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from . import backends
from .cache import ResultCache
from .selection import Selection
from .validate.grid import RAGGED_SKEW
from .validate.host_probe import HOST_SLOW


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


WIDE = 120  # from this terminal width on, the candidates table shows every column
STYLES = {"selected": "bold green", "valid": "green", "rejected": "red", "unavailable": "yellow"}


def one_line(reason: str, limit: int = 160) -> str:
    """A reason's one-line summary for a table cell: its first line (a stack trace's last line names the error);
    the full text stays in --json and the log."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0]
    if len(lines) > 1:
        text += f" (+{len(lines) - 1} lines: --json)"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _time_note(sel: Selection, wide: bool) -> str:
    """The legend of what the report shows: the time columns when a phase was timed (a phase with one valid
    candidate is not), the check time in the wide layout, the dispatch tables when there are any."""
    timed = [c.score_us is not None for cands in sel.candidates.values() for c in cands
             if c.status in ("valid", "selected")]
    parts = []
    if any(timed):
        where = "inputs read from HBM" if sel.device.get("gpu") else "on the CPU"
        parts.append(f"{sel.mode} us: time per call, geometric mean over the phase's timed buckets (each the median of "
                     f"interleaved samples, {where}); vs best: over the fastest candidate's.")
    if not all(timed):
        parts.append(f"A blank {sel.mode} us: not timed (a phase with one valid candidate, an explicit backend or "
                     "policy priority).")
    if wide:
        parts.append("check s: validation wall time.")
    if any(t is not None for t in sel.dispatch.values()):
        parts.append("Dispatch tables: us/call of the bucket's backend, spread (max - min) / median of its samples, "
                     "x: the runner-up's time over it. Shapes between timed buckets take the backend with the least "
                     "slowdown interpolated from the buckets around them (possibly one that wins no bucket).")
    return " ".join(parts)


def _cut(text: str, room: int) -> str:
    return text if len(text) <= room else text[:max(1, room - 1)] + "…"


def report_table(sel: Selection, width: int = 80) -> Group:
    """Every backend x phase: status, error vs tolerance, time, one-line reason; fits ``width`` columns. From WIDE
    columns on: one table with every column, the reason wrapped in the room left. Narrower: one table per phase
    without the check time, each reason below it, wrapped at the width (a reason's first line is never cut; a
    multi-line reason, e.g. a stack, is summarised by its first line). Full reasons: --json, the log."""
    wide = width >= WIDE
    head = Text(f"attnsel on {sel.device.get('gpu') or 'CPU'}: {sel.spec.describe()}", style="bold")
    cols = (["phase"] if wide else []) + ["backend", "status"]
    cols += (["max err", "tolerance", "check s"] if wide else ["err/tol"]) + [f"{sel.mode} us", "vs best"]
    parts: list = [head]
    rows_by_phase = {}
    for phase, cands in sel.candidates.items():
        scores = [c.score_us for c in cands if c.score_us]
        best = min(scores) if scores else None
        rows = []
        for c in cands:
            ratio = f"{c.score_us / best:.2f}x" if best and c.score_us else ""
            err = ([_fmt(c.max_abs_err, ".1e"), _fmt(c.tolerance, ".1e"), _fmt(c.time_s, ".1f")] if wide else
                   [f"{c.max_abs_err:.0e}/{c.tolerance:.0e}" if c.max_abs_err is not None and c.tolerance else ""])
            reason = one_line(c.reason, limit=10_000) + (" (cached)" if c.from_cache and c.status == "rejected" else "")
            rows.append(([phase] if wide else []) + [c.name, c.status, *err, _fmt(c.score_us, ".1f"), ratio, reason])
        rows_by_phase[phase] = rows
    all_rows = [r for rows in rows_by_phase.values() for r in rows]
    widths = [max([len(col)] + [len(r[i]) for r in all_rows]) for i, col in enumerate(cols)]
    status_col = cols.index("status")

    def table(rows: list, title: str | None, with_reason: bool) -> Table:
        out = Table(title=title, title_justify="left")
        for col, w in zip(cols, widths):
            out.add_column(col, no_wrap=True, min_width=w)
        room = max(12, width - sum(w + 3 for w in widths) - 4)  # 3 per column (padding, border), 4: the last
        if with_reason:
            out.add_column("reason", overflow="fold", max_width=room)  # the summary wraps in its cell, never cut
        for r in rows:
            cells = list(r[:len(cols)])
            cells[status_col] = f"[{STYLES[r[status_col]]}]{r[status_col]}[/]"
            out.add_row(*cells, *([r[-1]] if with_reason else []))
        return out

    if wide:
        parts.append(table(all_rows, None, True))
    else:
        for phase, rows in rows_by_phase.items():
            parts.append(table(rows, f"{phase} candidates", False))
            reasons = Table.grid(padding=(0, 1))  # name | reason: a reason wraps under itself, never under the name
            reasons.add_column(no_wrap=True)
            reasons.add_column(overflow="fold")
            for r in rows:
                if r[-1]:
                    reasons.add_row(f"  {r[0]}:", Text(r[-1]))
            if reasons.row_count:
                parts.append(reasons)
    return Group(*parts)


def dispatch_table(sel: Selection, phase: str, width: int = 80) -> Table | None:
    """The phase's dispatch table: per bucket the backend, its time and spread, the runner-up and the ratio. Fits
    ``width`` columns: long bucket labels and backend names are cut (in full in --json)."""
    table = sel.dispatch.get(phase)
    if table is None:
        return None
    axes = ", ".join(table.axes)
    skipped = f"; {len(table.skipped)} bucket(s) skipped for the time budget" if table.skipped else ""
    if table.pruned:
        skipped += "; not timed on the finer grid (slower on every coarse bucket): " + ", ".join(
            f"{n} (>= {r:.2f}x)" for n, r in table.pruned)
    def wins(t) -> str:
        return ", ".join(f"{n} {k}" for n, k in sorted(t.wins().items(), key=lambda kv: -kv[1]))

    ragged_cut = [x for x in table.skipped if x.startswith("ragged ")]
    if table.mode == "eager" and table.ragged is None and ragged_cut:  # every ragged bucket was skipped: say
        # that the uniform ones serve (graph tables have no sub-table: a ragged batch counts in its batch size)
        skipped += f" ({len(ragged_cut)} of them ragged: no ragged table, ragged batches take the uniform buckets)"
    slow = sum(1 for b in table.buckets + (table.ragged.buckets if table.ragged is not None else ())
               if b.host is not None and b.host >= HOST_SLOW)
    if slow:  # the host's speed moves (timing's module doc): say how much of the table was timed on a slow one
        skipped += (f"; {slow} bucket(s) timed while the host was slow (launches >= {HOST_SLOW:g}x the "
                    f"phase's lower decile)")
    if table.ragged is not None:  # its buckets are listed after the uniform ones, labelled "ragged ..."
        cut = f", {len(table.ragged.skipped)} skipped for the time budget" if table.ragged.skipped else ""
        skipped += (f"; ragged batches (longest row >= {RAGGED_SKEW:g}x the mean): "
                    f"{len(table.ragged.buckets)} bucket(s){cut}, wins: {wins(table.ragged)}")
    out = Table(title=f"{phase} dispatch, {sel.mode}: buckets over {axes}; wins: {wins(table)}{skipped}",
                title_justify="left")
    rows = []
    for b in table.buckets + (table.ragged.buckets if table.ragged is not None else ()):
        spread = b.spread.get(b.backend)
        rows.append([b.label, b.backend, f"{b.us:.1f}", f"{spread:.0%}" if spread is not None else "",
                     f"{b.ratio:.2f}x" if b.ratio else "", b.runner_up or ""])
    heads = ["bucket", "backend", "us/call", "spread", "x", "runner-up"]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(heads)]
    room = width - 3 * len(heads) - 1 - sum(widths[2:5])  # for bucket, backend and runner-up
    if sum(widths[i] for i in (0, 1, 5)) > room:
        name_w = max(10, min(max(widths[1], widths[5]), (room - min(widths[0], 14)) // 2))
        widths[1] = widths[5] = min(name_w, max(widths[1], widths[5]))
        widths[0] = max(8, room - widths[1] - widths[5])
    for i, h in enumerate(heads):
        out.add_column(h, no_wrap=True, justify="right" if 2 <= i <= 4 else "left", width=widths[i])
    for r in rows:
        out.add_row(*(_cut(cell, widths[i]) for i, cell in enumerate(r)))
    return out


def choice_line(sel: Selection, phase: str) -> str:
    """'prefill: fa3 (auto)'; with a dispatch table, the backends it uses; or why the phase cannot be served."""
    choice = sel.phases[phase]
    if not choice.backend:
        return f"{phase}: cannot be served: {one_line(choice.error)}"
    line = f"{phase}: {choice.backend} ({choice.source})"
    if choice.table and len(choice.table.wins()) > 1:
        line += f", dispatch over {len(choice.table.buckets)} buckets ({len(choice.table.wins())} backends)"
    return line


def report_json(sel: Selection) -> dict:
    out = sel.to_json()
    for phase in sel.phases:
        out[phase]["candidates"] = [
            {k: c[k] for k in ("name", "status", "reason", "max_abs_err", "tolerance", "time_s", "score_us",
                               "timings_us", "from_cache")} for c in out[phase]["candidates"]]
    out["backend_extras"] = _backend_extras(sel)
    out["time_units"] = {"score_us": f"{sel.mode} us per call, geometric mean over the phase's timed buckets",
                         "dispatch.buckets.us": f"{sel.mode} us per call, median of interleaved samples",
                         "dispatch.buckets.host": "the host's launch time while the bucket was timed over the "
                                                  "phase's lower decile (eager on CUDA; null otherwise)",
                         "time_s": "validation wall time in seconds"}
    return out


def _backend_extras(sel: Selection) -> dict[str, dict]:
    """Facts each available candidate reports about itself (e.g. FlashInfer's JIT cache directory), by name."""
    extras = {}
    for name in dict.fromkeys(c.name for cands in sel.candidates.values() for c in cands if c.status != "unavailable"):
        facts = backends.report_extras(backends.get(name))
        if facts:
            extras[name] = facts
    return extras


def json_text(data) -> str:
    """Strict JSON (indented): NaN and infinities, which json.dumps would write as NaN/Infinity, become null."""
    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(data), indent=2, allow_nan=False)

def print_report(sel: Selection, args: argparse.Namespace, out: Console) -> None:
    """The tables of one selection (candidates, dispatch per phase) and the lines under it, ending with the
    choices."""
    out.print(report_table(sel, out.width))
    out.print(_time_note(sel, out.width >= WIDE), soft_wrap=False)
    for phase in sel.phases:
        table = dispatch_table(sel, phase, out.width)
        if table is not None:
            out.print(table)
    stats = sel.stats
    cache_where = "" if sel.cache == "off" else f" ({ResultCache(args.cache_dir).path})"
    out.print(f"cache: {sel.cache}{cache_where}", highlight=False)
    mem = f", peak GPU memory {stats['worker_peak_gpu_mem_mb']:.0f} MiB" if stats["worker_peak_gpu_mem_mb"] else ""
    rss = f", peak RSS {stats['worker_peak_rss_mb']:.0f} MiB" if stats["worker_peak_rss_mb"] else ""
    timed = f", timing {stats['timing_wall_s']:.1f} s" if stats.get("timing_wall_s") else ""
    out.print(f"validation worker: {stats['spawns']} spawn(s), {stats['deaths']} death(s), "
              f"{stats['worker_wall_s']:.1f} s{timed}{rss}{mem}", highlight=False)
    for name, facts in _backend_extras(sel).items():
        out.print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in facts.items()), highlight=False, soft_wrap=True)
    if sel.canary is not None:
        out.print(sel.canary.summary(), highlight=False, markup=False, soft_wrap=True)
    for phase in sel.phases:
        out.print(choice_line(sel, phase), highlight=False, markup=False, soft_wrap=True)
