"""`attnsel report | select | bench | cache | serve`: exit 0 on success, 2 for bad input (attnsel's own errors), 3 when
a phase cannot be served (or no CUDA device for `bench`, `--mode graph`), 1 when stdout cannot take the output."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys

from rich.console import Console, Group
from rich.logging import RichHandler
from rich.table import Table
from rich.text import Text

from . import __version__, backends, errors, serve, settings
from .backends import UnknownBackendError
from .cache import ResultCache
from .selection import AUTO, DEFAULT_PRIORITY, MODES, POLICIES, Selection, SelectionError, select
from .spec import DTYPES, KV_DTYPES, AttentionSpec, LayerKind, SpecError, layer_specs, short_dtype_name
from .validate import timing

log = logging.getLogger("attnsel")
# AttentionSpec field -> its flag; -> its argparse dest
FIELD_FLAGS = {"num_q_heads": "--num-heads", "num_kv_heads": "--num-kv-heads", "head_dim": "--head-dim",
               "dtype": "--dtype", "page_size": "--page-size", "sliding_window": "--sliding-window",
               "softcap": "--softcap", "sinks": "--sinks", "kv_dtype": "--kv-dtype", "softmax_scale": "--softmax-scale"}
FIELD_DESTS = {"num_q_heads": "num_heads", "num_kv_heads": "num_kv_heads", "head_dim": "head_dim", "dtype": "dtype",
               "page_size": "page_size", "sliding_window": "sliding_window", "softcap": "softcap", "sinks": "sinks",
               "kv_dtype": "kv_dtype", "softmax_scale": "softmax_scale"}
BACKEND_FLAGS = {"prefill": "--llm_prefill_att_backend", "decode": "--llm_decode_att_backend"}
EXIT_OUTPUT, EXIT_USAGE, EXIT_UNSERVED = 1, 2, 3  # 1: stdout could not take the output
LayerSpecs = list[tuple[LayerKind, AttentionSpec, list[int]]]


class UsageError(errors.AttnselError, ValueError):
    """A flag's value the command refuses (exit 2)."""


class CannotRun(errors.AttnselError, RuntimeError):
    """The input is fine but this machine cannot do it (exit 3): `bench` or `--mode graph` without a CUDA device."""


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model attention shape (from --config, flags override)")
    g.add_argument("--config", metavar="PATH", help="Hugging Face config.json of the model, or its directory")
    g.add_argument("--num-heads", type=int, help="query heads (num_attention_heads)")
    g.add_argument("--num-kv-heads", type=int, help="key/value heads (num_key_value_heads); default: --num-heads")
    g.add_argument("--head-dim", type=int, help="head dimension")
    g.add_argument("--dtype", type=short_dtype_name, choices=list(DTYPES),
                   help="activation dtype (default bf16; bfloat16, float16/half, float32/float also accepted)")
    g.add_argument("--page-size", type=int, help="tokens per KV-cache page (default 16)")
    g.add_argument("--sliding-window", type=int, metavar="W", help="every layer attends to its last W keys")
    g.add_argument("--softcap", type=float, metavar="C", help="logit softcap: scores -> C*tanh(scores/C)")
    g.add_argument("--sinks", action=argparse.BooleanOptionalAction, default=None,
                   help="the layers have learned per-head attention sinks (gpt-oss)")
    g.add_argument("--kv-dtype", choices=list(KV_DTYPES), help="paged KV-cache dtype (default: --dtype)")
    g.add_argument("--softmax-scale", type=float, metavar="S", help="softmax scale (default 1/sqrt(head_dim))")


