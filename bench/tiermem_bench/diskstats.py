"""Requests the disk under a directory completed: the kernel's per-device counters
(`/sys/dev/block/MAJOR:MINOR/stat`, Documentation/admin-guide/iostats.rst), read before and
after a run. They count requests after the block layer merged adjacent ones, which is what the
disk serves: for 4 KiB pages its limit is requests a second, not bytes (docs/application-
benchmarks.md, *What the disk and the CPUs do at PageRank's and k-means' 20% points*). They
count every request to that disk in the meantime, not only paging: the program's file reads
too, and anything else running."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SYS_DEV_BLOCK = Path("/sys/dev/block")


@dataclass(frozen=True)
class DiskCounts:
    reads: int  # read requests completed
    reads_merged: int  # reads merged into a neighbour before they reached the disk
    writes: int
    writes_merged: int

    def since(self, before: DiskCounts) -> DiskCounts:
        return DiskCounts(self.reads - before.reads, self.reads_merged - before.reads_merged,
                          self.writes - before.writes, self.writes_merged - before.writes_merged)


def stat_file_for(path: Path, sys_dev_block: Path = SYS_DEV_BLOCK) -> Path | None:
    """The counters' file of the block device holding `path`, or None where there is none (a
    tmpfs, an overlay without a backing device) or it cannot be read."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    stat = sys_dev_block / f"{os.major(dev)}:{os.minor(dev)}" / "stat"
    return stat if read_counts(stat) is not None else None


def read_counts(stat_file: Path | None) -> DiskCounts | None:
    """The counters in `stat_file`, or None when it is missing or not in the kernel's format
    (at least the eleven fields every kernel since 2.6 writes)."""
    if stat_file is None:
        return None
    try:
        fields = stat_file.read_text().split()
    except OSError:
        return None
    if len(fields) < 11 or not all(f.isdigit() for f in fields[:11]):
        return None
    return DiskCounts(int(fields[0]), int(fields[1]), int(fields[4]), int(fields[5]))
