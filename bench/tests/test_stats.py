"""The aggregation maths, against values worked out by hand."""

import math

import pytest

from tiermem_bench import stats


def run(workload, system, ratio, wall, status="ok"):
    return {"workload": workload, "system": system, "ratio": ratio, "wall_s": wall, "status": status}


def test_median_and_failure_rate_ignore_failed_runs():
    runs = [run("w", "linux-swap", 20, 10.0), run("w", "linux-swap", 20, 30.0),
            run("w", "linux-swap", 20, 2.0, status="oom"), run("w", "linux-swap", 20, 20.0)]
    s = stats.summarise(runs)[("w", "linux-swap", 20)]
    # median of 10, 30, 20 (the OOM run's 2.0 is not a time of a completed run) = 20
    assert s["median_s"] == 20.0
    assert s["runs"] == 4 and s["ok"] == 3 and s["failures"] == 1
    assert s["failure_rate"] == 0.25
    assert s["statuses"] == {"ok": 3, "oom": 1}


def test_point_where_every_run_failed_has_no_median_but_is_kept():
    s = stats.summarise([run("w", "linux-swap", 20, 1.0, "oom"), run("w", "linux-swap", 20, 1.0, "wrong")])
    point = s[("w", "linux-swap", 20)]
    assert point["median_s"] is None and point["failure_rate"] == 1.0


def test_even_number_of_runs_takes_the_mean_of_the_middle_two():
    s = stats.summarise([run("w", "x", 50, v) for v in (4.0, 1.0, 3.0, 2.0)])
    assert s[("w", "x", 50)]["median_s"] == 2.5


def test_normalised_to_the_unlimited_run():
    runs = [run("w", "unlimited", None, 2.0), run("w", "unlimited", None, 4.0), run("w", "unlimited", None, 3.0),
            run("w", "linux-swap", 20, 12.0), run("w", "tiermem-file", 20, 4.5)]
    norm = stats.normalised(stats.summarise(runs))
    assert norm[("w", "linux-swap", 20)] == pytest.approx(4.0)  # 12 / 3
    assert norm[("w", "tiermem-file", 20)] == pytest.approx(1.5)  # 4.5 / 3
    assert ("w", "unlimited", None) not in norm


def test_speedup_table_geometric_mean_over_workloads():
    runs = []
    # workload a: swap 8 s, file 2 s at 20% -> 4x; workload b: swap 3 s, file 3 s -> 1x
    runs += [run("a", "linux-swap", 20, 8.0), run("a", "tiermem-file", 20, 2.0)]
    runs += [run("b", "linux-swap", 20, 3.0), run("b", "tiermem-file", 20, 3.0)]
    # at 100%: a 1.0 vs 0.5 -> 2x; b: swap OOM -> no speed-up for b at 100%
    runs += [run("a", "linux-swap", 100, 1.0), run("a", "tiermem-file", 100, 0.5)]
    runs += [run("b", "linux-swap", 100, 1.0, "oom"), run("b", "tiermem-file", 100, 1.0)]
    table = stats.speedup_table(stats.summarise(runs), ["linux-swap", "tiermem-file"], [100, 20])
    assert table["tiermem-file"][20] == pytest.approx(2.0)  # sqrt(4 * 1)
    assert table["tiermem-file"][100] == pytest.approx(2.0)  # only a
    assert table["tiermem-file"]["avg"] == pytest.approx((4 * 1 * 2) ** (1 / 3))
    assert "linux-swap" not in table


def test_gap_closed_hand_computed():
    # Normalised times at 20%: swap 5, ideal 1, file 2 -> closes (5-2)/(5-1) = 75%.
    # At 60%: swap 2, ideal 1, file 1 -> 100%. Overall: (3 + 1) / (4 + 1) = 80%.
    norm = {("w", "linux-swap", 20): 5.0, ("w", "tiermem-mem", 20): 1.0, ("w", "tiermem-file", 20): 2.0,
            ("w", "linux-swap", 60): 2.0, ("w", "tiermem-mem", 60): 1.0, ("w", "tiermem-file", 60): 1.0}
    gap = stats.gap_closed(norm, [60, 20])
    assert gap[20] == pytest.approx(0.75)
    assert gap[60] == pytest.approx(1.0)
    assert gap["avg"] == pytest.approx(0.8)


def test_gap_closed_without_a_gap_or_a_complete_point_is_none():
    norm = {("w", "linux-swap", 100): 1.0, ("w", "tiermem-mem", 100): 1.0, ("w", "tiermem-file", 100): 1.1,
            ("w", "linux-swap", 20): 3.0, ("w", "tiermem-file", 20): 1.5}  # no ideal at 20%
    gap = stats.gap_closed(norm, [100, 20])
    assert gap[100] is None and gap[20] is None


def test_slower_than_swap_gives_a_negative_share():
    norm = {("w", "linux-swap", 20): 2.0, ("w", "tiermem-mem", 20): 1.0, ("w", "tiermem-file", 20): 2.5}
    assert stats.gap_closed(norm, [20])[20] == pytest.approx(-0.5)


def test_geomean():
    assert stats.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert stats.geomean([]) is None
    with pytest.raises(ValueError):
        stats.geomean([1.0, 0.0])
    assert math.isclose(stats.geomean([3.0]), 3.0)