def add_selection_args(p: argparse.ArgumentParser) -> None:
    opt_in = [n for n in backends.BUILTINS if not any(n in DEFAULT_PRIORITY[ph] for ph in DEFAULT_PRIORITY)]
    g = p.add_argument_group("selection", f"built-in backends: {', '.join(backends.BUILTINS)}. 'auto' "
                                          f"tries all but {', '.join(opt_in)} (opt-in: name them in "
                                          "--prefill-priority/--decode-priority or as the backend). Plugins from "
                                          "$ATTNSEL_BACKENDS or entry points add theirs; `attnsel report` shows the "
                                          "candidates of a selection")
    g.add_argument("--llm_prefill_att_backend", "--prefill-backend", dest="prefill",
                   help="'auto' (default; $ATTNSEL_PREFILL_BACKEND) or a backend name")
    g.add_argument("--llm_decode_att_backend", "--decode-backend", dest="decode",
                   help="'auto' (default; $ATTNSEL_DECODE_BACKEND) or a backend name")
    g.add_argument("--policy", choices=POLICIES, default="measure",
                   help="auto: time valid candidates (measure, default) or take the first valid (priority)")
    g.add_argument("--mode", choices=MODES, default="eager",
                   help="how the engine launches kernels, for timing: eager or CUDA graph replays")
    g.add_argument("--prefill-priority", type=_names, metavar="A,B,...", help="auto candidates for prefill, in order")
    g.add_argument("--decode-priority", type=_names, metavar="A,B,...", help="auto candidates for decode, in order")
    g.add_argument("--timeout", type=float, metavar="S",
                   help="seconds per candidate in the validation worker (default $ATTNSEL_VALIDATION_TIMEOUT or 600)")
    g.add_argument("--device", help="torch device to validate on (default: cuda if present, else cpu)")
    add_cache_dir_arg(g)
    g.add_argument("--no-cache", action="store_true", help="neither read nor write the result cache")


def add_cache_dir_arg(p) -> None:
    p.add_argument("--cache-dir", metavar="DIR", help="result cache directory (default $ATTNSEL_CACHE_DIR or the "
                                                      "user cache dir)")


def _given(args: argparse.Namespace) -> dict:
    """The spec fields given as flags."""
    return {f: getattr(args, d) for f, d in FIELD_DESTS.items() if getattr(args, d, None) is not None}


def _named(exc: SpecError, given: dict, from_config: bool) -> SpecError:
    """The error in the words of what the user typed: a flag for a flag, "the config's X" for a config value; a
    config value that a flag could replace says which flag."""
    msg = str(exc)
    if msg.startswith("config:"):
        if exc.field in FIELD_FLAGS:
            msg += f" ({FIELD_FLAGS[exc.field]} overrides it)"
    else:
        for field, flag in FIELD_FLAGS.items():
            msg = re.sub(rf"\b{field}\b", f"the config's {field}" if from_config and field not in given else flag,
                         msg)
        # "must be None or ..." is Python's wording: on a command line, None is leaving the flag out
        msg = re.sub(r"^(--[a-z-]+) must be None or (.*?), got (.*)$", r"\1 must be \2 (leave the flag out for none),"
                     r" got \3", msg)
        msg = re.sub(r"^(--[a-z-]+) must be (.*?) or None, got (.*)$", r"\1 must be \2 (leave the flag out for the"
                     r" default), got \3", msg)
    return SpecError(msg, exc.field)


def layer_specs_from_args(args: argparse.Namespace) -> LayerSpecs:
    """One (kind, spec, layer indices) per distinct layer kind of --config, flags overriding it in every layer;
    flags alone give one kind."""
    given = _given(args)
    window = getattr(args, "sliding_window", None)
    if window is not None and window < 1:  # the spec's own message says None, which no command line can pass
        raise UsageError(f"--sliding-window must be a positive number of tokens (leave the flag out for no window), "
                         f"got {window}")
    if args.config:
        try:
            return layer_specs(args.config, **given)
        except SpecError as exc:
            raise _named(exc, given, True) from None
    missing = [FIELD_FLAGS[f] for f in ("num_q_heads", "head_dim") if f not in given]
    if missing:
        raise UsageError(f"missing {', '.join(missing)}: give --config PATH or --num-heads, --num-kv-heads, "
                         "--head-dim")
    try:
        spec = AttentionSpec(**{"num_kv_heads": given["num_q_heads"], **given})
    except SpecError as exc:
        raise _named(exc, given, False) from None
    return [("sliding_attention" if spec.sliding_window else "full_attention", spec, [])]


def spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    """The one spec of the flags / --config; SpecError when the config's layers differ (see layer_specs_from_args)."""
    kinds = layer_specs_from_args(args)
    if len(kinds) > 1:
        raise SpecError(f"{args.config}: layers differ ({', '.join(_label(k, ls) for k, _, ls in kinds)}); this "
                        "command takes one attention shape: give --sliding-window W to use one window for every "
                        "layer, or the shape flags without --config")
    return kinds[0][1]


