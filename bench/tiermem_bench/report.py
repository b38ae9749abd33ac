"""Writing runs as CSV/JSON and formatting the printed tables."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tiermem_bench import stats
from tiermem_bench.runner import CSV_FIELDS
from tiermem_bench.systems import GROUPS, SYSTEMS, UNLIMITED

SCHEMA_VERSION = 1


def write_csv(runs: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for run in runs:
            writer.writerow({k: ("" if run.get(k) is None else run.get(k)) for k in CSV_FIELDS})


def write_json(runs: list[dict], meta: dict, summary: dict, path: Path) -> None:
    document = {
        "schema": SCHEMA_VERSION,
        "meta": meta,
        "runs": runs,
        "points": [{"workload": w, "system": s, "ratio": r, **v} for (w, s, r), v in sorted(
            summary.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0))],
    }
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


def _fmt(value, spec="{:.2f}", none="-"):
    return none if value is None else spec.format(value)


def _rows_per_point(found: dict, systems: list[str], ratios: list[int], cell, width: int = 12,
                    label: int = 30) -> list[str]:
    """One row per workload and system with a cell per ratio, `width` characters: `cell(values)`
    of the values found for that point, '-' where there are none; rows with no values left out.
    The workload and system take `label` characters."""
    rows = []
    for workload in sorted({w for w, _, _ in found}):
        for system in systems:
            cells = [cell(found[(workload, system, r)]) if found.get((workload, system, r)) else "-" for r in ratios]
            if any(c != "-" for c in cells):
                rows.append(f"  {workload + ' ' + system:<{label}}" + "".join(f" {c:>{width - 1}}" for c in cells))
    return rows


def _prefetch_table(runs: list[dict], systems: list[str], ratios: list[int], label: int = 30) -> list[str]:
    """One row per workload and tiermem system: the engine's prefetch accuracy / coverage at
    each ratio, '-' where no run reported them. Empty when no run did."""
    def accuracy_coverage(run):
        merged = (run.get("tiermem_stats") or {}).get("merged") or {}
        if merged.get("prefetch_accuracy") is None:
            return None
        return merged["prefetch_accuracy"], merged.get("prefetch_coverage") or 0.0

    found = _values_per_point(runs, accuracy_coverage)
    return _rows_per_point(found, systems, ratios, lambda pairs: (
        f"{stats.median([a for a, _ in pairs]):.0%}/{stats.median([c for _, c in pairs]):.0%}"), label=label)


def _values_per_point(runs: list[dict], value) -> dict:
    """(workload, system, ratio) -> what `value` gives for each successful limited run of that
    point, runs it gives None for left out."""
    found = {}
    for run in runs:
        got = value(run) if run.get("status") == "ok" and run.get("ratio") is not None else None
        if got is not None:
            found.setdefault((run["workload"], run["system"], run["ratio"]), []).append(got)
    return found


def device_traffic(run: dict) -> tuple[int, int] | None:
    """Bytes (read, written) a run moved to and from its paging device: tiermem's device
    counters summed over its processes, else the kernel's swap traffic; None when neither was
    recorded."""
    processes = (run.get("tiermem_stats") or {}).get("processes") or []
    devices = [p.get("device") or {} for p in processes]
    if any("bytes_read_medium" in d for d in devices):
        return (sum(d.get("bytes_read_medium", 0) for d in devices),
                sum(d.get("bytes_written_medium", 0) for d in devices))
    if run.get("swap_in_bytes") is not None and run.get("swap_out_bytes") is not None:
        return run["swap_in_bytes"], run["swap_out_bytes"]
    return None


# Cells of the traffic table: room for "123456/123456" (MiB), as a full-scale run at 60% reaches.
TRAFFIC_WIDTH = 16


def _traffic_table(runs: list[dict], systems: list[str], ratios: list[int], label: int = 30) -> list[str]:
    """One row per workload and system: MiB read/written at each ratio (median of the
    successful runs), '-' where none recorded it. Empty when no run did."""
    found = _values_per_point(runs, device_traffic)
    mib = 1 << 20
    return _rows_per_point(found, systems, ratios, lambda pairs: (
        f"{stats.median([r for r, _ in pairs]) / mib:.0f}/{stats.median([w for _, w in pairs]) / mib:.0f}"),
        TRAFFIC_WIDTH, label)


def disk_rates(run: dict) -> tuple[float, float] | None:
    """Requests a second (read, written) the scratch directory's disk completed during a run,
    over its wall time; None when they were not counted."""
    reads, writes, wall = run.get("disk_reads"), run.get("disk_writes"), run.get("wall_s")
    if reads is None or writes is None or not wall:
        return None
    return reads / wall, writes / wall


def _disk_table(runs: list[dict], systems: list[str], ratios: list[int], label: int = 30) -> list[str]:
    """One row per workload and system: thousands of disk requests a second read/written at
    each ratio (median of the successful runs). Empty when no run counted them."""
    return _rows_per_point(_values_per_point(runs, disk_rates), systems, ratios, lambda pairs: (
        f"{stats.median([r for r, _ in pairs]) / 1000:.1f}/{stats.median([w for _, w in pairs]) / 1000:.1f}"),
        TRAFFIC_WIDTH, label)


# The engine's paths that are page faults (Ultraswap Table 6 counts page faults).
FAULT_PATHS = ("critical_fault", "zero_fault", "hit_fault", "wp_fault")


def engine_faults(run: dict) -> int | None:
    """Page faults the engine served in a run (on demand, zero-fill, waiting for a prefetch,
    write protection), None when the run has no engine statistics."""
    paths = ((run.get("tiermem_stats") or {}).get("merged") or {}).get("paths")
    if not paths:
        return None
    return sum(p.get("count", 0) for p in paths if p.get("path") in FAULT_PATHS)


# Cells of the work/outside table: room for "123.4/123.4" (seconds).
SPLIT_WIDTH = 13


def outside_work(run: dict) -> float | None:
    """Seconds of a run outside the workload's own timed part (`work_s`, what its Timer
    measured: reading its input and computing): starting the program, an interpreter's
    imports, and its exit. None when the workload timed nothing."""
    wall, work = run.get("wall_s"), run.get("work_s")
    if not isinstance(wall, (int, float)) or not _timed(run):
        return None
    return max(0.0, wall - work)


def _timed(run: dict) -> bool:
    """Whether the workload reported its timed part."""
    return isinstance(run.get("work_s"), (int, float))


def _work_section(runs: list[dict], systems: list[str], ratios: list[int], label: int) -> list[str]:
    """Where the time goes: per point, the median seconds of the workload's timed part and of
    the rest of the run (start, imports, exit), and the speed-up over Linux swap and the gap
    closed on the timed part alone. An explanation of the figures above, which are spawn to exit
    and stay the result: an interpreter's start and exit are part of what a user waits for.
    Empty when no run timed its work."""
    timed = [r for r in runs if _timed(r) and r.get("status") == "ok"]
    if not timed:
        return []
    found = {}
    for run in timed:
        if run.get("ratio") is not None:
            found.setdefault((run["workload"], run["system"], run["ratio"]), []).append(
                (run["work_s"], outside_work(run)))
    lines = ["Where the time goes: seconds in the workload's timed part / outside it (the program's start, "
             "imports and exit), median of the successful runs",
             f"{'':<{label + 2}}" + "".join(f"{str(r) + '%':>{SPLIT_WIDTH}}" for r in ratios)]
    lines.extend(_rows_per_point(found, systems, ratios, lambda pairs: (
        f"{stats.median([w for w, _ in pairs]):.1f}/{stats.median([o for _, o in pairs]):.1f}"),
        SPLIT_WIDTH, label))
    lines.append("")
    # The failed runs count as failures here too; a successful run that timed nothing is left out.
    summary = stats.summarise([r for r in runs if r["status"] != "ok" or _timed(r)], "work_s")
    speedup = _speedup_lines(summary, systems, ratios, "Speed-up over Linux swap on the timed part alone (geometric "
                             "mean over the workloads where both completed; not the result, which is spawn to exit)")
    if speedup:
        lines.extend(speedup)
        if stats.FILE in systems and stats.IDEAL in systems:
            lines.append(_ratio_row("gap closed by tiermem-file", stats.gap_closed(stats.normalised(summary), ratios),
                                    ratios, "{:.0%}"))
        lines.append("")
    return lines


def _time_spent_section(runs: list[dict], systems: list[str], ratios: list[int]) -> list[str]:
    """What running the matrix cost: seconds of wall time summed over every run (failed ones
    too, which cost their time as well) per system and ratio, a total per system, and how much
    of it the baselines took, the unlimited reference, Linux swap and the ideal, which a matrix
    has to run whatever tiermem-file takes. Empty without runs that took time."""
    spent: dict[tuple[str, int | None], float] = {}
    for run in runs:
        wall = run.get("wall_s")
        if isinstance(wall, (int, float)):
            key = (run["system"], run.get("ratio"))
            spent[key] = spent.get(key, 0.0) + wall
    if not spent:
        return []
    lines = ["Time spent running: seconds of wall time summed over the runs (failed ones too) per system and ratio",
             f"{'':<32}" + "".join(f"{str(r) + '%':>9}" for r in ratios) + f"{'total':>9}"]
    totals = {}
    for system in [UNLIMITED, *systems]:
        cells = [spent.get((system, r)) for r in ratios] if system != UNLIMITED else [None] * len(ratios)
        totals[system] = sum(v for (s, _), v in spent.items() if s == system)
        if totals[system] or system != UNLIMITED:
            lines.append(f"  {system:<30}" + "".join(f"{_fmt(c, '{:.0f}'):>9}" for c in cells)
                         + f"{totals[system]:>9.0f}")
    baselines = [s for s in (UNLIMITED, stats.SWAP, stats.IDEAL) if s == UNLIMITED or s in systems]
    everything = sum(spent.values())
    lines.append(f"  all runs: {everything:.0f} s, of which the baselines ({', '.join(baselines)}) "
                 f"{sum(totals.get(s, 0.0) for s in baselines):.0f} s")
    lines.append("")
    return lines


def _ratio_row(name: str, row: dict, ratios: list[int], spec: str) -> str:
    """A row of a per-ratio summary: `name`, then row[ratio] for each ratio and row["avg"]."""
    return f"  {name:<30}" + "".join(f"{_fmt(row[r], spec):>9}" for r in [*ratios, "avg"])


def _ratio_header(ratios: list[int]) -> str:
    """The header of a per-ratio summary whose rows are [`_ratio_row`]s."""
    return f"{'':<32}" + "".join(f"{str(r) + '%':>9}" for r in ratios) + f"{'avg':>9}"


def _speedup_lines(summary: dict, systems: list[str], ratios: list[int], title: str) -> list[str]:
    """`title`, a header and each system's speed-up over Linux swap per ratio and on average;
    empty without Linux swap in the run (nothing to divide by)."""
    table = stats.speedup_table(summary, systems, ratios) if stats.SWAP in systems else {}
    if not table:
        return []
    return [title, _ratio_header(ratios)] + [
        _ratio_row(system, row, ratios, "{:.2f}x") for system, row in table.items()]


def _medians(runs: list[dict], value) -> dict:
    """(workload, system, ratio) -> median of `value(run)` over the successful limited runs
    where it is not None."""
    found = {}
    for run in runs:
        if run.get("status") != "ok" or run.get("ratio") is None:
            continue
        v = value(run)
        if v is not None:
            found.setdefault((run["workload"], run["system"], run["ratio"]), []).append(v)
    return {k: stats.median(v) for k, v in found.items()}


def _variants_section(runs: list[dict], summary: dict, systems: list[str], ratios: list[int]) -> list[str]:
    """Ultraswap §4.4 for the variants run beside tiermem-file: their time relative to it
    (Fig. 9), the page faults of poll-only against it (Table 6), and the kernel CPU time with
    reclaim on the fault path against background reclaim (Table 7). Empty without them."""
    variants = [s for s in systems if s in GROUPS["variants"]]
    if stats.FILE not in systems or not variants:
        return []
    workloads = sorted({w for w, s, r in summary if s == stats.FILE and r is not None})
    header = f"{'':<32}" + "".join(f"{str(r) + '%':>12}" for r in ratios)
    lines = ["Ultraswap §4.4, Fig. 9: each variant's time / tiermem-file's (median of the successful runs; "
             "> 1 = the variant is slower; geometric mean over the workloads both completed)", header]

    def median_s(workload, system, ratio):
        point = summary.get((workload, system, ratio))
        return point and point["median_s"]

    for variant in variants:
        lines.append(f"  {variant}")
        for workload in workloads:
            cells = []
            for ratio in ratios:
                mine, base = median_s(workload, variant, ratio), median_s(workload, stats.FILE, ratio)
                cells.append(f"{mine / base:.2f}" if mine and base else "-")
            lines.append(f"    {workload:<28}" + "".join(f"{c:>12}" for c in cells))
        means = []
        for ratio in ratios:
            pairs = [(median_s(w, variant, ratio), median_s(w, stats.FILE, ratio)) for w in workloads]
            quotients = [m / b for m, b in pairs if m and b]
            means.append(f"{stats.geomean(quotients):.2f}" if quotients else "-")
        lines.append(f"    {'geometric mean':<28}" + "".join(f"{c:>12}" for c in means))
    lines.append("")
    faults = _medians(runs, engine_faults)
    poll = "tiermem-poll-only"
    if poll in variants and any(k[1] == poll for k in faults):
        lines.append("Table 6: page faults the engine served, thousands, tiermem-file / poll-only (median)")
        lines.append(header)
        lines.extend(_rows_pair(faults, workloads, ratios, stats.FILE, poll, lambda v: f"{v / 1000:.0f}"))
        lines.append("")
    kernel = _medians(runs, lambda run: run.get("sys_s"))
    on_fault = "tiermem-reclaim-on-fault-path"
    if on_fault in variants and any(k[1] == on_fault for k in kernel):
        lines.append("Table 7: kernel CPU seconds of the program, background reclaim (tiermem-file) / reclaim on "
                     "the fault path (median)")
        lines.append(header)
        lines.extend(_rows_pair(kernel, workloads, ratios, stats.FILE, on_fault, lambda v: f"{v:.1f}"))
        lines.append("")
    return lines


def _rows_pair(values: dict, workloads: list[str], ratios: list[int], first: str, second: str, fmt) -> list[str]:
    """One row per workload: `first`'s value / `second`'s at each ratio, '-' where one is missing."""
    rows = []
    for workload in workloads:
        cells = []
        for ratio in ratios:
            a, b = values.get((workload, first, ratio)), values.get((workload, second, ratio))
            cells.append(f"{fmt(a)}/{fmt(b)}" if a is not None and b is not None else "-")
        rows.append(f"  {workload:<30}" + "".join(f"{c:>12}" for c in cells))
    return rows


def device_line(meta: dict) -> str:
    """What the device read when the matrix began and ended (empty when not measured): a 4 KiB
    read's latency and, where the probe measured it, the disk's rate of them with several in
    flight, against which the table's *Disk requests* read."""
    measured = meta.get("device_read_latency_us") or {}
    parts = [f"{_fmt(measured[k], '{:.0f} µs')} {k}" for k in ("before", "after") if measured.get(k) is not None]
    if not parts:
        return ""
    rates = meta.get("device_read_rate") or {}
    rated = [(k, rates[k]) for k in ("before", "after") if (rates.get(k) or {}).get("reads_per_s") is not None]
    served = ""
    if rated:  # "; with 32 in flight it served 133k reads a second before and 126k after"
        cells = [f"{rate['reads_per_s'] / 1000:.0f}k{' reads a second' if i == 0 else ''} {k}"
                 for i, (k, rate) in enumerate(rated)]
        served = f"; with {rated[0][1].get('depth')} in flight it served {' and '.join(cells)}"
    return f"Device: a 4 KiB read took {' and '.join(parts)} the matrix{served} (tiermem probe --latency)\n\n"


