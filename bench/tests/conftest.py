import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))


def find_tiermem():
    candidates = [os.environ.get("TIERMEM_BIN")]
    target = os.environ.get("CARGO_TARGET_DIR") or str(REPO_DIR / "target")
    candidates += [os.path.join(target, "debug", "tiermem"), os.path.join(target, "release", "tiermem")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    return None


def memory_cgroup_available():
    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        return False
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup" and "memory" in fields[3].split(","):
            return True
        if len(fields) >= 3 and fields[2] == "cgroup2":
            try:
                if "memory" in (Path(fields[1]) / "cgroup.controllers").read_text().split():
                    return True
            except OSError:
                pass
    return False


def stop_process(proc, group=False, grace=30.0):
    """Stop a process the way a user would, so it can undo its setup (swap file, cgroup): SIGTERM
    (to its process group with `group`), then SIGKILL if it is still there after `grace` seconds."""
    if proc.poll() is not None:
        return
    send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    try:
        send(signal.SIGTERM)
        proc.wait(timeout=grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            send(signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_stopping_group(argv, timeout, **kwargs):
    """subprocess.run in a session of its own; at the timeout the whole process group is stopped
    (SIGTERM, then SIGKILL), not only the direct child, so no helper, server or swap file it
    started outlives the test."""
    with subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # the timeout, or Ctrl-C (which the new session does not get)
            stop_process(proc, group=True)
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# The cgroups of this test session's runs: the harness's prefix for them (the variable its
# `systems.cgroup_prefix` reads) names this pytest process, so cleaning up after a test never
# touches the cgroups of a benchmark or another test session running beside it.
APPS_CGROUP_PREFIX = f"tiermem-apps-pytest{os.getpid()}"
os.environ["TIERMEM_BENCH_CGROUP_PREFIX"] = APPS_CGROUP_PREFIX
CGROUP_ROOTS = (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup"))


def apps_cgroup_paths(prefix=APPS_CGROUP_PREFIX):
    """Memory cgroups this session's runs made (every prefix they use starts so)."""
    return {p for root in CGROUP_ROOTS if root.is_dir() for p in root.iterdir() if p.name.startswith(prefix)}


def swap_files(directory):
    """Active swap files under `directory`."""
    table = Path("/proc/swaps").read_text().splitlines()[1:]
    return [line.split()[0] for line in table if line.split()[0].startswith(str(directory))]


def remove_leftovers(swap_dir, cgroups_before):
    """What a failed test may have left: swap files under `swap_dir` still on, and memory cgroups
    this session's runs made during the test (their tasks killed first)."""
    for path in swap_files(swap_dir):
        subprocess.run(["swapoff", path], capture_output=True)
    for cgroup in apps_cgroup_paths() - cgroups_before:
        try:
            for pid in (cgroup / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        except OSError:
            pass
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


@pytest.fixture
def tiermem_root(tmp_path):
    """The tiermem binary, for tests that need root and a memory cgroup (skipped visibly otherwise).
    Afterwards, pass or fail, no swap file under the test's tmp_path stays on and no cgroup of the
    harness made meanwhile stays behind."""
    if os.geteuid() != 0:
        pytest.skip("needs root (memory cgroups, swapon)")
    if not memory_cgroup_available():
        pytest.skip("no memory cgroup controller mounted (v1 memory or cgroup2 with memory)")
    binary = find_tiermem()
    if binary is None:
        pytest.skip("no tiermem binary built (cargo build, or set TIERMEM_BIN)")
    cgroups_before = apps_cgroup_paths()
    yield binary
    remove_leftovers(tmp_path, cgroups_before)


@pytest.fixture(autouse=True, scope="session")
def bench_lock_of_the_tests(tmp_path_factory):
    """The harnesses the tests start take a bench lock of their own, so that running the tests
    while a real matrix measures does not fail them (they still share the machine)."""
    from tiermem_bench import exclusive
    previous = os.environ.get(exclusive.LOCK_ENV)
    os.environ[exclusive.LOCK_ENV] = str(tmp_path_factory.mktemp("bench-lock") / "tiermem-bench.lock")
    yield
    if previous is None:
        os.environ.pop(exclusive.LOCK_ENV, None)
    else:
        os.environ[exclusive.LOCK_ENV] = previous
