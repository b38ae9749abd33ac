"""PageRank: igraph's PageRank (PRPACK) on a directed graph read from an edge-list file with
igraph's own C reader. The graph is shaped like the paper's (655k nodes, 7.5M edges, scaled):
uniform sources, Zipf-distributed targets; `prepare` writes it once per shape."""

import argparse
import os

from tiermem_bench.workloads._common import Timer, digest, emit


def edge_file(cache_dir, nodes, edges, seed):
    return os.path.join(cache_dir, f"pagerank-{nodes}-{edges}-{seed}.edges")


def prepare(cache_dir, nodes, edges, seed):
    """Write the edge list (text, "src dst" per line) unless it is already there."""
    import numpy as np

    path = edge_file(cache_dir, nodes, edges, seed)
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(seed)
    tmp = path + f".tmp{os.getpid()}"
    chunk = 1 << 20
    with open(tmp, "w") as out:
        # Mention the last node so the graph has exactly `nodes` vertices.
        out.write(f"{nodes - 1} {nodes - 1}\n")
        for start in range(1, edges, chunk):
            count = min(chunk, edges - start)
            sources = rng.integers(0, nodes, count)
            targets = (rng.zipf(1.7, count) - 1 + rng.integers(0, 64, count) * 7919) % nodes
            lines = np.char.add(np.char.add(sources.astype(str), " "), targets.astype(str))
            out.write("\n".join(lines.tolist()))
            out.write("\n")
    os.replace(tmp, path)
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
