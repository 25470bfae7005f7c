"""`attnsel report | select | bench | cache | serve`: exit 0 on success, 2 for bad input, 3 when a phase cannot be
served."""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import sys

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from . import backends, serve
from .backends import UnknownBackendError
from .cache import ResultCache
from .selection import AUTO, MODES, POLICIES, Selection, SelectionError, select
from .spec import DTYPES, AttentionSpec, SpecError, hf_fields, load_config_file

log = logging.getLogger("attnsel")
FIELD_FLAGS = {"num_q_heads": "--num-heads", "num_kv_heads": "--num-kv-heads", "head_dim": "--head-dim",
               "dtype": "--dtype", "page_size": "--page-size"}
EXIT_USAGE, EXIT_UNSERVED = 2, 3


class UsageError(ValueError):
    pass


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model attention shape (from --config, flags override)")
    g.add_argument("--config", metavar="PATH", help="Hugging Face config.json of the model")
    g.add_argument("--num-heads", type=int, help="query heads (num_attention_heads)")
    g.add_argument("--num-kv-heads", type=int, help="key/value heads (num_key_value_heads); default: --num-heads")
    g.add_argument("--head-dim", type=int, help="head dimension")
    g.add_argument("--dtype", choices=list(DTYPES), help="activation dtype (default bf16)")
    g.add_argument("--page-size", type=int, help="tokens per KV-cache page (default 16)")


