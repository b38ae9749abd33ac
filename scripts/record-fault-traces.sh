#!/usr/bin/env bash
# Record page-level traces of the application benchmark's quick programs (90-330 MiB
# footprints, a hundred times what Valgrind lackey can trace here) and of a random-update kernel,
# for `tiermem sim`. Each program runs under `tiermem trace record` with a 2 MiB budget on the
# mem device and no prefetching, so nearly every page change faults and is recorded; what the
# trace lacks is the touches of pages that were still among the last 512 resident, and the first
# touches that zero-fill-around mapped ahead of a fault (docs/policies.md, "Real programs at
# their quick-scale footprints").
#
#   scripts/record-fault-traces.sh OUTDIR [SECONDS]
#
# Traces go to OUTDIR/NAME-quick.tmtrace (NAME: quicksort, kmeans, pagerank, intsort, linpack,
# mlp, random). A program still running after SECONDS (default 300) is stopped (SIGTERM: a
# Python program would take SIGINT only once its current numpy call returned) and its trace is
# the prefix so far. Needs root (userfaultfd for kernel-mode faults), python3 with the bench requirements
# (bench/requirements.txt), a C and C++ compiler, and a release build (cargo build --release
# -p tiermem-cli -p tiermem-preload). Inputs are made as `tiermem bench apps` makes them, in
# target/bench-apps/cache.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: $0 OUTDIR [SECONDS]}
cap=${2:-300}
tiermem=${TIERMEM:-$here/../target/release/tiermem}
cache=$here/../target/bench-apps/cache
mkdir -p "$out" "$cache"
out=$(cd "$out" && pwd)

# HPCC-style random updates over a 128 MiB table, 4 M updates a pass (two passes).
${CC:-cc} -O2 -DTABLE_LOG2=24 '-DUPDATES=(TABLE / 4)' -o "$out/random_update" "$here/traces/random_update.c" || exit 1

# NAME ARGV... per line, shell-quoted, for the quick scale (inputs prepared first).
commands=$(cd "$here/../bench" && python3 - "$cache" <<'EOF'
import shlex
import sys
from pathlib import Path

from tiermem_bench.workloads import WORKLOADS

cache = Path(sys.argv[1]).resolve()
for name in ("quicksort", "kmeans", "pagerank", "intsort", "linpack", "mlp"):
    WORKLOADS[name].prepare("quick", cache)
    print(shlex.join([name, *WORKLOADS[name].command("quick", cache, "python3")]))
EOF
) || exit 1
commands+=$'\n'"random $out/random_update"

while read -r line; do
    eval "argv=($line)"
    name=${argv[0]}
    # From bench/, so `python3 -m tiermem_bench...` finds the package.
    ( cd "$here/../bench" && timeout -s TERM "$cap" "$tiermem" trace record -o "$out/$name-quick.tmtrace" \
        --limit 2MiB --footprint 400MiB --device mem --prefetch none --replace lru \
        --dirty-tracking sync-wp --quiet -- "${argv[@]:1}" > /dev/null )
    case $? in
        0) echo "$name: complete" ;;
        124) echo "$name: stopped after $cap s, the trace is a prefix" ;;
        *) echo "$name: failed, see above" ;;
    esac
done <<< "$commands"
rm -f "$out/random_update"
