"""Key-value store: a real Redis server (Debian's redis-server) loaded with N values, then a
YCSB-B-style run against it: Zipf-distributed keys (skew 0.99, hot keys scattered over the
keyspace as YCSB scrambles them), 90% GET and 10% SET, pipelined over a Unix socket.

Only the server is under test, as with a remote client: it runs in the memory cgroup the script
was started in and under `tiermem run` if the script was (it inherits the preload and gets its
own engine), while this script, the load generator, takes itself out of both first: it moves to
the parent cgroup and re-executes itself without the preload (where it can: root and a memory
cgroup; otherwise everything stays together). Every reply is checked against the value last
written to that key; the digest covers the counts and the number of wrong replies, so one wrong
byte fails the run.
"""

import argparse
import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from tiermem_bench.workloads._common import Timer, digest, emit

# Distinct value contents are slices of one random block at an offset derived from key and version.
BLOCK_SPREAD = 1 << 16


# Set in the re-executed client: the preload to give back to the server.
SERVER_PRELOAD = "TIERMEM_BENCH_SERVER_PRELOAD"
# Set in the re-executed client: the cgroup.procs file of the cgroup the server goes into.
SERVER_CGROUP = "TIERMEM_BENCH_SERVER_CGROUP"


def memory_cgroup_dir() -> str | None:
    """This process's memory cgroup directory (v1 memory controller or v2), if it can be moved."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and os.path.isdir("/sys/fs/cgroup/memory"):
            return "/sys/fs/cgroup/memory" + path
    for line in lines:
        if line.startswith("0::"):
            return "/sys/fs/cgroup" + line[3:]
    return None


def step_aside() -> None:
    """Before anything else: move this process (the client) to the parent of its memory cgroup
    and run it again without the tiermem preload, remembering both for the server."""
    if SERVER_CGROUP in os.environ or os.geteuid() != 0:
        return
    here = memory_cgroup_dir()
    if not here or os.path.normpath(here) in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup"):
        return
    try:
        with open(os.path.join(os.path.dirname(os.path.normpath(here)), "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        return
    env = dict(os.environ)
    env[SERVER_CGROUP] = os.path.join(here, "cgroup.procs")
    env[SERVER_PRELOAD] = env.pop("LD_PRELOAD", "")
    os.execve(sys.executable, [sys.executable, "-m", "tiermem_bench.workloads.kvstore", *sys.argv[1:]], env)


# Loaded before any fork: server_setup runs between fork and exec, where importing is unsafe.
_LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def server_setup(client_pid: int):
    """Put the server into the client's former cgroup, with the preload it had, and have it
    killed if the client dies first (a client killed at a time limit cannot stop it itself)."""
    if _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != client_pid:
        os._exit(111)  # cannot be tied to the client, or it is gone already: do not start
    procs = os.environ.get(SERVER_CGROUP)
    if procs:
        with open(procs, "w") as f:
            f.write("0")


def server_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (SERVER_CGROUP, SERVER_PRELOAD)}
    if os.environ.get(SERVER_PRELOAD):
        env["LD_PRELOAD"] = os.environ[SERVER_PRELOAD]
    return env


def find_server() -> str:
    path = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if not path:
        raise SystemExit("kvstore: no redis-server on PATH; install it (apt-get install redis-server)")
    return path


def start_server(binary: str, work_dir: str) -> tuple[subprocess.Popen, str]:
    sock_path = os.path.join(work_dir, "redis.sock")
    args = [binary, "--port", "0", "--unixsocket", sock_path, "--unixsocketperm", "700",
            "--dir", work_dir, "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--protected-mode", "no", "--databases", "1", "--loglevel", "verbose",
            "--logfile", os.path.join(work_dir, "redis.log"), "--maxmemory", "0",
            "--activedefrag", "no", "--lazyfree-lazy-user-del", "no", "--io-threads", "1"]
    server = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=server_env(),
                              preexec_fn=functools.partial(server_setup, os.getpid()))
    return server, sock_path


def connect(sock_path: str, server: subprocess.Popen, wait_s: float = 60.0) -> socket.socket:
    deadline = time.monotonic() + wait_s
    while True:
        if server.poll() is not None:
            raise SystemExit(f"kvstore: redis-server exited with status {server.returncode} before accepting")
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock_path)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise SystemExit(f"kvstore: redis-server did not open {sock_path} within {wait_s:.0f} s")
            time.sleep(0.01)


class ServerGone(Exception):
    """The server closed the connection before replying in full."""


def server_end(server: subprocess.Popen, work_dir: str) -> str:
    """How the server ended, for the error: its exit status or signal and its log's last lines."""
    try:
        server.wait(timeout=5)
        code = server.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
    except subprocess.TimeoutExpired:
        how = "is still running"
    try:
        with open(os.path.join(work_dir, "redis.log"), errors="replace") as f:
            tail = [line.rstrip() for line in f.readlines()[-5:] if line.strip()]
    except OSError:
        tail = []
    return f"redis-server {how}" + ("; its log ends: " + " | ".join(tail) if tail else "")


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            raise ServerGone()
        got += k
    return bytes(buf)


