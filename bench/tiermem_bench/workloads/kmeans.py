"""k-means: scikit-learn's KMeans (Lloyd) on overlapping Gaussian blobs.

The points come from make_blobs once, in `prepare`, and are saved as a .npy file; a run loads them
(a sequential read, as a job reads its input) and clusters them. Generating them inside the run
measured make_blobs' shuffle, a gather of every row in random order, rather than k-means: at 20%
of the footprint that gather cost about half the run's critical reads (docs/application-benchmarks.md).
"""

import argparse
import os

from tiermem_bench.workloads._common import Timer, digest, emit, generator_tag, save_npy


# What the input file depends on, and which of those only it needs (not the run's options).
INPUT_PARAMS = ("samples", "features", "clusters", "seed")
INPUT_ONLY = ("samples", "features")


def input_args(cache_dir, samples, features, clusters, seed):
    """The run's options naming its input file."""
    return ["--points-file", points_file(cache_dir, samples, features, clusters, seed)]


def points_file(cache_dir, samples, features, clusters, seed):
    tag = generator_tag(prepare, "scikit-learn", "numpy")
    return os.path.join(cache_dir, f"kmeans-{samples}-{features}-{clusters}-{seed}-{tag}.npy")


def prepare(cache_dir, samples, features, clusters, seed):
    """Write the points unless they are already there; returns the file's path."""
    path = points_file(cache_dir, samples, features, clusters, seed)
    if not os.path.exists(path):
        from sklearn.datasets import make_blobs

        points, _ = make_blobs(n_samples=samples, n_features=features, centers=clusters,
                               cluster_std=6.0, center_box=(-10.0, 10.0), random_state=seed)
        save_npy(path, points)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--points-file", required=True, help="written by prepare()")
    parser.add_argument("--clusters", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)

    import numpy as np
    from sklearn.cluster import KMeans

    with Timer() as timer:
        points = np.load(args.points_file)
        model = KMeans(n_clusters=args.clusters, n_init=1, max_iter=args.iterations, tol=0.0,
                       algorithm="lloyd", random_state=args.seed).fit(points)
        sizes = np.bincount(model.labels_, minlength=args.clusters)
    centers = np.round(model.cluster_centers_, 6)
    emit(digest(sizes.tolist(), centers.tolist(), int(model.n_iter_)), timer.seconds,
         iterations=int(model.n_iter_), inertia=float(model.inertia_))


if __name__ == "__main__":
    main()
