"""Draw `tiermem bench micro --json` results: per-page write and read time of every system, one
panel per array size, with each tiermem system's speed-up over Linux swap written on its bars.

    python3 -m tiermem_bench.micro_plot micro-100.json micro-1000.json -o micro.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BASELINE = "linux-swap"


def speedups(result: dict) -> dict[str, tuple[float | None, float | None]]:
    """(write, read) speed-up over Linux swap of every system in one micro result: Linux swap's
    per-page time / the system's. None where Linux swap did not run or a time is missing."""
    rows = {r["system"]: r for r in result["rows"]}
    base = rows.get(BASELINE)

    def ratio(system_row, key):
        if base is None or not base.get(key) or not system_row.get(key):
            return None
        return base[key] / system_row[key]

    return {name: (ratio(row, "write_us"), ratio(row, "read_us")) for name, row in rows.items()}


def plot(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.6 * len(results), 3.8), squeeze=False)
    for ax, result in zip(axes[0], results):
        rows = result["rows"]
        names = [r["system"] for r in rows]
        ratios = speedups(result)
        xs = range(len(rows))
        width = 0.38
        for offset, key, label in ((-width / 2, "write_us", "write"), (width / 2, "read_us", "read")):
            values = [r[key] for r in rows]
            bars = ax.bar([x + offset for x in xs], values, width, label=label)
            for bar, name in zip(bars, names):
                r = ratios[name][0 if key == "write_us" else 1]
                if name != BASELINE and r is not None:
                    ax.annotate(f"{r:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([n.replace("tiermem-", "tm-") for n in names], rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("µs per page (mean)")
        device = result.get("device_read_us")
        note = f"; device 4 KiB read {device:.0f} µs" if device else ""
        ax.set_title(f"{result['size_mb']} MiB array, {result['limit_mb']} MiB limit{note}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("tiermem bench micro: per-page time (labels: speed-up over Linux swap)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tiermem_bench.micro_plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="JSON files of `tiermem bench micro --json`")
    p.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        try:
            result = json.loads(path.read_text())
            result["rows"], result["size_mb"], result["limit_mb"]
        except (OSError, ValueError) as e:
            print(f"micro_plot: cannot read {path}: {e}", file=sys.stderr)
            return 2
        except (KeyError, TypeError):
            print(f"micro_plot: {path} is not the JSON of `tiermem bench micro --json`", file=sys.stderr)
            return 2
        results.append(result)
    print(plot(results, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
