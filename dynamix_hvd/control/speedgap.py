"""Is the ranks' difference in speed real? A paired test on one interval's per-step times. Pure NumPy.

Leaving the neutral split is worth it only when the ranks' speeds differ by more than the split
margin, and the difference must be measured, not a few noisy steps. Every step is timed on every
rank at once, so what slows the whole step (a busy host, the allreduce) cancels in each step's
differences between ranks: for rank i and step k, d_ik = log t_ik - mean_j log t_jk, its log arrival
time against the step's mean. The differences are then shrunk towards equal arrivals (no gain at
the sizes that ran) by a one-sided Student-t bound on each rank's mean d_i (the steps' scatter,
`CONFIDENCE`), and the bound on the split's gain is the time the arrival-equalising split saves at
the speeds these imply (the interval's sizes, time in proportion to samples) over the measured
step, which also holds the allreduce and the update that no split shortens. Equal ranks give a
bound at or below zero; a 2x straggler (a gain of 1/3) timed for six steps gives 0.16-0.34.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

CONFIDENCE = 0.99
"""One-sided confidence of the bound on each rank's speed."""

MIN_STEPS = 5
"""Fewest timed steps the test needs (fewer: no bound, NaN)."""


def t_quantile(p: float, df: int) -> float:
    """Student-t quantile (Cornish-Fisher expansion around the normal one: within 1% of the exact
    value for df >= 4 at p <= 0.99)."""
    z = NormalDist().inv_cdf(p)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) \
        + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)


def shrunk_mean(d: np.ndarray, confidence: float = CONFIDENCE) -> np.ndarray:
    """Column means of `d` [n, R] shrunk towards 0 by their one-sided Student-t bound: sign(m) x
    max(|m| - t x se, 0), 0 where the steps' scatter cannot tell the mean from 0 (n >= 2)."""
    n = len(d)
    mean = d.mean(0)
    se = d.std(0, ddof=1) / math.sqrt(n)
    return np.sign(mean) * np.maximum(np.abs(mean) - t_quantile(confidence, n - 1) * se, 0.0)


def speed_gap(batches: np.ndarray, arrival: np.ndarray, step_s: np.ndarray | None = None,
              confidence: float = CONFIDENCE) -> tuple[float, int]:
    """Lower confidence bound on the step-time gain of equalising arrivals, from per-step sizes and
    arrival times [n, R] and step times [n] (None or NaN: the step is the slowest arrival) of one
    interval (module docstring), and the slowest rank by the shrunk means (the rank whose arrival a
    split shortens most); NaN and -1 with fewer than `MIN_STEPS` steps or one rank."""
    b = np.asarray(batches, dtype=np.float64)
    t = np.asarray(arrival, dtype=np.float64)
    ok = (b > 0).all(1) & (t > 0).all(1) & np.isfinite(t).all(1)
    b, t = b[ok], t[ok]
    n, R = b.shape if b.ndim == 2 else (0, 0)
    if n < MIN_STEPS or R < 2:
        return math.nan, -1
    step = None if step_s is None else np.asarray(step_s, dtype=np.float64)[ok]
    x = np.log(t)
    shrunk = shrunk_mean(x - x.mean(1, keepdims=True), confidence)
    sizes = np.median(b, axis=0)
    per_sample = np.exp(shrunk) / sizes              # relative seconds per sample
    equalised = float(sizes.sum() / (1.0 / per_sample).sum())
    gain = 1.0 - equalised / float(np.exp(shrunk).max())
    timed = step[np.isfinite(step) & (step > 0)] if step is not None else step
    if timed is not None and len(timed):
        # the saving, a fraction of the slowest arrival, as a fraction of the measured step
        gain *= min(1.0, float(t.mean(0).max() / timed.mean()))
    return gain, int(np.argmax(shrunk))
