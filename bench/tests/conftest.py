import os
import sys
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


@pytest.fixture
def tiermem_root():
    """The tiermem binary, for tests that need root and a memory cgroup (skipped visibly otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (memory cgroups, swapon)")
    if not memory_cgroup_available():
        pytest.skip("no memory cgroup controller mounted (v1 memory or cgroup2 with memory)")
    binary = find_tiermem()
    if binary is None:
        pytest.skip("no tiermem binary built (cargo build, or set TIERMEM_BIN)")
    return binary
