"""Linpack: solve A x = b for a dense random A by LU with partial pivoting (SciPy's LAPACK getrf /
getrs) and check the scaled residual, as HPL does."""

import argparse

from tiermem_bench.workloads._common import Timer, digest, emit


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)

    import numpy as np
    import scipy.linalg

    with Timer() as timer:
        rng = np.random.default_rng(args.seed)
        a = rng.random((args.n, args.n)) - 0.5
        b = rng.random(args.n) - 0.5
        factors = scipy.linalg.lu_factor(a, check_finite=False)
        x = scipy.linalg.lu_solve(factors, b, check_finite=False)
        residual = a @ x - b
        eps = np.finfo(np.float64).eps
        scaled = float(np.linalg.norm(residual, np.inf)
                       / (eps * (np.linalg.norm(a, np.inf) * np.linalg.norm(x, np.inf) + np.linalg.norm(b, np.inf))
                          * args.n))
    passed = scaled < 16.0  # HPL's threshold
    emit(digest(args.n, passed, np.round(x[:64], 6).tolist(), round(float(np.abs(x).sum()), 3)), timer.seconds,
         scaled_residual=scaled, passed=passed)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
