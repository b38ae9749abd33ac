#!/usr/bin/env bash
# Record page-level traces of real programs with Valgrind lackey, for `tiermem sim`: five we did
# not write (GNU sort twice, SQLite, numpy k-means and PageRank) and two small C kernels in the
# style of the paper's streaming and random cases (an NPB-IS-style integer sort, HPCC-style
# random updates; scripts/traces/*.c).
#
#   scripts/record-traces.sh OUTDIR [SECONDS]
#
# Each program runs under `valgrind --tool=lackey --trace-mem=yes` (at most SECONDS, default
# 150, except the two C kernels: a capped run keeps the prefix of the trace), its text trace goes to /dev/shm, and
# `tiermem sim --save` turns it into OUTDIR/NAME.tmtrace through a 128 KiB 8-way LLC and the
# hot-page table (N = 8); the text is deleted. Needs valgrind, python3 with numpy, sqlite3, a C
# compiler, and a release build (cargo build --release -p tiermem-cli).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: $0 OUTDIR [SECONDS]}
cap=${2:-150}
tiermem=${TIERMEM:-$here/../target/release/tiermem}
mkdir -p "$out"
python3 "$here/traces/make_inputs.py" "$out"
for c in intsort_is random_update; do
    ${CC:-cc} -O2 -o "$out/$c" "$here/traces/$c.c" || exit 1
done
py=$(python3 -c 'import sys; print(sys.executable)') # the real binary, not a pyenv shim
record() {
    local name=$1; shift
    local text=/dev/shm/tiermem-$name.lackey
    ( cd "$out" && timeout "${limit:-$cap}" valgrind --tool=lackey --trace-mem=yes --log-file="$text" "$@" > /dev/null )
    echo "$name: valgrind exit $? (124: capped at ${limit:-$cap} s, the trace is a prefix)"
    "$tiermem" sim "$text" --format lackey --llc 128KiB:8 --save "$out/$name.tmtrace" \
        --prefetch none --replace lru --local 50% --json > "$out/$name.convert.json"
    rm -f "$text"
}
export LC_ALL=C
record sort sort l10k.txt
record intsort sort -n ints.txt
record sqlite sqlite3 t.db 'SELECT sum(length(b.pad)) FROM t a JOIN t b ON b.id = a.k;'
record kmeans "$py" "$here/traces/kmeans.py"
record pagerank "$py" "$here/traces/pagerank.py"
# The two kernels run to completion (5-6 minutes each under lackey), whatever SECONDS says.
limit=900 record npb-is "$out/intsort_is"
limit=900 record random "$out/random_update"
