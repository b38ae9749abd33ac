"""k-means: scikit-learn's KMeans (Lloyd) on overlapping Gaussian blobs from make_blobs."""

import argparse

from tiermem_bench.workloads._common import Timer, digest, emit


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--clusters", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)

    import numpy as np
    from sklearn.cluster import KMeans
    from sklearn.datasets import make_blobs

    with Timer() as timer:
        points, _ = make_blobs(n_samples=args.samples, n_features=args.features, centers=args.clusters,
                               cluster_std=6.0, center_box=(-10.0, 10.0), random_state=args.seed)
        model = KMeans(n_clusters=args.clusters, n_init=1, max_iter=args.iterations, tol=0.0,
                       algorithm="lloyd", random_state=args.seed).fit(points)
        sizes = np.bincount(model.labels_, minlength=args.clusters)
    centers = np.round(model.cluster_centers_, 6)
    emit(digest(sizes.tolist(), centers.tolist(), int(model.n_iter_)), timer.seconds,
         iterations=int(model.n_iter_), inertia=float(model.inertia_))


if __name__ == "__main__":
    main()