def add_selection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("selection")
    g.add_argument("--llm_prefill_att_backend", "--prefill-backend", dest="prefill",
                   default=os.environ.get("ATTNSEL_PREFILL_BACKEND", AUTO),
                   help="'auto' (default; $ATTNSEL_PREFILL_BACKEND) or a backend name")
    g.add_argument("--llm_decode_att_backend", "--decode-backend", dest="decode",
                   default=os.environ.get("ATTNSEL_DECODE_BACKEND", AUTO),
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


def spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    fields: dict = {}
    if args.config:
        fields.update(hf_fields(load_config_file(args.config)))
    flags = {"num_q_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
             "dtype": args.dtype, "page_size": args.page_size}
    fields.update({k: v for k, v in flags.items() if v is not None})
    if "num_kv_heads" not in fields and "num_q_heads" in fields:
        fields["num_kv_heads"] = fields["num_q_heads"]
    missing = [FIELD_FLAGS[f] for f in ("num_q_heads", "head_dim") if f not in fields]
    if missing:
        raise UsageError(f"missing {', '.join(missing)}: give --config PATH or --num-heads, --num-kv-heads, "
                         "--head-dim")
    try:
        return AttentionSpec(**fields)
    except SpecError as exc:
        msg = str(exc)
        for field, flag in FIELD_FLAGS.items():  # name what the user typed (or what --config supplied)
            msg = re.sub(rf"\b{field}\b", f"{flag}", msg)
        raise SpecError(msg) from None


def _check_backend_choice(flag: str, value: str) -> None:
    if value != AUTO and value not in backends.names():
        raise UnknownBackendError(f"{flag}: unknown backend {value!r}; valid: {AUTO}, {', '.join(backends.names())}")


def run_selection(args: argparse.Namespace) -> Selection:
    spec = spec_from_args(args)
    _check_backend_choice("--llm_prefill_att_backend", args.prefill)
    _check_backend_choice("--llm_decode_att_backend", args.decode)
    return select(spec, args.prefill, args.decode, policy=args.policy, mode=args.mode,
                  prefill_priority=args.prefill_priority, decode_priority=args.decode_priority, timeout=args.timeout,
                  cache_dir=args.cache_dir, use_cache=not args.no_cache, device=args.device)


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def report_table(sel: Selection) -> Table:
    table = Table(title=f"attnsel on {sel.device.get('gpu') or 'CPU'}: {sel.spec.describe()}")
    for col in ("phase", "backend", "status", "max err", "tolerance", "valid. s", f"{sel.mode} score us",
                "vs best", "reason"):
        table.add_column(col, overflow="fold")
    styles = {"selected": "bold green", "valid": "green", "rejected": "red", "unavailable": "yellow"}
    for phase, cands in sel.candidates.items():
        scores = [c.score_us for c in cands if c.score_us]
        best = min(scores) if scores else None
        for c in cands:
            ratio = f"{c.score_us / best:.2f}x" if best and c.score_us else ""
            table.add_row(phase, c.name, f"[{styles[c.status]}]{c.status}[/]", _fmt(c.max_abs_err, ".2e"),
                          _fmt(c.tolerance, ".2e"), _fmt(c.time_s, ".2f"), _fmt(c.score_us, ".1f"), ratio,
                          c.reason + (" (cached)" if c.from_cache and c.status in ("rejected",) else ""))
    return table


def report_json(sel: Selection) -> dict:
    out = sel.to_json()
    for phase in ("prefill", "decode"):
        out[phase]["candidates"] = [
            {k: c[k] for k in ("name", "status", "reason", "max_abs_err", "tolerance", "time_s", "score_us",
                               "timings_us", "from_cache")} for c in out[phase]["candidates"]]
    out["device"] = {**out["device"], "flashinfer_jit_dir": _flashinfer_jit_dir()}
    return out


def _flashinfer_jit_dir() -> str | None:
    from .backends.flashinfer import jit_cache_dir

    return jit_cache_dir() if importlib.util.find_spec("flashinfer") else None


def cmd_report(args: argparse.Namespace, out: Console) -> int:
    sel = run_selection(args)
    if args.json:
        print(json.dumps(report_json(sel), indent=2))
        return 0
    out.print(report_table(sel))
    stats = sel.stats
    cache_where = "" if sel.cache == "off" else f" ({ResultCache(args.cache_dir).path})"
    out.print(f"cache: {sel.cache}{cache_where}")
    mem = f", peak GPU memory {stats['worker_peak_gpu_mem_mb']:.0f} MiB" if stats["worker_peak_gpu_mem_mb"] else ""
    rss = f", peak RSS {stats['worker_peak_rss_mb']:.0f} MiB" if stats["worker_peak_rss_mb"] else ""
    out.print(f"validation worker: {stats['spawns']} spawn(s), {stats['deaths']} death(s), "
              f"{stats['worker_wall_s']:.1f} s{rss}{mem}")
    out.print(f"flashinfer JIT cache: {_flashinfer_jit_dir() or '(flashinfer not installed)'}")
    out.print(f"prefill: {sel.prefill} ({sel.prefill_source})")
    out.print(f"decode: {sel.decode} ({sel.decode_source})")
    return 0


def cmd_select(args: argparse.Namespace, out: Console) -> int:
    sel = run_selection(args)
    print(f"prefill: {sel.prefill} ({sel.prefill_source})")
    print(f"decode: {sel.decode} ({sel.decode_source})")
    return 0


def cmd_cache(args: argparse.Namespace, out: Console) -> int:
    cache = ResultCache(args.cache_dir)
    if args.action == "path":
        print(cache.path)
    elif args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.path}")
    else:
        entries = cache.entries()
        table = Table(title=f"{cache.path}: {len(entries)} entries")
        for col in ("backend", "phase", "status", "device", "spec", "timed modes"):
            table.add_column(col, overflow="fold")
        for e in entries.values():
            spec = e.get("spec", {})
            table.add_row(e.get("backend", "?"), e.get("phase", "?"), e.get("status", "?"), str(e.get("device")),
                          f"{spec.get('num_q_heads')}/{spec.get('num_kv_heads')}x{spec.get('head_dim')} "
                          f"{spec.get('dtype')} p{spec.get('page_size')}", ",".join(e.get("timings", {})))
        out.print(table)
    return 0


def cmd_bench(args: argparse.Namespace, out: Console) -> int:
    from .bench import run_bench

    return run_bench(args, out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnsel", description=__doc__)
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
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("cache", help="show, locate or clear the result cache")
    p.add_argument("action", choices=("show", "path", "clear"))
    add_cache_dir_arg(p)
    p.set_defaults(func=cmd_cache)
    p = sub.add_parser("serve", help="serve a model with transformers' OpenAI-compatible server on attnsel")
    serve.add_serve_args(p)
    add_selection_args(p)
    p.set_defaults(func=serve.cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    err = Console(stderr=True)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=err, show_path=False, show_time=False)], force=True)
    try:
        return args.func(args, Console(width=max(160, Console().width)))
    except (SpecError, UsageError, UnknownBackendError, ValueError) as exc:
        err.print(f"attnsel: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    except SelectionError as exc:
        err.print(f"attnsel: cannot serve: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_UNSERVED


if __name__ == "__main__":
    sys.exit(main())