def _backend_choice(args: argparse.Namespace, phase: str) -> tuple[str, str]:
    """(value, where it came from in words): the flag, else the environment variable, else auto."""
    flag = BACKEND_FLAGS[phase]
    value = getattr(args, phase)
    if value is not None:
        alias = f"--{phase}-backend"  # argparse takes unambiguous prefixes too: name the flag they stand for
        typed = [f for a in getattr(args, "argv", []) if a.startswith("--") and len(a.split("=", 1)[0]) > 2
                 for f in (flag, alias) if f.startswith(a.split("=", 1)[0])]
        return value, (typed[-1] if typed else flag)  # the last one given wins in argparse
    env, value = settings.ENV[f"{phase}_backend"], settings.read(f"{phase}_backend")
    if value != AUTO:
        return value, f"{env}={value} (environment variable)"
    return AUTO, flag


def _check_backend_choice(where: str, value: str, allow_auto: bool = True) -> None:
    """UnknownBackendError naming ``where`` (a flag or an environment variable) when value is not a backend."""
    valid = ([AUTO] if allow_auto else []) + backends.names()
    if value not in valid:
        raise UnknownBackendError(f"{where}: unknown backend {value!r}; valid: {', '.join(valid)}")


def check_backend_args(args: argparse.Namespace) -> None:
    """Resolve --llm_*_att_backend from the environment and check every backend name given, naming its source."""
    for phase in ("prefill", "decode"):
        value, where = _backend_choice(args, phase)
        _check_backend_choice(where, value)
        setattr(args, phase, value)
        for name in getattr(args, f"{phase}_priority") or ():
            _check_backend_choice(f"--{phase}-priority", name, allow_auto=False)


def run_selection(args: argparse.Namespace, spec: AttentionSpec | None = None) -> Selection:
    spec = spec if spec is not None else spec_from_args(args)
    check_backend_args(args)
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.mode == "graph" and not str(device).startswith("cuda"):
        raise CannotRun(f"--mode graph times CUDA-graph replays and needs a CUDA device; the device is {device} "
                        "(use --mode eager)")
    return select(spec, args.prefill, args.decode, policy=args.policy, mode=args.mode,
                  prefill_priority=args.prefill_priority, decode_priority=args.decode_priority, timeout=args.timeout,
                  cache_dir=args.cache_dir, use_cache=not args.no_cache, device=args.device)


def _label(kind: str, layers: list[int]) -> str:
    return f"{kind} ({len(layers)} layers)" if layers else kind


