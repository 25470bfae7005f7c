"""The held-out bench's statistics: per group of cells and strategy, the share of cells within WITHIN (3%) of the
cell's fastest valid backend, the geometric-mean slowdown and the worst slowdown, each with a 95% confidence
interval from a bootstrap over the cells (numpy, seeded: the same numbers on every run), and under CUDA graphs the
per-batch-size bound: the best single backend per decode batch size, chosen afterwards from the cells' own times.

A strategy's value in a cell is its pick's time over the cell's fastest, or None where its pick has no time there
(it failed in that cell): a miss for the within-3% share, outside the geometric mean and the worst (as
bench.summarise counts it). The bootstrap interval of the worst cannot reach above the observed worst: read it as
how much the worst depends on a few cells, not as a bound on what another draw could find.
"""
from __future__ import annotations

import math

import numpy as np

from .bench import WITHIN

BOOTSTRAP = 2000  # resamples per interval
LEVEL = 0.95
BOUND = "batch_bound"  # the per-batch-size bound's strategy name in rows and summaries
STRATEGIES = ("selected", "one_backend", "static", BOUND, "repeat")


def point_stats(values: list[float | None]) -> dict:
    """within (share of all values), geomean and worst (over the values that are not None)."""
    if not values:
        raise ValueError("no cells to summarise")
    ratios = [v for v in values if v is not None]
    if any(not (v >= 1.0 and math.isfinite(v)) for v in ratios):
        raise ValueError(f"slowdowns are times over the cell's fastest (>= 1, finite), got {sorted(ratios)[:3]}")
    return {"within": sum(v <= 1 + WITHIN for v in ratios) / len(values),
            "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
            "worst": max(ratios) if ratios else None}


def bootstrap(values: list[float | None], seed: int, resamples: int = BOOTSTRAP, level: float = LEVEL) -> dict:
    """[low, high] percentile intervals of within, geomean and worst over ``resamples`` resamples of the cells (with
    replacement; a resample without a timed value has no geomean or worst and is left out of those intervals)."""
    point_stats(values)  # the same checks
    arr = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    rng = np.random.default_rng(seed)
    sample = arr[rng.integers(0, arr.size, size=(resamples, arr.size))]
    timed = ~np.isnan(sample)
    within = np.mean(timed & (np.nan_to_num(sample, nan=np.inf) <= 1 + WITHIN), axis=1)
    counts = timed.sum(axis=1)
    logs = np.where(timed, np.log(np.where(timed, sample, 1.0)), 0.0)
    has = counts > 0
    geomean = np.exp(logs.sum(axis=1)[has] / counts[has])
    worst = np.where(timed, sample, -np.inf).max(axis=1)[has]
    tail = (1 - level) / 2 * 100

    def interval(xs: np.ndarray) -> list[float] | None:
        if xs.size == 0:
            return None
        lo, hi = np.percentile(xs, [tail, 100 - tail])
        return [float(lo), float(hi)]

    return {"within_ci": interval(within), "geomean_ci": interval(geomean), "worst_ci": interval(worst)}


def batch_bound(rows: list[dict]) -> None:
    """Add the per-batch-size bound (``BOUND`` and ``BOUND + "_ratio"``) to the CUDA-graph decode rows: per (spec,
    batch size) the one backend that is within WITHIN of the fastest in the most of that batch size's cells (ties:
    fewer cells without a time, then the least geometric mean), chosen from the cells' own times (``ratios``: each
    backend's time over the fastest). No per-batch dispatch judged on these cells can be within 3% more often; the
    choice is made once, not per bootstrap resample."""
    groups: dict = {}
    for r in rows:
        if r["phase"] in ("decode", "extend") and r["mode"] == "graph":
            groups.setdefault((r["spec"], r["phase"], r["batch"]), []).append(r)
    for group in groups.values():
        names = sorted({n for r in group for n in r["ratios"]})

        def score(name: str) -> tuple:
            ratios = [r["ratios"].get(name) for r in group]
            timed = [x for x in ratios if x is not None]
            within = sum(x <= 1 + WITHIN for x in timed)
            mean_log = sum(map(math.log, timed)) / len(timed) if timed else math.inf
            return (-within, len(ratios) - len(timed), mean_log, name)

        best = min(names, key=score)
        for r in group:
            r[BOUND], r[BOUND + "_ratio"] = best, r["ratios"].get(best)


def summarise(rows: list[dict], seed: int) -> list[dict]:
    """Per (spec, phase, mode) and over all specs ("all"), each strategy's point values and intervals; under CUDA
    graphs decode once more over the cells at untimed batch sizes (phase "decode, untimed batch")."""
    groups: dict = {}
    for r in rows:
        phases = [r["phase"]]
        if r["phase"] == "decode" and r["mode"] == "graph" and not r.get("timed_batch"):
            phases.append("decode, untimed batch")
        for phase in phases:
            for spec in (r["spec"], "all"):
                groups.setdefault((spec, phase, r["mode"]), []).append(r)
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    order = {s: i for i, s in enumerate(["all", *specs])}
    out = []
    for (spec, phase, mode), group in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][2], kv[0][1])):
        if spec == "all" and len(specs) == 1:
            continue
        for strategy in STRATEGIES:
            values = [r.get(f"{strategy}_ratio") for r in group if r.get(strategy)]
            if not values:
                continue
            out.append({"spec": spec, "phase": phase, "mode": mode, "strategy": strategy, "cells": len(group),
                        "timed": len(values), "no_time": sum(v is None for v in values),
                        **point_stats(values), **bootstrap(values, seed)})
    return out


def fmt_share(s: dict) -> str:
    ci = s["within_ci"]
    return f"{s['within']:.0%} [{ci[0]:.0%}, {ci[1]:.0%}]" + (f" ({s['no_time']} no time)" if s["no_time"] else "")


def fmt_ratio(s: dict, key: str) -> str:
    if s[key] is None:
        return "-"
    ci = s[f"{key}_ci"]
    return f"{s[key]:.3f}x [{ci[0]:.3f}, {ci[1]:.3f}]"
