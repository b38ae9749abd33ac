"""Reading a workload's result line and checking it against the unlimited run."""

from __future__ import annotations

import json

RESULT_PREFIX = "TIERMEM_BENCH_RESULT "


def parse_result(stdout: str) -> dict | None:
    """The last result line of a workload's stdout as a dict, or None if there is none (or it is
    not valid JSON with a string digest)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                record = json.loads(line[len(RESULT_PREFIX):])
            except json.JSONDecodeError:
                return None
            if isinstance(record, dict) and isinstance(record.get("digest"), str) and record["digest"]:
                return record
            return None
    return None


def check_digest(expected: str | None, result: dict | None) -> tuple[bool, str]:
    """(ok, reason). A run is correct only if it printed a result whose digest equals the
    reference run's."""
    if result is None:
        return False, "no result line"
    if expected is None:
        return False, "no reference digest"
    if result["digest"] != expected:
        return False, f"digest {result['digest']} != reference {expected}"
    return True, ""
