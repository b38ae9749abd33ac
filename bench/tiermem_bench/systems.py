"""The systems a workload is run under, and the helper command line for each.

Every run goes through `tiermem bench limited-run` (Rust): it creates the memory cgroup (and, for
Linux swap, the swap file), starts the program inside, and removes all of it again, also on
Ctrl-C, with the same signal-safe cleanup registry as `tiermem bench micro`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

UNLIMITED = "unlimited"


@dataclass(frozen=True)
class System:
    name: str
    kind: str  # "unlimited" | "linux-swap" | "tiermem"
    description: str
    tiermem_args: tuple = field(default_factory=tuple)  # extra `tiermem run` options
    device: str = "file"  # tiermem device: "file" or "mem"


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in [
        System("linux-swap", "linux-swap", "kernel swap to a swap file, cgroup memory limit"),
        System("tiermem-file", "tiermem", "tiermem run, file device (Ultraswap I/O path)"),
        System("tiermem-mem", "tiermem", "tiermem run, mem device: the ideal", device="mem"),
        System("tiermem-poll-only", "tiermem", "tiermem run, file device, every request polled",
               ("--io-mode", "poll-only")),
        System("tiermem-interrupt-only", "tiermem", "tiermem run, file device, every request interrupt-driven",
               ("--io-mode", "interrupt-only")),
        System("tiermem-reclaim-on-fault-path", "tiermem", "tiermem run, file device, reclaim in the faulting thread",
               ("--reclaim-mode", "on-fault-path")),
        # Not in any group from here on. Thread: faults served by a handler thread (the default of
        # `tiermem run` until 2026-11-26; the default now takes them on the faulting thread).
        # Evict-at-70: pages dropped from the 70% watermark on, as in the paper's kernel, rather
        # than cleaned there and dropped from 98% (the default): the cost of leaving 30% unused.
        System("tiermem-file-thread", "tiermem", "tiermem run, file device, faults served by a handler thread",
               ("--fault-mode", "thread")),
        System("tiermem-file-evict-at-70", "tiermem", "tiermem run, file device, pages dropped from 70% of the budget",
               ("--evict-watermark", "0.7")),
        # Stream-first replacement (co-designed remote memory §3.1): pages of detected streams go
        # before randomly accessed ones, against the loop pathology of a scan a little larger
        # than the budget.
        System("tiermem-file-stream-first", "tiermem", "tiermem run, file device, stream-first replacement",
               ("--replace", "stream-first")),
        # SEQ-style scan-resistant replacement: pages of sequential fault runs go first, most
        # recent first behind a window.
        System("tiermem-file-seq", "tiermem", "tiermem run, file device, seq replacement",
               ("--replace", "seq")),
        # A quarter of the budget as a victim tier: evicted pages wait in DRAM, unmapped, and a
        # fault on one costs a copy, not a device read (VMS's segmented FIFO, in place of the
        # accessed bits user space lacks). Same cgroup limit: the tier's memory comes out of
        # the budget.
        System("tiermem-file-victim", "tiermem", "tiermem run, file device, a quarter of the budget as a victim tier",
               ("--victim-tier", "25%")),
        # The same, most recent first only while page-ins are mostly short refaults (the default
        # until 2026-11-26).
        System("tiermem-file-seq-adaptive", "tiermem", "tiermem run, file device, seq-adaptive replacement",
               ("--replace", "seq-adaptive")),
        # seq-adaptive that also keeps pages which came back soon after eviction (short
        # refaults) until the others are gone, up to half of the budget: the default from
        # 2026-11-26 to 2026-12-06 (seq-balance since).
        System("tiermem-file-seq-protect", "tiermem", "tiermem run, file device, seq-protect replacement",
               ("--replace", "seq-protect")),
        # seq-protect whose protected share grows only when pages that left protection come
        # back soon, as ARC sizes its lists by ghost hits: the default since 2026-12-06, so
        # this names it explicitly.
        System("tiermem-file-seq-balance", "tiermem", "tiermem run, file device, seq-balance replacement",
               ("--replace", "seq-balance")),
        # No prefetching at all: what prefetches cost where misses are random (kvstore).
        System("tiermem-file-no-prefetch", "tiermem", "tiermem run, file device, no prefetcher",
               ("--prefetch", "none")),
        # ondemand plus strided streams (misses a fixed number of pages apart: dense linear
        # algebra walking rows of a column-major matrix): the default since 2026-12-06, so
        # this names it explicitly.
        System("tiermem-file-stride", "tiermem", "tiermem run, file device, ondemand readahead plus strided streams",
               ("--prefetch", "stride")),
        # Sequential windows only (the default until 2026-12-06).
        System("tiermem-file-ondemand", "tiermem", "tiermem run, file device, ondemand readahead (sequential streams only)",
               ("--prefetch", "ondemand")),
        # ondemand plus a replayed history of misses (loops over scattered pages: an
        # interpreter's final collections, an iterative solver's gathers).
        System("tiermem-file-temporal", "tiermem", "tiermem run, file device, ondemand readahead plus a replayed miss history",
               ("--prefetch", "temporal")),
        # The same history on top of `stride` (the default), so strided streams keep their windows.
        System("tiermem-file-stride-temporal", "tiermem", "tiermem run, file device, stride readahead plus a replayed miss history",
               ("--prefetch", "stride-temporal")),
        # ondemand plus the same element of parallel arrays (a gather through an index over
        # several arrays of one length: igraph's PageRank conversion).
        System("tiermem-file-sibling", "tiermem", "tiermem run, file device, ondemand readahead plus parallel arrays' siblings",
               ("--prefetch", "sibling")),
        # Without indirect prefetching (on by default since 2026-12-06): misses of a gather
        # through an index array left to the prefetcher (igraph's PageRank conversion).
        System("tiermem-file-no-indirect", "tiermem", "tiermem run, file device, no indirect prefetching from index arrays",
               ("--indirect", "off")),
        # The co-designed remote-memory paper's comparison, live: Fastswap's next 7 pages on
        # every miss, and the paper's stream prefetcher (which reads those 7 too).
        System("tiermem-file-fastswap", "tiermem", "tiermem run, file device, fastswap prefetching (next 7 pages)",
               ("--prefetch", "fastswap")),
        System("tiermem-file-stream", "tiermem", "tiermem run, file device, the paper's stream prefetcher",
               ("--prefetch", "stream")),
        # The same comparison with each side's own replacement, as the paper ran it: Fastswap
        # under the kernel's reclaim (clock, a second chance) against the stream prefetcher with
        # stream-first replacement sharing its table (§3.1).
        System("tiermem-file-fastswap-clock", "tiermem", "tiermem run, file device, fastswap prefetching, clock replacement",
               ("--prefetch", "fastswap", "--replace", "clock")),
        System("tiermem-file-stream-stream-first", "tiermem",
               "tiermem run, file device, the paper's stream prefetcher with stream-first replacement",
               ("--prefetch", "stream", "--replace", "stream-first")),
        # CLOCK (FIFO with a second chance), the default before seq-adaptive.
        System("tiermem-file-clock", "tiermem", "tiermem run, file device, clock replacement",
               ("--replace", "clock")),
        # Streams keep stdio's locks even while the program has one thread (what the engine's
        # threads made glibc do before the shim switched them off).
        System("tiermem-file-locked-stdio", "tiermem", "tiermem run, file device, stdio locks kept",
               ("--single-thread-stdio", "off")),
        System("tiermem-file-2-handlers", "tiermem", "tiermem run, file device, two fault handler threads",
               ("--handler-threads", "2")),
        # Every large malloc gets a fresh region (first-touch faults on all of it) instead of
        # reusing a freed one of about its size.
        System("tiermem-file-no-reuse", "tiermem", "tiermem run, file device, freed allocations not reused",
               ("--reuse-freed", "off")),
        # Address-contiguous dirty pages of a reclaim batch written as one request (up to 32
        # pages) instead of one request per page.
        System("tiermem-file-write-runs", "tiermem", "tiermem run, file device, contiguous write-backs merged",
               ("--write-runs", "on")),
        # Each handler thread polls for the next fault for 30 µs after one instead of sleeping.
        System("tiermem-file-handler-spin", "tiermem", "tiermem run, file device, handlers poll 30 µs after a fault",
               ("--handler-spin-us", "30")),
        # The same for 200 µs: longer than the gap between a Redis server's small-object faults.
        System("tiermem-file-handler-spin-200", "tiermem", "tiermem run, file device, handlers poll 200 µs after a fault",
               ("--handler-spin-us", "200")),
        # 256 I/O buffers (1 MiB) at any budget: the default gives a 64th of the budget, at least
        # 256 and at most 1024 (4 MiB), so this differs from it above a 64 MiB budget.
        System("tiermem-file-256-buffers", "tiermem", "tiermem run, file device, 256 I/O buffers",
               ("--io-buffers", "256")),
        # Dirty pages tracked by synchronous write-protect faults, victims dropped with one
        # batched MADV_DONTNEED per reclaim batch, instead of async WP + UFFDIO_MOVE per page.
        System("tiermem-file-sync-wp", "tiermem", "tiermem run, file device, sync write-protect dirty tracking",
               ("--dirty-tracking", "sync-wp")),
        # The same, a write fault unprotecting the clean resident pages of its aligned block of
        # 16 (written back only if they changed): sync-wp's batched drops without most of its
        # write faults.
        System("tiermem-file-sync-wp-around", "tiermem",
               "tiermem run, file device, sync write-protect with write fault-around of 16 pages",
               ("--dirty-tracking", "sync-wp", "--write-fault-around", "16")),
        System("tiermem-mem-sync-wp-around", "tiermem",
               "tiermem run, mem device (the ideal), sync write-protect with write fault-around of 16 pages",
               ("--dirty-tracking", "sync-wp", "--write-fault-around", "16"), device="mem"),
        # Async-WP eviction as before 2026-12-04: victims moved out with UFFDIO_MOVE, one call
        # and one TLB flush per run of contiguous pages, instead of held in a pipe and dropped
        # a batch per call.
        System("tiermem-file-move", "tiermem", "tiermem run, file device, victims moved out run by run (no page pipe)",
               ("--evict-pipe", "off")),
        System("tiermem-mem-move", "tiermem", "tiermem run, mem device (the ideal), victims moved out run by run",
               ("--evict-pipe", "off"), device="mem"),
        # Prefetched pages that sit in consecutive slots read as one request (up to 32 pages);
        # with write runs too, contiguous dirty pages also land in consecutive slots.
        System("tiermem-file-read-runs", "tiermem", "tiermem run, file device, contiguous prefetches merged",
               ("--read-runs", "on")),
        # Thread fault mode: a fault on a page whose prefetch is in flight sleeps until the
        # completion maps it, instead of the handler spinning for it.
        System("tiermem-file-defer-hits", "tiermem", "tiermem run, file device, faults on pages in flight left to their completion",
               ("--defer-hits", "on")),
        System("tiermem-file-runs", "tiermem", "tiermem run, file device, contiguous prefetches and write-backs merged",
               ("--read-runs", "on", "--write-runs", "on")),
        # Room for prefetches: reclaim drops from at least 256 pages (the default since
        # 2026-12-07) or 512 under the limit less a batch, where 98% of a small budget leaves
        # prefetches less room to land in; 0 is the evict watermark alone, as before.
        System("tiermem-file-room-0", "tiermem", "tiermem run, file device, no pages kept for prefetches beyond the evict watermark",
               ("--prefetch-room", "0")),
        System("tiermem-file-room-512", "tiermem", "tiermem run, file device, 512 pages kept for prefetches",
               ("--prefetch-room", "512")),
        # The prefetcher's lists read whole however few of the sampled prefetched pages are used
        # (the engine's default caps them then: docs/policies.md, the prefetch governor).
        System("tiermem-file-ungoverned", "tiermem", "tiermem run, file device, prefetch governor off",
               ("--prefetch-governor", "off")),
    ]
}
BASELINE = System(UNLIMITED, "unlimited", "no memory limit (footprint and reference output)")

# Named sets, usable in --systems beside single names. `main` (the default) is the comparison the
# figures are about: Linux swap, tiermem on the file device and the ideal (Ultraswap §4.3).
# `variants` are §4.4's ablations of tiermem-file; `paper` is both. The variants are not in the
# default because each system adds (ratios x repeats) runs of every workload: three repeats of
# the quick matrix took 26 minutes with `main` on 2026-11-27, so `paper`, twice the systems,
# would take about 50 (docs/application-benchmarks.md).
GROUPS: dict[str, tuple[str, ...]] = {
    "main": ("linux-swap", "tiermem-file", "tiermem-mem"),
    "variants": ("tiermem-poll-only", "tiermem-interrupt-only", "tiermem-reclaim-on-fault-path"),
    # The co-designed remote-memory paper's live comparison: Fastswap against the stream
    # prefetcher, each with its own replacement and with the engine's, beside the default.
    "prefetchers": ("tiermem-file", "tiermem-file-fastswap-clock", "tiermem-file-stream-stream-first",
                    "tiermem-file-fastswap", "tiermem-file-stream"),
}
GROUPS["paper"] = GROUPS["main"] + GROUPS["variants"]
DEFAULT_SYSTEMS = GROUPS["main"]


def parse_systems(text: str) -> list[System]:
    """Comma-separated system and group names, in order, each system once."""
    names: list[str] = []
    unknown = []
    for part in (n.strip() for n in text.split(",")):
        if not part:
            continue
        expanded = GROUPS.get(part, (part,))
        unknown += [n for n in expanded if n not in SYSTEMS]
        names += [n for n in expanded if n in SYSTEMS and n not in names]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}; "
                         f"groups: {', '.join(GROUPS)}")
    if not names:
        raise ValueError("no systems given")
    return [SYSTEMS[n] for n in names]


def mem_store_room(footprint: int) -> int:
    """Cgroup room for the mem device's store on top of the local limit: every managed page
    evicted at once, twice over (freed regions' slots are reused, but allocations come and go),
    plus 64 MiB."""
    return 2 * footprint + (64 << 20)


CGROUP_PREFIX_VARIABLE = "TIERMEM_BENCH_CGROUP_PREFIX"


def cgroup_prefix() -> str:
    """The start of the names of the memory cgroups the harness's runs make: `tiermem-apps`, or
    $TIERMEM_BENCH_CGROUP_PREFIX (tests give theirs a name of their own, so that cleaning up
    after one never touches the cgroups of a run beside it). Must start with `tiermem-`, so
    that a killed run's cgroups are swept by the next one."""
    prefix = os.environ.get(CGROUP_PREFIX_VARIABLE, "tiermem-apps")
    if not prefix.startswith("tiermem-") or "/" in prefix or not prefix.replace("-", "").isalnum():
        raise ValueError(f"{CGROUP_PREFIX_VARIABLE}={prefix!r}: a cgroup name prefix starting with 'tiermem-' "
                         "and made of letters, digits and dashes")
    return prefix


def helper_command(system: System, *, tiermem_bin: str, limit: int | None, workload_argv: list[str],
                   result_file: Path, work_dir: Path, swap_bytes: int, device_file: Path,
                   footprint: int, stats_file: Path, timeout: float | None) -> list[str]:
    """The `tiermem bench limited-run ...` argv for one run of `workload_argv` under `system`."""
    cmd = [tiermem_bin, "bench", "limited-run", "--result", str(result_file)]
    if timeout:
        cmd += ["--timeout", f"{timeout:.1f}"]
    program = list(workload_argv)
    if system.kind == "unlimited":
        cmd += ["--cgroup-prefix", f"{cgroup_prefix()}-unlimited"]
    elif system.kind == "linux-swap":
        cmd += ["--cgroup-prefix", f"{cgroup_prefix()}-swap", "--limit", str(limit),
                "--swap-dir", str(work_dir), "--swap-bytes", str(swap_bytes)]
    elif system.kind == "tiermem":
        if system.device == "mem":
            # The ideal differs from tiermem-file only in its device: the mem device keeps evicted
            # pages in DRAM (far memory emulated), which the cgroup charges too, so the cgroup
            # gets room for that store on top of the limit; `tiermem run` then fits its budget
            # into the limit minus everything unmanaged, as it does for the file device.
            cmd += ["--cgroup-prefix", f"{cgroup_prefix()}-ideal", "--limit", str(limit + mem_store_room(footprint)),
                    "--no-swap"]
            device = "mem"
        else:
            # Same memory as Linux swap had, and no swap: everything tiermem uses must fit.
            cmd += ["--cgroup-prefix", f"{cgroup_prefix()}-tiermem", "--limit", str(limit), "--no-swap"]
            # A directory: `tiermem run` makes its temporary device file there (same file system as
            # the swap file) and removes it when the program ends.
            device = f"file:{device_file}"
        # `--cgroup guard`: a burst of memory tiermem does not manage pauses the program while the
        # budget shrinks, instead of the cgroup's OOM killer ending it (docs/running-programs.md, *OOM guard*).
        program = [tiermem_bin, "run", "--limit", str(limit), "--footprint", str(footprint),
                   "--device", device, "--cgroup", "guard", *system.tiermem_args,
                   "--stats-json", str(stats_file), "--", *program]
    else:
        raise ValueError(f"unknown system kind {system.kind}")
    return cmd + ["--", *program]
