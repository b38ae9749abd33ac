"""ML training: scikit-learn's MLPClassifier (one hidden layer, Adam, mini-batches) trained for a
fixed number of epochs on a synthetic make_classification data set.

The data set is made once, in `prepare`, and saved as two .npy files (features, labels); a run
loads them, as a training job reads its input, and trains. Making it inside the run measured
make_classification's shuffle (a gather of every row in random order) rather than training.
"""

import argparse
import os
import warnings

from tiermem_bench.workloads._common import Timer, digest, emit, generator_tag, save_npy


# What the input files depend on, and which of those only they need (not the run's options).
INPUT_PARAMS = ("samples", "features", "seed")
INPUT_ONLY = ("samples", "features")


def input_args(cache_dir, samples, features, seed):
    """The run's options naming its input files."""
    features_path, labels_path = data_files(cache_dir, samples, features, seed)
    return ["--features-file", features_path, "--labels-file", labels_path]


def data_files(cache_dir, samples, features, seed):
    tag = generator_tag(prepare, "scikit-learn", "numpy")
    stem = os.path.join(cache_dir, f"mlp-{samples}-{features}-{seed}-{tag}")
    return stem + "-features.npy", stem + "-labels.npy"


def prepare(cache_dir, samples, features, seed):
    """Write the data set unless it is already there; returns (features file, labels file)."""
    features_path, labels_path = data_files(cache_dir, samples, features, seed)
    if not (os.path.exists(features_path) and os.path.exists(labels_path)):
        from sklearn.datasets import make_classification

        data, labels = make_classification(n_samples=samples, n_features=features,
                                           n_informative=features // 2, n_classes=4, random_state=seed)
        save_npy(labels_path, labels)
        save_npy(features_path, data)
    return features_path, labels_path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--features-file", required=True, help="written by prepare()")
    parser.add_argument("--labels-file", required=True, help="written by prepare()")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)

    import numpy as np
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    with Timer() as timer:
        features = np.load(args.features_file)
        labels = np.load(args.labels_file)
        model = MLPClassifier(hidden_layer_sizes=(args.hidden,), batch_size=args.batch, max_iter=args.epochs,
                              shuffle=True, random_state=args.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model.fit(features, labels)
        accuracy = float(model.score(features, labels))
    emit(digest(round(accuracy, 6), round(float(model.loss_), 6),
                [np.round(w[:4, :4], 5).tolist() for w in model.coefs_]), timer.seconds,
         accuracy=accuracy, loss=float(model.loss_))


if __name__ == "__main__":
    main()
