"""The disk's request counters: parsed as the kernel writes them, found for a directory, and
counted around each run."""

import mmap
import os
import sys

import pytest

from tiermem_bench import diskstats, runner
from tiermem_bench.diskstats import DiskCounts, read_counts, stat_file_for

# A line of /sys/block/*/stat (17 fields since Linux 5.5): reads, reads merged, sectors read,
# ms reading, writes, writes merged, ...
KERNEL_LINE = "  589418771 1031866302 94118 2771 200004517 809561861 5 6 0 7 8 9 10 11 12 13 14\n"


def test_counters_are_read_in_the_kernel_s_field_order(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(KERNEL_LINE)
    assert read_counts(stat) == DiskCounts(reads=589418771, reads_merged=1031866302, writes=200004517,
                                           writes_merged=809561861)
    later = DiskCounts(589418800, 1031866302, 200004520, 809561870)
    assert later.since(read_counts(stat)) == DiskCounts(29, 0, 3, 9)


@pytest.mark.parametrize("text", ["", "1 2 3 4 5 6 7 8 9 10\n", "1 2 3 4 x 6 7 8 9 10 11\n"])
def test_a_file_not_in_the_kernel_s_format_counts_nothing(tmp_path, text):
    stat = tmp_path / "stat"
    stat.write_text(text)
    assert read_counts(stat) is None
    assert read_counts(tmp_path / "missing") is None
    assert read_counts(None) is None


def test_a_directory_s_disk_is_found_by_its_device_number(tmp_path):
    dev = os.stat(tmp_path).st_dev
    sys_dev_block = tmp_path / "sys"
    assert stat_file_for(tmp_path, sys_dev_block) is None, "no counters for that device: nothing"
    node = sys_dev_block / f"{os.major(dev)}:{os.minor(dev)}"
    node.mkdir(parents=True)
    (node / "stat").write_text(KERNEL_LINE)
    assert stat_file_for(tmp_path, sys_dev_block) == node / "stat"
    assert stat_file_for(tmp_path / "missing", sys_dev_block) is None


FAKE_HELPER = r"""
import json, sys
stat, result = sys.argv[1], sys.argv[2]
open(stat, "w").write("110 7 0 0 52 9 0 0 0 0 0\n")  # the run: 10 reads, 2 writes
json.dump({"wall_s": 0.5, "exit_code": 0, "signal": None, "timed_out": False}, open(result, "w"))
"""


def test_each_run_records_the_requests_its_disk_completed_meanwhile(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("100 7 0 0 50 9 0 0 0 0 0\n")
    result = tmp_path / "result.json"
    argv = [sys.executable, "-c", FAKE_HELPER, str(stat), str(result)]
    make = lambda: runner.RunRecord(workload="w", system="linux-swap", ratio=20, repeat=1, limit_bytes=1,
                                    footprint_bytes=5)
    rec = runner.run_once(make(), argv, result_file=result, expected=None, disk_stat=stat)
    assert (rec.disk_reads, rec.disk_writes) == (10, 2)
    stat.write_text("100 7 0 0 50 9 0 0 0 0 0\n")
    rec = runner.run_once(make(), argv, result_file=result, expected=None)
    assert (rec.disk_reads, rec.disk_writes) == (None, None), "no counters asked for, none recorded"


def test_direct_reads_of_a_file_show_in_its_disk_s_counters(tmp_path):
    stat = stat_file_for(tmp_path)
    if stat is None:
        pytest.skip(f"SKIPPED: {tmp_path} is on no block device with counters under {diskstats.SYS_DEV_BLOCK}")
    data = tmp_path / "data"
    with open(data, "wb") as f:
        f.write(os.urandom(64 << 12))
        f.flush()
        os.fsync(f.fileno())
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    try:
        fd = os.open(data, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        pytest.skip(f"SKIPPED: O_DIRECT is refused here ({e})")
    try:
        before = read_counts(stat)
        for k in range(16):
            os.preadv(fd, [buf], k * 8192)
        after = read_counts(stat)
    except OSError as e:
        pytest.skip(f"SKIPPED: O_DIRECT reads are refused here ({e})")
    finally:
        os.close(fd)
    assert after.since(before).reads >= 16
