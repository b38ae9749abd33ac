"""The application workloads, their sizes per scale, and how to start them.

Every workload is real library code (C++ std::sort, scikit-learn, igraph/PRPACK, LAPACK through
SciPy, numpy; SQLite, Redis and OpenJDK among the optional ones) driven by a short script with a fixed seed that prints a digest of its result.
Scales: "tiny" (CI smoke and tests, tens of MB), "quick" (a few hundred MB: the whole matrix in
minutes) and "full" (footprints of 2-6 GB).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCALES = ("tiny", "quick", "full")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    params: dict = field(default_factory=dict)  # scale -> parameters

    def command(self, scale: str, cache_dir: Path, python: str = sys.executable) -> list[str]:
        """The argv that runs this workload at `scale` (call `prepare` first)."""
        p = self.params[scale]
        if self.name == "quicksort":
            return [str(quicksort_binary(cache_dir)), str(p["n"]), str(p["seed"])]
        if self.name == "javasort":
            # G1 named: the JVM picks its collector from the memory it sees, which a memory
            # cgroup's limit makes small (the serial collector), so limited runs would differ
            # from the unlimited one. No perf-data file in /tmp, which a run killed at its
            # time limit would leave behind.
            return ["java", "-XX:+DisplayVMOutputToStderr", "-XX:-UsePerfData", "-XX:+UseG1GC",
                    f"-Xmx{p['heap-mb']}m", "-cp", str(java_classes(cache_dir)),
                    "JavaSort", str(p["n"]), str(p["groups"]), str(p["seed"])]
        args = [python, "-m", f"tiermem_bench.workloads.{self.name}"]
        generator = input_generator(self.name)
        if generator:
            # Parameters that shape a prepared input file go into its name, not onto the command line.
            args += generator.input_args(str(cache_dir), **{k: p[k] for k in generator.INPUT_PARAMS})
            p = {k: v for k, v in p.items() if k not in generator.INPUT_ONLY}
        for key, value in p.items():
            args += [f"--{key}", str(value)]
        return args

    def prepare(self, scale: str, cache_dir: Path) -> None:
        """One-time, unmeasured set-up: compile the C++ driver, write the input files."""
        cache_dir.mkdir(parents=True, exist_ok=True)
        p = self.params[scale]
        if self.name == "quicksort":
            quicksort_binary(cache_dir)
        elif self.name == "javasort":
            java_classes(cache_dir)
        elif generator := input_generator(self.name):
            generator.prepare(str(cache_dir), **{k: p[k] for k in generator.INPUT_PARAMS})
        elif self.name == "kvstore":
            from tiermem_bench.workloads import kvstore

            kvstore.find_server()


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("quicksort", "C++ std::sort over 64-bit integers (g++ -O2)", {
            "tiny": {"n": 4_000_000, "seed": 4},
            "quick": {"n": 12_000_000, "seed": 4},
            "full": {"n": 400_000_000, "seed": 4},
        }),
        Workload("kmeans", "scikit-learn KMeans (Lloyd) on make_blobs points read from a file", {
            "tiny": {"samples": 100_000, "features": 32, "clusters": 8, "iterations": 5, "seed": 4},
            "quick": {"samples": 300_000, "features": 32, "clusters": 16, "iterations": 8, "seed": 4},
            "full": {"samples": 4_000_000, "features": 64, "clusters": 16, "iterations": 10, "seed": 4},
        }),
        Workload("pagerank", "igraph PageRank (PRPACK), 655k/7.5M-shaped graph scaled", {
            "tiny": {"nodes": 40_000, "edges": 460_000, "seed": 4},
            "quick": {"nodes": 164_000, "edges": 1_875_000, "seed": 4},
            "full": {"nodes": 5_240_000, "edges": 60_000_000, "seed": 4},
        }),
        Workload("linpack", "LU solve of a dense system (SciPy/LAPACK getrf+getrs)", {
            "tiny": {"n": 1_500, "seed": 4},
            "quick": {"n": 2_800, "seed": 4},
            "full": {"n": 14_000, "seed": 4},
        }),
        Workload("mlp", "scikit-learn MLPClassifier training (Adam, mini-batches) on a data set read from a file", {
            "tiny": {"samples": 40_000, "features": 64, "hidden": 128, "epochs": 1, "batch": 1024, "seed": 4},
            "quick": {"samples": 80_000, "features": 128, "hidden": 256, "epochs": 1, "batch": 4096, "seed": 4},
            "full": {"samples": 800_000, "features": 256, "hidden": 512, "epochs": 2, "batch": 4096, "seed": 4},
        }),
        Workload("kvstore", "Redis server (Debian's redis-server), YCSB-B-style: Zipf 0.99 keys, 90% GET", {
            "tiny": {"keys": 30_000, "value-bytes": 1000, "ops": 60_000, "seed": 4},
            "quick": {"keys": 200_000, "value-bytes": 1000, "ops": 400_000, "seed": 4},
            "full": {"keys": 4_000_000, "value-bytes": 1000, "ops": 8_000_000, "seed": 4},
        }),
        Workload("intsort", "NPB-IS-style integer sort (bucket ranking + radix sort, streaming)", {
            "tiny": {"keys": 4_000_000, "bits": 19, "iterations": 5, "seed": 4},
            "quick": {"keys": 16_000_000, "bits": 21, "iterations": 5, "seed": 4},
            "full": {"keys": 320_000_000, "bits": 23, "iterations": 10, "seed": 4},
        }),
        Workload("sqlite", "SQLite (the system's libsqlite3): in-memory table loaded from a file, index, GROUP BY, sort, index probes", {
            "tiny": {"rows": 100_000, "probes": 5_000, "seed": 4},
            "quick": {"rows": 1_000_000, "probes": 40_000, "seed": 4},
            "full": {"rows": 25_000_000, "probes": 1_000_000, "seed": 4},
        }),
        Workload("javasort", "Java (OpenJDK): Arrays.sort of random longs, then a HashMap of boxed counts", {
            "tiny": {"n": 3_000_000, "groups": 100_000, "seed": 4, "heap-mb": 1024},
            "quick": {"n": 12_000_000, "groups": 500_000, "seed": 4, "heap-mb": 2048},
            "full": {"n": 300_000_000, "groups": 4_000_000, "seed": 4, "heap-mb": 8192},
        }),
    ]
}


# Run only when asked for (`--workloads kvstore,javasort,sqlite`): not among the paper's programs;
# kvstore is a client-server pair rather than one program (see kvstore.py), javasort needs a JDK.
NOT_BY_DEFAULT = ("kvstore", "javasort", "sqlite")
DEFAULT_WORKLOADS = tuple(n for n in WORKLOADS if n not in NOT_BY_DEFAULT)


# Workloads whose input is generated once, unmeasured, and read from a file by each run: their
# modules name the parameters the file depends on (INPUT_PARAMS), those only it needs
# (INPUT_ONLY), the run's options naming it (input_args) and how it is made (prepare).
GENERATED_INPUTS = ("pagerank", "kmeans", "mlp", "sqlite")


def input_generator(name: str):
    """The module that makes `name`'s input file, or None."""
    if name not in GENERATED_INPUTS:
        return None
    return importlib.import_module(f"tiermem_bench.workloads.{name}")