def machine_line(meta: dict) -> str:
    """What paging costs on the machine the matrix ran on (empty when not measured): on a VM a
    TLB shootdown and a thread wake-up cost many times what they do on bare metal, and every
    eviction of a scattered page, every fault a handler thread serves, pays them."""
    machine = meta.get("machine") or {}
    facts, costs = machine.get("facts") or {}, machine.get("costs") or {}
    if not facts:
        return ""
    cpus = facts.get("cpus", "?")
    what = f"{cpus} CPU{'' if cpus == 1 else 's'}"
    if facts.get("virtual_machine"):
        what += ", a virtual machine"
        if facts.get("guest_halt_poll_ns") == 0:
            what += " without guest halt polling"
    measured = [f"{label} {_fmt(costs.get(key), '{:.1f} µs')}"
                for label, key in (("TLB shootdown", "tlb_shootdown_us"), ("thread wake-up", "thread_wakeup_us"),
                                   ("page map", "page_map_us")) if costs.get(key) is not None]
    return f"Machine: {what}; {', '.join(measured) or 'costs not measured'} (tiermem probe --machine)\n"


def format_tables(runs: list[dict], systems: list[str], ratios: list[int]) -> str:
    """The printed result: per-workload normalised medians with failure counts, the speed-up
    over Linux swap per ratio and on average, the gap closed, and every failed point."""
    summary = stats.summarise(runs)
    norm = stats.normalised(summary)
    workloads = sorted({r["workload"] for r in runs})
    lines = []
    header = f"{'':<32}" + "".join(f"{str(r) + '%':>12}" for r in ratios)
    lines.append("Execution time normalised to the unlimited run (median of the successful runs; "
                 "'x' = every run failed; (k/n) = k of n runs failed)")
    for workload in workloads:
        base = summary.get((workload, UNLIMITED, None))
        base_s = _fmt(base and base["median_s"], "{:.2f} s")
        lines.append(f"{workload}  (unlimited: {base_s})")
        lines.append(header)
        for system in systems:
            cells = []
            for ratio in ratios:
                s = summary.get((workload, system, ratio))
                if s is None:
                    cells.append("")
                    continue
                value = norm.get((workload, system, ratio))
                cell = "x" if value is None else f"{value:.2f}"
                if s["failures"]:
                    cell += f"({s['failures']}/{s['runs']})"
                cells.append(cell)
            lines.append(f"  {system:<30}" + "".join(f"{c:>12}" for c in cells))
        lines.append("")

    speedup = _speedup_lines(summary, systems, ratios, "Speed-up over Linux swap (Linux swap time / system time; "
                             "geometric mean over the workloads where both completed)")
    if speedup:
        lines.extend(speedup + [""])
    spread = stats.spread_table(summary, systems, ratios)
    if any(m is not None for row in spread.values() for m, _ in row.values()):
        lines.append("Run-to-run spread (slowest / fastest successful run of a point; median over the workloads, "
                     "worst in brackets)")
        lines.append(header)
        for system, row in spread.items():
            cells = [f"{m:.2f} ({w:.2f})" if m is not None else "-" for m, w in row.values()]
            if system == UNLIMITED:
                cells = cells + [""] * (len(ratios) - 1)
            lines.append(f"  {system:<30}" + "".join(f"{c:>12}" for c in cells))
        lines.append("")
    if stats.FILE in systems and stats.IDEAL in systems and stats.SWAP in systems:
        gap = stats.gap_closed(norm, ratios)
        lines.append("Share of the gap between Linux swap and the ideal (tiermem-mem) closed by tiermem-file")
        lines.append(_ratio_header(ratios))
        lines.append(_ratio_row("tiermem-file", gap, ratios, "{:.0%}"))
        lines.append("")
    lines.extend(_variants_section(runs, summary, systems, ratios))
    # Rows named by workload and system: as wide as the longest pair (the §4.4 variants' names
    # are long).
    label = max([30] + [len(w) + 1 + len(s) for w in workloads for s in systems])
    def section(title: str, rows: list[str], width: int) -> None:
        # A titled table with a ratio header, left out when no run gave it a row.
        if rows:
            lines.append(title)
            lines.append(f"{'':<{label + 2}}" + "".join(f"{str(r) + '%':>{width}}" for r in ratios))
            lines.extend(rows)
            lines.append("")

    section("tiermem's prefetching: accuracy / coverage (median of the successful runs; "
            "estimated from sampled prefetches)",
            _prefetch_table(runs, [s for s in systems if s.startswith("tiermem")], ratios, label), 12)
    section("Paging traffic: MiB read / written (median of the successful runs; tiermem's device counters, "
            "Linux swap's pswpin/pswpout)", _traffic_table(runs, systems, ratios, label), TRAFFIC_WIDTH)
    section("Disk requests: thousands a second read / written during the run (the scratch directory's disk, "
            "after the block layer's merging; all of its I/O, the program's files too)",
            _disk_table(runs, systems, ratios, label), TRAFFIC_WIDTH)
    lines.extend(_work_section(runs, systems, ratios, label))
    lines.extend(_time_spent_section(runs, systems, ratios))
    failures = stats.failure_table(summary)
    lines.append("Failed runs" if failures else "Failed runs: none")
    for workload, system, ratio, failed, total, statuses in failures:
        where = "unlimited" if ratio is None else f"{ratio}%"
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()) if k != "ok")
        lines.append(f"  {workload:<10} {system:<30} {where:>9}: {failed}/{total} failed ({failed / total:.0%}; {kinds})")
    return "\n".join(lines) + "\n"


