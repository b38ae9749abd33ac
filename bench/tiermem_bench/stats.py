"""Aggregation: medians per point, failure rates, normalised times, speed-ups over Linux swap and
the share of the Linux-swap-to-ideal gap a system closes. Pure functions over run dicts."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from tiermem_bench.runner import OK
from tiermem_bench.systems import UNLIMITED

SWAP = "linux-swap"
IDEAL = "tiermem-mem"
FILE = "tiermem-file"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def geomean(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    if any(v <= 0 for v in values):
        raise ValueError("geometric mean of non-positive values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def spread(times):
    """Slowest over fastest, or None with fewer than two positive times."""
    times = [t for t in times if t is not None and t > 0]
    return max(times) / min(times) if len(times) >= 2 else None


def spread_table(summary: dict, systems: list[str], ratios: list[int]) -> dict:
    """{system: {ratio: (median, worst) spread over the workloads}}, the unlimited runs under
    ratio None; (None, None) where no point had two successful runs."""
    out = {}
    for system, points in [(UNLIMITED, [None])] + [(s, ratios) for s in systems]:
        row = {}
        for ratio in points:
            values = [v["spread"] for (_, name, r), v in summary.items()
                      if name == system and r == ratio and v["spread"] is not None]
            row[ratio] = (median(values), max(values)) if values else (None, None)
        out[system] = row
    return out


def summarise(runs: list[dict], time_key: str = "wall_s") -> dict:
    """{(workload, system, ratio): {"runs", "ok", "failures", "failure_rate", "median_s",
    "spread", "statuses"}}; the median is over the successful runs only (None when none
    succeeded), the spread is the slowest successful run's time over the fastest's (None with
    fewer than two)."""
    groups = defaultdict(list)
    for run in runs:
        groups[(run["workload"], run["system"], run["ratio"])].append(run)
    out = {}
    for key, group in groups.items():
        ok = [r for r in group if r["status"] == OK]
        statuses = defaultdict(int)
        for r in group:
            statuses[r["status"]] += 1
        out[key] = {
            "runs": len(group),
            "ok": len(ok),
            "failures": len(group) - len(ok),
            "failure_rate": (len(group) - len(ok)) / len(group),
            "median_s": median(r[time_key] for r in ok),
            "spread": spread([r[time_key] for r in ok]),
            "statuses": dict(statuses),
        }
    return out


def normalised(summary: dict) -> dict:
    """{(workload, system, ratio): median time / the unlimited run's median time of that workload}."""
    base = {w: s["median_s"] for (w, system, _), s in summary.items() if system == UNLIMITED}
    out = {}
    for (workload, system, ratio), s in summary.items():
        b = base.get(workload)
        if system == UNLIMITED or s["median_s"] is None or not b:
            continue
        out[(workload, system, ratio)] = s["median_s"] / b
    return out


def speedups(summary: dict, system: str, baseline: str = SWAP) -> dict:
    """{(workload, ratio): baseline median / system median}, where both have a median."""
    out = {}
    for (workload, name, ratio), s in summary.items():
        if name != system:
            continue
        b = summary.get((workload, baseline, ratio))
        if b and b["median_s"] and s["median_s"]:
            out[(workload, ratio)] = b["median_s"] / s["median_s"]
    return out


def speedup_table(summary: dict, systems: list[str], ratios: list[int]) -> dict:
    """{system: {ratio: geometric mean over workloads, "avg": geometric mean over all points}}."""
    table = {}
    for system in systems:
        if system in (SWAP, UNLIMITED):
            continue
        per_point = speedups(summary, system)
        row = {ratio: geomean([v for (w, r), v in per_point.items() if r == ratio]) for ratio in ratios}
        row["avg"] = geomean(list(per_point.values()))
        table[system] = row
    return table


def gap_closed(norm: dict, ratios: list[int], system: str = FILE, swap: str = SWAP, ideal: str = IDEAL) -> dict:
    """Share of the gap between Linux swap and the ideal that `system` closes, per ratio and
    overall ("avg"): sum(swap - system) / sum(swap - ideal) over the workloads where all three
    completed, in normalised time. 1.0 means as fast as the ideal, 0.0 as slow as Linux swap.
    None where there is no gap (Linux swap already as fast as the ideal) or no complete point."""
    def share(points):
        closed = gap = 0.0
        for workload, ratio in points:
            s, t, i = norm[(workload, swap, ratio)], norm[(workload, system, ratio)], norm[(workload, ideal, ratio)]
            closed += s - t
            gap += s - i
        return closed / gap if gap > 0 else None

    complete = sorted({(w, r) for (w, name, r) in norm
                       if name == swap and (w, system, r) in norm and (w, ideal, r) in norm})
    out = {ratio: share([p for p in complete if p[1] == ratio]) for ratio in ratios}
    out["avg"] = share(complete)
    return out


def failure_table(summary: dict) -> list[tuple]:
    """[(workload, system, ratio, failures, runs, statuses)] for every point with a failure."""
    rows = []
    for (workload, system, ratio), s in sorted(summary.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        if s["failures"]:
            rows.append((workload, system, ratio, s["failures"], s["runs"], s["statuses"]))
    return rows
