"""`attnsel bench`'s own flags: the fixed grid's (--backends, --mode, --out, --quick, --repeats), the specs to bench
(--specs) and the held-out evaluation (--heldout SEED, --cells), with the checks that turn a bad value into a clear
error (ValueError: exit 2) before any device is touched."""
from __future__ import annotations

import argparse
import re

from .errors import InvalidArgument
from .selection import MODES
from .spec import DTYPES, AttentionSpec, SpecError, short_dtype_name

SPEC_FORMAT = "Q/KV[/HEAD_DIM][/DTYPE][/pPAGE]"
_FEATURE = re.compile(r"(soft|cap|win|w[0-9]|sw|slid|sink|fp8|e4m3|e5m2|kv|scale)", re.IGNORECASE)


def comma_names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_priority_args(p, more: str = "") -> None:
    """--prefill-priority, --decode-priority, --extend-priority: a selection's auto candidates per phase."""
    for phase in ("prefill", "decode", "extend"):
        p.add_argument(f"--{phase}-priority", type=comma_names, metavar="A,B,...",
                       help=f"auto candidates for {phase}, in order{more}")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", type=comma_names, metavar="A,B,...", help="backends to time (default: all available)")
    p.add_argument("--mode", choices=(*MODES, "both"), default="both", help="eager launches, CUDA graphs, or both")
    p.add_argument("--out", metavar="DIR", default="bench-out", help="where to write the table and plot")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="time the whole grid N times; a cell's time is the median over the passes, and the summary "
                        "adds how often the first pass's fastest stays within 3%% in the later ones (default 1)")
    add_priority_args(p, " (default attnsel's; name an opt-in backend to judge it)")
    p.add_argument("--specs", metavar=f"{SPEC_FORMAT},...",
                   help="the specs to bench instead of the default ones, e.g. 32/8,40/8/128,32/8/64/fp16,32/8/p1 "
                        "(head_dim 128 and bf16 unless given; page size from a pPAGE field, else --page-size, "
                        "default 16)")
    g = p.add_argument_group("held-out evaluation", "judge the dispatch on cells drawn at random (prefill: 1-64 "
                             "prompts of 16-32768 tokens, 65536 at most in all; decode: batches of 1-512, heavy-tailed "
                             "contexts of 16-32768, 2^20 KV tokens at most; ragged and uniform), none on the timed "
                             "grid; default specs: 32/8, 28/4, 8/1, 40/8, 48/8, 32/8/64, 16/8/256, 32/8/fp16")
    g.add_argument("--heldout", metavar="SEED", help="draw the cells with this seed (a non-negative integer); "
                                                     "writes heldout.json and heldout.md to --out")
    g.add_argument("--cells", metavar="N or PREFILL,DECODE[,EXTEND]",
                   help="cells per spec, phase and launch mode (default 12 prefill, 24 decode, 16 extend)")
    g.add_argument("--phases", type=comma_names, metavar="P,...", default=None,
                   help="the phases to draw cells of: prefill, decode, extend (default prefill,decode)")


def parse_seed(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text.strip()):
        raise InvalidArgument(f"--heldout takes the seed of the draw, a non-negative integer (e.g. --heldout 1); got "
                         f"{text!r}")
    return int(text)


def parse_cells(text: str, default: dict) -> dict:
    """``N`` (every phase) or ``PREFILL,DECODE[,EXTEND]``: cells per spec, phase and mode, each 1 to 1000."""
    if text is None:
        return dict(default)
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (1, 2, 3) or not all(re.fullmatch(r"[0-9]+", p) and 1 <= int(p) <= 1000 for p in parts):
        raise InvalidArgument(f"--cells takes N or PREFILL,DECODE, whole numbers of cells from 1 to 1000 (e.g. --cells 8 "
                         f"or --cells 8,16); got {text!r}")
    counts = [int(p) for p in parts]
    if len(counts) == 1:
        return {"prefill": counts[0], "decode": counts[0], "extend": counts[0]}
    return {"prefill": counts[0], "decode": counts[1], "extend": counts[2] if len(counts) == 3 else default["extend"]}


