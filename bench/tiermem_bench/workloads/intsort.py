"""Integer sort in the style of NPB IS: keys drawn as the mean of four uniforms (NPB's roughly
Gaussian key distribution) over [0, 2^bits), ranked by bucket counting (numpy.bincount + cumsum, a
streaming pass over all keys) for several iterations with two keys changed per iteration, then
fully sorted (numpy's radix/stable sort) and verified."""

import argparse

from tiermem_bench.workloads._common import Timer, digest, emit


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, required=True)
    parser.add_argument("--bits", type=int, default=19)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)

    import numpy as np

    max_key = 1 << args.bits
    with Timer() as timer:
        rng = np.random.default_rng(args.seed)
        keys = np.zeros(args.keys, dtype=np.int32)
        for _ in range(4):
            keys += rng.integers(0, max_key // 4, args.keys, dtype=np.int32)
        partial = []
        for iteration in range(1, args.iterations + 1):
            keys[iteration] = iteration
            keys[iteration + args.iterations] = max_key - iteration
            counts = np.bincount(keys, minlength=max_key)
            ranks = np.cumsum(counts)
            probe = keys[:: max(1, args.keys // 5)]
            partial.append(ranks[probe].tolist())
        ordered = np.sort(keys, kind="stable")
        verified = bool(np.all(ordered[1:] >= ordered[:-1]))
    emit(digest(args.keys, verified, partial, ordered[:: max(1, args.keys // 64)].tolist()), timer.seconds,
         verified=verified)
    return 0 if verified else 1


if __name__ == "__main__":
    raise SystemExit(main())
