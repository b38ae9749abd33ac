"""The CI smoke run: one tiny workload at two ratios under Linux swap, end to end (helper, cgroup,
swap file, digest check, CSV/JSON, table, plot). Needs root and a memory cgroup."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import run_stopping_group

BENCH_DIR = Path(__file__).resolve().parent.parent


def test_smoke_one_workload_two_ratios_under_linux_swap(tiermem_root, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(BENCH_DIR), TIERMEM_BIN=tiermem_root)
    proc = run_stopping_group([sys.executable, "-m", "tiermem_bench", "--scale", "tiny", "--workloads", "intsort",
                               "--systems", "linux-swap", "--ratios", "100,60", "--repeats", "1", "--out", str(out),
                               "--cache", str(tmp_path / "cache")],
                              text=True, env=env, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["system"], r["ratio"]) for r in rows] == [("unlimited", ""), ("linux-swap", "100"),
                                                         ("linux-swap", "60")]
    unlimited = rows[0]
    assert unlimited["status"] == "ok" and int(unlimited["peak_bytes"]) > 16 << 20
    for row in rows[1:]:
        assert int(row["footprint_bytes"]) == int(unlimited["peak_bytes"])
        assert row["expected_digest"] == unlimited["digest"]
        # Every run is recorded with a classified outcome; a completed one was checked.
        assert row["status"] in ("ok", "oom", "wrong", "crash", "timeout")
        if row["status"] == "ok":
            assert row["digest"] == unlimited["digest"]
    assert rows[1]["status"] == "ok", rows[1]  # at 100% of its footprint it must complete
    assert int(rows[2]["limit_bytes"]) < int(rows[1]["limit_bytes"])
    doc = json.loads((out / "runs.json").read_text())
    assert len(doc["runs"]) == 3 and doc["meta"]["scale"] == "tiny"
    # The device's own read latency, before and after, so the figures can be read against it.
    latency = doc["meta"]["device_read_latency_us"]
    assert 0 < latency["before"] < 1e6 and 0 < latency["after"] < 1e6
    assert "Device: a 4 KiB read took" in proc.stdout
    # And what paging costs on this machine, measured before the matrix.
    costs = doc["meta"]["machine"]["costs"]
    assert costs["page_map_us"] > 0 and doc["meta"]["machine"]["facts"]["cpus"] >= 1
    assert "Machine: " in proc.stdout and "(tiermem probe --machine)" in proc.stdout
    assert (out / "apps.png").stat().st_size > 5000
    assert "intsort" in (out / "table.txt").read_text()
    assert "Execution time normalised" in proc.stdout
    assert not (out / "scratch").exists()
    assert all(str(tmp_path) not in line for line in Path("/proc/swaps").read_text().splitlines())
