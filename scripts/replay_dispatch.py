"""Replay the dispatch of recorded `attnsel bench` runs on the CPU: each bench JSON holds the selection's dispatch
tables (timed buckets) and every cell's measured times, so the dispatch's choice per cell can be recomputed with the
current lookup rules and scored against the cell's fastest, without a GPU.

Usage: python3 scripts/replay_dispatch.py bench/results/2026-12-04-round11/bench-*.json [...]
       python3 scripts/replay_dispatch.py --without ragged [--without interpolation] FILES   (the current rules with
       these switched off (dispatch.LOOKUP_RULES), against all of them, and the cells where the two differ)
       python3 scripts/replay_dispatch.py --rules FILES   (one device and mode: one table row per rule, all cells of
       FILES with all rules and with each rule off, and how often the bench disagrees with itself between passes)
       python3 scripts/replay_dispatch.py --ragged FILES   (eager: the uniform table's choice at each timed ragged
       batch)
       python3 scripts/replay_dispatch.py --runs A1.json A2.json B1.json B2.json   (two runs a and b of the same specs
       and grid, run a's files then run b's in the same order: cells whose fastest in one run is more than 3% behind
       in the other, both ways; for benches of one pass)
       python3 scripts/replay_dispatch.py --heldout bench/results/2026-12-06-extend-h100/heldout.json   (a held-out
       run's eager cells of every phase, each dispatched as the bench did (a ragged decode or an extend batch by its
       means and its longest context): recorded choice against the current code's; figures on seeds that chose a
       rule are in-sample; `--heldout --without RULE FILES`: with that lookup rule off)
       python3 scripts/replay_dispatch.py --passes bench/results/2026-12-05-round14/bench-*.json   (runs with
       --repeats 2 or more: every strategy judged by each pass and by their median, each pass's fastest judged by the
       median of the other passes)
Prints per file and phase: cells within 3% of the fastest, geometric mean and worst ratio, for the recorded choice
("recorded": what the bench run's code picked) and the current code's ("now"), and the cells where they differ.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnsel import bench  # noqa: E402
from attnsel.dispatch import LOOKUP_RULES, DispatchTable  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402

WITHIN = bench.WITHIN


def load(path: Path) -> dict:
    """A bench JSON, plain or xz-compressed (``.json.xz``: large raw runs are kept compressed in bench/results)."""
    if path.suffix == ".xz":
        import lzma

        return json.loads(lzma.decompress(path.read_bytes()))
    return json.loads(path.read_text())


def score(ratios: list[float]) -> str:
    within = sum(r <= 1 + WITHIN for r in ratios)
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return f"{within}/{len(ratios)} within 3%, geomean {geo:.3f}x, worst {max(ratios):.2f}x"


def replay(path: Path, without: tuple[str, ...] = ()) -> dict:
    """Per phase: the recorded choices' score, the current rules' score (``without``: these rules switched off,
    DispatchTable.without) and the cells whose choice differs, with their ratios."""
    data = load(path)
    out = {}
    for phase, rows in _picks(data, path, without).items():
        recorded = [r["selected_ratio"] for r, _, _ in rows]
        changed = [f"{r['shape']}: {r['selected']} {r['selected_ratio']:.2f}x -> {pick} {ratio:.2f}x"
                   for r, pick, ratio in rows if pick != r["selected"]]
        out[phase] = (score(recorded), score([ratio for _, _, ratio in rows]), changed)
    return out


def _picks(data: dict, path: Path, without: tuple[str, ...] = ()) -> dict:
    """Per phase: (comparison row, the current rules' pick, its time over the cell's fastest) for every cell."""
    if len({json.dumps(c["spec"], sort_keys=True) for c in data["cells"]}) > 1:
        raise SystemExit(f"{path}: one spec per file (run attnsel bench with spec flags)")
    sel = data["selections"][0]
    spec = AttentionSpec.from_dict(sel["spec"]) if isinstance(sel["spec"], dict) else None
    if spec is None:
        first = data["cells"][0]["spec"]
        spec = AttentionSpec(**first)
    out = {}
    for phase in ("prefill", "decode"):
        table = DispatchTable.from_json(sel["dispatch"][phase]).without(*without)
        keys = {label: key for label, key, _, _ in bench.shapes(spec, phase, quick=False)}
        times = {}
        for c in data["cells"]:
            if c["phase"] == phase and c["us"]:
                times.setdefault(c["shape"], {})[c["backend"]] = c["us"]
        out[phase] = []
        for r in (r for r in data["comparison"] if r["phase"] == phase):
            cell = times[r["shape"]]
            key = keys[r["shape"]]
            longest = key[2] if phase == "decode" and len(key) > 2 else None  # a ragged decode cell's longest row
            pick = table.backend_for(key[:len(table.axes)], longest)
            out[phase].append((r, pick, cell[pick] / min(cell.values())))
    return out


def rules(paths: list[Path]) -> None:
    """One device and mode (the bench files of its specs): a markdown table of all cells replayed with all lookup
    rules and with each rule switched off (within 3%, geometric mean, worst), the cells lost without it (in all, and
    judged by each pass alone), the cells whose choice it changes (and how many of those the bench's passes
    disagree on), and the bench's own disagreement between passes over all cells: a cell disagrees when its pass-1
    fastest is more than 3% behind in the median of the later passes (the bench's "repeat")."""
    cols = [()] + [(rule,) for rule in LOOKUP_RULES]
    ratios: dict = {c: [] for c in cols}
    per_pass: dict = {c: {} for c in cols}  # pass index -> cells within 3% by that pass's times
    changed = {c: [0, 0] for c in cols}  # cells whose pick differs from all rules', of them disagreeing
    has_ragged = False  # whether the decode tables hold a ragged sub-table (older grids do not)
    disagree, judged = 0, 0
    for path in paths:
        data = load(path)
        has_ragged |= bool(data["selections"][0]["dispatch"]["decode"].get("ragged"))
        picks = {c: _picks(data, path, c) for c in cols}
        for phase in picks[()]:
            for i, (r, full, _) in enumerate(picks[()][phase]):
                later = _later_passes(data, r)
                if later is not None:
                    judged += 1
                    disagree += later > 1 + WITHIN
                cells = _row_cells(data, r)
                for col in cols:
                    _, pick, ratio = picks[col][phase][i]
                    ratios[col].append(ratio)
                    if pick != full:
                        changed[col][0] += 1
                        changed[col][1] += later is not None and later > 1 + WITHIN
                    for k in range(len(cells[pick].get("passes") or ()) if later is not None else 0):
                        t = [c["passes"][k] for c in cells.values()]
                        per_pass[col][k] = per_pass[col].get(k, 0) + (cells[pick]["passes"][k] <= (1 + WITHIN) * min(t))
    base = sum(x <= 1 + WITHIN for x in ratios[()])
    agree = f"{disagree}/{judged}" if judged else "n/a (one pass)"
    print("| rules | within 3% | geomean | worst | lost (judged by pass 1, 2, ...) | cells changed (disagreeing) "
          "| bench passes disagree |\n|---|---|---|---|---|---|---|")
    for col in cols:
        name = f"without {col[0]}" if col else "all"
        if col == ("ragged",) and not has_ragged:
            print(f"| {name} | n/a: no ragged sub-table | | | | | |")
            continue
        geo = math.exp(sum(math.log(r) for r in ratios[col]) / len(ratios[col]))
        within = sum(x <= 1 + WITHIN for x in ratios[col])
        lost = "" if not col else f"{base - within}" + (
            f" ({', '.join(str(per_pass[()][k] - per_pass[col][k]) for k in sorted(per_pass[col]))})"
            if per_pass[col] else "")
        change = "" if not col else f"{changed[col][0]} ({changed[col][1]})" if judged else f"{changed[col][0]}"
        print(f"| {name} | {within}/{len(ratios[col])} | {geo:.4f} | {max(ratios[col]):.3f}x | {lost} | {change} | "
              f"{agree if not col else ''} |")


def ragged(paths: list[Path]) -> None:
    """The timed ragged batches of eager decode tables: the uniform buckets' choice for each (batch, mean context)
    against the ragged bucket's fastest, i.e. what serving a skewed batch by its mean costs at the timed shapes (the
    ragged sub-table serves its own bucket's winner there: in-sample for it, out of sample for the uniform table)."""
    ratios = []
    for path in paths:
        table = DispatchTable.from_json(load(path)["selections"][0]["dispatch"]["decode"])
        if table.ragged is None:
            raise SystemExit(f"{path}: no ragged sub-table (an eager decode table of grid version 4 or later has one)")
        uniform = table.without("ragged")
        for b in table.ragged.buckets:
            pick = uniform.backend_for(b.key)
            ratios.append(b.times_us[pick] / min(b.times_us.values()) if pick in b.times_us else math.inf)
            if ratios[-1] > 1 + WITHIN:
                print(f"{path.name} {b.label}: uniform {pick} {ratios[-1]:.2f}x, ragged {b.backend}")
    print(f"the uniform choice at the timed ragged batches: {score(ratios)}")


def runs(a: Path, b: Path) -> tuple[int, int]:
    """Two bench runs of one spec and grid: (cells whose run-a fastest is more than 3% behind in run b, cells in
    both). For benches of one pass, how far the bench agrees with itself between runs."""
    def times(path: Path) -> dict:
        out: dict = {}
        for c in load(path)["cells"]:
            if c["us"]:
                out.setdefault((c["phase"], c["shape"], c["mode"]), {})[c["backend"]] = c["us"]
        return out
    specs = {json.dumps(load(p)["cells"][0]["spec"], sort_keys=True) for p in (a, b)}
    if len(specs) > 1:
        raise SystemExit(f"{a} and {b}: not one spec")
    ta, tb = times(a), times(b)
    both = [k for k in ta if k in tb]
    behind = 0
    for k in both:
        first = min(ta[k], key=ta[k].get)
        behind += first not in tb[k] or tb[k][first] > (1 + WITHIN) * min(tb[k].values())
    return behind, len(both)


def _later_passes(data: dict, row: dict) -> float | None:
    """A comparison row's pass-1 fastest judged by the median of the later passes (its time over the least median);
    None without passes. A pass-1 fastest without a time in a later pass counts as infinitely behind."""
    cells = _row_cells(data, row)
    if not cells or any(not c.get("passes") or len(c["passes"]) < 2 for c in cells.values()):
        return None
    first = min((n for n, c in cells.items() if c["passes"][0]), key=lambda n: cells[n]["passes"][0])
    later = {n: statistics.median(c["passes"][1:]) for n, c in cells.items() if all(c["passes"][1:])}
    return later[first] / min(later.values()) if first in later else math.inf


def _row_cells(data: dict, row: dict) -> dict:
    """A comparison row's cells with a time: backend -> cell."""
    return {c["backend"]: c for c in data["cells"] if (_spec_label(c["spec"]), c["shape"], c["phase"], c["mode"])
            == (row["spec"], row["shape"], row["phase"], row["mode"]) and c["us"]}


def passes(paths: list[Path]) -> None:
    """For benches run with --repeats 2 or more: each strategy judged by each pass alone and by their median, and each
    pass's fastest judged by the median of the other passes (how far the bench agrees with itself)."""
    tot: dict = {}
    missing = 0
    for path in paths:
        data = load(path)
        for r in data["comparison"]:
            cells = _row_cells(data, r)
            counts = {len(c.get("passes") or ()) for c in cells.values()}
            if len(counts) != 1 or min(counts) < 2:
                raise SystemExit(f"{path}: --passes needs a bench run with --repeats 2 or more")
            n = counts.pop()
            for judge in [f"pass {p + 1}" for p in range(n)] + ["median"]:
                t = {b: c["us"] if judge == "median" else c["passes"][int(judge[5:]) - 1] for b, c in cells.items()}
                for strategy in ("selected", "one_backend", "static"):
                    if r.get(strategy) not in t:  # no selection, or its pick has no time in the cell
                        missing += judge == "median"
                        continue
                    tot.setdefault((strategy, judge), []).append(t[r[strategy]] / min(t.values()))
            for a in range(n):
                others = [p for p in range(n) if p != a]
                first = min(cells, key=lambda b: cells[b]["passes"][a])
                other = {b: statistics.median(c["passes"][p] for p in others) for b, c in cells.items()}
                judge = (f"pass {others[0] + 1}" if n == 2
                         else f"the median of passes {', '.join(str(p + 1) for p in others)}")
                tot.setdefault((f"pass {a + 1}'s fastest", judge), []).append(other[first] / min(other.values()))
    for (strategy, judge), ratios in tot.items():
        print(f"{strategy} judged by {judge}: {score(ratios)}, above 1.10x: {sum(r > 1.10 for r in ratios)}")
    if missing:
        print(f"{missing} strategy pick(s) without a time in their cell (or no selection): left out above")


def _spec_label(spec: dict) -> str:
    """A cell's spec as the bench's comparison rows name it."""
    return f"{spec['num_q_heads']}/{spec['num_kv_heads']}"


def drift(a: Path, b: Path) -> None:
    """Two selections' tables of one spec (bench JSONs of two runs): per bucket timed in both, each candidate's ratio
    to the bucket's fastest, Triton and torch left out; how far those ratios moved between the runs (median, 90th
    percentile, largest) and how often run a's winner of a bucket was within 3% in run b."""
    tables = []
    for path in (a, b):
        sel = load(path)["selections"][0]
        tables.append({ph: {tuple(bk["key"]): bk["times_us"] for bk in sel["dispatch"][ph]["buckets"]}
                       for ph in ("prefill", "decode")})
    for ph in ("prefill", "decode"):
        ta, tb = tables[0][ph], tables[1][ph]
        moves, kept = [], []
        for key in ta.keys() & tb.keys():
            names = [n for n in ta[key] if n in tb[key] and n not in ("triton", "torch")]
            if len(names) < 2:
                continue
            best_a, best_b = min(ta[key][n] for n in names), min(tb[key][n] for n in names)
            moves += [abs(math.log(ta[key][n] / best_a * best_b / tb[key][n])) for n in names]
            kept.append(tb[key][min(names, key=lambda n: ta[key][n])] / best_b)
        moves.sort()
        at = lambda f: math.exp(moves[min(len(moves) - 1, int(f * len(moves)))])  # noqa: E731
        print(f"{ph}: {len(kept)} buckets; ratios moved median {at(0.5):.3f}x, 90th percentile {at(0.9):.3f}x, "
              f"largest {math.exp(moves[-1]):.2f}x; a's winner within 3% in b: {score(kept)}")


def heldout(path: Path, without: tuple[str, ...] = ()) -> None:
    """A held-out run's eager cells (prefill, decode, extend) replayed on its own selections' tables (``without``:
    these lookup rules switched off), each looked up as the bench dispatched it (bench_cells.HeldoutCell.key: a
    ragged decode or an extend batch by its means and its longest row; module doc)."""
    from attnsel.bench_cells import HeldoutCell

    data = load(path)
    # by spec: a spec whose selection failed has no record (bench.select_modes), so the order does not pair them
    tables = {bench.spec_label(s["spec"]): s.get("dispatch") or {} for s in data["selections"] if s["mode"] == "eager"}
    for phase in ("prefill", "decode", "extend"):
        rows = [r for r in data["comparison"] if r["phase"] == phase and r["mode"] == "eager"]
        for spec in dict.fromkeys(r["spec"] for r in rows):
            if not (tables.get(spec) or {}).get(phase):
                print(f"{path} {phase} {spec}: no eager selection recorded with {'an' if phase == 'extend' else 'a'} "
                      f"{phase} table")
                continue
            table = DispatchTable.from_json(tables[spec][phase]).without(*without)
            mine = [r for r in rows if r["spec"] == spec]
            now = []
            for r in mine:
                key = HeldoutCell(phase, tuple(r["lens"]), bool(r.get("ragged")), tuple(r.get("q_lens") or ())).key
                name = table.backend_for(key[:len(table.axes)], *key[len(table.axes):])  # the longest row, if keyed
                now.append(r["ratios"].get(name, math.inf))
                if name != r["selected"]:
                    was = f"{r['selected_ratio']:.2f}x" if r["selected_ratio"] else "no time"
                    print(f"    {spec} {r['shape']}: {r['selected']} {was} -> {name} {now[-1]:.2f}x")
            print(f"{path} {phase} {spec}\n  recorded: {score([r['selected_ratio'] or math.inf for r in mine])}\n"
                  f"  now:      {score(now)}")


def main(args: list[str]) -> None:
    if args and args[0] == "--heldout":
        args, without = args[1:], []
        while len(args) >= 2 and args[0] == "--without":
            if args[1] not in LOOKUP_RULES:
                raise SystemExit(f"--without {args[1]}: not a lookup rule; the rules: {', '.join(LOOKUP_RULES)}")
            without.append(args[1])
            args = args[2:]
        for p in args:
            heldout(Path(p), tuple(without))
        return
    if args and args[0] == "--passes":
        passes([Path(p) for p in args[1:]])
        return
    if args and args[0] == "--drift":
        drift(Path(args[1]), Path(args[2]))
        return
    if args and args[0] == "--runs":
        files = [Path(x) for x in args[1:]]
        if not files or len(files) % 2:
            raise SystemExit("--runs needs run a's bench files, then run b's, as many and in the same order")
        pairs = list(zip(files[:len(files) // 2], files[len(files) // 2:]))
        for x, y in (("a", "b"), ("b", "a")):
            got = [runs(a, b) if x == "a" else runs(b, a) for a, b in pairs]
            print(f"run {x}'s fastest more than 3% behind in run {y}: "
                  f"{sum(g[0] for g in got)}/{sum(g[1] for g in got)}")
        return
    if args and args[0] == "--ragged":
        ragged([Path(p) for p in args[1:]])
        return
    if args and args[0] == "--rules":
        rules([Path(p) for p in args[1:]])
        return
    without = []
    while len(args) >= 2 and args[0] == "--without":
        if args[1] not in LOOKUP_RULES:
            raise SystemExit(f"--without {args[1]}: not a lookup rule; the rules: {', '.join(LOOKUP_RULES)}")
        without.append(args[1])
        args = args[2:]
    if without:
        for p in args:
            data = load(Path(p))
            full, off = _picks(data, Path(p)), _picks(data, Path(p), tuple(without))
            for phase in full:
                print(f"{p} {phase}\n  all rules: {score([x for _, _, x in full[phase]])}\n  without "
                      f"{', '.join(without)}: {score([x for _, _, x in off[phase]])}")
                for (r, a, ra), (_, b, rb) in zip(full[phase], off[phase]):
                    if a != b:
                        print(f"    {r['shape']}: {a} {ra:.2f}x -> {b} {rb:.2f}x")
        return
    for p in args:
        for phase, (rec, now, changed) in replay(Path(p)).items():
            print(f"{p} {phase}\n  recorded: {rec}\n  now:      {now}")
            for line in changed:
                print("   ", line)


if __name__ == "__main__":
    main(sys.argv[1:])
