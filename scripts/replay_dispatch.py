"""Replay the dispatch of recorded `attnsel bench` runs on the CPU: each bench JSON holds the selection's dispatch
tables (timed buckets) and every cell's measured times, so the dispatch's choice per cell can be recomputed with the
current lookup rules and scored against the cell's fastest, without a GPU.

Usage: python3 scripts/replay_dispatch.py bench/results/2026-12-04-round11/bench-*.json [...]
       python3 scripts/replay_dispatch.py --passes bench/results/2026-12-05-round14/bench-*.json   (--repeats 2 runs:
       every strategy judged by each pass and by their median, each pass's fastest judged by the other pass)
Prints per file and phase: cells within 3% of the fastest, geometric mean and worst ratio, for the recorded choice
("recorded": what the bench run's code picked) and the current code's ("now"), and the cells where they differ.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnsel import bench  # noqa: E402
from attnsel.dispatch import DispatchTable  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402

WITHIN = bench.WITHIN


def score(ratios: list[float]) -> str:
    within = sum(r <= 1 + WITHIN for r in ratios)
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return f"{within}/{len(ratios)} within 3%, geomean {geo:.3f}x, worst {max(ratios):.2f}x"


def replay(path: Path) -> dict:
    data = json.loads(path.read_text())
    if len({json.dumps(c["spec"], sort_keys=True) for c in data["cells"]}) > 1:
        raise SystemExit(f"{path}: one spec per file (run attnsel bench with spec flags)")
    sel = data["selections"][0]
    spec = AttentionSpec.from_dict(sel["spec"]) if isinstance(sel["spec"], dict) else None
    if spec is None:
        first = data["cells"][0]["spec"]
        spec = AttentionSpec(**first)
    out = {}
    for phase in ("prefill", "decode"):
        table = DispatchTable.from_json(sel["dispatch"][phase])
        keys = {label: key for label, key, _, _ in bench.shapes(spec, phase, quick=False)}
        rows = [c for c in data["comparison"] if c["phase"] == phase]
        times = {}
        for c in data["cells"]:
            if c["phase"] == phase and c["us"]:
                times.setdefault(c["shape"], {})[c["backend"]] = c["us"]
        recorded, now, changed = [], [], []
        for r in rows:
            cell = times[r["shape"]]
            key = keys[r["shape"]]
            longest = key[2] if phase == "decode" and len(key) > 2 else None  # a ragged decode cell's longest row
            pick = table.backend_for(key[:len(table.axes)], longest)
            best = min(cell.values())
            recorded.append(r["selected_ratio"])
            now.append(cell[pick] / best)
            if pick != r["selected"]:
                changed.append(f"{r['shape']}: {r['selected']} {r['selected_ratio']:.2f}x -> {pick} "
                               f"{cell[pick] / best:.2f}x")
        out[phase] = (score(recorded), score(now), changed)
    return out


def passes(paths: list[Path]) -> None:
    """For benches run with --repeats 2: each strategy judged by pass 1 alone, by pass 2 alone and by their median,
    and each pass's fastest judged by the other pass (how far the bench agrees with itself)."""
    tot: dict = {}
    missing = 0
    for path in paths:
        data = json.loads(path.read_text())
        for r in data["comparison"]:
            cells = {c["backend"]: c for c in data["cells"] if (_spec_label(c["spec"]), c["shape"], c["phase"],
                     c["mode"]) == (r["spec"], r["shape"], r["phase"], r["mode"]) and c["us"]}
            if any(not c.get("passes") or len(c["passes"]) != 2 for c in cells.values()):
                raise SystemExit(f"{path}: --passes needs a bench run with --repeats 2")
            for judge in ("pass 1", "pass 2", "median"):
                t = {n: c["us"] if judge == "median" else c["passes"][int(judge[-1]) - 1] for n, c in cells.items()}
                for strategy in ("selected", "one_backend", "static"):
                    if r.get(strategy) not in t:  # no selection, or its pick has no time in the cell
                        missing += judge == "median"
                        continue
                    tot.setdefault((strategy, judge), []).append(t[r[strategy]] / min(t.values()))
            for a, b in ((0, 1), (1, 0)):
                first = min(cells, key=lambda n: cells[n]["passes"][a])
                tot.setdefault((f"pass {a + 1}'s fastest", f"pass {b + 1}"), []).append(
                    cells[first]["passes"][b] / min(c["passes"][b] for c in cells.values()))
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
        sel = json.loads(path.read_text())["selections"][0]
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


def main(paths: list[str]) -> None:
    if paths and paths[0] == "--passes":
        passes([Path(p) for p in paths[1:]])
        return
    if paths and paths[0] == "--drift":
        drift(Path(paths[1]), Path(paths[2]))
        return
    for p in paths:
        for phase, (rec, now, changed) in replay(Path(p)).items():
            print(f"{p} {phase}\n  recorded: {rec}\n  now:      {now}")
            for line in changed:
                print("   ", line)


if __name__ == "__main__":
    main(sys.argv[1:])
