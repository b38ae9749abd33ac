"""ML training: scikit-learn's MLPClassifier (one hidden layer, Adam, mini-batches) trained for a
fixed number of epochs on a synthetic make_classification data set."""

import argparse
import warnings

from tiermem_bench.workloads._common import Timer, digest, emit


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)

    import numpy as np
    from sklearn.datasets import make_classification
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    with Timer() as timer:
        features, labels = make_classification(n_samples=args.samples, n_features=args.features,
                                               n_informative=args.features // 2, n_classes=4,
                                               random_state=args.seed)
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
