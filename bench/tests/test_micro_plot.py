"""The microbenchmark's plot: speed-ups over Linux swap computed from `bench micro --json`."""

import json

import pytest

from tiermem_bench import micro_plot


def result(rows, size=100, limit=50):
    return {"size_mb": size, "limit_mb": limit, "device_read_us": 40.0, "rows": rows}


def test_speedups_are_linux_swap_time_over_the_systems():
    r = result([{"system": "linux-swap", "write_us": 8.0, "read_us": 16.0},
                {"system": "tiermem-file", "write_us": 2.0, "read_us": 8.0},
                {"system": "tiermem-mem", "write_us": 4.0, "read_us": None}])
    s = micro_plot.speedups(r)
    assert s["tiermem-file"] == (4.0, 2.0)
    assert s["tiermem-mem"] == (2.0, None)
    assert s["linux-swap"] == (1.0, 1.0)
    # Without Linux swap in the run there is nothing to compare with.
    assert micro_plot.speedups(result([{"system": "tiermem-file", "write_us": 2.0, "read_us": 8.0}])) == {
        "tiermem-file": (None, None)}


def test_the_command_draws_a_png_and_refuses_other_json(tmp_path):
    pytest.importorskip("matplotlib")
    good = tmp_path / "micro.json"
    good.write_text(json.dumps(result([{"system": "linux-swap", "write_us": 8.0, "read_us": 16.0},
                                       {"system": "tiermem-file", "write_us": 2.0, "read_us": 8.0}])))
    png = tmp_path / "micro.png"
    assert micro_plot.main([str(good), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"runs": []}))
    assert micro_plot.main([str(other), "-o", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()