def recv_line(s: socket.socket) -> bytes:
    """One reply line, without its CRLF."""
    line = b""
    while not line.endswith(b"\r\n"):
        k = s.recv(1)
        if not k:
            raise ServerGone()
        line += k
    return line[:-2]


def bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def zipf_keys(rng, keys: int, count: int, skew: float):
    """`count` keys: ranks drawn from Zipf(skew) over `keys`, mapped through a fixed permutation."""
    import numpy as np

    weights = 1.0 / np.arange(1, keys + 1, dtype=np.float64) ** skew
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(count)), keys - 1)
    scramble = rng.permutation(keys)
    return scramble[ranks]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, required=True)
    parser.add_argument("--value-bytes", type=int, required=True)
    parser.add_argument("--ops", type=int, required=True)
    parser.add_argument("--skew", type=float, default=0.99)
    parser.add_argument("--write-share", type=float, default=0.1)
    parser.add_argument("--pipeline", type=int, default=64)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)
    if args.keys < 1 or args.value_bytes < 1 or args.ops < 0 or args.pipeline < 1:
        raise SystemExit("kvstore: --keys, --value-bytes and --pipeline must be positive, --ops not negative")

    import numpy as np

    binary = find_server()
    rng = np.random.default_rng(args.seed)
    size = args.value_bytes
    block = rng.bytes(size + BLOCK_SPREAD)
    versions = np.zeros(args.keys, dtype=np.int64)

    def value(key: int, version: int) -> bytes:
        off = (key * 2654435761 + version * 40503) % BLOCK_SPREAD
        return block[off:off + size]

    key_names = [b"key:%d" % k for k in range(args.keys)]
    get_reply_len = len(bulk(b"x" * size))
    ops_keys = zipf_keys(rng, args.keys, args.ops, args.skew)
    ops_write = rng.random(args.ops) < args.write_share

    work_dir = tempfile.mkdtemp(prefix="tiermem-kvstore-")
    server, sock_path = start_server(binary, work_dir)
    wrong = gets = sets = 0
    try:
        conn = connect(sock_path, server)
        with Timer() as timer:
            # Load: every key once, version 0.
            for start in range(0, args.keys, args.pipeline):
                end = min(start + args.pipeline, args.keys)
                conn.sendall(b"".join(b"*3\r\n$3\r\nSET\r\n" + bulk(key_names[k]) + bulk(value(k, 0))
                                      for k in range(start, end)))
                reply = recv_exactly(conn, 5 * (end - start))
                wrong += reply != b"+OK\r\n" * (end - start)
            load_s = time.perf_counter() - timer.start
            # Run: pipelined batches of GETs and SETs, every reply checked.
            for start in range(0, args.ops, args.pipeline):
                end = min(start + args.pipeline, args.ops)
                request, expected, length = [], [], 0
                for k, w in zip(ops_keys[start:end].tolist(), ops_write[start:end].tolist()):
                    if w:
                        versions[k] += 1
                        request.append(b"*3\r\n$3\r\nSET\r\n" + bulk(key_names[k]) + bulk(value(k, int(versions[k]))))
                        expected.append(b"+OK\r\n")
                        length += 5
                        sets += 1
                    else:
                        request.append(b"*2\r\n$3\r\nGET\r\n" + bulk(key_names[k]))
                        expected.append(bulk(value(k, int(versions[k]))))
                        length += get_reply_len
                        gets += 1
                conn.sendall(b"".join(request))
                reply = recv_exactly(conn, length)
                if reply != b"".join(expected):
                    wrong += sum(1 for e, r in zip(expected, split_replies(reply, expected)) if e != r)
            run_s = time.perf_counter() - timer.start - load_s
        conn.sendall(b"*1\r\n$6\r\nDBSIZE\r\n")
        dbsize = recv_line(conn)
        conn.sendall(b"*2\r\n$8\r\nSHUTDOWN\r\n$6\r\nNOSAVE\r\n")
        conn.recv(64)  # the server closes the connection as it exits (or says why not)
        conn.close()
        server.wait(timeout=30)
    except (ServerGone, ConnectionError) as e:
        # A reset (the server died with replies unread) or a clean close: say how it ended.
        how = "reset" if isinstance(e, ConnectionError) else "closed"
        raise SystemExit(f"kvstore: the server {how} the connection: {server_end(server, work_dir)}") from None
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGKILL)
            server.wait()
        shutil.rmtree(work_dir, ignore_errors=True)
    emit(digest(args.keys, size, args.ops, gets, sets, wrong, dbsize.decode()), timer.seconds,
         load_s=round(load_s, 3), run_s=round(run_s, 3),
         run_ops_per_s=round(args.ops / run_s) if run_s > 0 else None, wrong=wrong)


def split_replies(reply: bytes, expected: list[bytes]) -> list[bytes]:
    """Cut `reply` into pieces as long as the expected replies (enough to count the wrong ones)."""
    out, at = [], 0
    for e in expected:
        out.append(reply[at:at + len(e)])
        at += len(e)
    return out


if __name__ == "__main__":
    step_aside()
    main()
