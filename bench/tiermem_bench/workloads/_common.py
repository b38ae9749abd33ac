"""What every workload shares: one thread for every math library, a fixed seed, and one result line
that the harness parses ("TIERMEM_BENCH_RESULT {json}") carrying the digest of the output."""

import hashlib
import json
import os
import sys
import time

# Before numpy/scipy/sklearn load their BLAS and OpenMP runtimes; the harness sets the same.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                    "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
for _name in THREAD_VARIABLES:
    os.environ.setdefault(_name, "1")

RESULT_PREFIX = "TIERMEM_BENCH_RESULT "


def digest(*parts) -> str:
    """A stable hash of the given values (ints, strings, floats as repr, bytes, nested lists)."""
    h = hashlib.sha256()

    def feed(value):
        if isinstance(value, (bytes, bytearray, memoryview)):
            h.update(b"b%d:" % len(value))
            h.update(value)
        elif isinstance(value, (list, tuple)):
            h.update(b"[%d" % len(value))
            for item in value:
                feed(item)
            h.update(b"]")
        else:
            text = repr(value).encode()
            h.update(b"s%d:" % len(text))
            h.update(text)

    for part in parts:
        feed(part)
    return h.hexdigest()[:32]


def emit(digest_hex: str, work_s: float, **info) -> None:
    """Print the result line the harness reads."""
    record = {"digest": digest_hex, "work_s": round(work_s, 6), **info}
    sys.stdout.write(RESULT_PREFIX + json.dumps(record, sort_keys=True) + "\n")
    sys.stdout.flush()


class Timer:
    """Wall time of the measured part of a workload (after imports and argument parsing)."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        return False


def generator_tag(generator, *packages) -> str:
    """A short hash of `generator`'s source and of the versions of `packages`: part of a prepared
    input's file name, so that changing how an input is made (the code or a pinned library)
    makes a new file instead of reusing one made the old way."""
    import importlib.metadata
    import inspect

    h = hashlib.sha256(inspect.getsource(generator).encode())
    for package in packages:
        h.update(f"\0{package}={importlib.metadata.version(package)}".encode())
    return h.hexdigest()[:10]


def remove_stale_temporaries(path: str) -> None:
    """Remove `path.tmp<pid>` files that a killed `prepare` left (their pid no longer runs)."""
    directory, name = os.path.split(path)
    for entry in os.listdir(directory or "."):
        pid = entry[len(name) + 4:] if entry.startswith(name + ".tmp") else ""
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            os.unlink(os.path.join(directory, entry))
        except PermissionError:
            pass  # someone else's process: still running


def write_atomically(path: str, write) -> None:
    """Call `write(file)` on a temporary file next to `path`, then sync it and rename it to
    `path`: a run never sees a half-written input file, also after a crash."""
    remove_stale_temporaries(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_npy(path: str, array) -> None:
    """Write `array` to `path` as .npy, atomically (see `write_atomically`)."""
    import numpy as np

    write_atomically(path, lambda out: np.save(out, array))
