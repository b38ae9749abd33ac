"""Result-line parsing, the digest check, and how a run's outcome is classified."""

from tiermem_bench.digest import check_digest, parse_result
from tiermem_bench.runner import RunRecord, classify
from tiermem_bench.workloads._common import digest

LINE = 'TIERMEM_BENCH_RESULT {"digest": "abc123", "work_s": 1.5}'


def test_parse_takes_the_last_result_line():
    out = "noise\nTIERMEM_BENCH_RESULT {\"digest\": \"old\"}\nmore\n" + LINE + "\ntrailing\n"
    assert parse_result(out) == {"digest": "abc123", "work_s": 1.5}


def test_parse_rejects_missing_or_broken_lines():
    assert parse_result("") is None
    assert parse_result("TIERMEM_BENCH_RESULT {not json") is None
    assert parse_result('TIERMEM_BENCH_RESULT {"work_s": 1}') is None
    assert parse_result('TIERMEM_BENCH_RESULT {"digest": ""}') is None


def test_check_digest():
    assert check_digest("abc123", parse_result(LINE)) == (True, "")
    ok, why = check_digest("zzz", parse_result(LINE))
    assert not ok and "abc123" in why and "zzz" in why
    assert check_digest("abc123", None) == (False, "no result line")
    assert check_digest(None, parse_result(LINE))[0] is False


def test_digest_is_stable_and_sensitive():
    a = digest([1, 2, 3], 0.5, "x")
    assert a == digest([1, 2, 3], 0.5, "x")
    assert a != digest([1, 2, 4], 0.5, "x")
    assert digest([1, 23]) != digest([12, 3])  # lengths are part of the hash


def record():
    return RunRecord(workload="w", system="linux-swap", ratio=20, repeat=1, limit_bytes=1, footprint_bytes=5)


def report(**kw):
    base = {"wall_s": 2.0, "exit_code": 0, "signal": None, "timed_out": False, "oom_kills": 0, "peak_bytes": 10}
    base.update(kw)
    return base


def test_classify_ok_and_wrong():
    assert classify(record(), report(), LINE, "abc123").status == "ok"
    r = classify(record(), report(), LINE, "other")
    assert r.status == "wrong" and r.digest == "abc123" and r.work_s == 1.5


def test_classify_oom_kill_crash_timeout_and_missing_report():
    assert classify(record(), report(exit_code=None, signal=9, oom_kills=1), "", "abc123").status == "oom"
    assert classify(record(), report(exit_code=None, signal=11), "", "abc123").status == "crash"
    assert classify(record(), report(exit_code=1), LINE, "abc123").status == "crash"
    assert classify(record(), report(exit_code=137, oom_kills=2), "", "abc123").status == "oom"
    assert classify(record(), report(exit_code=None, timed_out=True), "", "abc123").status == "timeout"
    assert classify(record(), None, LINE, "abc123").status == "error"
    # A clean exit without a result line is not a success.
    assert classify(record(), report(), "", "abc123").status == "wrong"
