"""The recorded-programs table of docs/policies.md from `tiermem sim --json` results.

    python3 scripts/traces/table.py DIR NAME...

reads DIR/NAME.fig.json (every prefetcher x replacement at 50%) and DIR/NAME.convert.json (the
raw access count of a lackey trace) or, for a fault trace of `tiermem trace record`,
DIR/NAME.tmtrace.json (its description), and prints one Markdown row per program: accuracy /
coverage of each prefetcher under `clock`, modeled speed-ups over `fastswap` x `clock`, and
faults of `stream-first` against `clock` without prefetching.
"""
import os
import json
import sys

LABELS = {
    'sort': 'GNU sort, 10k lines',
    'intsort': 'GNU sort -n, 25k integers (prefix)',
    'sqlite': 'SQLite, 40k random index lookups (prefix)',
    'kmeans': 'numpy k-means (prefix)',
    'pagerank': 'numpy PageRank (prefix)',
    'npb-is': 'NPB-IS-style integer sort, 2^20 keys, 10 rankings (C)',
    'random': 'HPCC-style random updates, 16 MiB table (C)',
    'quicksort-quick': 'C++ std::sort, 12 M integers',
    'kmeans-quick': 'scikit-learn k-means',
    'pagerank-quick': 'igraph PageRank',
    'intsort-quick': 'NPB-IS-style integer sort, numpy (prefix)',
    'linpack-quick': 'SciPy LU solve (Linpack)',
    'mlp-quick': 'scikit-learn MLP training',
    'random-quick': 'HPCC-style random updates, 128 MiB table (C)',
}


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f'cannot read {path}: {e}')


def pairs(directory, name):
    """DIR/NAME.fig.json, and a lookup of its result for a prefetcher x replacement pair that
    exits naming a missing one."""
    path = f'{directory}/{name}.fig.json'
    fig = load(path)
    runs = {(r['prefetch'], r['replace']): r for r in fig.get('results', [])}

    def run(prefetch, replace):
        if (prefetch, replace) not in runs:
            sys.exit(f'{name}: no {prefetch} x {replace} result in {path}')
        return runs[(prefetch, replace)]

    return fig, run


def row(directory, name):
    fig, run = pairs(directory, name)
    fault_trace = f'{directory}/{name}.tmtrace.json'
    lackey = f'{directory}/{name}.convert.json'
    if os.path.exists(fault_trace):
        budget = load(fault_trace).get('budget_pages')
        if not isinstance(budget, int):
            sys.exit(f'{fault_trace}: no budget_pages (not a `tiermem trace record` description?)')
        source = f"faults under a {budget}-page budget"
    elif os.path.exists(lackey):
        source = f"{load(lackey)['raw_accesses'] / 1e6:.0f}M accesses"
    else:
        sys.exit(f'cannot read {lackey} (a lackey trace\'s) or {fault_trace} (a fault trace\'s description)')
    def acc_cov(prefetch):
        r = run(prefetch, 'clock')
        return f"{r['accuracy']:.0%} / {r['coverage']:.0%}"

    base = run('fastswap', 'clock')['modeled_ns']
    accesses = run('none', 'clock')['accesses']
    cells = [
        f"{LABELS.get(name, name)} ({fig['footprint_pages']} pages, {source} → "
        f"{accesses / 1e3:.0f}k page events)",
        *(acc_cov(p) for p in ('readahead', 'fastswap', 'leap', 'stream')),
        f"{base / run('stream', 'clock')['modeled_ns']:.3f}×",
        f"{base / run('stream', 'stream-first')['modeled_ns']:.3f}×",
        f"{run('none', 'clock')['faults']} → {run('none', 'stream-first')['faults']}",
    ]
    return '| ' + ' | '.join(cells) + ' |'


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for name in sys.argv[2:]:
        print(row(sys.argv[1], name))


if __name__ == '__main__':
    main()
