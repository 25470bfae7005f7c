"""`attnsel report | select | bench | cache | serve`: exit 0 on success, 2 for bad input (attnsel's own errors), 3 when
this machine cannot do it (a phase cannot be served; no CUDA device for `bench`, `--mode graph`, `--device cuda`;
serve's extra missing), 1 for an internal error (a bug, with its traceback) or when stdout cannot take the output."""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING

from . import __version__, errors, settings
from .cli_stdout import MarkedStdout, StdoutError
from .cli_backends import BACKEND_FLAGS, check_backend_args, check_names, priority_args
from .errors import CannotRun, SpecError, UsageError

if TYPE_CHECKING:  # the commands import what they use when they run: --version and --help import no torch
    from rich.console import Console

    from .selection import Selection
    from .spec import AttentionSpec, LayerKind

    LayerSpecs = list[tuple[LayerKind, AttentionSpec, list[int]]]

log = logging.getLogger("attnsel")
# AttentionSpec field -> its flag; -> its argparse dest
FIELD_FLAGS = {"num_q_heads": "--num-heads", "num_kv_heads": "--num-kv-heads", "head_dim": "--head-dim",
               "dtype": "--dtype", "page_size": "--page-size", "sliding_window": "--sliding-window",
               "softcap": "--softcap", "sinks": "--sinks", "kv_dtype": "--kv-dtype", "softmax_scale": "--softmax-scale"}
FIELD_DESTS = {"num_q_heads": "num_heads", "num_kv_heads": "num_kv_heads", "head_dim": "head_dim", "dtype": "dtype",
               "page_size": "page_size", "sliding_window": "sliding_window", "softcap": "softcap", "sinks": "sinks",
               "kv_dtype": "kv_dtype", "softmax_scale": "softmax_scale"}
EXIT_OUTPUT, EXIT_USAGE, EXIT_UNSERVED = 1, 2, 3  # 1: stdout could not take the output (and a bug's traceback)


