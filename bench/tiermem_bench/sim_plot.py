"""Draw `tiermem sim --json` results. With several `--local` sizes: a miss-ratio curve (faults
per access against local memory, one line per prefetcher x replacement pair) beside the modeled
time; with one size: the pairs side by side.

    tiermem sim trace.tmtrace --local 10%,25%,50%,75% --prefetch none,stream \\
        --replace lru,belady --json > mrc.json
    python3 -m tiermem_bench.sim_plot mrc.json -o mrc.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def curves(result: dict) -> dict[str, list[tuple[float, float, float]]]:
    """Per pair ("prefetch x replace"), by growing local memory: (local memory in % of the
    trace's footprint, faults per access, modeled seconds). Faults are the demand misses: a
    prefetched page used in time is not one."""
    footprint = result["footprint_pages"]
    out: dict[str, list[tuple[float, float, float]]] = {}
    for row in result["results"]:
        pair = f"{row['prefetch']} x {row['replace']}"
        share = 100.0 * row["local_pages"] / footprint if footprint else 0.0
        ratio = row["faults"] / row["accesses"] if row["accesses"] else 0.0
        out.setdefault(pair, []).append((share, ratio, row["modeled_ns"] / 1e9))
    for points in out.values():
        points.sort()
    return out


def plot(result: dict, path: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = curves(result)
    several = any(len(points) > 1 for points in lines.values())
    fig, (faults_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4))
    if several:
        for pair, points in lines.items():
            shares = [p[0] for p in points]
            faults_ax.plot(shares, [p[1] for p in points], marker="o", label=pair)
            time_ax.plot(shares, [p[2] for p in points], marker="o", label=pair)
        for ax in (faults_ax, time_ax):
            ax.set_xlabel("local memory, % of the trace's footprint")
            ax.grid(alpha=0.3)
        faults_ax.legend(fontsize=8)
    else:
        pairs = list(lines)
        xs = range(len(pairs))
        faults_ax.bar(xs, [lines[p][0][1] for p in pairs])
        time_ax.bar(xs, [lines[p][0][2] for p in pairs])
        for ax in (faults_ax, time_ax):
            ax.set_xticks(list(xs))
            ax.set_xticklabels(pairs, rotation=25, ha="right", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
    faults_ax.set_ylabel("faults per access")
    faults_ax.set_ylim(bottom=0)
    time_ax.set_ylabel("modeled time, s")
    time_ax.set_ylim(bottom=0)
    sizes = sorted({row["local_pages"] for row in result["results"]})
    fig.suptitle(title or f"tiermem sim: {result.get('trace', '?')} ({result['footprint_pages']} pages; "
                 f"local memory {', '.join(str(s) for s in sizes)} pages)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tiermem_bench.sim_plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="the JSON of `tiermem sim --json`")
    p.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--title", help="the figure's title (default: the trace and the sizes)")
    args = p.parse_args(argv)
    try:
        result = json.loads(args.result.read_text())
    except (OSError, ValueError) as e:
        print(f"sim_plot: cannot read {args.result}: {e}", file=sys.stderr)
        return 2
    try:
        if not result["results"]:
            raise KeyError("results")
        curves(result)
    except (KeyError, TypeError, AttributeError):
        print(f"sim_plot: {args.result} is not the JSON of `tiermem sim --json`", file=sys.stderr)
        return 2
    print(plot(result, args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