def _select_each(args: argparse.Namespace, kinds: LayerSpecs) -> list[Selection | SelectionError]:
    """The selection of every layer kind, or why it cannot be served (also printed on stderr)."""
    err = Console(stderr=True)
    results = []
    for kind, spec, layers in kinds:
        try:
            results.append(run_selection(args, spec))
        except SelectionError as exc:
            where = f" {_label(kind, layers)}" if len(kinds) > 1 else ""
            err.print(f"attnsel: cannot serve{where}: {exc}", markup=False, highlight=False, soft_wrap=True)
            results.append(exc)
    return results


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
    if table.ragged is None and ragged_cut:  # every ragged bucket was skipped: say that the uniform ones serve
        skipped += f" ({len(ragged_cut)} of them ragged: no ragged table, ragged batches take the uniform buckets)"
    slow = sum(1 for b in table.buckets + (table.ragged.buckets if table.ragged is not None else ())
               if b.host is not None and b.host >= timing.HOST_SLOW)
    if slow:  # the host's speed moves (timing's module doc): say how much of the table was timed on a slow one
        skipped += (f"; {slow} bucket(s) timed while the host was slow (launches >= {timing.HOST_SLOW:g}x the "
                    f"phase's lower decile)")
    if table.ragged is not None:  # its buckets are listed after the uniform ones, labelled "ragged ..."
        cut = f", {len(table.ragged.skipped)} skipped for the time budget" if table.ragged.skipped else ""
        skipped += (f"; ragged batches (longest row >= {timing.RAGGED_SKEW:g}x the mean): "
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
    for phase in ("prefill", "decode"):
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


def _json_text(data) -> str:
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


def cmd_report(args: argparse.Namespace, out: Console) -> int:
    """The report of every layer kind; a kind that cannot be served still shows what was found (exit 3)."""
    kinds = layer_specs_from_args(args)
    results = _select_each(args, kinds)
    code = EXIT_UNSERVED if any(isinstance(r, SelectionError) for r in results) else 0
    found = [r.selection if isinstance(r, SelectionError) else r for r in results]  # partial selections too
    for sel in filter(None, found):  # long reasons (stack tails) in full, once, in the log
        for phase, cands in sel.candidates.items():
            for c in cands:
                if "\n" in c.reason.strip():
                    log.info("%s %s, full reason:\n%s", c.name, phase, c.reason.strip())
    if args.json:
        if len(kinds) == 1:  # one kind: the object of one selection, as always
            if found[0] is not None:
                print(_json_text(report_json(found[0])))
            return code
        print(_json_text({"layer_kinds": [
            {"kind": kind, "layers": layers, "spec": spec.to_dict(),
             **({"error": str(res)} if isinstance(res, SelectionError) else {}),
             **({"selection": report_json(sel)} if sel is not None else {})}
            for (kind, spec, layers), res, sel in zip(kinds, results, found)]}))
        return code
    out = Console()  # fits the terminal (80 columns when not a terminal and COLUMNS is unset)
    for (kind, _, layers), res, sel in zip(kinds, results, found):
        if len(kinds) > 1:
            out.print(f"\n[bold]{_label(kind, layers)}[/]: layers {serve.layer_ranges(layers)}")
        if sel is not None:
            print_report(sel, args, out)
        if isinstance(res, SelectionError) and len(kinds) > 1:
            out.print(f"cannot be served: {res}", markup=False)
    return code


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
    for phase in sel.phases:
        out.print(choice_line(sel, phase), highlight=False, markup=False, soft_wrap=True)


def cmd_select(args: argparse.Namespace, out: Console) -> int:
    kinds = layer_specs_from_args(args)
    results = _select_each(args, kinds)
    for (kind, _, layers), res in zip(kinds, results):
        prefix = f"{_label(kind, layers)}: " if len(kinds) > 1 else ""
        if not isinstance(res, SelectionError):
            for phase in res.phases:
                print(prefix + choice_line(res, phase))
    return EXIT_UNSERVED if any(isinstance(r, SelectionError) for r in results) else 0


def cmd_cache(args: argparse.Namespace, out: Console) -> int:
    cache = ResultCache(args.cache_dir)
    if args.action == "path":
        print(cache.path)
    elif args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.path}")
    else:
        cache.check_file()  # a directory in its place: exit 2 as for select and clear (not "0 entries")
        entries = cache.entries()
        table = Table(title=f"{cache.path}: {len(entries)} entries")
        for col in ("key", "backend", "phase", "status", "device", "spec", "timed modes"):
            table.add_column(col, overflow="fold")
        for key, e in sorted(entries.items(), key=lambda ke: (str(ke[1].get("spec")), str(ke[1].get("backend")))):
            table.add_row(key[:8], str(e.get("backend", "?")), str(e.get("phase", "?")), str(e.get("status", "?")),
                          str(e.get("device")), _spec_label(e.get("spec", {})),
                          ",".join(map(str, e.get("timings") or {})))
        out.print(table)
        out.print("key: the entry's hash of (device fingerprint, spec, backend identity, phase): entries alike but "
                  "for the key were made under other package versions or attnsel sources; only those matching this "
                  "machine are used.", highlight=False)
    return 0


def _spec_label(spec: dict) -> str:
    """A cached entry's spec in words (every field, features included); the raw dict where it does not parse."""
    try:
        return AttentionSpec.from_dict(spec).describe()
    except (SpecError, TypeError, ValueError):
        return str(spec)


