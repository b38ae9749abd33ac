"""The simulator's plot: miss-ratio curves from `tiermem sim --json`."""

import json
import subprocess

import pytest

from conftest import find_tiermem
from tiermem_bench import sim_plot

PNG = b"\x89PNG\r\n\x1a\n"


def row(prefetch, replace, local, faults, accesses=1000, modeled_ns=2e9):
    return {"prefetch": prefetch, "replace": replace, "local_pages": local, "faults": faults,
            "accesses": accesses, "modeled_ns": modeled_ns}


def test_curves_are_faults_per_access_by_growing_local_memory():
    result = {"footprint_pages": 200, "results": [
        row("none", "lru", 100, 400), row("none", "belady", 100, 250),
        row("none", "lru", 50, 900, modeled_ns=9e9), row("none", "belady", 50, 500)]}
    c = sim_plot.curves(result)
    assert c["none x lru"] == [(25.0, 0.9, 9.0), (50.0, 0.4, 2.0)]
    assert [p[1] for p in c["none x belady"]] == [0.5, 0.25]


def test_the_command_draws_a_png_and_refuses_other_json(tmp_path):
    pytest.importorskip("matplotlib")
    good = tmp_path / "sim.json"
    good.write_text(json.dumps({"trace": "t", "footprint_pages": 200,
                                "results": [row("none", "lru", 100, 400), row("stream", "lru", 100, 100)]}))
    png = tmp_path / "sim.png"
    assert sim_plot.main([str(good), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG
    for other in ({"rows": []}, {"footprint_pages": 1, "results": []}, [1, 2]):
        path = tmp_path / "other.json"
        path.write_text(json.dumps(other))
        assert sim_plot.main([str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def test_a_curve_from_the_simulator_itself(tmp_path):
    """The built binary's JSON at several sizes plots as one line per pair, and its faults per
    access fall as local memory grows (LRU and the optimum are stack algorithms)."""
    pytest.importorskip("matplotlib")
    binary = find_tiermem()
    if binary is None:
        pytest.skip("no tiermem binary built (cargo build, or set TIERMEM_BIN)")
    out = subprocess.run([binary, "sim", "--synthetic", "hot:200000:4000", "--local", "5%,20%,60%",
                          "--prefetch", "none", "--replace", "lru,belady", "--json"],
                         capture_output=True, check=True, text=True)
    path = tmp_path / "mrc.json"
    path.write_text(out.stdout)
    result = json.loads(out.stdout)
    c = sim_plot.curves(result)
    assert set(c) == {"none x lru", "none x belady"}
    for points in c.values():
        assert [round(p[0]) for p in points] == [5, 20, 60]
        ratios = [p[1] for p in points]
        assert ratios == sorted(ratios, reverse=True) and ratios[0] > ratios[-1], ratios
    png = tmp_path / "mrc.png"
    assert sim_plot.main([str(path), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG
