"""The programs scripts/record-traces.sh records, and the table its results make."""
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_DIR

TRACES = REPO_DIR / "scripts" / "traces"
FIGURES = REPO_DIR / "docs" / "figures" / "policies"


def compile_kernel(name, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("SKIPPED: no C compiler (cc or gcc) on PATH")
    binary = tmp_path / name
    subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(TRACES / f"{name}.c")],
                   check=True)
    return binary


@pytest.mark.parametrize("name,verdict", [("intsort_is", "sorted"), ("random_update", "restored")])
def test_each_kernel_checks_its_own_result_and_is_deterministic(name, verdict, tmp_path):
    binary = compile_kernel(name, tmp_path)
    outputs = [subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=60).stdout
               for _ in range(2)]
    checksum, word = outputs[0].split()
    assert word == verdict
    assert len(checksum) == 16 and int(checksum, 16) != 0
    assert outputs[0] == outputs[1]


def test_table_rows_come_from_the_stored_results():
    names = ["npb-is", "random"]
    out = subprocess.run([sys.executable, str(TRACES / "table.py"), str(FIGURES), *names],
                         capture_output=True, text=True, check=True).stdout
    rows = out.strip().splitlines()
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 8
        # Accuracy / coverage cells are percentages; the speed-ups end in ×.
        assert all(c.count("%") == 2 for c in cells[1:5])
        assert cells[5].endswith("×") and cells[6].endswith("×")
    assert "NPB-IS-style" in rows[0] and "random updates" in rows[1]


def test_table_names_a_missing_result(tmp_path):
    done = subprocess.run([sys.executable, str(TRACES / "table.py"), str(tmp_path), "nothing"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "cannot read" in done.stderr and "nothing.fig.json" in done.stderr
    assert "Traceback" not in done.stderr