def cmd_bench(args: argparse.Namespace, out: Console) -> int:
    import torch

    from .bench import run_bench

    if any(getattr(args, f) is not None for f in ("config", "num_heads", "head_dim")):
        spec_from_args(args)  # bad input is exit 2 on any machine
    for name in args.backends or ():
        _check_backend_choice("--backends", name, allow_auto=False)
    if args.repeats < 1:
        raise UsageError(f"--repeats must be a whole number of passes, at least 1; got {args.repeats}")
    if not torch.cuda.is_available():
        raise CannotRun("attnsel bench times kernels on a CUDA device; none was found")
    given = any(getattr(args, f) is not None for f in ("config", "num_heads", "head_dim"))
    return run_bench(spec_from_args(args) if given else None, args.backends, args.mode, args.out, args.quick,
                     Console(), args.repeats)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnsel", description=__doc__)
    parser.add_argument("--version", action="version", version=f"attnsel {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("report", help="validate and select backends, then show every backend x phase")
    add_spec_args(p)
    add_selection_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("select", help="validate and select backends; print the two choices")
    add_spec_args(p)
    add_selection_args(p)
    p.set_defaults(func=cmd_select)
    p = sub.add_parser("bench", help="time every valid backend over a grid of shapes (needs CUDA)")
    add_spec_args(p)
    p.add_argument("--backends", type=_names, metavar="A,B,...", help="backends to time (default: all available)")
    p.add_argument("--mode", choices=(*MODES, "both"), default="both", help="eager launches, CUDA graphs, or both")
    p.add_argument("--out", metavar="DIR", default="bench-out", help="where to write the table and plot")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="time the whole grid N times; a cell's time is the median over the passes, and the summary "
                        "adds how often the first pass's fastest stays within 3%% in the later ones (default 1)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("cache", help="show, locate or clear the result cache")
    p.add_argument("action", choices=("show", "path", "clear"))
    add_cache_dir_arg(p)
    p.set_defaults(func=cmd_cache)
    p = sub.add_parser("serve", help="serve a model with transformers' OpenAI-compatible server on attnsel")
    serve.add_serve_args(p)
    add_selection_args(p)
    p.set_defaults(func=serve.cmd_serve)
    for p in sub.choices.values():  # -q after the subcommand too (SUPPRESS: absent there keeps the main default)
        p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="only warnings and errors on stderr")
        p.set_defaults(parser=p)  # main() names a flag the command does not take with this parser's usage
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # which spelling of a flag the user typed, for errors
    if unknown:  # named by the command's own parser, with its usage (the top-level usage lists no command's flags)
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    err = Console(stderr=True)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=err, show_path=False, show_time=False)], force=True)
    stdout = sys.stdout
    if stdout is not None:  # None: started with stdout closed (`>&-`); print() and rich write nothing then
        sys.stdout = _MarkedStdout(stdout)
    try:
        settings.Settings.from_env()  # every ATTNSEL_* variable, whatever the command reads
        result = args.func(args, Console())
        if sys.stdout is not None:
            sys.stdout.flush()  # a full disk shows here for output still buffered
        return result
    except (SelectionError, CannotRun) as exc:
        what = "cannot serve" if isinstance(exc, SelectionError) else "cannot run"
        err.print(f"attnsel: {what}: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_UNSERVED
    except errors.AttnselError as exc:  # SpecError, UnknownBackendError, SettingsError, ...: bad input; any other
        err.print(f"attnsel: error: {exc}", markup=False, highlight=False, soft_wrap=True)  # error is a bug: traceback
        return EXIT_USAGE
    except BrokenPipeError as pipe:  # the reader of stdout went away (`attnsel cache path | head -0`; rich's
        # tables handle it themselves: exit 1): no traceback, the shell's status for SIGPIPE
        try:
            fd = sys.stdout.fileno()
        except (OSError, ValueError):  # not a real stdout (main() called from Python): not ours to handle
            raise pipe from None
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)  # Python's flush of stdout at exit would raise again
        return 128 + 13
    except StdoutError as exc:  # `attnsel cache path > /dev/full`: ENOSPC
        err.print(f"attnsel: error: cannot write the output to stdout: {exc.strerror or exc}", markup=False,
                  highlight=False, soft_wrap=True)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit would raise again
        except (OSError, ValueError):  # not a real stdout (main() called from Python)
            pass
        return EXIT_OUTPUT
    finally:
        sys.stdout = stdout


class StdoutError(OSError):
    """Writing the command's output to stdout failed (full disk, I/O error); a closed pipe stays BrokenPipeError."""


class _MarkedStdout:
    """sys.stdout while a command runs: an OSError from writing or flushing it becomes StdoutError, so that main()
    can tell it from the command's own OS errors (those keep their tracebacks)."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return self._marked(self._stream.write, text)

    def flush(self) -> None:
        self._marked(self._stream.flush)

    @staticmethod
    def _marked(call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutError(exc.errno, exc.strerror) from exc


if __name__ == "__main__":
    sys.exit(main())
