"""The stream-ramp table of docs/policies.md (*A ramp instead of a fixed distance*).

    python3 scripts/traces/ramp_table.py DIR OUT.json

DIR holds, for each recorded quick program NAME (scripts/record-fault-traces.sh), the
`tiermem sim --json` results NAME.d100.json (fastswap and stream x clock and stream-first),
NAME.d32.json and NAME.d8.json (stream x clock at those distances) and NAME.r4.json (stream x
clock and stream-first with --stream-ramp 4); see the docs for the commands. Writes the results
side by side to OUT.json and prints the Markdown table and the averages over the six programs.
"""

import json
import math
import sys
from pathlib import Path

from table import load as load_json  # a clear exit for a missing or broken results file

PROGRAMS = ["quicksort", "kmeans", "pagerank", "intsort", "linpack", "mlp", "random"]
VARIANTS = ["d100", "d32", "d8", "r4"]
FIELDS = ("accuracy", "coverage", "faults", "prefetch_issued", "unused_prefetches", "late_prefetches", "modeled_ns")


def collect(directory: Path) -> dict:
    table = {}
    for name in PROGRAMS:
        rows = {}
        for variant in VARIANTS:
            runs = load_json(directory / f"{name}.{variant}.json")
            for r in runs["results"]:
                key = f"{r['prefetch']}/{r['replace']}"
                if r["prefetch"] != "fastswap":
                    key += f"/{variant}"
                rows[key] = {k: r[k] for k in FIELDS}
        table[name] = {"local_pages": runs["local_pages"], "footprint_pages": runs["footprint_pages"], "results": rows}
    return table


def main() -> None:
    directory, out = Path(sys.argv[1]), Path(sys.argv[2])
    table = collect(directory)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")

    def cell(r: dict) -> str:
        return f"{r['accuracy'] * 100:.0f}% / {r['coverage'] * 100:.0f}%"

    print("| program | i = 100 (paper) | i = 32 | i = 8 | ramp 4 → 100 "
          "| modeled time, ramp ÷ i = 100 (clock · stream-first) | speed-up over fastswap, i = 100 → ramp |")
    print("|---|---|---|---|---|---|---|")
    programs = [p for p in PROGRAMS if p != "random"]
    for name in PROGRAMS:
        rows = table[name]["results"]
        clock = {v: rows[f"stream/clock/{v}"] for v in VARIANTS}
        ratio = clock["r4"]["modeled_ns"] / clock["d100"]["modeled_ns"]
        ratio_sf = rows["stream/stream-first/r4"]["modeled_ns"] / rows["stream/stream-first/d100"]["modeled_ns"]
        fastswap = rows["fastswap/clock"]["modeled_ns"]
        print(f"| {name} | {cell(clock['d100'])} | {cell(clock['d32'])} | {cell(clock['d8'])} | {cell(clock['r4'])} "
              f"| {ratio:.3f} · {ratio_sf:.3f} "
              f"| {fastswap / clock['d100']['modeled_ns']:.3f}× → {fastswap / clock['r4']['modeled_ns']:.3f}× |")

    def mean(key: str, field: str) -> float:
        return 100 * sum(table[p]["results"][key][field] for p in programs) / len(programs)

    print(f"\nMeans over the {len(programs)} programs (random updates left out):")
    for v in VARIANTS:
        print(f"  stream x clock, {v}: accuracy {mean(f'stream/clock/{v}', 'accuracy'):.1f}%, "
              f"coverage {mean(f'stream/clock/{v}', 'coverage'):.1f}%")
    for v in ("d100", "r4"):
        print(f"  stream x stream-first, {v}: accuracy {mean(f'stream/stream-first/{v}', 'accuracy'):.1f}%, "
              f"coverage {mean(f'stream/stream-first/{v}', 'coverage'):.1f}%")
        logs = [math.log(table[p]["results"]["fastswap/clock"]["modeled_ns"]
                         / table[p]["results"][f"stream/clock/{v}"]["modeled_ns"]) for p in programs]
        print(f"  speed-up of stream x clock ({v}) over fastswap x clock, geometric mean: "
              f"{math.exp(sum(logs) / len(logs)):.3f}x")


if __name__ == "__main__":
    main()
