"""The figure in the paper's style (Ultraswap Fig. 8): one panel per workload, local-memory ratio
on the x axis from 100% down to 20%, execution time normalised to the unlimited run, one line per
system; a failed point (every run failed) is drawn as an x at the top of the panel."""

from __future__ import annotations

from pathlib import Path

from tiermem_bench import stats

MARKERS = {"linux-swap": "s", "tiermem-file": "o", "tiermem-mem": "^", "tiermem-poll-only": "v",
           "tiermem-interrupt-only": "D", "tiermem-reclaim-on-fault-path": "P"}


def plot(runs: list[dict], systems: list[str], ratios: list[int], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = stats.summarise(runs)
    norm = stats.normalised(summary)
    workloads = sorted({r["workload"] for r in runs})
    columns = min(3, max(1, len(workloads)))
    rows = (len(workloads) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    xs = sorted(ratios, reverse=True)
    for index, workload in enumerate(workloads):
        ax = axes[index // columns][index % columns]
        top = max([v for (w, _, _), v in norm.items() if w == workload] + [1.0])
        for system in systems:
            points = [(r, norm.get((workload, system, r))) for r in xs if (workload, system, r) in summary]
            if not points:
                continue
            ok = [(r, v) for r, v in points if v is not None]
            line, = ax.plot([r for r, _ in ok], [v for _, v in ok], marker=MARKERS.get(system, "."),
                            label=system, linewidth=1.4, markersize=5)
            failed = [r for r, v in points if v is None]
            if failed:
                ax.plot(failed, [top * 1.08] * len(failed), linestyle="none", marker="x", markersize=8,
                        color=line.get_color())
        ax.set_title(workload)
        ax.set_xlim(max(xs) + 5, min(xs) - 5)  # 100% on the left, as in the paper
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{r}%" for r in xs])
        ax.set_xlabel("local memory (share of footprint)")
        ax.set_ylabel("normalised execution time")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    for index in range(len(workloads), rows * columns):
        axes[index // columns][index % columns].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6) or 1, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