def seconds(text: str) -> float:
    """A flag's number of seconds; argparse's message names the flag and what is allowed (positive: run_selection)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (e.g. 600), got {text!r}") from None


def add_spec_args(p: argparse.ArgumentParser) -> None:
    from .spec import DTYPES, KV_DTYPES, short_dtype_name

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
    from . import backends
    from .bench_args import add_priority_args
    from .priority import DEFAULT_PRIORITY
    from .selection import MODES, POLICIES

    opt_in = [n for n in backends.BUILTINS if not any(n in DEFAULT_PRIORITY[ph] for ph in DEFAULT_PRIORITY)]
    g = p.add_argument_group("selection", f"built-in backends: {', '.join(backends.BUILTINS)}. 'auto' "
                                          f"tries all but {', '.join(opt_in)} (opt-in: name it in a "
                                          "--PHASE-priority list or as the backend). Plugins from "
                                          "$ATTNSEL_BACKENDS or entry points add theirs; `attnsel report` shows the "
                                          "candidates of a selection")
    g.add_argument(*BACKEND_FLAGS["prefill"], dest="prefill",
                   help="'auto' (default; $ATTNSEL_PREFILL_BACKEND) or a backend name")
    g.add_argument(*BACKEND_FLAGS["decode"], dest="decode",
                   help="'auto' (default; $ATTNSEL_DECODE_BACKEND) or a backend name")
    g.add_argument(*BACKEND_FLAGS["extend"], dest="extend",
                   help="ragged queries over the paged cache (chunked prefill, prompt-cache hits, multi-token "
                        "decode): 'auto' (default; $ATTNSEL_EXTEND_BACKEND) or a backend name")
    g.add_argument("--policy", choices=POLICIES, default="measure",
                   help="auto: time valid candidates (measure, default) or take the first valid (priority)")
    g.add_argument("--mode", choices=MODES, default="eager",
                   help="how the engine launches kernels, for timing: eager or CUDA graph replays")
    add_priority_args(g)
    g.add_argument("--timeout", type=seconds, metavar="S",
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
    from .spec import AttentionSpec, layer_specs

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


def run_selection(args: argparse.Namespace, spec: AttentionSpec | None = None) -> Selection:
    from .selection import select

    spec = spec if spec is not None else spec_from_args(args)
    check_backend_args(args)
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.mode == "graph" and not str(device).startswith("cuda"):
        raise CannotRun(f"--mode graph times CUDA-graph replays and needs a CUDA device; the device is {device} "
                        "(use --mode eager)")
    return select(spec, args.prefill, args.decode, args.extend, policy=args.policy, mode=args.mode,
                  prefill_priority=args.prefill_priority, decode_priority=args.decode_priority,
                  extend_priority=args.extend_priority, timeout=args.timeout,
                  cache_dir=args.cache_dir, use_cache=not args.no_cache, device=args.device)


def _label(kind: str, layers: list[int]) -> str:
    return f"{kind} ({len(layers)} layers)" if layers else kind


def _select_each(args: argparse.Namespace, kinds: LayerSpecs) -> list[Selection | SelectionError]:
    """The selection of every layer kind, or why it cannot be served (also printed on stderr)."""
    from rich.console import Console

    from .selection import SelectionError

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


def cmd_report(args: argparse.Namespace, out: Console) -> int:
    """The report of every layer kind; a kind that cannot be served still shows what was found (exit 3)."""
    from rich.console import Console

    from .render import json_text, print_report, report_json
    from .selection import SelectionError
    from .serve import layer_ranges

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
                print(json_text(report_json(found[0])))
            return code
        print(json_text({"layer_kinds": [
            {"kind": kind, "layers": layers, "spec": spec.to_dict(),
             **({"error": str(res)} if isinstance(res, SelectionError) else {}),
             **({"selection": report_json(sel)} if sel is not None else {})}
            for (kind, spec, layers), res, sel in zip(kinds, results, found)]}))
        return code
    out = Console()  # fits the terminal (80 columns when not a terminal and COLUMNS is unset)
    for (kind, _, layers), res, sel in zip(kinds, results, found):
        if len(kinds) > 1:
            out.print(f"\n[bold]{_label(kind, layers)}[/]: layers {layer_ranges(layers)}")
        if sel is not None:
            print_report(sel, args, out)
        if isinstance(res, SelectionError) and len(kinds) > 1:
            out.print(f"cannot be served: {res}", markup=False)
    return code


def cmd_select(args: argparse.Namespace, out: Console) -> int:
    from .render import choice_line
    from .selection import SelectionError

    kinds = layer_specs_from_args(args)
    results = _select_each(args, kinds)
    for (kind, _, layers), res in zip(kinds, results):
        prefix = f"{_label(kind, layers)}: " if len(kinds) > 1 else ""
        if not isinstance(res, SelectionError):
            for phase in res.phases:
                print(prefix + choice_line(res, phase))
    return EXIT_UNSERVED if any(isinstance(r, SelectionError) for r in results) else 0


def cmd_cache(args: argparse.Namespace, out: Console) -> int:
    from rich.table import Table

    from .cache import ResultCache

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
    from .spec import AttentionSpec

    try:
        return AttentionSpec.from_dict(spec).describe()
    except (SpecError, TypeError, ValueError):
        return str(spec)


def cmd_bench(args: argparse.Namespace, out: Console) -> int:
    import torch
    from rich.console import Console

    from . import bench_args
    from .bench import run_bench
    from .bench_heldout import DEFAULT_CELLS, HELDOUT_SPECS, PHASES, run_heldout

    flags = (["--config"] if args.config else []) + [FIELD_FLAGS[f] for f in _given(args) if f != "page_size"]
    bench_args.check(args, flags)  # --specs takes --page-size alone of the spec flags
    given = any(getattr(args, f) is not None for f in ("config", "num_heads", "head_dim"))
    base = spec_from_args(args) if given else None  # bad input is exit 2 on any machine
    base = bench_args.parse_specs(args.specs, args.page_size) if args.specs is not None else base
    if args.backends is not None:
        check_names("--backends", args.backends)
    priority = priority_args(args)
    bench_args.check_untimed(args.backends, priority)
    if args.repeats < 1:
        raise UsageError(f"--repeats must be a whole number of passes, at least 1; got {args.repeats}")
    seed = bench_args.parse_seed(args.heldout) if args.heldout is not None else None
    counts = bench_args.parse_cells(args.cells, DEFAULT_CELLS)
    phases = bench_args.parse_phases(args.phases, PHASES)
    if not torch.cuda.is_available():
        raise CannotRun("attnsel bench times kernels on a CUDA device; none was found")
    if seed is not None:
        return run_heldout(base if isinstance(base, list) else [base] if base else HELDOUT_SPECS, args.backends,
                           args.mode, args.out, seed, counts, Console(), args.repeats, args.argv, phases, priority)
    return run_bench(base, args.backends, args.mode, args.out, args.quick, Console(), args.repeats, priority)


def _report_args(p: argparse.ArgumentParser) -> None:
    add_spec_args(p)
    add_selection_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_report)


def _select_args(p: argparse.ArgumentParser) -> None:
    add_spec_args(p)
    add_selection_args(p)
    p.set_defaults(func=cmd_select)


def _bench_args(p: argparse.ArgumentParser) -> None:
    from . import bench_args

    add_spec_args(p)
    bench_args.add_bench_args(p)
    p.set_defaults(func=cmd_bench)


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("show", "path", "clear"))
    add_cache_dir_arg(p)
    p.set_defaults(func=cmd_cache)


def _serve_args(p: argparse.ArgumentParser) -> None:
    from . import serve

    serve.add_serve_args(p)
    add_selection_args(p)
    p.set_defaults(func=serve.cmd_serve)


# command -> (its line in the help, what adds its flags)
COMMANDS = {"report": ("validate and select backends, then show every backend x phase", _report_args),
            "select": ("validate and select backends; print the choice per phase", _select_args),
            "bench": ("time every valid backend over a grid of shapes (needs CUDA)", _bench_args),
            "cache": ("show, locate or clear the result cache", _cache_args),
            "serve": ("serve a model with transformers' OpenAI-compatible server on attnsel", _serve_args)}


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Only the commands in ``commands`` (default: all) get their flags, whose choices import torch and
    the backends: `attnsel --version`, `--help` and `attnsel` alone need none of them."""
    parser = argparse.ArgumentParser(prog="attnsel", description=__doc__)
    parser.add_argument("--version", action="version", version=f"attnsel {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add_args) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if commands is None or name in commands:
            add_args(p)
        # -q after the subcommand too (SUPPRESS: absent there keeps the main default)
        p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="only warnings and errors on stderr")
        p.set_defaults(parser=p)  # main() names a flag the command does not take with this parser's usage
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(commands=set(argv) & set(COMMANDS))  # the command is the first word argparse takes
    if not argv:  # `attnsel` alone: the commands, not an argparse error
        parser.print_help()
        return 0
    args, unknown = parser.parse_known_args(argv)
    args.argv = argv  # which spelling of a flag the user typed, for errors
    if unknown:  # named by the command's own parser, with its usage (the top-level usage lists no command's flags)
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from rich.console import Console
    from rich.logging import RichHandler

    from .selection import SelectionError

    err = Console(stderr=True)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=err, show_path=False, show_time=False)], force=True)
    stdout = sys.stdout
    if stdout is not None:  # None: started with stdout closed (`>&-`); print() and rich write nothing then
        sys.stdout = MarkedStdout(stdout)
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


if __name__ == "__main__":
    sys.exit(main())