def compare_runs(base: list[dict], new: list[dict]) -> str:
    """An A/B of two sets of runs of the same matrix (the same harness with two tiermem builds,
    say): per point (workload, ratio, system) each side's median time and MiB read over its
    successful runs, and new/base of the times; then the geometric mean of new/base over the
    points both sides completed in every run: over the tiermem systems (Linux swap does not run
    the build being judged: its lines show how much the machine drifted between the sides), per
    system, and per system and ratio. A point where a run of either side failed has no time to
    compare: it is listed apart, and every mean says how many such points it left out. Runs are
    expected validated (see `cli.compare`)."""
    mib = 1 << 20
    summaries = [stats.summarise([r for r in runs if r["system"] != UNLIMITED and r["ratio"] is not None])
                 for runs in (base, new)]
    reads = [_medians(runs, lambda r: (device_traffic(r) or (None,))[0]) for runs in (base, new)]

    def side(k, key):
        point = summaries[k][key]
        if point["median_s"] is None:
            return f"- (0/{point['runs']} ok)"
        read = reads[k].get(key)
        text = f"{point['median_s']:.2f} s" + ("" if read is None else f" {read / mib:.0f} MiB")
        return f"{text} ({point['ok']}/{point['runs']} ok)"

    def groups(system, ratio):
        tiermem = SYSTEMS.get(system) is not None and SYSTEMS[system].kind == "tiermem"
        return ([("tiermem",)] if tiermem else []) + [(system,), (system, ratio)]

    before, after = summaries
    keys = sorted(set(before) | set(after), key=lambda k: (k[0], -k[2], k[1]))
    cells = {key: [side(k, key) if key in summaries[k] else "" for k in (0, 1)] for key in keys}
    width = max([27] + [len(c) + 1 for pair in cells.values() for c in pair])
    lines = ["Time of the new runs against the base runs, per point (median of the successful runs; MiB read "
             "from the paging device)",
             f"  {'workload':<10} {'ratio':>5}  {'system':<30} {'base':<{width}} {'new':<{width}} new/base"]
    ratios: dict[tuple, list[float]] = {}
    left_out: dict[tuple, int] = {}
    failed, unmatched = [], []
    for key in keys:
        workload, system, ratio = key
        (b, n), (b_text, n_text) = (before.get(key), after.get(key)), cells[key]
        if b is None or n is None:
            unmatched.append(f"{workload} {ratio}% {system}: only in the {'base' if b else 'new'} runs")
            continue
        cell = "-"
        if b["failures"] == 0 and n["failures"] == 0:
            ratio_of_times = n["median_s"] / b["median_s"]
            cell = f"{ratio_of_times:.3f}x"
            for group in groups(system, ratio):
                ratios.setdefault(group, []).append(ratio_of_times)
        else:
            failed.append(f"{workload} {ratio}% {system}: base {b_text}, new {n_text}")
            for group in groups(system, ratio):
                left_out[group] = left_out.get(group, 0) + 1
        lines.append(f"  {workload:<10} {ratio:>4}%  {system:<30} {b_text:<{width}} {n_text:<{width}} {cell}")
    lines.append("")
    every = sorted(set(ratios) | set(left_out), key=lambda g: (len(g), g[0] != "tiermem", g[0], -(g[1:] or (0,))[0]))
    if not every:
        lines.append("No point is in both sets of runs: nothing to compare.")
    else:
        lines.append("Geometric mean of new/base over the points completed in every run on both sides")
        for group in every:
            label = "all tiermem systems" if group == ("tiermem",) else " ".join(
                [group[0]] + [f"{r}%" for r in group[1:]])
            mean = f"{stats.geomean(ratios[group]):.3f}x" if group in ratios else "-"
            extra = f" ({left_out[group]} with a failed run left out)" if left_out.get(group) else ""
            lines.append(f"  {label:<36} {mean:>7} over {len(ratios.get(group, []))}{extra}")
    for title, items in (("Points with a failed run (left out of the means)", failed),
                         ("Points on one side only", unmatched)):
        if items:
            lines += ["", title] + [f"  {item}" for item in items]
    return "\n".join(lines) + "\n"
