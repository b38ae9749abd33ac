#!/usr/bin/env bash
# Record page-level traces of the application benchmark's quick programs (90-335 MiB
# footprints, far beyond what Valgrind lackey can trace here) and of a random-update kernel,
# for `tiermem sim`. Each program runs under `tiermem trace record` with a 2 MiB budget on the
# mem device and no prefetching, so nearly every page change faults and is recorded; what the
# trace lacks is the touches of pages the run still had resident, and the first touches that
# zero-fill-around mapped ahead of a fault (docs/policies.md, "Real programs at their
# quick-scale footprints").
#
#   scripts/record-fault-traces.sh OUTDIR [SECONDS]
#
# Traces go to OUTDIR/NAME-quick.tmtrace (NAME: quicksort, kmeans, pagerank, intsort, linpack,
# mlp, random), each with its description NAME-quick.tmtrace.json; the random-update kernel's
# binary stays in OUTDIR too (its description names it). A program still running after SECONDS
# (default 300) is stopped with SIGTERM (a Python program would take SIGINT only once its
# current numpy call returned) and its trace is the prefix so far; one still there 30 s later
# is killed, and that recording fails. The exit status is non-zero if any recording failed;
# Ctrl-C stops the current recording and the script. Needs root (userfaultfd for kernel-mode
# faults), python3 with the bench requirements (bench/requirements.txt), a C and C++ compiler,
# and a release build (cargo build --release -p tiermem-cli -p tiermem-preload). Inputs are
# made as `tiermem bench apps` makes them, in target/bench-apps/cache.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: $0 OUTDIR [SECONDS]}
cap=${2:-300}
tiermem=${TIERMEM:-$here/../target/release/tiermem}
cache=$here/../target/bench-apps/cache
mkdir -p "$out" "$cache" || exit 1
out=$(cd "$out" && pwd) || exit 1

# HPCC-style random updates over a 128 MiB table, 4 M updates a pass (two passes).
${CC:-cc} -O2 -DTABLE_LOG2=24 '-DUPDATES=(TABLE / 4)' -o "$out/random_update" "$here/traces/random_update.c" || exit 1

# NAME ARGV... per line, shell-quoted, for the quick scale (inputs prepared first). Only these
# lines reach standard output, which is evaluated below: whatever the preparation, or a
# compiler it runs, prints goes to standard error, file descriptor and all.
commands=$(cd "$here/../bench" && python3 - "$cache" "$out/random_update" <<'PY'
import os
import shlex
import sys
from pathlib import Path

from tiermem_bench.workloads import WORKLOADS

answer = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
cache = Path(sys.argv[1]).resolve()
lines = []
for name in ("quicksort", "kmeans", "pagerank", "intsort", "linpack", "mlp"):
    WORKLOADS[name].prepare("quick", cache)
    lines.append(shlex.join([name, *WORKLOADS[name].command("quick", cache, "python3")]))
lines.append(shlex.join(["random", sys.argv[2]]))
answer.write("\n".join(lines) + "\n")
answer.close()
PY
) || exit 1

# `timeout` runs each recording in a process group of its own, which Ctrl-C does not reach:
# pass the interrupt on (timeout hands it to the recording and its program), then stop.
recording=
trap 'if [[ -n $recording ]]; then kill -TERM "$recording" 2>/dev/null; wait "$recording"; fi; exit 130' INT TERM

failed=0
while read -r line; do
    [[ -n $line ]] || continue
    eval "argv=($line)"
    name=${argv[0]}
    trace=$out/$name-quick.tmtrace
    rm -f "$trace" "$trace.json"
    # From bench/, so `python3 -m tiermem_bench...` finds the package.
    ( cd "$here/../bench" && exec timeout -s TERM -k 30 "$cap" "$tiermem" trace record -o "$trace" \
        --limit 2MiB --footprint 400MiB --device mem --prefetch none --replace lru \
        --dirty-tracking sync-wp --quiet -- "${argv[@]:1}" ) < /dev/null > /dev/null &
    recording=$!
    wait "$recording"
    status=$?
    recording=
    if [[ $status -eq 0 ]]; then
        echo "$name: complete"
    elif [[ $status -eq 124 && -s $trace ]]; then
        echo "$name: stopped after $cap s, the trace is a prefix"
    else
        echo "$name: failed (exit $status), see above"
        failed=1
    fi
done <<< "$commands"
exit $failed
