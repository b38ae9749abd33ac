"""tiermem's simulator beside libCacheSim, the reference its throughput target is set against:
the same trace through libCacheSim's LRU and FIFO and through `tiermem sim`'s, in one run on one
machine.

The fault counts must agree exactly (an independent implementation of the same two policies;
a difference fails the run), and the speeds are measured side by side, so their ratio holds on
any machine where an absolute figure such as "20 M requests/s" does not.

    tiermem bench sim-anchor --synthetic hot:100000000:65536 --local 50%
    tiermem bench sim-anchor run.tmtrace --local 30% --also s3fifo,sieve,arc --json out.json

(`tiermem bench sim-anchor ARGS` runs `python3 -m tiermem_bench.sim_anchor ARGS` with bench/ on
PYTHONPATH and this binary as the one measured.)

The trace is written once more in libCacheSim's oracleGeneral format (24 bytes a request) in a
temporary directory, removed at the end. libCacheSim comes from PyPI (bench/requirements.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The tmtrace header (docs/trace-format.md).
MAGIC = b"TMTRACE\0"
HEADER_BYTES = 24
PAGE_BYTES = 4096
# Kinds 0 and 1 are reads and writes; 2 (report) and 3 (compute) are not accesses.
ACCESS_KINDS = (0, 1)
# Records converted per step: bounds the conversion's memory (about 60 bytes a record).
CHUNK_RECORDS = 8 << 20

# The policies checked against tiermem's, by tiermem's name.
CHECKED = ("lru", "fifo")
# libCacheSim policies that may be shown beside them (faults and speed, nothing checked).
REFERENCES = {
    "lru": "LRU", "fifo": "FIFO", "clock": "Clock", "arc": "ARC", "lirs": "LIRS",
    "s3fifo": "S3FIFO", "sieve": "Sieve", "twoq": "TwoQ", "lfu": "LFU", "slru": "SLRU",
}


class AnchorError(Exception):
    """A bad input or a failed step, reported as one line."""


def oracle_general_dtype():
    import numpy as np

    # libCacheSim's oracleGeneral record: clock time, object id, object size, next access
    # (virtual time; -1 = unknown, which only Belady-style policies read).
    return np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


# Set in a compute record's value, it is a discard (format version 2).
DISCARD = 1 << 59


def read_header(path: Path) -> int:
    """The record count of an uncompressed page-number tmtrace; anything else is refused (see
    `as_page_tmtrace`, which has the simulator convert it)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise AnchorError(f"{path} is not an uncompressed tiermem binary trace")
    version = int.from_bytes(head[8:12], "little")
    unit = int.from_bytes(head[12:16], "little")
    if version not in (1, 2):
        raise AnchorError(f"{path}: trace format version {version}, this script reads versions 1 and 2")
    if unit != 0:
        raise AnchorError(f"{path} holds byte addresses; its page events come from the simulator")
    size = path.stat().st_size - HEADER_BYTES
    if size % 8:
        raise AnchorError(f"{path}: truncated record at the end")
    return size // 8


def convert(tmtrace: Path, out: Path, progress: bool = True) -> int:
    """Write the accesses of a page-number tmtrace as oracleGeneral records of 4 KiB objects;
    returns how many. Request i gets time i, as the simulator counts in accesses."""
    import numpy as np

    total = read_header(tmtrace)
    records = np.memmap(tmtrace, dtype="<u8", mode="r", offset=HEADER_BYTES, shape=(total,)) if total else []
    dtype = oracle_general_dtype()
    written = 0
    bar = None
    if progress and total > CHUNK_RECORDS:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="rec", unit_scale=True, desc="to oracleGeneral", file=sys.stderr)
    with open(out, "wb") as f:
        for start in range(0, total, CHUNK_RECORDS):
            chunk = np.asarray(records[start:start + CHUNK_RECORDS])
            kinds = chunk & 3
            # A discard (docs/trace-format.md) drops pages from the simulator's memory; libCacheSim
            # has no such request, so the two would not replay the same trace.
            if np.any((kinds == 3) & ((chunk >> 2) & DISCARD != 0)):
                raise AnchorError(f"{tmtrace} holds discards (pages the program gave back), which "
                                  "libCacheSim cannot replay")
            pages = chunk[(kinds == ACCESS_KINDS[0]) | (kinds == ACCESS_KINDS[1])] >> 2
            rec = np.empty(len(pages), dtype=dtype)
            rec["time"] = np.arange(written, written + len(pages), dtype=np.uint64).astype(np.uint32)
            rec["id"] = pages
            rec["size"] = PAGE_BYTES
            rec["next"] = -1
            rec.tofile(f)
            written += len(pages)
            if bar:
                bar.update(len(chunk))
    if bar:
        bar.close()
    return written


