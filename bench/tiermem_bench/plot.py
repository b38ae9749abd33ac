"""The figure in the paper's style (Ultraswap Fig. 8): one panel per workload, local-memory ratio
on the x axis from 100% down to 20%, execution time normalised to the unlimited run, one line per
system; a failed point (every run failed) is drawn as an x at the top of the panel. With a single
ratio there is no line to draw: one bar chart instead, a group of bars per workload."""

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
    if len(ratios) == 1:
        return _bars(plt, bars(summary, norm, workloads, systems, ratios[0]), workloads, systems, ratios[0], path,
                     title)
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


def bars(summary: dict, norm: dict, workloads: list[str], systems: list[str], ratio: int) -> list[tuple]:
    """[(workload, system, normalised time or None when every run failed)] for the points run at
    `ratio`, workloads in order, systems in order within each."""
    return [(w, s, norm.get((w, s, ratio))) for w in workloads for s in systems if (w, s, ratio) in summary]


def _bars(plt, points: list[tuple], workloads: list[str], systems: list[str], ratio: int, path: Path,
          title: str) -> Path:
    shown = [s for s in systems if any(p[1] == s for p in points)]
    width = 0.8 / max(1, len(shown))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.2))
    top = max([v for _, _, v in points if v is not None] + [1.0])
    for k, system in enumerate(shown):
        offset = (k - (len(shown) - 1) / 2) * width
        mine = {w: v for w, s, v in points if s == system}
        xs = [i + offset for i, w in enumerate(workloads) if w in mine and mine[w] is not None]
        ys = [mine[w] for w in workloads if w in mine and mine[w] is not None]
        container = ax.bar(xs, ys, width, label=system)
        ax.bar_label(container, fmt="%.2f", fontsize=7, padding=1)
        failed = [i + offset for i, w in enumerate(workloads) if w in mine and mine[w] is None]
        if failed:
            color = container.patches[0].get_facecolor() if container.patches else None
            ax.plot(failed, [top * 1.05] * len(failed), linestyle="none", marker="x", markersize=9, color=color)
            for x in failed:
                ax.annotate("failed", (x, top * 1.05), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=7)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_ylabel(f"execution time at {ratio}% of the footprint\n(normalised to the unlimited run)")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_ylim(0, top * 1.18)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(frameon=False, ncol=min(len(shown), 6) or 1, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
