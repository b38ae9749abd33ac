"""The simulator beside libCacheSim: the conversion to oracleGeneral, and the two simulators'
LRU and FIFO fault counts on the same traces (an independent implementation as the oracle)."""

import json

import pytest

from conftest import find_tiermem
from tiermem_bench import sim_anchor


def write_tmtrace(path, records, unit=0, magic=b"TMTRACE\0", version=1):
    header = magic + version.to_bytes(4, "little") + unit.to_bytes(4, "little") + len(records).to_bytes(8, "little")
    path.write_bytes(header + b"".join(r.to_bytes(8, "little") for r in records))


def test_conversion_keeps_reads_and_writes_in_order_and_drops_reports_and_compute(tmp_path):
    np = pytest.importorskip("numpy")
    # (page, kind): read 7, write 9, report 7, compute 100, read 2^39.
    events = [(7, 0), (9, 1), (7, 2), (100, 3), (1 << 39, 0)]
    trace = tmp_path / "t.tmtrace"
    write_tmtrace(trace, [page << 2 | kind for page, kind in events])
    out = tmp_path / "t.og"
    assert sim_anchor.convert(trace, out, progress=False) == 3
    rec = np.fromfile(out, dtype=sim_anchor.oracle_general_dtype())
    assert rec["id"].tolist() == [7, 9, 1 << 39]
    assert rec["time"].tolist() == [0, 1, 2]
    assert set(rec["size"].tolist()) == {4096}
    assert set(rec["next"].tolist()) == {-1}
    assert out.stat().st_size == 3 * 24


def test_other_files_are_refused_with_the_reason(tmp_path):
    byte_trace = tmp_path / "bytes.tmtrace"
    write_tmtrace(byte_trace, [4096 << 2], unit=1)
    with pytest.raises(sim_anchor.AnchorError, match="byte addresses"):
        sim_anchor.read_header(byte_trace)
    other = tmp_path / "other"
    write_tmtrace(other, [1], magic=b"NOTTRACE")
    with pytest.raises(sim_anchor.AnchorError, match="not an uncompressed"):
        sim_anchor.read_header(other)
    cut = tmp_path / "cut.tmtrace"
    write_tmtrace(cut, [5 << 2])
    cut.write_bytes(cut.read_bytes()[:-3])
    with pytest.raises(sim_anchor.AnchorError, match="truncated"):
        sim_anchor.read_header(cut)
    future = tmp_path / "v3.tmtrace"
    write_tmtrace(future, [5 << 2], version=3)
    with pytest.raises(sim_anchor.AnchorError, match="version 3"):
        sim_anchor.read_header(future)


def test_a_trace_with_discards_is_refused_and_one_without_converts(tmp_path):
    pytest.importorskip("numpy")
    # Version 2: pages 5..8 given back between two reads (docs/trace-format.md).
    discard = (sim_anchor.DISCARD | 4 << 40 | 5) << 2 | 3
    trace = tmp_path / "d.tmtrace"
    write_tmtrace(trace, [5 << 2, discard, 5 << 2], version=2)
    with pytest.raises(sim_anchor.AnchorError, match="discards"):
        sim_anchor.convert(trace, tmp_path / "d.og", progress=False)
    plain = tmp_path / "p.tmtrace"
    write_tmtrace(plain, [5 << 2, 100 << 2 | 3, 6 << 2 | 1], version=2)
    assert sim_anchor.convert(plain, tmp_path / "p.og", progress=False) == 2


def test_bad_arguments_exit_with_usage(tmp_path, capsys):
    for argv in ([], ["x.tmtrace", "--synthetic", "hot:10:10"], ["--synthetic", "hot:10:10", "--also", "belady"],
                 ["--synthetic", "hot:10:10", "--local", "10%,20%"]):
        with pytest.raises(SystemExit) as e:
            sim_anchor.main(argv)
        assert e.value.code == 2, argv
    capsys.readouterr()


def needs_both():
    pytest.importorskip("libcachesim", reason="libcachesim not installed (bench/requirements.txt)")
    binary = find_tiermem()
    if binary is None:
        pytest.skip("no tiermem binary built (cargo build, or set TIERMEM_BIN)")
    return binary


@pytest.mark.parametrize("synthetic,local", [("mixed:300000:5000", "20%"), ("random:200000:3000", "50%"),
                                             ("hot:300000:20000", "7%")])
def test_tiermem_and_libcachesim_count_the_same_lru_and_fifo_faults(tmp_path, synthetic, local):
    binary = needs_both()
    out = tmp_path / "anchor.json"
    code = sim_anchor.main(["--synthetic", synthetic, "--local", local, "--tiermem", binary, "--json", str(out),
                            "--also", "s3fifo", "--work-dir", str(tmp_path)])
    result = json.loads(out.read_text())
    assert code == 0, result
    assert [r["policy"] for r in result["checked"]] == ["lru", "fifo"]
    for r in result["checked"]:
        assert r["agree"] and r["tiermem_faults"] == r["libcachesim_faults"], r
        # Far from trivial: neither every access nor only the cold misses.
        assert result["footprint_pages"] < r["tiermem_faults"] < result["accesses"], r
    lru, fifo = result["checked"]
    assert lru["tiermem_faults"] != fifo["tiermem_faults"]
    assert result["references"][0]["libcachesim_faults"] > 0
    assert result["stream"]["faults"] > 0
    # The temporary traces are gone.
    assert [p.name for p in tmp_path.iterdir()] == ["anchor.json"]


def test_a_trace_file_is_read_as_the_simulator_reads_it(tmp_path):
    """A page list (not a tmtrace) goes through `tiermem sim --save` first."""
    binary = needs_both()
    pages = tmp_path / "pages.txt"
    pages.write_text("\n".join(str((i * 37) % 101 + (i % 7) * 300) for i in range(20000)) + "\n")
    out = tmp_path / "a.json"
    assert sim_anchor.main([str(pages), "--local", "64", "--tiermem", binary, "--json", str(out),
                            "--no-stream"]) == 0
    result = json.loads(out.read_text())
    assert result["accesses"] == 20000 and result["local_pages"] == 64
    assert all(r["agree"] for r in result["checked"])
    assert result["stream"] is None


def test_a_difference_fails_the_run(tmp_path, monkeypatch, capsys):
    binary = needs_both()
    real = sim_anchor.run_libcachesim

    def off_by_some(trace, policy, local_pages):
        run = real(trace, policy, local_pages)
        if policy == "fifo":
            run["miss_ratio"] *= 1.01
        return run

    monkeypatch.setattr(sim_anchor, "run_libcachesim", off_by_some)
    assert sim_anchor.main(["--synthetic", "random:100000:2000", "--local", "30%", "--tiermem", binary,
                            "--no-stream"]) == 1
    out = capsys.readouterr()
    assert "DIFFER" in out.out and "differ" in out.err


def test_a_missing_trace_is_refused(tmp_path, capsys):
    binary = needs_both()
    assert sim_anchor.main([str(tmp_path / "none.tmtrace"), "--tiermem", binary]) == 2
    assert "no trace file" in capsys.readouterr().err