def run_libcachesim(trace: Path, policy: str, local_pages: int) -> dict:
    """One libCacheSim policy over an oracleGeneral trace: misses and requests a second (the
    whole replay inside libCacheSim, reading the trace as it goes)."""
    import libcachesim as lcs

    reader = lcs.TraceReader(str(trace), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(lcs, REFERENCES[policy])(cache_size=local_pages * PAGE_BYTES)
    start = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    seconds = time.perf_counter() - start
    return {"policy": policy, "miss_ratio": miss_ratio, "seconds": seconds}


def run_tiermem(binary: str, trace: Path, local: str, prefetch: str, replace: str) -> dict:
    """One pair through `tiermem sim --bench --json`: its result row, with the trace's footprint
    and accesses a second over the process's whole wall time (loading the trace included)."""
    # libCacheSim counts every first touch as a miss: so must the replay it is checked against.
    command = [binary, "sim", str(trace), "--local", local, "--prefetch", prefetch, "--replace", replace,
               "--first-touch", "miss", "--bench", "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise AnchorError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    result = json.loads(done.stdout)
    if not isinstance(result["local_pages"], int):
        raise AnchorError("give one --local size")
    row = result["results"][0]
    return {**row, "footprint_pages": result["footprint_pages"], "end_to_end_per_second": row["accesses"] / seconds}


def save_as_tmtrace(binary: str, source: list[str], out: Path, what: str) -> None:
    """Have `tiermem sim` write what it reads from `source` (a trace file, or --synthetic and a
    spec) as a page-number tmtrace; it replays it once through one page of FIFO meanwhile."""
    command = [binary, "sim", *source, "--save", str(out), "--local", "1", "--prefetch", "none", "--replace", "fifo"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise AnchorError(f"{what}: {done.stderr.strip()}")


def as_page_tmtrace(binary: str, trace: Path, work: Path) -> Path:
    """The trace itself when it is an uncompressed page-number tmtrace, else what `tiermem sim
    --save` makes of it (lackey and page lists, byte-address and compressed tmtraces)."""
    try:
        read_header(trace)
        return trace
    except AnchorError:
        pass
    out = work / "input.tmtrace"
    save_as_tmtrace(binary, [str(trace)], out, f"tiermem sim cannot read {trace}")
    return out


def compare(binary: str, trace: Path | None, synthetic: str | None, local: str, also: list[str],
            stream: bool, work: Path, log=print) -> dict:
    """Everything the command prints, as one dict (see `main`)."""
    if synthetic:
        log(f"making {synthetic} ...")
        tmtrace = work / "synthetic.tmtrace"
        save_as_tmtrace(binary, ["--synthetic", synthetic], tmtrace, "making the synthetic trace failed")
        label = synthetic
    else:
        if not trace.is_file():
            raise AnchorError(f"no trace file {trace}")
        tmtrace = as_page_tmtrace(binary, trace, work)
        label = str(trace)
    oracle = work / "trace.oracleGeneral"
    accesses = convert(tmtrace, oracle)
    if accesses == 0:
        raise AnchorError(f"{label} holds no accesses")

    rows = []
    local_pages = None
    for policy in CHECKED:
        log(f"tiermem sim {policy} ...")
        ours = run_tiermem(binary, tmtrace, local, "none", policy)
        if ours["accesses"] != accesses:
            raise AnchorError(f"tiermem sim counted {ours['accesses']:,} accesses, the trace holds {accesses:,}")
        # tiermem's JSON fixes the local memory in pages for libCacheSim.
        local_pages = ours["local_pages"]
        log(f"libCacheSim {REFERENCES[policy]} over {accesses:,} requests ...")
        lcs_run = run_libcachesim(oracle, policy, local_pages)
        lcs_faults = round(lcs_run["miss_ratio"] * accesses)
        rows.append({
            "policy": policy,
            "tiermem_faults": ours["faults"],
            "libcachesim_faults": lcs_faults,
            "agree": ours["faults"] == lcs_faults,
            "tiermem_per_s": ours["accesses_per_second"],
            "tiermem_end_to_end_per_s": ours["end_to_end_per_second"],
            "libcachesim_per_s": accesses / lcs_run["seconds"],
        })
    extra = []
    for policy in also:
        log(f"libCacheSim {REFERENCES[policy]} ...")
        lcs_run = run_libcachesim(oracle, policy, local_pages)
        extra.append({"policy": policy, "libcachesim_faults": round(lcs_run["miss_ratio"] * accesses),
                      "libcachesim_per_s": accesses / lcs_run["seconds"]})
    stream_row = None
    if stream:
        log("tiermem sim stream x stream-first ...")
        ours = run_tiermem(binary, tmtrace, local, "stream", "stream-first")
        stream_row = {"pair": "stream x stream-first", "faults": ours["faults"],
                      "tiermem_per_s": ours["accesses_per_second"],
                      "tiermem_end_to_end_per_s": ours["end_to_end_per_second"]}
    return {
        "trace": label,
        "accesses": accesses,
        "footprint_pages": ours["footprint_pages"],
        "local_pages": local_pages,
        "checked": rows,
        "references": extra,
        "stream": stream_row,
        "tiermem": binary,
        "libcachesim_version": package_version("libcachesim"),
        "note": "tiermem's speed: its replay of the trace already in memory (--bench), and end to end "
                "(the process's wall time: loading the trace, then the replay); libCacheSim's: "
                "process_trace, reading the trace from the page cache as it goes",
    }


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def table(result: dict) -> str:
    lcs_lru = next(r["libcachesim_per_s"] for r in result["checked"] if r["policy"] == "lru")
    m = 1e6
    lines = [
        f"trace {result['trace']}: {result['accesses']:,} accesses, footprint {result['footprint_pages']:,} pages, "
        f"local memory {result['local_pages']:,} pages",
        f"{'':<24}{'faults':>30}  {'M accesses/s: tiermem':>26}{'':>13}",
        f"{'policy':<24}{'tiermem':>16}{'libCacheSim':>14}  {'replay':>10}{'end to end':>12}{'libCacheSim':>13}"
        f"{'ratio':>8}",
    ]
    for r in result["checked"]:
        mark = "" if r["agree"] else "   <-- DIFFER"
        lines.append(f"{r['policy']:<24}{r['tiermem_faults']:>16,}{r['libcachesim_faults']:>14,}  "
                     f"{r['tiermem_per_s'] / m:>10.1f}{r['tiermem_end_to_end_per_s'] / m:>12.1f}"
                     f"{r['libcachesim_per_s'] / m:>13.1f}{r['tiermem_per_s'] / r['libcachesim_per_s']:>7.2f}x{mark}")
    for r in result["references"]:
        lines.append(f"{'libCacheSim ' + r['policy']:<24}{'':>16}{r['libcachesim_faults']:>14,}  "
                     f"{'':>10}{'':>12}{r['libcachesim_per_s'] / m:>13.1f}")
    if result["stream"]:
        s = result["stream"]
        lines.append(f"{s['pair']:<24}{s['faults']:>16,}{'':>14}  {s['tiermem_per_s'] / m:>10.1f}"
                     f"{s['tiermem_end_to_end_per_s'] / m:>12.1f}{'':>13}{s['tiermem_per_s'] / lcs_lru:>7.2f}x"
                     " libCacheSim's LRU")
    lines.append("ratio: tiermem's replay over libCacheSim's. " + result["note"])
    return "\n".join(lines)


def find_binary(given: str | None) -> str:
    """--tiermem, else the binary that started this (`tiermem bench sim-anchor`), else as the
    application harness finds one."""
    from tiermem_bench.cli import find_tiermem

    found = find_tiermem(given)
    if found is None:
        raise AnchorError("no tiermem binary: build it (cargo build --release -p tiermem-cli) or give --tiermem")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tiermem bench sim-anchor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", type=Path, help="a trace `tiermem sim` reads")
    p.add_argument("--synthetic", metavar="KIND:ACCESSES:FOOTPRINT_PAGES",
                   help="a synthetic trace instead (as `tiermem sim --synthetic`)")
    p.add_argument("--local", default="50%", help="local memory: pages or %% of the footprint (default 50%%)")
    p.add_argument("--also", default="", help=f"libCacheSim policies to show too: {', '.join(REFERENCES)}")
    p.add_argument("--no-stream", action="store_true", help="leave out tiermem's stream x stream-first row")
    p.add_argument("--tiermem", help="the tiermem binary (default: target/release, then target/debug, then PATH)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--work-dir", type=Path, help="where the temporary traces go (default: the system's)")
    args = p.parse_args(argv)
    if (args.trace is None) == (args.synthetic is None):
        p.error("give a trace file or --synthetic, not both")
    also = [a for a in args.also.split(",") if a]
    for a in also:
        if a not in REFERENCES:
            p.error(f"--also {a}: expected some of {', '.join(REFERENCES)}")
    if "," in args.local:
        p.error("--local takes one size here")
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        print("sim_anchor: libcachesim is not installed (pip install -r bench/requirements.txt)", file=sys.stderr)
        return 2
    try:
        binary = find_binary(args.tiermem)
        with tempfile.TemporaryDirectory(prefix="tiermem-anchor-", dir=args.work_dir) as work:
            result = compare(binary, args.trace, args.synthetic, args.local, also, not args.no_stream,
                             Path(work), log=lambda m: print(m, file=sys.stderr))
    except AnchorError as e:
        print(f"sim_anchor: {e}", file=sys.stderr)
        return 2
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not all(r["agree"] for r in result["checked"]):
        print("sim_anchor: tiermem's and libCacheSim's fault counts differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
