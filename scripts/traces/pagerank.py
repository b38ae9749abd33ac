# PageRank by power iteration over a random power-law graph (40000 nodes, 320000 edges), numpy.
import numpy as np
rng = np.random.default_rng(5)
n, m = 40000, 320000
src = rng.integers(0, n, m)
dst = (rng.zipf(1.3, m) * 7919) % n
outdeg = np.bincount(src, minlength=n).astype(np.float64)
outdeg[outdeg == 0] = 1
r = np.full(n, 1.0 / n)
for _ in range(8):
    r = 0.15 / n + 0.85 * np.bincount(dst, weights=r[src] / outdeg[src], minlength=n)
print(float(r.sum()))