def parse_phases(names: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """--phases: a subset of prefill, decode, extend (InvalidArgument naming the allowed ones)."""
    if names is None:
        return default
    allowed = ("prefill", "decode", "extend")
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise InvalidArgument(f"--phases takes phases from {', '.join(allowed)}, comma-separated; got "
                              f"{','.join(names)!r}")
    return tuple(dict.fromkeys(names))


def parse_specs(text: str, page_size: int | None) -> list[AttentionSpec]:
    """Comma-separated ``Q/KV[/HEAD_DIM][/DTYPE][/pPAGE]`` items (head_dim 128, bf16 unless given; the page size
    from an item's pPAGE field, else ``page_size``, else 16), so that one run can cover several page sizes."""
    if page_size is not None and page_size < 1:  # --page-size's fault, not that of the items that take it
        raise InvalidArgument(f"--page-size must be a positive integer, got {page_size}")
    specs = []
    for item in (i.strip() for i in text.split(",")):
        fields = item.split("/")
        try:
            if len(fields) < 2 or not all(re.fullmatch(r"[0-9]+", f) for f in fields[:2]):
                raise SpecError("expected Q/KV heads first")
            if len(fields) > 5:
                raise SpecError(f"{len(fields)} fields, at most 5")
            given = {"head_dim": 128, "dtype": "bf16", "page_size": 16 if page_size is None else page_size}
            seen = set()
            for extra in fields[2:]:
                if re.fullmatch(r"[0-9]+", extra):
                    field, value = "head_dim", int(extra)
                elif re.fullmatch(r"p[0-9]+", extra):
                    field, value = "page_size", int(extra[1:])
                elif short_dtype_name(extra) in DTYPES:
                    field, value = "dtype", short_dtype_name(extra)
                elif _FEATURE.match(extra):  # a model feature: named as one, not as a bad field
                    raise SpecError(f"{extra!r} looks like a model feature; --specs items give heads, head_dim, dtype "
                                    "and page size only: bench a spec with a sliding window, softcap, sinks or an "
                                    "fp8 KV cache with the spec flags (--sliding-window, --softcap, --sinks, "
                                    "--kv-dtype)")
                else:
                    raise SpecError(f"{extra!r} is neither a head_dim, a dtype ({', '.join(DTYPES)}) nor a page "
                                    "size (p1, p16, ...)")
                if field in seen:
                    raise SpecError(f"{field} given twice")
                seen.add(field)
                given[field] = value
            specs.append(AttentionSpec(int(fields[0]), int(fields[1]), given["head_dim"], given["dtype"],
                                       given["page_size"]))
        except SpecError as exc:
            raise InvalidArgument(f"--specs item {item!r}: {exc}; each item is {SPEC_FORMAT}, e.g. 32/8, 32/8/64/fp16 "
                                  "or 32/8/p1") from None
    return specs


def check_untimed(names: list[str] | None, priority: dict) -> None:
    """The --PHASE-priority names (``priority``: select()'s keyword arguments) beside --backends (``names``; None:
    every backend is timed): each one timed, else the selection's picks of it have no time in any cell (misses)."""
    for arg, chosen in priority.items():
        untimed = [n for n in chosen if names is not None and n not in names]
        if untimed:
            raise InvalidArgument(f"--{arg.replace('_', '-')} names {', '.join(untimed)}, which --backends does not "
                                  "time: the bench could not judge the selection's picks; add it to --backends")


def check(args: argparse.Namespace, spec_flags: list[str]) -> None:
    """The combinations that make no sense: --cells without --heldout, --quick with it, --specs beside spec flags
    (``spec_flags``: those given, --page-size aside, which --specs uses), --extend-priority for an untimed extend."""
    if args.phases is not None and args.heldout is None:
        raise InvalidArgument("--phases sets the held-out phases: give --heldout SEED too")
    if args.cells is not None and args.heldout is None:
        raise InvalidArgument("--cells sets the held-out cells per phase: give --heldout SEED too")
    if args.extend_priority is not None and args.heldout is not None and "extend" not in (args.phases or ()):
        raise InvalidArgument("--extend-priority sets the timed extend candidates; a held-out run times extend only "
                              "with extend in --phases (e.g. --phases prefill,decode,extend)")
    if args.quick and args.heldout is not None:
        raise InvalidArgument("--quick picks the fixed grid's smaller set; with --heldout set the cells with --cells")
    if args.specs is not None and spec_flags:
        raise InvalidArgument(f"--specs gives each spec's heads, head_dim and dtype; it does not go with "
                         f"{', '.join(spec_flags)} (use one or the other)")
