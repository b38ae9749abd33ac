"""One measuring command at a time: the bench lock (`tiermem_bench.exclusive`)."""

import os
import subprocess
import sys

import pytest

from conftest import BENCH_DIR, stop_process

HOLDER = """
import sys, time
from tiermem_bench import exclusive
with exclusive.machine_to_ourselves("tiermem bench apps --scale full"):
    print("held", flush=True)
    time.sleep(60)
"""


def start_holder():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(BENCH_DIR)))
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_measuring_command_is_refused_while_the_first_runs_and_admitted_after():
    from tiermem_bench import exclusive

    holder = start_holder()
    try:
        with pytest.raises(exclusive.Busy) as refused:
            with exclusive.machine_to_ourselves("tiermem bench micro"):
                pytest.fail("ran beside another measuring command")
        message = str(refused.value)
        assert f"pid {holder.pid}: tiermem bench apps --scale full" in message, message
        assert "would time each other" in message
    finally:
        stop_process(holder)
    # The lock went with the holder, killed as it was.
    with exclusive.machine_to_ourselves("tiermem bench micro"):
        assert f"pid {os.getpid()}: tiermem bench micro" in exclusive.lock_path().read_text()
    # And it is given back at the end of the block, for the next command of this process too.
    with exclusive.machine_to_ourselves("again"):
        pass


def test_the_matrix_refuses_to_start_beside_another_one(monkeypatch, capsys):
    from tiermem_bench import cli

    if os.geteuid() != 0:
        pytest.skip("SKIPPED: the matrix needs root before it looks at the lock")
    measured = []
    monkeypatch.setattr(cli, "measure", lambda *a: measured.append(a) or 0)
    monkeypatch.setattr(cli, "find_tiermem", lambda explicit: "/bin/true")
    monkeypatch.setattr(cli, "tiermem_run_available", lambda tiermem: True)
    argv = ["--scale", "tiny", "--workloads", "intsort", "--no-plot"]
    holder = start_holder()
    try:
        assert cli.main(argv) == 2
        assert "another benchmark is measuring on this machine" in capsys.readouterr().err
        assert measured == []
    finally:
        stop_process(holder)
    assert cli.main(argv) == 0 and len(measured) == 1
