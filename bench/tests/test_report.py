"""CSV and JSON schema of the outputs, the printed tables and the plot."""

import csv
import json
import re

from tiermem_bench import report, stats
from tiermem_bench.runner import CSV_FIELDS, STATUSES, RunRecord


def make_runs():
    runs = []
    for system, ratio, wall, status in [("unlimited", None, 1.0, "ok"), ("linux-swap", 100, 1.2, "ok"),
                                        ("linux-swap", 20, 4.0, "ok"), ("linux-swap", 20, 0.5, "oom"),
                                        ("tiermem-file", 100, 1.1, "ok"), ("tiermem-file", 20, 2.0, "ok"),
                                        ("tiermem-mem", 100, 1.0, "ok"), ("tiermem-mem", 20, 1.5, "ok")]:
        rec = RunRecord(workload="sortw", system=system, ratio=ratio, repeat=1, limit_bytes=None if ratio is None
                        else 1000 * ratio, footprint_bytes=100000, status=status, wall_s=wall, digest="d")
        runs.append(rec.to_dict())
    return runs


def test_csv_has_one_row_per_run_with_the_documented_columns(tmp_path):
    runs = make_runs()
    report.write_csv(runs, tmp_path / "runs.csv")
    with open(tmp_path / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(runs)
    assert list(rows[0].keys()) == CSV_FIELDS
    for needed in ("workload", "system", "ratio", "repeat", "status", "wall_s", "limit_bytes", "footprint_bytes",
                   "digest", "expected_digest", "oom_kills", "peak_bytes"):
        assert needed in CSV_FIELDS
    assert rows[0]["ratio"] == ""  # the unlimited run has no ratio
    assert {r["status"] for r in rows} <= set(STATUSES)
    assert float(rows[2]["wall_s"]) == 4.0


def test_json_has_meta_runs_and_points(tmp_path):
    runs = make_runs()
    report.write_json(runs, {"scale": "tiny"}, stats.summarise(runs), tmp_path / "runs.json")
    doc = json.loads((tmp_path / "runs.json").read_text())
    assert doc["schema"] == report.SCHEMA_VERSION
    assert doc["meta"] == {"scale": "tiny"}
    assert len(doc["runs"]) == len(runs)
    point = next(p for p in doc["points"] if p["system"] == "linux-swap" and p["ratio"] == 20)
    assert point["runs"] == 2 and point["failures"] == 1 and point["median_s"] == 4.0
    assert point["failure_rate"] == 0.5


def test_table_shows_speedup_gap_and_failures():
    text = report.format_tables(make_runs(), ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    # normalised: swap 20% = 4.0 with 1 of 2 runs failed
    assert "4.00(1/2)" in text
    # speed-up at 20%: 4.0 / 2.0 = 2.00x; at 100%: 1.2 / 1.1 = 1.09x
    assert "2.00x" in text and "1.09x" in text
    # gap at 20%: (4 - 2) / (4 - 1.5) = 80%; at 100%: (1.2 - 1.1) / (1.2 - 1.0) = 50%
    assert "80%" in text and "50%" in text
    assert "sortw      linux-swap" in text and "1/2 failed (50%; oom 1)" in text


def test_plot_writes_a_png(tmp_path):
    from tiermem_bench import plot

    path = plot.plot(make_runs(), ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20], tmp_path / "a.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_table_shows_prefetch_accuracy_and_coverage_of_tiermem_runs():
    runs = make_runs()
    for run, (accuracy, coverage) in zip([r for r in runs if r["system"] == "tiermem-file"], [(0.9, 0.5), (0.25, 1.0)]):
        run["tiermem_stats"] = {"merged": {"prefetch_accuracy": accuracy, "prefetch_coverage": coverage}}
    text = report.format_tables(runs, ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    assert "accuracy / coverage" in text
    row = next(line for line in text.splitlines() if line.startswith("  sortw tiermem-file"))
    assert row.split()[2:] == ["90%/50%", "25%/100%"]
    # No run reported them: no section.
    assert "accuracy / coverage" not in report.format_tables(make_runs(), ["tiermem-file"], [100, 20])


def test_table_shows_run_to_run_spread():
    runs = make_runs()
    again = [dict(r) for r in runs if r["status"] == "ok"]
    for run in again:
        run["repeat"] = 2
        run["wall_s"] *= {"unlimited": 1.1, "linux-swap": 1.5, "tiermem-file": 1.2, "tiermem-mem": 1.0}[run["system"]]
    text = report.format_tables(runs + again, ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    assert "Run-to-run spread" in text
    rows = text.split("Run-to-run spread")[1].splitlines()
    row = lambda name: next(line for line in rows if line.startswith(f"  {name} ")).split()[1:]
    assert row("unlimited") == ["1.10", "(1.10)"]
    # linux-swap at 20%: runs of 4.0 (ok), 0.5 (oom: not counted) and 6.0 -> 1.5
    assert row("linux-swap") == ["1.50", "(1.50)", "1.50", "(1.50)"]
    assert row("tiermem-file") == ["1.20", "(1.20)", "1.20", "(1.20)"]
    assert row("tiermem-mem") == ["1.00", "(1.00)", "1.00", "(1.00)"]


def test_table_shows_paging_traffic_of_both_systems():
    runs = make_runs()
    mib = 1 << 20
    for run in runs:
        if run["system"] == "linux-swap" and run["status"] == "ok":
            run["swap_in_bytes"], run["swap_out_bytes"] = 300 * mib * run["ratio"] // 20, 100 * mib
        if run["system"] == "tiermem-file":
            # Two processes: their device counters add up.
            run["tiermem_stats"] = {"processes": [
                {"device": {"bytes_read_medium": 200 * mib, "bytes_written_medium": 50 * mib}},
                {"device": {"bytes_read_medium": 10 * mib, "bytes_written_medium": 0}}]}
    # The failed Linux swap run's counters must not count.
    oom = next(r for r in runs if r["status"] == "oom")
    oom["swap_in_bytes"], oom["swap_out_bytes"] = 1, 1
    text = report.format_tables(runs, ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    assert "Paging traffic" in text
    rows = text.split("Paging traffic")[1].splitlines()
    row = lambda name: next(line for line in rows if line.startswith(f"  sortw {name} ")).split()[2:]
    assert row("linux-swap") == ["1500/100", "300/100"]
    assert row("tiermem-file") == ["210/50", "210/50"]
    assert not any(line.startswith("  sortw tiermem-mem ") for line in rows), "no counters, no row"
    assert report.device_traffic({"tiermem_stats": None}) is None


def test_paging_traffic_cells_stay_apart_at_full_scale_volumes():
    runs = make_runs()
    mib = 1 << 20
    for run in runs:
        if run["system"] == "linux-swap" and run["status"] == "ok":
            run["swap_in_bytes"], run["swap_out_bytes"] = 178276 * mib, 38407 * mib
    text = report.format_tables(runs, ["linux-swap"], [100, 20])
    row = next(line for line in text.split("Paging traffic")[1].splitlines() if line.startswith("  sortw linux-swap "))
    assert row.split()[2:] == ["178276/38407", "178276/38407"]


def test_table_shows_the_disk_s_requests_a_second_where_they_were_counted():
    runs = make_runs()
    for run in runs:
        if run["system"] == "linux-swap":  # 20%: 4.0 s ok (counted) and 0.5 s oom (left out)
            run["disk_reads"], run["disk_writes"] = 240_000, 48_000
        if run["system"] == "tiermem-file" and run["ratio"] == 20:
            run["disk_reads"], run["disk_writes"] = 114_000, 3_000
    text = report.format_tables(runs, ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    rows = text.split("Disk requests")[1].splitlines()
    row = lambda name: next(line for line in rows if line.startswith(f"  sortw {name} ")).split()[2:]
    # 240k reads in 1.2 s at 100%, in 4.0 s at 20%; tiermem-file 114k in 2.0 s at 20%.
    assert row("linux-swap") == ["200.0/40.0", "60.0/12.0"]
    assert row("tiermem-file") == ["-", "57.0/1.5"]
    assert not any(line.startswith("  sortw tiermem-mem ") for line in rows), "not counted, no row"
    assert "Disk requests" not in report.format_tables(make_runs(), ["linux-swap"], [100, 20])


def test_device_line_says_what_a_read_took_before_and_after():
    meta = {"device_read_latency_us": {"before": 13.4, "after": 109.6}}
    assert report.device_line(meta) == (
        "Device: a 4 KiB read took 13 µs before and 110 µs after the matrix (tiermem probe --latency)\n\n")
    only_before = report.device_line({"device_read_latency_us": {"before": 52.0, "after": None}})
    assert "52 µs before the matrix" in only_before and "after" not in only_before
    # Older results, or a device that could not be measured: nothing is claimed.
    assert report.device_line({}) == ""
    assert report.device_line({"device_read_latency_us": {"before": None}}) == ""


def test_device_line_gives_the_disk_s_request_rate_where_the_probe_measured_it():
    meta = {"device_read_latency_us": {"before": 38.1, "after": 45.3},
            "device_read_rate": {"before": {"depth": 32, "reads_per_s": 132_700.0},
                                 "after": {"depth": 32, "reads_per_s": 126_100.0}}}
    assert report.device_line(meta) == (
        "Device: a 4 KiB read took 38 µs before and 45 µs after the matrix; with 32 in flight it served "
        "133k reads a second before and 126k after (tiermem probe --latency)\n\n")
    # A probe without the rate (an older binary, or one side not measured): only what was.
    meta["device_read_rate"] = {"before": None, "after": {"depth": 32, "reads_per_s": 90_000.0}}
    assert "it served 90k reads a second after (" in report.device_line(meta)
    meta["device_read_rate"] = {"before": None, "after": None}
    assert "served" not in report.device_line(meta)


def test_machine_line_gives_what_paging_costs_where_the_matrix_ran():
    meta = {"machine": {"facts": {"cpus": 2, "virtual_machine": True, "guest_halt_poll_ns": 0},
                        "costs": {"tlb_shootdown_us": 9.34, "thread_wakeup_us": 21.2, "page_map_us": 1.08,
                                  "unmap_alone_us": 1.3}}}
    assert report.machine_line(meta) == (
        "Machine: 2 CPUs, a virtual machine without guest halt polling; TLB shootdown 9.3 µs, "
        "thread wake-up 21.2 µs, page map 1.1 µs (tiermem probe --machine)\n")
    one_cpu = {"machine": {"facts": {"cpus": 1, "virtual_machine": False},
                           "costs": {"tlb_shootdown_us": None, "thread_wakeup_us": None, "page_map_us": 0.8}}}
    assert report.machine_line(one_cpu) == "Machine: 1 CPU; page map 0.8 µs (tiermem probe --machine)\n"
    # Older results, or a binary without --machine: nothing is claimed.
    assert report.machine_line({}) == ""
    assert report.machine_line({"machine": {"facts": None}}) == ""


def make_variant_runs():
    """tiermem-file and the three §4.4 variants at 50%, with engine fault counts and kernel time."""
    runs = [RunRecord(workload="lin", system="unlimited", ratio=None, repeat=1, limit_bytes=None,
                      footprint_bytes=100000, status="ok", wall_s=1.0, digest="d").to_dict()]
    for system, wall, faults, sys_s in [("tiermem-file", 2.0, 40000, 3.0), ("tiermem-poll-only", 2.5, 46000, 3.5),
                                        ("tiermem-interrupt-only", 2.2, 41000, 3.1),
                                        ("tiermem-reclaim-on-fault-path", 3.0, 40500, 4.5)]:
        rec = RunRecord(workload="lin", system=system, ratio=50, repeat=1, limit_bytes=50000, footprint_bytes=100000,
                        status="ok", wall_s=wall, digest="d", sys_s=sys_s)
        rec.tiermem_stats = {"merged": {"paths": [
            {"path": "critical_fault", "count": faults // 2}, {"path": "hit_fault", "count": faults // 4},
            {"path": "zero_fault", "count": faults // 4}, {"path": "prefetch_io", "count": 999999}]}}
        runs.append(rec.to_dict())
    return runs


def test_the_variants_are_shown_as_in_ultraswap_section_4_4():
    systems = ["tiermem-file", "tiermem-poll-only", "tiermem-interrupt-only", "tiermem-reclaim-on-fault-path"]
    text = report.format_tables(make_variant_runs(), systems, [50])
    # Fig. 9: time relative to tiermem-file, per workload and as a geometric mean.
    assert "Fig. 9" in text
    assert "  tiermem-poll-only\n    lin" in text and "1.25" in text  # 2.5 / 2.0
    assert "1.10" in text and "1.50" in text  # interrupt-only 2.2 / 2.0, on the fault path 3.0 / 2.0
    # Table 6: engine faults (the I/O paths are not faults), tiermem-file / poll-only.
    assert "Table 6" in text and "40/46" in text
    # Table 7: kernel seconds, background reclaim / reclaim on the fault path.
    assert "Table 7" in text and "3.0/4.5" in text
    # No Linux swap in this run: no speed-up table of dashes.
    assert "Speed-up over Linux swap" not in text


def test_without_variants_there_is_no_section_4_4():
    text = report.format_tables(make_runs(), ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    assert "Fig. 9" not in text and "Table 6" not in text and "Table 7" not in text


def _document(workloads, walls, started):
    """A runs.json document: an unlimited and a tiermem-file 50% run of each workload."""
    runs = []
    for workload in workloads:
        for system, ratio in (("unlimited", None), ("tiermem-file", 50)):
            runs.append(RunRecord(workload=workload, system=system, ratio=ratio, repeat=1,
                                  limit_bytes=None if ratio is None else 50000, footprint_bytes=100000,
                                  status="ok", wall_s=1.0 if ratio is None else walls[workload],
                                  digest="d").to_dict())
    return {"schema": 1, "meta": {"systems": ["tiermem-file"], "ratios": [50], "started": started,
                                  "scale": "quick"}, "runs": runs, "points": []}


def test_several_runs_files_merge_with_a_workload_measured_again_replacing_its_runs(tmp_path):
    from tiermem_bench import cli

    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps(_document(["sortw", "kmw"], {"sortw": 2.0, "kmw": 3.0}, "t1")))
    second.write_text(json.dumps(_document(["kmw"], {"kmw": 5.0}, "t2")))
    out = tmp_path / "merged"
    assert cli.main(["--report-only", str(first), str(second), "--out", str(out), "--no-plot"]) == 0
    merged = json.loads((out / "runs.json").read_text())
    walls = {(r["workload"], r["system"]): r["wall_s"] for r in merged["runs"]}
    assert len(merged["runs"]) == 4, "kmw's first runs replaced, not added to"
    assert walls[("kmw", "tiermem-file")] == 5.0 and walls[("sortw", "tiermem-file")] == 2.0
    assert [m["workloads"] for m in merged["meta"]["merged_from"]] == [["kmw", "sortw"], ["kmw"]]
    table = (out / "table.txt").read_text()
    assert "kmw  (unlimited: 1.00 s)" in table and "5.00" in table
    # Merging needs somewhere to write.
    assert cli.main(["--report-only", str(first), str(second), "--no-plot"]) == 2


def test_a_system_measured_again_replaces_only_its_own_runs(tmp_path):
    from tiermem_bench import cli

    first, second = tmp_path / "first.json", tmp_path / "second.json"
    matrix = _document(["sortw", "kmw"], {"sortw": 2.0, "kmw": 3.0}, "t1")
    for run in [dict(r) for r in matrix["runs"] if r["system"] == "tiermem-file"]:
        run["system"], run["wall_s"] = "tiermem-poll-only", 9.0
        matrix["runs"].append(run)
    matrix["meta"]["systems"] = ["tiermem-file", "tiermem-poll-only"]
    first.write_text(json.dumps(matrix))
    again = _document(["sortw", "kmw"], {"sortw": 4.0, "kmw": 6.0}, "t2")
    for run in again["runs"]:
        if run["system"] == "tiermem-file":
            run["system"] = "tiermem-poll-only"
    again["meta"]["systems"] = ["tiermem-poll-only"]
    second.write_text(json.dumps(again))
    out = tmp_path / "merged"
    assert cli.main(["--report-only", str(first), str(second), "--out", str(out), "--no-plot"]) == 0
    merged = json.loads((out / "runs.json").read_text())
    walls = {(r["workload"], r["system"]): r["wall_s"] for r in merged["runs"]}
    assert len(merged["runs"]) == 6, "poll-only's and the reference's first runs replaced, tiermem-file's kept"
    assert walls[("sortw", "tiermem-file")] == 2.0 and walls[("kmw", "tiermem-file")] == 3.0
    assert walls[("sortw", "tiermem-poll-only")] == 4.0 and walls[("kmw", "tiermem-poll-only")] == 6.0
    assert merged["meta"]["systems"] == ["tiermem-file", "tiermem-poll-only"]


def test_matrices_of_other_ratios_add_up_and_a_ratio_measured_again_replaces_its_runs(tmp_path):
    from tiermem_bench import cli

    # The full scale is measured a ratio or two at a time: 50% first, then 20% and 50% again.
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps(_document(["sortw"], {"sortw": 2.0}, "t1")))
    later = _document(["sortw"], {"sortw": 3.0}, "t2")
    twenty = [dict(r) for r in later["runs"] if r["system"] == "tiermem-file"]
    for run in twenty:
        run["ratio"], run["limit_bytes"], run["wall_s"] = 20, 20000, 7.0
    later["runs"] += twenty
    later["runs"][0]["wall_s"] = 1.5  # the later unlimited run is the reference
    later["meta"]["ratios"] = [50, 20]
    second.write_text(json.dumps(later))
    out = tmp_path / "merged"
    assert cli.main(["--report-only", str(first), str(second), "--out", str(out), "--no-plot"]) == 0
    merged = json.loads((out / "runs.json").read_text())
    walls = sorted((r["system"], r["ratio"] or 0, r["wall_s"]) for r in merged["runs"])
    assert walls == [("tiermem-file", 20, 7.0), ("tiermem-file", 50, 3.0), ("unlimited", 0, 1.5)]
    assert merged["meta"]["ratios"] == [50, 20]
    # Only the first file's 50% point: the second adds 20% and keeps the first's 50% runs.
    only_twenty = dict(later, runs=[r for r in later["runs"] if r["ratio"] != 50])
    second.write_text(json.dumps(only_twenty))
    assert cli.main(["--report-only", str(first), str(second), "--out", str(out), "--no-plot"]) == 0
    merged = json.loads((out / "runs.json").read_text())
    walls = sorted((r["system"], r["ratio"] or 0, r["wall_s"]) for r in merged["runs"])
    assert walls == [("tiermem-file", 20, 7.0), ("tiermem-file", 50, 2.0), ("unlimited", 0, 1.5)]
    table = (out / "table.txt").read_text()
    assert "sortw  (unlimited: 1.50 s)" in table


def test_report_only_refuses_a_damaged_runs_file_with_a_message(tmp_path, capsys):
    from tiermem_bench import cli

    good = tmp_path / "good.json"
    good.write_text(json.dumps(_document(["sortw"], {"sortw": 2.0}, "t1")))
    (tmp_path / "broken.json").write_text('{"runs": [')
    # A run without its system made the report fail with a KeyError traceback.
    for name, document, message in [
            ("keyless", {"runs": [{"workload": "x"}]}, "run 0: workload, system or status missing"),
            ("empty", {}, "no list of runs"),
            ("meta", dict(_document(["sortw"], {"sortw": 2.0}, "t1"), meta=[1]), "its meta is not an object"),
            ("broken", None, "cannot read")]:
        path = tmp_path / f"{name}.json"
        if document is not None:
            path.write_text(json.dumps(document))
        argv = ["--report-only", str(good), str(path), "--out", str(tmp_path / "out"), "--no-plot"]
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err
        assert message in err and str(path) in err and "Traceback" not in err, err


def _ab_run(workload, system, ratio, wall, status="ok", read_mib=None):
    run = RunRecord(workload=workload, system=system, ratio=ratio, repeat=1, limit_bytes=50000,
                    footprint_bytes=100000, status=status, wall_s=wall, digest="d").to_dict()
    if read_mib is not None:
        run["tiermem_stats"] = {"processes": [{"device": {"bytes_read_medium": read_mib << 20,
                                                           "bytes_written_medium": 0}}]}
    return run


def test_an_ab_compares_medians_per_point_and_leaves_failed_points_out_of_the_means():
    base = [_ab_run("sortw", "tiermem-file", 100, w, read_mib=m) for w, m in ((2.0, 100), (3.0, 120), (10.0, 400))]
    base += [_ab_run("sortw", "tiermem-mem", 100, 1.0), _ab_run("kmw", "tiermem-file", 20, 8.0),
             _ab_run("kmw", "linux-swap", 20, 4.0), _ab_run("prw", "tiermem-file", 20, 60.0, status="timeout"),
             _ab_run("onlyw", "tiermem-file", 40, 1.0), _ab_run("sortw", "unlimited", None, 0.5),
             _ab_run("sortw", "tiermem-file", None, 0.7)]
    new = [_ab_run("sortw", "tiermem-file", 100, 1.5, read_mib=90), _ab_run("sortw", "tiermem-mem", 100, 0.5),
           _ab_run("kmw", "tiermem-file", 20, 16.0), _ab_run("kmw", "linux-swap", 20, 1.0),
           _ab_run("prw", "tiermem-file", 20, 50.0), _ab_run("newonlyw", "tiermem-mem", 60, 1.0)]
    text = report.compare_runs(base, new)
    lines = text.splitlines()
    row = next(line for line in lines if "sortw" in line and "tiermem-file" in line)
    # Base medians 3.0 s and 120 MiB over three uneven runs (means would be 5.0 s, 207 MiB);
    # new 1.5 s and 90 MiB: 0.5x.
    assert "3.00 s 120 MiB (3/3 ok)" in row and "1.50 s 90 MiB (1/1 ok)" in row and row.endswith("0.500x")
    assert next(line for line in lines if "kmw" in line and "tiermem-file" in line).endswith("2.000x")
    found = [re.match(r"^  (\S.*?)\s+(\S+) over (\d+)( \(.*\))?$", line) for line in lines]
    means = {m.group(1): (m.group(2), int(m.group(3)), m.group(4) or "") for m in found if m}
    # Over the tiermem systems: sortw file 0.5, sortw mem 0.5 and kmw file 2.0, new/base not
    # base/new: (0.5 * 0.5 * 2) ** (1/3) = 0.794; Linux swap's 0.25 is not in it.
    assert means["all tiermem systems"][:2] == ("0.794x", 3), text
    assert means["tiermem-file"][:2] == ("1.000x", 2) and means["tiermem-mem"][:2] == ("0.500x", 1)
    assert means["linux-swap"][:2] == ("0.250x", 1) and means["tiermem-file 20%"][:2] == ("2.000x", 1)
    assert list(means)[:4] == ["all tiermem systems", "linux-swap", "tiermem-file", "tiermem-mem"], list(means)
    assert list(means)[4:] == ["linux-swap 20%", "tiermem-file 100%", "tiermem-file 20%", "tiermem-mem 100%"]
    assert means["tiermem-file 20%"][2] == " (1 with a failed run left out)", text
    prw = next(line for line in lines if "prw" in line and "base" not in line)
    assert prw.rstrip().endswith("-"), "a point with a failed run has no ratio"
    assert "prw 20% tiermem-file: base - (0/1 ok), new 50.00 s (1/1 ok)" in text
    assert "onlyw 40% tiermem-file: only in the base runs" in text
    assert "newonlyw 60% tiermem-mem: only in the new runs" in text
    assert "unlimited" not in text and "0.70" not in text, "runs without a ratio are not points"


def _runs_file(path, runs, scale="quick"):
    path.write_text(json.dumps({"schema": 1, "meta": {"scale": scale}, "runs": runs, "points": []}))
    return path


def test_the_ab_option_reads_runs_files_and_rejects_bad_input(tmp_path, capsys):
    from tiermem_bench import cli

    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(_document(["sortw"], {"sortw": 2.0}, "t1")))
    new.write_text(json.dumps(_document(["sortw"], {"sortw": 3.0}, "t2")))
    out = tmp_path / "ab"
    assert cli.main(["--compare", str(base), "--to", str(new), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1.500x" in printed and (out / "compare.txt").read_text() == printed
    assert "WARNING" not in printed
    # Two files on a side are pooled: the base median becomes that of 2.0 and 4.0.
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_document(["sortw"], {"sortw": 4.0}, "t3")))
    assert cli.main(["--compare", str(base), str(other), "--to", str(new)]) == 0
    assert "1.000x" in capsys.readouterr().out
    full = _runs_file(tmp_path / "full.json", [_ab_run("sortw", "tiermem-file", 50, 9.0)], scale="full")
    assert cli.main(["--compare", str(base), "--to", str(full)]) == 0
    assert capsys.readouterr().out.startswith("WARNING: the files were measured at different scales")

    def refused(argv, message):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err

    refused(["--compare", str(base)], "--compare and --to go together")
    refused(["--to", str(new)], "--compare and --to go together")
    refused(["--compare", str(base), "--to", str(new), "--report-only", str(base)], "do not go together")
    refused(["--compare", str(base), "--to", str(new), "--workloads", "sortw"], "--workloads cannot apply")
    refused(["--compare", str(base), "--to", str(tmp_path / "missing.json")], "cannot read")
    (tmp_path / "broken.json").write_text("{not json")
    refused(["--compare", str(base), "--to", str(tmp_path / "broken.json")], "cannot read")
    for name, document, message in [
            ("empty", {}, "no list of runs"), ("string", {"runs": "abc"}, "no list of runs"),
            ("number", {"runs": [1]}, "run 0: not an object"),
            ("keyless", {"runs": [{"system": "tiermem-file", "status": "ok"}]}, "workload, system or status missing"),
            ("text-ratio", {"runs": [dict(_ab_run("w", "tiermem-file", 20, 1.0), ratio="20")]}, "ratio '20'"),
            ("untimed", {"runs": [dict(_ab_run("w", "tiermem-file", 20, 1.0), wall_s=None)]}, "without a positive"),
            ("zero", {"runs": [dict(_ab_run("w", "tiermem-file", 20, 1.0), wall_s=0)]}, "without a positive")]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(document))
        refused(["--compare", str(base), "--to", str(path)], message)
    (tmp_path / "afile").write_text("")
    refused(["--compare", str(base), "--to", str(new), "--out", str(tmp_path / "afile" / "sub")], "cannot write")


def test_table_splits_each_point_into_the_timed_work_and_the_rest():
    runs = make_runs()
    # What each workload's Timer measured: the rest of the run (start, imports, exit) is
    # 0.5 s everywhere but tiermem-file at 20%, whose exit took 1.2 s.
    for run in runs:
        if run["status"] == "ok":
            run["work_s"] = run["wall_s"] - (1.2 if (run["system"], run["ratio"]) == ("tiermem-file", 20) else 0.5)
    text = report.format_tables(runs, ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    assert "Where the time goes" in text
    rows = text.split("Where the time goes")[1].splitlines()
    row = lambda name: next(line for line in rows if line.startswith(f"  sortw {name} ")).split()[2:]
    assert row("linux-swap") == ["0.7/0.5", "3.5/0.5"]  # the OOM-killed run timed nothing
    assert row("tiermem-file") == ["0.6/0.5", "0.8/1.2"]
    # On the timed part alone tiermem-file is 3.5 / 0.8 = 4.38x Linux swap at 20% (2.00x spawn
    # to exit); gap closed (3.5 - 0.8) / (3.5 - 1.0) = 108%.
    split = text.split("on the timed part alone")[1]
    assert "4.38x" in split and "108%" in split
    assert "2.00x" in text.split("Where the time goes")[0], "the result stays spawn to exit"


def test_without_timed_work_there_is_no_split():
    text = report.format_tables(make_runs(), ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    assert "Where the time goes" not in text
    assert report.outside_work({"wall_s": 2.0, "work_s": None}) is None
    assert report.outside_work({"wall_s": 2.0, "work_s": 2.5}) == 0.0


def test_table_says_what_running_the_matrix_cost():
    runs = make_runs()
    for run in runs:
        run["wall_s"] *= 10
    text = report.format_tables(runs, ["linux-swap", "tiermem-file", "tiermem-mem"], [100, 20])
    rows = text.split("Time spent running")[1].splitlines()
    row = lambda name: next(line for line in rows if line.startswith(f"  {name} ")).split()[1:]
    assert row("unlimited") == ["-", "-", "10"]
    # The OOM-killed run at 20% cost its 5 s too.
    assert row("linux-swap") == ["12", "45", "57"]
    assert row("tiermem-file") == ["11", "20", "31"]
    assert row("tiermem-mem") == ["10", "15", "25"]
    assert "all runs: 123 s, of which the baselines (unlimited, linux-swap, tiermem-mem) 92 s" in text


def test_time_spent_leaves_out_the_baselines_a_run_did_not_have():
    runs = [r for r in make_runs() if r["system"] in ("unlimited", "tiermem-file")]
    for run in runs:
        run["wall_s"] *= 10
    text = report.format_tables(runs, ["tiermem-file"], [100, 20])
    assert "all runs: 41 s, of which the baselines (unlimited) 10 s" in text


def test_a_single_ratio_is_drawn_as_bars_with_failures_kept(tmp_path):
    from tiermem_bench import plot

    runs = [r for r in make_runs() if r["ratio"] in (None, 20)]
    # Every Linux swap run at 20% failed in a second workload: its bar is None, not dropped.
    for r in [dict(r) for r in runs]:
        r["workload"] = "other"
        if r["system"] == "linux-swap":
            r["status"] = "oom"
        runs.append(r)
    summary = stats.summarise(runs)
    points = plot.bars(summary, stats.normalised(summary), ["other", "sortw"], ["linux-swap", "tiermem-file"], 20)
    assert points == [("other", "linux-swap", None), ("other", "tiermem-file", 2.0),
                      ("sortw", "linux-swap", 4.0), ("sortw", "tiermem-file", 2.0)]
    data = plot.plot(runs, ["linux-swap", "tiermem-file", "tiermem-mem"], [20], tmp_path / "b.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_crashed_program_s_last_lines_stay_in_the_stderr_tail():
    """`tiermem run`'s summary comes after the program's own stderr: the tail kept in the
    results must still show the program's last lines (a traceback), then the summary's start."""
    from tiermem_bench.runner import program_stderr, stderr_tail

    program = "noise\n" * 1000 + "Traceback (most recent call last):\nMemoryError\n"
    summary = "tiermem: the program exited with status 1 after 2.19 s\n" + "path  count\n" * 400
    tail = stderr_tail(program + summary)
    assert len(tail) <= 2000
    assert "MemoryError\ntiermem: the program exited with status 1" in tail
    assert tail.count("path  count") < 400, "the summary's end is cut, not the traceback"
    assert program_stderr(program + summary) == program, "the failure's reason comes from here"
    # A short program part leaves the rest of the room to the summary.
    assert len(stderr_tail("short\n" + summary)) == 2000
    # Without a summary, or when everything fits, the plain tail.
    assert stderr_tail(program) == program[-2000:]
    assert stderr_tail("short\n" + summary[:100]) == "short\n" + summary[:100]