def quicksort_binary(cache_dir: Path) -> Path:
    """Compile quicksort.cpp with g++ -O2 into `cache_dir` (once per source version)."""
    source = HERE / "quicksort.cpp"
    tag = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    binary = Path(cache_dir) / f"quicksort-{tag}"
    if binary.exists():
        return binary
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++) found; install g++ to run the quicksort workload")
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(binary.name + f".tmp{os.getpid()}")
    subprocess.run([compiler, "-O2", "-std=c++17", "-o", str(tmp), str(source)], check=True)
    os.replace(tmp, binary)
    return binary


def java_classes(cache_dir: Path) -> Path:
    """Compile JavaSort.java with javac into a directory in `cache_dir` (once per source version)."""
    source = HERE / "JavaSort.java"
    if not shutil.which("javac") or not shutil.which("java"):
        raise RuntimeError("no JDK (java, javac) found; install one (apt-get install default-jdk-headless) "
                           "to run the javasort workload")
    # Per source and compiler version, so another JDK compiles afresh.
    version = subprocess.run(["javac", "-version"], capture_output=True, text=True).stdout.strip()
    tag = hashlib.sha256(source.read_bytes() + version.encode()).hexdigest()[:12]
    classes = Path(cache_dir) / f"javasort-{tag}"
    if (classes / "JavaSort.class").exists():
        return classes
    tmp = classes.with_name(classes.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    subprocess.run(["javac", "-d", str(tmp), str(source)], check=True)
    try:
        os.replace(tmp, classes)
    except OSError:
        # Another process compiled it meanwhile (a directory is not renamed over a full one).
        shutil.rmtree(tmp, ignore_errors=True)
    if not (classes / "JavaSort.class").exists():
        raise RuntimeError(f"javac left no JavaSort.class in {classes}")
    return classes
