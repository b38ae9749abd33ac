"""Prefetchers side by side from `tiermem sim --json` results: a PNG of three panels, accuracy,
coverage and modeled speed-up over `fastswap`, one group of bars per program, one bar per
prefetcher, all with `clock` replacement.

    python3 scripts/traces/plot.py OUT.png DIR NAME...

reads DIR/NAME.fig.json for each NAME (the runs of docs/policies.md's tables).
"""
import sys

from table import pairs

PREFETCHERS = ("readahead", "fastswap", "leap", "stream")


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    out, directory, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    # Every pair looked up first, so a missing one ends the run before anything is drawn.
    runs = {}
    for name in names:
        _, run = pairs(directory, name)
        runs[name] = {p: run(p, "clock") for p in PREFETCHERS}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(PREFETCHERS)
    fig, axes = plt.subplots(3, 1, figsize=(max(6, 1.3 * len(names)), 8), sharex=True)
    panels = [
        ("accuracy", lambda r, base: r["accuracy"] * 100, "accuracy (%)"),
        ("coverage", lambda r, base: r["coverage"] * 100, "coverage (%)"),
        ("speed-up", lambda r, base: base / r["modeled_ns"], "speed-up over fastswap (modeled)"),
    ]
    for ax, (_, value, label) in zip(axes, panels):
        for k, prefetch in enumerate(PREFETCHERS):
            xs = [i + (k - (len(PREFETCHERS) - 1) / 2) * width for i in range(len(names))]
            ys = [value(runs[n][prefetch], runs[n]["fastswap"]["modeled_ns"]) for n in names]
            ax.bar(xs, ys, width, label=prefetch)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=len(PREFETCHERS), fontsize="small", loc="lower center", bbox_to_anchor=(0.5, 1.0),
                   frameon=False)
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[2].set_xticks(range(len(names)))
    axes[2].set_xticklabels([n.removesuffix("-quick") for n in names], rotation=20)
    fig.suptitle("Prefetchers at 50% local memory, clock replacement (tiermem sim)")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
