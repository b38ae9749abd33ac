"""`tiermem bench apps`: the application benchmark matrix (Ultraswap §4.3/§4.4 on this machine).

For every workload: run it unlimited (its footprint = the highest cgroup peak, its output digest =
the reference), then at each ratio of the footprint under every system, `--repeats` times, checking
each run's digest. Failed runs (OOM kill, crash, wrong output, timeout) are recorded as failures of
that system, never dropped, and the matrix goes on.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tiermem_bench import plot as plotting
from tiermem_bench import exclusive, report, stats
from tiermem_bench.diskstats import stat_file_for
from tiermem_bench.runner import OK, WRONG, RunRecord, run_once
from tiermem_bench.systems import BASELINE, DEFAULT_SYSTEMS, GROUPS, SYSTEMS, helper_command, parse_systems
from tiermem_bench.workloads import DEFAULT_WORKLOADS, NOT_BY_DEFAULT, SCALES, WORKLOADS
from tiermem_bench.workloads._common import THREAD_VARIABLES

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = BENCH_DIR.parent
PAGE = 4096
MIB = 1 << 20


def parse_ratios(text: str) -> list[int]:
    ratios = []
    for part in text.split(","):
        part = part.strip().removesuffix("%")
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"ratio '{part}' is not a whole percentage (like 60 or 60%)") from None
        if not 1 <= value <= 100:
            raise ValueError(f"ratio {value} is not a percentage in 1..100")
        ratios.append(value)
    if not ratios:
        raise ValueError("no ratios given")
    return sorted(set(ratios), reverse=True)


def parse_workloads(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    if not names:
        raise ValueError(f"no workloads given; known: {', '.join(WORKLOADS)}")
    return names


def limit_for(footprint: int, ratio: int) -> int:
    """ratio% of the footprint, rounded up to whole pages."""
    raw = footprint * ratio // 100
    return max(PAGE, -(-raw // PAGE) * PAGE)


def swap_bytes_for(footprint: int) -> int:
    """A swap file that can hold the whole footprint with room to spare."""
    return -(-(footprint * 3 // 2 + 64 * MIB) // MIB) * MIB


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiermem bench apps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=SCALES, default="quick",
                   help="workload sizes: tiny (CI smoke), quick (default), full (footprints of 2-6 GB)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated systems or groups; systems: {', '.join(SYSTEMS)}; groups: "
                        + "; ".join(f"{g} = {', '.join(members)}" for g, members in GROUPS.items())
                        + " (default: main)")
    p.add_argument("--ratios", default="100,80,60,40,20", help="memory limits in %% of the footprint")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: all but {', '.join(NOT_BY_DEFAULT)})")
    p.add_argument("--repeats", type=int, default=3, help="runs per point (median reported); default 3")
    p.add_argument("--out", type=Path, help="output directory (default target/bench-apps/<timestamp>)")
    p.add_argument("--dir", type=Path,
                   help="directory for the swap file and tiermem's device file (same file system for both; "
                        "default: <out>/scratch); made if missing, and what the harness made is removed "
                        "afterwards when empty")
    p.add_argument("--cache", type=Path, help="where the compiled drivers and the workloads' input files are kept "
                                              "(up to about 10 GB at --scale full; default target/bench-apps/cache)")
    p.add_argument("--tiermem", help="the tiermem binary (default: the one that started this, $TIERMEM_BIN)")
    p.add_argument("--timeout-factor", type=float, default=25.0,
                   help="kill a run after this many times the unlimited run's time (default 25)")
    # A safety bound, not a target: tiermem-file's PageRank at 20% at the quick scale took 53-89 s
    # on the machines of 2026-11-28 and 2026-12-02 (60 s cut it off) and 116-145 s on the slower
    # disk of 2026-12-04 (120 s cut it off in two runs of three). Only runs that would pass the
    # bound take longer with a higher one; no Linux swap run of the quick matrices reached 120 s.
    p.add_argument("--min-timeout", type=float, default=300.0,
                   help="but never sooner than this many seconds (default 300)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--report-only", type=Path, nargs="+", metavar="RUNS_JSON",
                   help="do not run anything: print the tables and draw the plot of an earlier runs.json; "
                        "of several merged into --out, each file's runs of a workload under a system at a ratio "
                        "replacing the earlier files' runs of that point (measured again), the other points kept "
                        "(matrices of other ratios add up)")
    p.add_argument("--compare", type=Path, nargs="+", metavar="BASE_RUNS_JSON",
                   help="do not run anything: an A/B of the runs in these runs.json files (the base, pooled) "
                        "against those given with --to (say the same matrix with another --tiermem build): "
                        "median time and MiB read per point, new/base of the times, and its geometric mean over "
                        "the tiermem systems, per system and per system and ratio; written to --out/compare.txt "
                        "too when --out is given")
    p.add_argument("--to", type=Path, nargs="+", metavar="NEW_RUNS_JSON",
                   help="the runs --compare compares with the base (pooled)")
    return p


def load_compared_runs(path: Path) -> tuple[list[dict], str | None]:
    """The runs of one runs.json for `--compare` (see `load_checked`) and the scale it was
    measured at. Raises ValueError with what is wrong."""
    document = load_checked(path)
    meta = document.get("meta")
    return document["runs"], meta.get("scale") if isinstance(meta, dict) else None


def load_checked(path: Path) -> dict:
    """One runs.json document for `--compare` or `--report-only`, its runs checked so that the
    tables cannot trip over them. Raises ValueError with what is wrong."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    runs = document.get("runs") if isinstance(document, dict) else None
    if not isinstance(runs, list):
        raise ValueError(f"{path}: not a runs.json written by tiermem bench apps (no list of runs in it)")
    for i, run in enumerate(runs):
        problem = None
        if not isinstance(run, dict):
            problem = "not an object"
        elif not all(isinstance(run.get(k), str) for k in ("workload", "system", "status")):
            problem = "workload, system or status missing"
        elif run.get("ratio") is not None and (type(run["ratio"]) is not int or run["ratio"] <= 0):
            problem = f"ratio {run['ratio']!r} is not a whole percentage"
        elif run["status"] == OK and not (isinstance(run.get("wall_s"), (int, float))
                                          and math.isfinite(run["wall_s"]) and run["wall_s"] > 0):
            problem = f"a successful run without a positive time (wall_s {run.get('wall_s')!r})"
        if problem:
            raise ValueError(f"{path}: run {i}: {problem}")
    if "meta" in document and not isinstance(document["meta"], dict):
        raise ValueError(f"{path}: its meta is not an object")
    return document


