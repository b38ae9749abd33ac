# k-means (Lloyd) over 24000 points in 8 dimensions, 8 clusters, 8 iterations, with numpy.
import numpy as np
rng = np.random.default_rng(4)
X = (rng.standard_normal((24000, 8)) + rng.integers(0, 6, (24000, 1))).astype(np.float32)
C = X[rng.choice(len(X), 8, replace=False)]
for _ in range(8):
    d = ((X[:, None, :] - C[None, :, :]) ** 2).sum(-1)
    lab = d.argmin(1)
    C = np.stack([X[lab == k].mean(0) if (lab == k).any() else C[k] for k in range(8)])
print(float(C.sum()))
