"""One measuring command on the machine at a time.

Two matrices (or a matrix and `tiermem bench micro`) running at once time each other: the
machine has two CPUs and one disk, and the swap counters the harness reads are machine-wide.
Each measuring command holds an exclusive flock on one file for as long as it runs; the lock
goes with the process however it ends, and the file names the holder for the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from pathlib import Path

#: Put the lock file elsewhere (tests, or machines where /run/lock is not shared).
LOCK_ENV = "TIERMEM_BENCH_LOCK"


class Busy(Exception):
    """Another measuring command holds the machine."""


def lock_path() -> Path:
    """The machine's bench lock: the same file `tiermem bench micro` uses."""
    if os.environ.get(LOCK_ENV):
        return Path(os.environ[LOCK_ENV])
    run_lock = Path("/run/lock")
    return (run_lock if run_lock.is_dir() else Path(tempfile.gettempdir())) / "tiermem-bench.lock"


@contextlib.contextmanager
def machine_to_ourselves(what: str):
    """Hold the bench lock while the block runs, or raise Busy naming the holder. A lock file
    that cannot be opened (another user's, a read-only directory) is not a reason to refuse a
    run: the block runs without it, after a note."""
    path = lock_path()
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            # Created only when missing: with fs.protected_regular, O_CREAT on a file someone
            # else made in a sticky directory such as /run/lock is refused even to root.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        print(f"NOTE: cannot open the bench lock {path} ({e.strerror}); "
              "not checking for another benchmark running", file=sys.stderr, flush=True)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process"
            raise Busy(f"another benchmark is measuring on this machine ({holder}; lock {path}): "
                       "two at once would time each other; wait for it to end, or stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
