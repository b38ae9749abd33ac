"""Nothing is left behind when the harness fails mid-run: the helper is stopped (SIGTERM) and, with
the real helper, the cgroup, the swap file and the program are gone."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import APPS_CGROUP_PREFIX, apps_cgroup_paths, stop_process, swap_files
from tiermem_bench import runner

FAKE_HELPER = r"""
import os, signal, subprocess, sys, time
marker = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
def on_term(sig, frame):
    child.kill(); child.wait()
    open(marker, "w").write("cleaned %d" % child.pid)
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
open(marker + ".pid", "w").write(str(child.pid))
time.sleep(60)
"""


class Injected(Exception):
    pass


def wait_for(predicate, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def fail_during_run(monkeypatch, started, error=Injected):
    """Make Popen.communicate raise once `started()` is true (an exception or Ctrl-C mid-run)."""
    real = subprocess.Popen.communicate

    def communicate(self, *a, **kw):
        assert wait_for(started), "the helper never got going"
        raise error("injected")

    monkeypatch.setattr(subprocess.Popen, "communicate", communicate)
    return real


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("error", [Injected, KeyboardInterrupt])
def test_helper_is_stopped_and_cleans_up_on_an_exception(tmp_path, monkeypatch, error):
    script = tmp_path / "fake_helper.py"
    script.write_text(FAKE_HELPER)
    marker = tmp_path / "marker"
    fail_during_run(monkeypatch, lambda: (tmp_path / "marker.pid").exists(), error)
    with pytest.raises(error):
        runner.run_helper([sys.executable, str(script), str(marker)], tmp_path / "result.json")
    # run_helper returned only after the helper had handled SIGTERM and exited.
    assert marker.read_text().startswith("cleaned")
    child = int((tmp_path / "marker.pid").read_text())
    assert not pid_alive(child)


def tiermem_cgroups():
    return sorted(p.name for p in apps_cgroup_paths())


def run_temp_dirs():
    """The helpers' per-run temporary directories in the system's temporary directory."""
    import tempfile
    return {p.name for p in Path(tempfile.gettempdir()).glob("tiermem-limited-run-*")}


def real_helper_argv(tiermem, tmp_path):
    return [tiermem, "bench", "limited-run", "--cgroup-prefix", APPS_CGROUP_PREFIX, "--limit", str(64 << 20),
            "--swap-dir", str(tmp_path), "--swap-bytes", str(32 << 20), "--result", str(tmp_path / "r.json"), "--",
            sys.executable, "-c", "import os, time; open(%r, 'w').write(str(os.getpid())); time.sleep(60)"
            % str(tmp_path / "program.pid")]


@pytest.mark.parametrize("error", [Injected, KeyboardInterrupt])
def test_real_helper_leaves_no_cgroup_swap_file_or_process(tiermem_root, tmp_path, monkeypatch, error):
    pid_file = tmp_path / "program.pid"
    temp_dirs = run_temp_dirs()
    fail_during_run(monkeypatch, lambda: pid_file.exists() and pid_file.read_text() != "", error)
    with pytest.raises(error):
        runner.run_helper(real_helper_argv(tiermem_root, tmp_path), tmp_path / "r.json")
    program = int(pid_file.read_text())
    if not wait_for(lambda: not pid_alive(program), 10):
        os.kill(program, signal.SIGKILL)  # still ours: it has not ended, so its pid is not reused
        pytest.fail("the program survived")
    assert tiermem_cgroups() == []
    assert swap_files(tmp_path) == []
    assert wait_for(lambda: run_temp_dirs() <= temp_dirs, 10), f"left behind: {run_temp_dirs() - temp_dirs}"
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".swap"] == []


def test_real_helper_cleans_up_on_ctrl_c(tiermem_root, tmp_path):
    pid_file = tmp_path / "program.pid"
    temp_dirs = run_temp_dirs()
    helper = subprocess.Popen(real_helper_argv(tiermem_root, tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
        assert len(swap_files(tmp_path)) == 1 and len(tiermem_cgroups()) == 1  # it really had them
        helper.send_signal(signal.SIGINT)
        assert helper.wait(timeout=30) == 130
    finally:
        stop_process(helper)
    assert not pid_alive(int(pid_file.read_text()))
    assert tiermem_cgroups() == [] and swap_files(tmp_path) == []
    assert run_temp_dirs() <= temp_dirs, f"left behind: {run_temp_dirs() - temp_dirs}"


def test_a_program_killed_at_the_timeout_leaves_no_temporary_files(tiermem_root, tmp_path):
    """`tiermem run` killed at the timeout (or by the OOM killer) cannot remove its statistics
    directory; the helper gives the program a TMPDIR of its own and removes it."""
    seen = tmp_path / "tmpdir.txt"
    script = ("import os, tempfile, time; d = tempfile.mkdtemp(prefix='tiermem-stats-'); "
              "open(os.path.join(d, 'x'), 'w').write('x'); open(%r, 'w').write(d); time.sleep(60)" % str(seen))
    argv = [tiermem_root, "bench", "limited-run", "--cgroup-prefix", APPS_CGROUP_PREFIX, "--timeout", "2",
            "--result", str(tmp_path / "r.json"), "--", sys.executable, "-c", script]
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    made = Path(seen.read_text())
    assert made.name.startswith("tiermem-stats-") and made.parent.name.startswith("tiermem-limited-run-")
    assert not made.parent.exists(), f"{made.parent} left behind"
    assert tiermem_cgroups() == []


def apps_cgroups():
    return {p.name for p in apps_cgroup_paths()}


@pytest.mark.parametrize("sig,ignored_at_start", [(signal.SIGTERM, False), (signal.SIGHUP, False),
                                                  (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT-ignored-at-start"])
def test_the_matrix_stops_cleanly_on_a_signal(tiermem_root, tmp_path, sig, ignored_at_start):
    """`kill`, a closed terminal, or `kill -INT` on a matrix started in the background (where the
    shell starts it with SIGINT ignored) stop the run in progress, remove its cgroup and swap
    file, and still write the results so far, marked interrupted."""
    bench_dir = Path(__file__).resolve().parent.parent
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    env = dict(os.environ, PYTHONPATH=str(bench_dir), TIERMEM_BIN=tiermem_root)
    cgroups_before = apps_cgroups()

    def start():
        os.setsid()
        # As from a terminal (this test may itself run under nohup, which ignores SIGHUP and
        # which the harness respects), or as a shell starts a background job.
        for inherited in (signal.SIGHUP, signal.SIGINT):
            signal.signal(inherited, signal.SIG_DFL)
        if ignored_at_start:
            signal.signal(sig, signal.SIG_IGN)

    harness = subprocess.Popen([sys.executable, "-m", "tiermem_bench", "--scale", "tiny", "--workloads", "intsort",
                                "--systems", "linux-swap", "--ratios", "60,40", "--repeats", "1", "--out", str(out),
                                "--dir", str(scratch), "--cache", str(tmp_path / "cache")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=start)
    try:
        # Past the unlimited run, into one under Linux swap: a swap file is on. A harness that
        # ended meanwhile (a missing package, a failed run) fails the test at once, with its say.
        assert wait_for(lambda: swap_files(scratch) or harness.poll() is not None, 240), "no run under Linux swap started"
        if harness.poll() is not None:
            _, err = harness.communicate()
            pytest.fail(f"the harness ended before a run under Linux swap ({harness.returncode}): "
                        f"{err.decode(errors='replace')[-2000:]}")
        harness.send_signal(sig)
        _, err = harness.communicate(timeout=60)
    finally:
        stop_process(harness, group=True)
    assert harness.returncode == 130, err.decode(errors="replace")[-2000:]
    assert swap_files(scratch) == [] and swap_files(tmp_path) == []
    assert wait_for(lambda: apps_cgroups() <= cgroups_before, 10), apps_cgroups() - cgroups_before
    doc = json.loads((out / "runs.json").read_text())
    assert doc["meta"]["interrupted"] is True
    assert [r["system"] for r in doc["runs"]][:1] == ["unlimited"]


def test_only_the_directories_the_harness_made_for_its_scratch_are_removed(tmp_path):
    from tiermem_bench.cli import make_dirs, remove_made
    users = tmp_path / "users"
    users.mkdir()
    scratch = users / "made" / "scratch"
    made = make_dirs(scratch)
    assert made == [users / "made", scratch] and scratch.is_dir()
    remove_made(made)
    assert users.is_dir() and not (users / "made").exists(), "the user's directory stays, the made ones go"
    # A directory the run left something in stays, and so does everything outside it.
    made = make_dirs(scratch)
    (users / "made" / "kept.txt").write_text("a result")
    remove_made(made)
    assert not scratch.exists() and (users / "made" / "kept.txt").exists()
    assert make_dirs(users) == [], "nothing made when it all exists"
