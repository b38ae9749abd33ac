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


def test_table_rows_of_fault_traces_say_where_the_events_come_from():
    quick = FIGURES / "quick"
    names = ["quicksort-quick", "random-quick"]
    out = subprocess.run([sys.executable, str(TRACES / "table.py"), str(quick), *names],
                         capture_output=True, text=True, check=True).stdout
    rows = out.strip().splitlines()
    assert len(rows) == 2
    assert "std::sort" in rows[0] and "128 MiB table" in rows[1]
    for row in rows:
        assert "faults under a 512-page budget" in row
        assert len([c for c in row.strip("|").split("|")]) == 8


def test_the_random_update_kernel_takes_another_size(tmp_path):
    default = subprocess.run([str(compile_kernel("random_update", tmp_path))], capture_output=True, text=True,
                             check=True, timeout=60).stdout.split()
    # The overrides scripts/record-fault-traces.sh uses, smaller: a 512 KiB table, a quarter
    # update per word.
    binary = tmp_path / "random_update_small"
    subprocess.run([shutil.which("cc") or shutil.which("gcc"), "-O2", "-Wall", "-Wextra", "-Werror",
                    "-DTABLE_LOG2=16", "-DUPDATES=(TABLE / 4)", "-o", str(binary), str(TRACES / "random_update.c")],
                   check=True)
    small = subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert small[1] == "restored" and len(small[0]) == 16
    # Another table, so another checksum: the sizes took effect.
    assert small[0] != default[0]


def test_table_names_what_a_fault_trace_lacks(tmp_path):
    (tmp_path / "t.fig.json").write_text((FIGURES / "quick" / "quicksort-quick.fig.json").read_text())
    done = subprocess.run([sys.executable, str(TRACES / "table.py"), str(tmp_path), "t"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "t.convert.json" in done.stderr and "t.tmtrace.json" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "t.tmtrace.json").write_text("{}")
    done = subprocess.run([sys.executable, str(TRACES / "table.py"), str(tmp_path), "t"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "budget_pages" in done.stderr and "Traceback" not in done.stderr


def test_the_quick_scale_plot_is_drawn_from_the_stored_results(tmp_path):
    pytest.importorskip("matplotlib", reason="SKIPPED: matplotlib not installed (bench/requirements.txt)")
    out = tmp_path / "p.png"
    names = ["quicksort-quick", "random-quick"]
    subprocess.run([sys.executable, str(TRACES / "plot.py"), str(out), str(FIGURES / "quick"), *names], check=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # A result without the pairs the plot needs is named, not drawn.
    (tmp_path / "bare.fig.json").write_text('{"results": []}')
    done = subprocess.run([sys.executable, str(TRACES / "plot.py"), str(out), str(tmp_path), "bare"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "no readahead x clock result" in done.stderr
