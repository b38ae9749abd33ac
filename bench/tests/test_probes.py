"""The unmap-cost probe (bench/probes/unmap_cost.c) builds, runs and shows the kernel keeping a
write that races MADV_FREE + MADV_PAGEOUT, the property any drop-if-clean eviction would rely on."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[1] / "probes" / "unmap_cost.c"


def test_unmap_cost_probe_runs_and_no_racing_write_is_lost(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("SKIPPED: no C compiler")
    binary = tmp_path / "unmap_cost"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-pthread", "-o", str(binary), str(PROBE)], check=True)
    bad = subprocess.run([str(binary), "100"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "multiple of 128" in bad.stderr
    out = subprocess.run([str(binary), "256"], capture_output=True, text=True, timeout=120, check=True).stdout
    if out.startswith("SKIPPED"):
        pytest.skip(out.strip())
    runs = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [int(r[0]) for r in runs] == [1, 2, 4, 8, 16, 32, 64], out
    raced = re.search(r"racing writes between FREE and PAGEOUT: (\d+), lost: (\d+)", out)
    assert raced and int(raced.group(1)) >= 1 and raced.group(2) == "0", out
    dropped = re.search(r"(\d+) of (\d+) dropped", out)
    # The pages nobody wrote go (nearly all: a page still in a per-CPU LRU batch may stay).
    assert dropped and int(dropped.group(1)) >= 0.9 * int(dropped.group(2)), out
