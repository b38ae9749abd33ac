"""One run: start the helper, wait, classify the outcome. Never leaves a helper behind: on any
exception (Ctrl-C included) the helper gets SIGTERM, which makes it kill the program's cgroup and
remove its swap file, and is waited for (SIGKILL only as a last resort)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tiermem_bench.digest import check_digest, parse_result
from tiermem_bench.diskstats import read_counts

# Outcomes. Everything but "ok" is a failure of the system at that point.
OK, OOM, WRONG, CRASH, TIMEOUT, ERROR = "ok", "oom", "wrong", "crash", "timeout", "error"
STATUSES = (OK, OOM, WRONG, CRASH, TIMEOUT, ERROR)

HELPER_GRACE_S = 30.0  # how long the helper may take to clean up after SIGTERM


@dataclass
class RunRecord:
    workload: str
    system: str
    ratio: int | None  # percent of the footprint; None for the unlimited runs
    repeat: int
    limit_bytes: int | None
    footprint_bytes: int | None
    status: str = ERROR
    reason: str = ""
    wall_s: float | None = None  # the program's wall time, spawn to exit
    work_s: float | None = None  # the workload's own timed part
    user_s: float | None = None  # CPU time of the program (and the children it reaped), user mode
    sys_s: float | None = None  # ... and in the kernel (Ultraswap §4.4.2 compares this one)
    exit_code: int | None = None
    signal: int | None = None
    oom_kills: int | None = None
    peak_bytes: int | None = None
    major_faults: int | None = None
    swap_in_bytes: int | None = None  # the kernel's swap traffic during the run (machine-wide)
    swap_out_bytes: int | None = None
    # Requests the scratch directory's disk completed during the run, after the block layer's
    # merging (all of its I/O, not only paging; see diskstats.py); None where it has no counters.
    disk_reads: int | None = None
    disk_writes: int | None = None
    digest: str | None = None
    expected_digest: str | None = None
    tiermem_stats: dict | None = None
    stderr_tail: str = ""
    started_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


# The columns of runs.csv, in order.
CSV_FIELDS = [f for f in RunRecord.__dataclass_fields__ if f not in ("tiermem_stats",)]


def classify(record: RunRecord, report: dict | None, stdout: str, expected: str | None) -> RunRecord:
    """Fill in status/reason from the helper's report and the program's stdout."""
    result = parse_result(stdout)
    if result is not None:
        record.digest = result["digest"]
        work = result.get("work_s")
        record.work_s = float(work) if isinstance(work, (int, float)) else None
    if report is None:
        record.status, record.reason = ERROR, record.reason or "the helper wrote no report"
        return record
    record.wall_s = report.get("wall_s")
    record.exit_code = report.get("exit_code")
    record.signal = report.get("signal")
    record.oom_kills = report.get("oom_kills")
    record.peak_bytes = report.get("peak_bytes")
    record.major_faults = report.get("major_faults")
    record.swap_in_bytes = report.get("swap_in_bytes")
    record.swap_out_bytes = report.get("swap_out_bytes")
    record.user_s = report.get("user_s")
    record.sys_s = report.get("sys_s")
    if report.get("timed_out"):
        record.status, record.reason = TIMEOUT, "killed after the time limit"
    elif record.signal is not None and (record.oom_kills or 0) > 0:
        record.status, record.reason = OOM, f"killed by signal {record.signal}, {record.oom_kills} OOM kill(s)"
    elif record.signal is not None:
        record.status, record.reason = CRASH, f"killed by signal {record.signal}"
    elif record.exit_code != 0:
        oom = f", {record.oom_kills} OOM kill(s)" if record.oom_kills else ""
        record.status = OOM if record.oom_kills else CRASH
        record.reason = f"exit code {record.exit_code}{oom}"
    else:
        ok, why = check_digest(expected, result)
        record.status, record.reason = (OK, "") if ok else (WRONG, why)
    return record


def _stop_helper(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HELPER_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass


def run_helper(argv: list[str], result_file: Path, env: dict | None = None,
               preexec_fn=None) -> tuple[dict | None, str, str, int]:
    """Run the helper to completion: (report or None, stdout, stderr, helper exit code)."""
    try:
        result_file.unlink()
    except FileNotFoundError:
        pass
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=env, text=True, errors="replace", preexec_fn=preexec_fn)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        _stop_helper(proc)
        raise
    report = None
    if result_file.exists():
        try:
            report = json.loads(result_file.read_text())
        except (OSError, json.JSONDecodeError):
            report = None
        result_file.unlink()
    return report, stdout, stderr, proc.returncode


SUMMARY_START = "tiermem: the program "


def program_stderr(stderr: str) -> str:
    """A run's stderr up to `tiermem run`'s summary (all of it when there is none)."""
    at = stderr.rfind(SUMMARY_START)
    return stderr if at < 0 else stderr[:at]


def stderr_tail(stderr: str, keep: int = 2000) -> str:
    """The end of a run's stderr, with the program's own last lines first: `tiermem run`'s
    summary (about 2 KB) comes after them and would otherwise push a crashed program's
    traceback out of the tail. What the program's lines leave of `keep` goes to the summary's
    start."""
    if len(stderr) <= keep:
        return stderr
    program = program_stderr(stderr)
    if len(program) == len(stderr):
        return stderr[-keep:]
    summary = stderr[len(program):]
    kept = program[-(keep - keep // 4):]
    return kept + summary[: keep - len(kept)]


def run_once(record: RunRecord, argv: list[str], *, result_file: Path, expected: str | None,
             env: dict | None = None, stats_file: Path | None = None,
             cleanup_paths: tuple = (), preexec_fn=None, disk_stat: Path | None = None) -> RunRecord:
    """Run `argv` (a helper command line) and classify it into `record`; with `disk_stat` (see
    `diskstats.stat_file_for`), count the disk's requests around it. The statistics file is
    removed afterwards whatever happens (an interrupted run would leave it in the scratch
    directory, which could then not be removed)."""
    try:
        try:
            disk_before = read_counts(disk_stat)
            report, stdout, stderr, code = run_helper(argv, result_file, env=env, preexec_fn=preexec_fn)
            disk_after = read_counts(disk_stat)
            if disk_before is not None and disk_after is not None:
                moved = disk_after.since(disk_before)
                record.disk_reads, record.disk_writes = moved.reads, moved.writes
        finally:
            for path in cleanup_paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        record.stderr_tail = stderr_tail(stderr)
        if report is None:
            tail = program_stderr(stderr).strip().splitlines()[-1:] or [f"helper exit code {code}"]
            record.reason = tail[0][:500]
        classify(record, report, stdout, expected)
        if stats_file is not None and stats_file.exists():
            try:
                record.tiermem_stats = json.loads(stats_file.read_text())
            except (OSError, json.JSONDecodeError):
                record.tiermem_stats = None
        return record
    finally:
        if stats_file is not None:
            try:
                stats_file.unlink()
            except FileNotFoundError:
                pass
