"""PageRank: igraph's PageRank (PRPACK) on a directed graph read from an edge-list file with
igraph's own C reader. The graph is shaped like the paper's (655k nodes, 7.5M edges, scaled):
uniform sources, Zipf-distributed targets; `prepare` writes it once per shape, sorted by source
(then target), as edge lists of real graphs (crawls, SNAP's data sets) come grouped by source.
Written in random order instead, igraph's graph build (radix sorts by source and by target)
gathered both ways at random, and at 20% of the footprint that was most of the run's misses."""

import argparse
import os

from tiermem_bench.workloads._common import Timer, digest, emit, generator_tag, write_atomically


# What the input file depends on; the run needs none of it but the file.
INPUT_PARAMS = ("nodes", "edges", "seed")
INPUT_ONLY = INPUT_PARAMS


def input_args(cache_dir, nodes, edges, seed):
    """The run's options naming its input file."""
    return ["--edges-file", edge_file(cache_dir, nodes, edges, seed)]


def edge_file(cache_dir, nodes, edges, seed):
    tag = generator_tag(prepare, "numpy")
    return os.path.join(cache_dir, f"pagerank-{nodes}-{edges}-{seed}-{tag}.edges")


def prepare(cache_dir, nodes, edges, seed):
    """Write the edge list (text, "src dst" per line) unless it is already there."""
    import numpy as np

    path = edge_file(cache_dir, nodes, edges, seed)
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(seed)
    chunk = 1 << 20
    # Mention the last node so the graph has exactly `nodes` vertices.
    sources, targets = [np.array([nodes - 1])], [np.array([nodes - 1])]
    for start in range(1, edges, chunk):
        count = min(chunk, edges - start)
        sources.append(rng.integers(0, nodes, count))
        targets.append((rng.zipf(1.7, count) - 1 + rng.integers(0, 64, count) * 7919) % nodes)
    # One key per edge, sorted in place: (source, target) order with a single array in memory.
    keys = np.concatenate(sources) * nodes + np.concatenate(targets)
    del sources, targets
    keys.sort()

    def write(out):
        for start in range(0, edges, chunk):
            part = keys[start:start + chunk]
            lines = np.char.add(np.char.add((part // nodes).astype(str), " "), (part % nodes).astype(str))
            out.write("\n".join(lines.tolist()).encode())
            out.write(b"\n")

    write_atomically(path, write)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--edges-file", required=True)
    parser.add_argument("--damping", type=float, default=0.85)
    args = parser.parse_args(argv)

    import igraph
    import numpy as np

    with Timer() as timer:
        graph = igraph.Graph.Read_Edgelist(args.edges_file, directed=True)
        ranks = np.asarray(graph.pagerank(damping=args.damping))
    top = np.argsort(-ranks, kind="stable")[:20]
    emit(digest(graph.vcount(), graph.ecount(), top.tolist(), np.round(ranks[top], 9).tolist(),
                round(float(ranks.sum()), 6)), timer.seconds, nodes=graph.vcount(), edges=graph.ecount())


if __name__ == "__main__":
    main()
