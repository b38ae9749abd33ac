"""Command lines per system, argument parsing, and the workloads' determinism at tiny scale."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_stopping_group
from tiermem_bench import cli
from tiermem_bench.digest import parse_result
from tiermem_bench.systems import BASELINE, SYSTEMS, helper_command, parse_systems
from tiermem_bench.workloads import WORKLOADS

BENCH_DIR = Path(__file__).resolve().parent.parent


def command(system, limit=1 << 20):
    return helper_command(system, tiermem_bin="tm", limit=limit, workload_argv=["prog", "-x"],
                          result_file=Path("/r.json"), work_dir=Path("/w"), swap_bytes=99,
                          device_file=Path("/w"), footprint=5 << 20, stats_file=Path("/s.json"), timeout=12)


def test_linux_swap_gets_a_limit_and_its_own_swap_file():
    argv = command(SYSTEMS["linux-swap"])
    assert argv[:3] == ["tm", "bench", "limited-run"]
    assert argv[argv.index("--limit") + 1] == str(1 << 20)
    assert argv[argv.index("--swap-dir") + 1] == "/w" and argv[argv.index("--swap-bytes") + 1] == "99"
    assert "--no-swap" not in argv
    assert argv[argv.index("--") + 1:] == ["prog", "-x"]


def test_tiermem_file_runs_under_the_same_limit_without_swap():
    argv = command(SYSTEMS["tiermem-file"])
    helper, program = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert "--no-swap" in helper and helper[helper.index("--limit") + 1] == str(1 << 20)
    assert program[:2] == ["tm", "run"]
    assert program[program.index("--limit") + 1] == str(1 << 20)
    assert program[program.index("--device") + 1] == "file:/w"
    assert program[program.index("--stats-json") + 1] == "/s.json"
    assert program[program.index("--footprint") + 1] == str(5 << 20)
    assert program[-3:] == ["--", "prog", "-x"]


def test_variants_pass_their_modes_and_the_ideal_uses_the_mem_device():
    assert "poll-only" in command(SYSTEMS["tiermem-poll-only"])
    assert "interrupt-only" in command(SYSTEMS["tiermem-interrupt-only"])
    assert "on-fault-path" in command(SYSTEMS["tiermem-reclaim-on-fault-path"])
    ideal = command(SYSTEMS["tiermem-mem"])
    helper, program = ideal[:ideal.index("--")], ideal[ideal.index("--") + 1:]
    assert ideal[ideal.index("--device") + 1] == "mem"
    # Same local limit as tiermem-file, no swap, and cgroup room for the DRAM store on top.
    assert program[program.index("--limit") + 1] == str(1 << 20)
    assert "--no-swap" in helper
    assert int(helper[helper.index("--limit") + 1]) == (1 << 20) + 2 * (5 << 20) + (64 << 20)


def test_cgroups_are_named_by_the_prefix_variable_which_must_be_a_tiermem_name(monkeypatch):
    monkeypatch.setenv("TIERMEM_BENCH_CGROUP_PREFIX", "tiermem-apps-mine")
    prefixes = {name: (argv := command(SYSTEMS[name]))[argv.index("--cgroup-prefix") + 1]
                for name in ("linux-swap", "tiermem-file", "tiermem-mem")}
    assert prefixes == {"linux-swap": "tiermem-apps-mine-swap", "tiermem-file": "tiermem-apps-mine-tiermem",
                        "tiermem-mem": "tiermem-apps-mine-ideal"}
    for bad in ("apps", "tiermem-a/b", "tiermem-a b", "tiermem-.."):
        monkeypatch.setenv("TIERMEM_BENCH_CGROUP_PREFIX", bad)
        with pytest.raises(ValueError, match="TIERMEM_BENCH_CGROUP_PREFIX"):
            command(SYSTEMS["linux-swap"])
    monkeypatch.delenv("TIERMEM_BENCH_CGROUP_PREFIX")
    argv = command(SYSTEMS["linux-swap"])
    assert argv[argv.index("--cgroup-prefix") + 1] == "tiermem-apps-swap"


def test_unlimited_has_no_limit():
    argv = command(BASELINE, limit=None)
    assert "--limit" not in argv and "--swap-dir" not in argv


def test_argument_parsing():
    assert cli.parse_ratios("20,100,60%") == [100, 60, 20]
    with pytest.raises(ValueError):
        cli.parse_ratios("0")
    with pytest.raises(ValueError):
        parse_systems("linux-swap,nope")
    with pytest.raises(ValueError):
        cli.parse_workloads("quicksort,bogus")
    with pytest.raises(ValueError, match="no workloads given"):
        cli.parse_workloads(" , ")
    assert cli.limit_for(1000 * 4096, 20) == 200 * 4096
    assert cli.limit_for(4096 * 10 + 1, 100) == 4096 * 11  # rounded up to pages
    assert cli.swap_bytes_for(1 << 30) >= 1 << 30


def test_system_groups_expand_in_order_without_repeats():
    names = lambda text: [s.name for s in parse_systems(text)]
    assert names(cli.build_parser().parse_args([]).systems) == ["linux-swap", "tiermem-file", "tiermem-mem"]
    assert names("paper") == ["linux-swap", "tiermem-file", "tiermem-mem", "tiermem-poll-only",
                              "tiermem-interrupt-only", "tiermem-reclaim-on-fault-path"]
    assert names("prefetchers,tiermem-file-stream") == ["tiermem-file", "tiermem-file-fastswap-clock",
                                                        "tiermem-file-stream-stream-first", "tiermem-file-fastswap",
                                                        "tiermem-file-stream"]
    assert names("tiermem-mem,main,tiermem-file-victim") == ["tiermem-mem", "linux-swap", "tiermem-file",
                                                             "tiermem-file-victim"]
    with pytest.raises(ValueError, match="groups: main"):
        parse_systems("mian")
    with pytest.raises(ValueError, match="no systems"):
        parse_systems(" , ")


def test_kvstore_javasort_and_sqlite_run_only_when_asked_for():
    defaults = cli.build_parser().parse_args([]).workloads.split(",")
    for name in ("kvstore", "javasort", "sqlite"):
        assert name in WORKLOADS
        assert name not in defaults


def test_every_workload_has_every_scale():
    for w in WORKLOADS.values():
        assert set(w.params) == {"tiny", "quick", "full"}, w.name


def run_tiny(name, cache):
    w = WORKLOADS[name]
    w.prepare("tiny", cache)
    env = dict(os.environ, PYTHONPATH=str(BENCH_DIR), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    out = run_stopping_group(w.command("tiny", cache), text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    result = parse_result(out.stdout)
    assert result is not None, out.stdout
    return result


def on_path(program):
    return any(os.access(os.path.join(d, program), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


@pytest.mark.parametrize("name", ["quicksort", "intsort", "linpack", "kmeans", "mlp", "kvstore", "javasort", "sqlite"])
def test_tiny_workloads_are_deterministic(tmp_path, name):
    if name == "quicksort" and not on_path("g++"):
        pytest.skip("no g++ to build the quicksort driver")
    if name == "javasort" and not (on_path("java") and on_path("javac")):
        pytest.skip("no JDK (java, javac) for the javasort workload")
    if name == "kvstore" and not on_path("redis-server"):
        pytest.skip("no redis-server (apt-get install redis-server)")
    first, second = run_tiny(name, tmp_path), run_tiny(name, tmp_path)
    assert first["digest"] == second["digest"]
    assert first["work_s"] > 0


def test_quicksort_digest_depends_on_the_input(tmp_path):
    if subprocess.run(["which", "g++"], capture_output=True).returncode != 0:
        pytest.skip("no g++ to build the quicksort driver")
    from tiermem_bench.workloads import quicksort_binary

    binary = quicksort_binary(tmp_path)
    a = parse_result(subprocess.run([str(binary), "1000", "1"], capture_output=True, text=True).stdout)
    b = parse_result(subprocess.run([str(binary), "1000", "2"], capture_output=True, text=True).stdout)
    assert a["digest"] != b["digest"] and a["digest"].endswith("-1000-1")


def test_every_system_runs_repeat_k_with_the_same_python_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    env = cli.run_environment()
    assert "PYTHONHASHSEED" not in env
    assert [cli.repeat_environment(env, k)["PYTHONHASHSEED"] for k in (0, 1, 3)] == ["0", "1", "3"]
    assert cli.repeat_environment(env, 2)["OMP_NUM_THREADS"] == "1", "the rest of the environment kept"
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    fixed = cli.run_environment()
    assert cli.repeat_environment(fixed, 2)["PYTHONHASHSEED"] == "7", "a seed the caller fixed is kept"


def test_a_missing_python_package_is_named_with_the_command_that_installs_it(tmp_path, monkeypatch, capsys):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# pins\nnumpy==0.0.1  # another version than installed\n"
                            "tiermem-no-such-package==1.0\npytest==9.2.0\n")
    found = cli.harness_packages(requirements)
    assert found["tiermem-no-such-package"] is None
    assert found["numpy"] not in (None, "0.0.1"), "the installed version, whatever the pin says"
    assert "pytest" not in found, "the tests' own package is not the harness's"

    monkeypatch.setattr(cli, "harness_packages", lambda: {"numpy": "2.4.6", "tqdm": None})
    assert cli.main(["--scale", "tiny", "--workloads", "quicksort"]) == 2
    err = capsys.readouterr().err
    assert "lacks the harness's Python packages tqdm" in err and "pip install -r" in err, err


@pytest.mark.parametrize("name", ["kmeans", "mlp", "sqlite"])
def test_generated_inputs_are_made_once_in_prepare_and_read_by_the_run(tmp_path, name):
    w = WORKLOADS[name]
    w.prepare("tiny", tmp_path)
    inputs = sorted(p for p in tmp_path.glob(f"{name}-*") if ".tmp" not in p.name)
    assert inputs, "prepare wrote no input file"
    argv = w.command("tiny", tmp_path)
    for path in inputs:
        assert str(path) in argv, (path, argv)
    made = {p: p.stat().st_mtime_ns for p in inputs}
    w.prepare("tiny", tmp_path)
    assert {p: p.stat().st_mtime_ns for p in inputs} == made, "prepare made the inputs again"
    assert not list(tmp_path.glob("*.tmp*")), "a temporary file was left behind"
    # The run reads the file: without it, it fails rather than generating the data itself.
    inputs[0].unlink()
    env = dict(os.environ, PYTHONPATH=str(BENCH_DIR), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    out = run_stopping_group(argv, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert inputs[0].name in out.stderr


def test_the_sqlite_digest_depends_on_the_rows_and_every_row_is_loaded(tmp_path):
    w = WORKLOADS["sqlite"]
    env = dict(os.environ, PYTHONPATH=str(BENCH_DIR))
    results = []
    for seed in (4, 5):
        params = dict(w.params["tiny"], seed=seed)
        variant = type(w)(w.name, w.description, {"tiny": params})
        variant.prepare("tiny", tmp_path)
        out = run_stopping_group(variant.command("tiny", tmp_path), text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        results.append(parse_result(out.stdout))
    assert results[0]["digest"] != results[1]["digest"]
    assert results[0]["rows"] == w.params["tiny"]["rows"]
    assert results[0]["probed_rows"] > 0, "the index probes found rows"


def test_the_pagerank_edge_list_is_sorted_by_source_then_target(tmp_path):
    import numpy as np

    w = WORKLOADS["pagerank"]
    w.prepare("tiny", tmp_path)
    (path,) = tmp_path.glob("pagerank-*.edges")
    edges = np.loadtxt(path, dtype=np.int64)
    assert len(edges) == w.params["tiny"]["edges"]
    assert edges.max() == w.params["tiny"]["nodes"] - 1
    order = np.lexsort((edges[:, 1], edges[:, 0]))
    assert (order == np.arange(len(edges))).all(), "edges are not in (source, target) order"
    assert str(path) in w.command("tiny", tmp_path)
    assert not list(tmp_path.glob("*.tmp*")), "a temporary file was left behind"


def test_prepare_removes_what_a_killed_prepare_left_and_keeps_a_running_one_s(tmp_path):
    from tiermem_bench.workloads import kmeans

    w = WORKLOADS["kmeans"]
    p = w.params["tiny"]
    path = kmeans.points_file(str(tmp_path), p["samples"], p["features"], p["clusters"], p["seed"])
    exited = subprocess.Popen(["true"])
    exited.wait()  # its pid now names no process
    dead = f"{path}.tmp{exited.pid}"
    live = f"{path}.tmp{os.getppid()}"
    for leftover in (dead, live):
        with open(leftover, "wb") as f:
            f.write(b"half")
    w.prepare("tiny", tmp_path)
    assert os.path.exists(path)
    assert not os.path.exists(dead), "a dead prepare's temporary file was kept"
    assert os.path.exists(live), "a running process's temporary file was removed"
    os.unlink(live)
