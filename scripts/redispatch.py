"""Re-derive a bench's dispatch tables under another tie band, from the same measurements, and score them on the
bench's own cells: what a rule change would have chosen, without new device time (a simulation on measured data,
not a measurement: the bucket timings and the cell timings are those of the bench run).

Usage: python scripts/redispatch.py BENCH.json [--headline-first] [TIE ...]   (default ties: 0 0.01 0.02 0.03)
For every selection in BENCH.json (spec, mode) and tie band: the tables' buckets get pick(times, priority, tie)
(with --headline-first the phase's headline backend comes first in that order, then the default priority);
each bench cell of that spec and mode is looked up as `attnsel bench` does, with this checkout's lookup rule
(DispatchTable.backend_for: since 2026-12-03's fourth session it interpolates between timed shapes); prints
within-3% counts, geomean and worst time over the cell's fastest, per phase.
"""
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnsel import bench as attnsel_bench  # noqa: E402
from attnsel.selection import DEFAULT_PRIORITY, DispatchTable, pick  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402


def retabled(table: dict, order: list[str], tie: float) -> DispatchTable:
    data = json.loads(json.dumps(table))
    for t in (data, data.get("ragged") or {"buckets": []}):  # the ragged sub-table's buckets too
        for b in t["buckets"]:
            b["backend"] = pick(b["times_us"], [n for n in order if n in b["times_us"]], tie)
        t["tie"] = tie  # the lookup's band too
    return DispatchTable.from_json(data)


def main() -> None:
    bench = json.loads(Path(sys.argv[1]).read_text())
    headline_first = "--headline-first" in sys.argv[2:]
    ties = [float(t) for t in sys.argv[2:] if t != "--headline-first"] or [0.0, 0.01, 0.02, 0.03]
    for sel in bench["selections"]:
        spec = f"{sel['spec']['num_q_heads']}/{sel['spec']['num_kv_heads']}"
        for phase in ("prefill", "decode"):
            table = sel["dispatch"].get(phase)
            if not table:
                continue
            rows = [r for r in bench["comparison"] if (r["spec"], r["phase"], r["mode"]) == (spec, phase, sel["mode"])]
            keys = {label: key for label, key, _, _ in
                    attnsel_bench.shapes(AttentionSpec.from_dict(sel["spec"]), phase, quick=False)}
            cells = {(c["phase"], c["mode"], c["shape"]): {} for c in bench["cells"]}
            for c in bench["cells"]:
                if c["us"] and c["spec"] == sel["spec"]:
                    cells[(c["phase"], c["mode"], c["shape"])][c["backend"]] = c["us"]
            for tie in ties:
                order = list(DEFAULT_PRIORITY[phase])
                if headline_first:
                    order = [sel[phase]] + [n for n in order if n != sel[phase]]
                t = retabled(table, order, tie)
                ratios = []
                for r in rows:
                    times = cells[(phase, sel["mode"], r["shape"])]
                    full = keys[r["shape"]]
                    longest = full[2] if phase == "decode" and len(full) > 2 else None  # a ragged cell's longest row
                    ratios.append(times[t.backend_for(tuple(full[:len(t.axes)]), longest)] / min(times.values()))
                if ratios:
                    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
                    print(f"{spec} {phase} {sel['mode']} tie {tie:.2f}: within 3% {sum(x <= 1.03 for x in ratios)}/"
                          f"{len(ratios)}, geomean {gm:.3f}x, worst {max(ratios):.2f}x")


if __name__ == "__main__":
    main()