def compare(base_paths: list[Path], new_paths: list[Path], out: Path | None) -> int:
    """`--compare BASE... --to NEW...`: print (and with `out`, save) the A/B of the two sets, the
    files of each side pooled."""
    sides, scales = [], set()
    for paths in (base_paths, new_paths):
        runs = []
        for path in paths:
            try:
                found, scale = load_compared_runs(path)
            except ValueError as e:
                print(f"tiermem bench apps: {e}", file=sys.stderr)
                return 2
            runs += found
            scales.add(scale)
        sides.append(runs)
    text = report.compare_runs(*sides)
    if len(scales) > 1:
        text = (f"WARNING: the files were measured at different scales "
                f"({', '.join(sorted(str(s) for s in scales))}): their points are not the same programs\n" + text)
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "compare.txt").write_text(text)
        except OSError as e:
            print(f"tiermem bench apps: cannot write {out / 'compare.txt'}: {e}", file=sys.stderr)
            return 2
    print(text, end="")
    return 0


def find_tiermem(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("TIERMEM_BIN"), shutil.which("tiermem"),
                      str(REPO_DIR / "target/release/tiermem")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def tiermem_run_available(tiermem: str) -> bool:
    """Whether this tiermem binary has the `run` subcommand the tiermem systems need."""
    try:
        probe = subprocess.run([tiermem, "run", "--help"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


# Variables of the harness itself; `tiermem run` rejects TIERMEM_* variables it does not know.
HARNESS_VARIABLES = ("TIERMEM_BIN", "TIERMEM_PYTHON", "TIERMEM_BENCH_DIR")


def run_environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in HARNESS_VARIABLES}
    for name in THREAD_VARIABLES:
        env[name] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return env


def repeat_environment(env: dict, repeat: int) -> dict:
    """The environment of run `repeat` of a point: Python's string hashing seeded with the repeat
    number, the same for every system, unless the caller fixed PYTHONHASHSEED. Python picks a
    random seed per process, and a program can then page differently from run to run: MLP at
    60% of its footprint read 364 MiB back under tiermem-mem with seed 0 and 527 with seed 1
    (Linux swap 284 and 313), deterministically per seed. With one seed per repeat, run k of
    every system runs the same program, and a re-run repeats it."""
    if "PYTHONHASHSEED" in env:
        return env
    return {**env, "PYTHONHASHSEED": str(repeat)}


_libc = None


def _die_with_parent():
    """preexec_fn: the helper gets SIGTERM (and cleans up) if this harness dies without warning."""
    global _libc
    try:
        _libc = _libc or ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Matrix:
    """Runs the matrix, keeping every run (also across an interruption) in `self.runs`."""

    def __init__(self, args, systems, workloads, ratios, tiermem, out, scratch, cache, progress):
        self.args, self.systems, self.workloads, self.ratios = args, systems, workloads, ratios
        self.tiermem, self.out, self.scratch, self.cache, self.progress = tiermem, out, scratch, cache, progress
        self.runs: list[dict] = []
        self.env = run_environment()
        self.journal = open(out / "runs.jsonl", "a")
        self.sequence = 0
        # The disk that tiermem's device files and Linux swap's swap files are on.
        self.disk_stat = stat_file_for(scratch)

    def record(self, rec: RunRecord) -> None:
        run = rec.to_dict()
        self.runs.append(run)
        self.journal.write(json.dumps(run, sort_keys=True) + "\n")
        self.journal.flush()
        self.progress.update(1)
        if rec.status != OK:
            where = "unlimited" if rec.ratio is None else f"{rec.ratio}%"
            self.progress.write(f"FAILED {rec.workload} {rec.system} {where} run {rec.repeat}: {rec.status}: "
                                f"{rec.reason}")

    def one(self, system, workload, ratio, repeat, footprint, expected, timeout) -> RunRecord:
        self.sequence += 1
        limit = None if ratio is None else limit_for(footprint, ratio)
        rec = RunRecord(workload=workload.name, system=system.name, ratio=ratio, repeat=repeat,
                        limit_bytes=limit, footprint_bytes=footprint, expected_digest=expected)
        stats_file = self.scratch / f"stats-{os.getpid()}-{self.sequence}.json"
        result_file = self.scratch / "limited-run.json"
        argv = helper_command(system, tiermem_bin=self.tiermem, limit=limit,
                              workload_argv=workload.command(self.args.scale, self.cache), result_file=result_file,
                              work_dir=self.scratch, swap_bytes=swap_bytes_for(footprint or 0),
                              device_file=self.scratch, footprint=footprint or 0, stats_file=stats_file,
                              timeout=timeout)
        self.progress.set_postfix_str(f"{workload.name} {system.name} "
                                      f"{'unlimited' if ratio is None else f'{ratio}%'} #{repeat}")
        env = repeat_environment(self.env, repeat)
        return run_once(rec, argv, result_file=result_file, expected=expected, env=env,
                        stats_file=stats_file if system.kind == "tiermem" else None,
                        preexec_fn=_die_with_parent, disk_stat=self.disk_stat)

    def run_workload(self, workload) -> None:
        repeats = self.args.repeats
        baseline = []
        # The footprint is the cgroup's peak, page cache included, which a cgroup is charged only
        # for files nobody has cached yet: PageRank's footprint was 185 or 228 MiB (37 or 46 MiB
        # at 20%) depending on whether its edge list and the Python libraries were cached before.
        # The limited runs find them cached (by the unlimited runs), so the footprint is measured
        # that way too: one unrecorded run first fills the cache.
        self.one(BASELINE, workload, None, 0, None, None, None)
        for repeat in range(1, repeats + 1):
            rec = self.one(BASELINE, workload, None, repeat, None, None, None)
            baseline.append(rec)
        # The reference output is the first unlimited run's; the others must agree with it.
        digests = [r.digest for r in baseline if r.status == "wrong" and r.reason == "no reference digest"]
        expected = digests[0] if digests else None
        for rec in baseline:
            if rec.status == "wrong" and rec.reason == "no reference digest":
                rec.expected_digest = expected
                rec.status, rec.reason = (OK, "") if rec.digest == expected else (WRONG, "unlimited runs disagree")
            self.record(rec)
        ok = [r for r in baseline if r.status == OK]
        peaks = [r.peak_bytes for r in ok if r.peak_bytes]
        if not peaks:
            why = ("no successful unlimited run, so no footprint or reference output" if not ok
                   else "its unlimited runs report no peak memory, so no footprint")
            skipped = len(self.ratios) * len(self.systems) * repeats
            self.progress.update(skipped)
            self.progress.write(f"{workload.name}: {why}; its {skipped} limited runs were not started")
            return
        footprint = max(peaks)
        base_time = stats.median(r.wall_s for r in ok)
        timeout = max(self.args.min_timeout, self.args.timeout_factor * base_time)
        self.progress.write(f"{workload.name}: footprint {footprint / MIB:.0f} MiB, unlimited {base_time:.2f} s")
        for ratio in self.ratios:
            for repeat in range(1, repeats + 1):
                for system in self.systems:  # systems interleaved, so drift hits them alike
                    self.record(self.one(system, workload, ratio, repeat, footprint, expected, timeout))


def make_dirs(path: Path) -> list[Path]:
    """Create `path` and whichever of its parents are missing; return the directories created,
    outermost first, so that the harness can remove exactly those afterwards."""
    made = []
    for directory in reversed([path, *path.parents]):
        if not directory.exists():
            directory.mkdir()
            made.append(directory)
    return made


def remove_made(made: list[Path]) -> None:
    """Remove the directories `make_dirs` created, innermost first, while they are empty: a user's
    own directory, or one the run left something in, stays."""
    for directory in reversed(made):
        try:
            directory.rmdir()
        except OSError:
            return


def probe_device(tiermem: str, directory: Path, machine: bool = False) -> dict:
    """`tiermem probe --latency --json` in `directory`: the device's own 4 KiB read latency
    (this VM's disk drifts by up to 10x between days, and every paging figure scales with it),
    and with `machine` what paging costs on this machine (`--machine`: TLB shootdown, thread
    wake-up; a binary without that option is asked again without it). Empty, with a note, where
    it cannot be measured."""
    why = ["not run"]
    for extra in (["--machine"], []) if machine else ([],):
        try:
            probe = subprocess.run([tiermem, "probe", "--dir", str(directory), "--latency", "--json", *extra],
                                   capture_output=True, text=True, timeout=300)
            if probe.returncode == 0:
                return json.loads(probe.stdout)
            why = probe.stderr.strip().splitlines()[-1:] or [f"exit status {probe.returncode}"]
        except (OSError, subprocess.TimeoutExpired, ValueError) as e:
            why = [str(e)]
    print(f"NOTE: device latency in {directory} not measured: {why[0]}", file=sys.stderr)
    return {}


def merge_runs(documents: list[tuple[Path, dict]]) -> tuple[list[dict], dict]:
    """The runs and meta of several runs.json documents, in order: a later document's runs of a
    workload under a system at a ratio replace every earlier run of that point (a workload, a
    system or a ratio measured again; its unlimited runs, the reference, likewise), and points
    only an earlier document measured stay, so matrices of other ratios add up (a full scale
    too long for one invocation); the meta is the first one's, with the systems and ratios of
    all, and `merged_from` saying what came from where."""
    def point(run: dict) -> tuple:
        return run["workload"], run["system"], run.get("ratio")

    runs, meta = [], {}
    for path, document in documents:
        theirs = document["runs"]
        again = {r["workload"] for r in theirs}
        measured = {point(r) for r in theirs}
        runs = [r for r in runs if point(r) not in measured] + list(theirs)
        their_meta = document.get("meta", {})
        if not meta:
            meta = dict(their_meta)
        else:
            meta["systems"] = list(meta.get("systems") or []) + [
                v for v in their_meta.get("systems") or [] if v not in (meta.get("systems") or [])]
            meta["ratios"] = sorted(set(meta.get("ratios") or []) | set(their_meta.get("ratios") or []), reverse=True)
        if len(documents) > 1:
            meta.setdefault("merged_from", []).append(
                {"file": str(path), "started": their_meta.get("started"), "workloads": sorted(again)})
    return runs, meta


def finish(out: Path, runs: list[dict], meta: dict, systems: list[str], ratios: list[int], draw: bool) -> str:
    summary = stats.summarise(runs)
    report.write_csv(runs, out / "runs.csv")
    report.write_json(runs, meta, summary, out / "runs.json")
    text = report.machine_line(meta) + report.device_line(meta) + report.format_tables(runs, systems, ratios)
    (out / "table.txt").write_text(text)
    if draw and runs:
        plotting.plot(runs, systems, ratios, out / "apps.png",
                      title=f"tiermem bench apps --scale {meta.get('scale')}")
    return text


def stop_cleanly_on_signals() -> None:
    """End the matrix the same way on Ctrl-C, `kill` (SIGTERM) and a closed terminal (SIGHUP):
    the run in progress is stopped (its helper removes its cgroup and swap file), and the results
    so far are written. SIGINT gets its default handler back as well, since a shell starts
    background jobs with it ignored and `kill -INT` should still stop the matrix; a SIGHUP
    ignored on purpose (nohup) stays ignored."""
    def interrupt(signum, _frame):
        # A second signal during the clean-up ends the process at once.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is interrupt:
                signal.signal(sig, signal.SIG_DFL)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def harness_packages(requirements: Path = BENCH_DIR / "requirements.txt") -> dict[str, str | None]:
    """The pinned packages of bench/requirements.txt the harness needs (pytest is for the tests
    only), each with the version this Python has (None: not installed). A version other than
    the pin is not an error: the harness still runs, and the results record what was used."""
    from importlib import metadata

    found = {}
    for line in requirements.read_text().splitlines():
        pin = line.split("#", 1)[0].strip()
        if not pin or pin.startswith("pytest"):
            continue
        name = pin.split("==", 1)[0].strip()
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare is not None:
        # Options of a run, which an A/B of finished runs would silently ignore.
        ignored = [f"--{dest.replace('_', '-')}" for dest in ("scale", "systems", "ratios", "workloads", "repeats",
                                                              "dir", "cache", "tiermem", "timeout_factor",
                                                              "min_timeout", "no_plot")
                   if getattr(args, dest) != parser.get_default(dest)]
        if ignored:
            print(f"tiermem bench apps: --compare runs nothing, so {', '.join(ignored)} cannot apply",
                  file=sys.stderr)
            return 2
    if (args.compare is None) != (args.to is None):
        print("tiermem bench apps: --compare and --to go together (the base runs and the new ones)", file=sys.stderr)
        return 2
    if args.compare is not None:
        if args.report_only:
            print("tiermem bench apps: --compare and --report-only do not go together", file=sys.stderr)
            return 2
        return compare(args.compare, args.to, args.out)
    try:
        ratios = parse_ratios(args.ratios)
        systems = parse_systems(args.systems)
        workload_names = parse_workloads(args.workloads)
    except ValueError as e:
        print(f"tiermem bench apps: {e}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("tiermem bench apps: --repeats must be at least 1", file=sys.stderr)
        return 2
    for option, value in (("--timeout-factor", args.timeout_factor), ("--min-timeout", args.min_timeout)):
        if not (math.isfinite(value) and value > 0):
            print(f"tiermem bench apps: {option} {value}: must be a positive number", file=sys.stderr)
            return 2
    for option, path in (("--out", args.out), ("--dir", args.dir), ("--cache", args.cache)):
        if path is not None and path.exists() and not path.is_dir():
            print(f"tiermem bench apps: {option} {path}: exists and is not a directory", file=sys.stderr)
            return 2

    packages = harness_packages()
    missing = [name for name, version in packages.items() if version is None]
    if missing and not (args.report_only and args.no_plot):
        print(f"tiermem bench apps: {sys.executable} lacks the harness's Python packages "
              f"{', '.join(missing)}; install the pinned versions with `{sys.executable} -m pip "
              f"install -r {BENCH_DIR / 'requirements.txt'}` (./scripts/test does this)", file=sys.stderr)
        return 2

    if args.report_only:
        try:
            runs, meta = merge_runs([(path, load_checked(path)) for path in args.report_only])
        except ValueError as e:
            print(f"tiermem bench apps: {e}", file=sys.stderr)
            return 2
        if len(args.report_only) > 1 and args.out is None:
            print("tiermem bench apps: merging several runs.json files needs --out", file=sys.stderr)
            return 2
        out = args.out or args.report_only[0].parent
        out.mkdir(parents=True, exist_ok=True)
        names = meta.get("systems") or [s.name for s in systems]
        print(finish(out, runs, meta, names, meta.get("ratios") or ratios, not args.no_plot), end="")
        return 0

    if os.geteuid() != 0:
        print("tiermem bench apps: needs root (memory cgroups, swapon); run it as root", file=sys.stderr)
        return 2
    if args.tiermem is not None and not (os.path.isfile(args.tiermem) and os.access(args.tiermem, os.X_OK)):
        print(f"tiermem bench apps: --tiermem {args.tiermem}: no such executable", file=sys.stderr)
        return 2
    tiermem = find_tiermem(args.tiermem)
    if tiermem is None:
        print("tiermem bench apps: no tiermem binary found (build it, or pass --tiermem)", file=sys.stderr)
        return 2
    skipped_systems = {}
    if any(s.kind == "tiermem" for s in systems) and not tiermem_run_available(tiermem):
        for s in systems:
            if s.kind == "tiermem":
                skipped_systems[s.name] = f"{tiermem} has no `run` subcommand yet"
        systems = [s for s in systems if s.kind != "tiermem"]
        print(f"NOTE: {tiermem} has no `tiermem run`; NOT measuring {', '.join(skipped_systems)}", file=sys.stderr)
    if not systems:
        print("tiermem bench apps: no system left to measure", file=sys.stderr)
        return 2

    command = "tiermem bench apps " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        with exclusive.machine_to_ourselves(command):
            return measure(args, command, systems, ratios, workload_names, tiermem, skipped_systems, packages)
    except exclusive.Busy as e:
        print(f"tiermem bench apps: {e}", file=sys.stderr)
        return 2


def measure(args, command: str, systems: list, ratios: list[int], workload_names: list[str], tiermem: str,
            skipped_systems: dict, packages: dict) -> int:
    """Run the matrix and report it (the machine is ours: see `exclusive`)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (args.out or REPO_DIR / "target" / "bench-apps" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = (args.dir or out / "scratch").resolve()
    made_for_scratch = make_dirs(scratch)
    cache = (args.cache or REPO_DIR / "target" / "bench-apps" / "cache").resolve()
    workloads = [WORKLOADS[n] for n in workload_names]
    system_names = [s.name for s in systems]
    meta = {
        "command": command,
        "scale": args.scale, "systems": system_names, "ratios": ratios, "workloads": workload_names,
        "repeats": args.repeats, "started": stamp, "kernel": platform.release(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "tiermem": tiermem, "scratch_dir": str(scratch),
        "skipped_systems": skipped_systems, "python_packages": packages,
        "workload_params": {w.name: w.params[args.scale] for w in workloads},
        "time": "wall_s: spawn to exit of the program (for tiermem systems, of `tiermem run`)",
        "python_hash_seed": os.environ.get("PYTHONHASHSEED", "the repeat number (0 for the cache-warming run)"),
    }

    from tqdm import tqdm

    first_probe = probe_device(tiermem, scratch, machine=True)
    meta["device_read_latency_us"] = {"before": first_probe.get("device_read_latency_us")}
    meta["device_read_rate"] = {"before": first_probe.get("device_read_rate")}
    if "machine" in first_probe:
        meta["machine"] = {"facts": first_probe["machine"], "costs": first_probe.get("costs")}
    for w in workloads:
        print(f"preparing {w.name} ({args.scale})", file=sys.stderr)
        w.prepare(args.scale, cache)
    total = len(workloads) * args.repeats * (1 + len(ratios) * len(systems))
    started = time.time()
    progress = tqdm(total=total, unit="run", desc="bench apps", file=sys.stderr, dynamic_ncols=True)
    matrix = Matrix(args, systems, workloads, ratios, tiermem, out, scratch, cache, progress)
    interrupted = False
    stop_cleanly_on_signals()
    try:
        for workload in workloads:
            matrix.run_workload(workload)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
        matrix.journal.close()
        meta["elapsed_s"] = round(time.time() - started, 1)
        meta["interrupted"] = interrupted
        if not interrupted:
            last_probe = probe_device(tiermem, scratch)
            meta["device_read_latency_us"]["after"] = last_probe.get("device_read_latency_us")
            meta["device_read_rate"]["after"] = last_probe.get("device_read_rate")
        text = finish(out, matrix.runs, meta, system_names, ratios, not args.no_plot)
        remove_made(made_for_scratch)
    print(text, end="")
    for name, why in skipped_systems.items():
        print(f"not measured: {name} ({why})")
    print(f"{len(matrix.runs)} runs in {meta['elapsed_s']:.0f} s; results in {out} "
          f"(runs.csv, runs.json, table.txt{'' if args.no_plot else ', apps.png'})")
    if interrupted:
        print("interrupted: the results above are partial", file=sys.stderr)
        return 130
    return 0
