"""Is the ranks' difference in speed real? A paired test on one interval's per-step times. Pure NumPy.

Leaving the neutral split is worth it only when the ranks' speeds differ by more than the split
margin, and the difference must be measured, not a few noisy steps. Every step is timed on every
rank at once, so what slows the whole step (a busy host, the allreduce) cancels in each step's
differences between ranks: for rank i and step k, d_ik = log t_ik - mean_j log t_jk, its log arrival
time against the step's mean. The differences are then shrunk towards equal arrivals (no gain at
the sizes that ran) by a one-sided Student-t bound on each rank's mean d_i (`CONFIDENCE`), and the
bound on the split's gain is the time the arrival-equalising split saves at the speeds these imply
(the interval's sizes, time in proportion to samples) over the measured step, which also holds the
allreduce and the update that no split shortens. Equal ranks give a bound at or below zero; a 2x
straggler (a gain of 1/3) timed for six steps gives 0.16-0.34.

Steps are not independent draws: a core slowed by its neighbours stays slow for many steps (on a
shared 2-core virtual machine the lag-1 autocorrelation of d in plain Horovod's runs on equal ranks is 0.51 and
0.68, medians over the two halves of the workload zoo), and a test that assumes
independence then finds gaps in noise. The bound's standard error and degrees of freedom therefore
come from the interval's effective number of steps, n divided by the variance inflation that the
steps' autocorrelation implies (Newey-West, Bartlett kernel, about n^(1/3) lags), from
`SERIAL_STEPS` steps on.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

CONFIDENCE = 0.99
"""One-sided confidence of the bound on each rank's speed. Not a setting: how readily a gap splits is
set by ``ProposalConfig.split_margin`` and ``split_intervals``, which the bound is compared with; the
confidence only keeps one interval's noise from passing them."""

MIN_STEPS = 5
"""Fewest timed steps the test needs (fewer: no bound, NaN). Not a setting: a Student-t bound on
fewer steps is too wide to pass any useful margin."""

SERIAL_STEPS = 12
"""Fewest steps from which their autocorrelation is estimated (three lags); fewer are taken as
independent draws: two lags of a handful of steps estimate it too noisily to be worth the power lost,
and the proposal asks for two intervals running anyway. Not a setting: a property of the estimator,
not of the job."""


def t_quantile(p: float, df: float) -> float:
    """Student-t quantile at ``floor(df)`` degrees of freedom (at least 1; a fractional df rounds
    down, the conservative side), for 0.5 <= p < 1: exact for 1-3 (their CDFs in closed form,
    inverted by bisection), for 4 and more the Cornish-Fisher expansion around the normal quantile
    (within 1% of the exact value at p <= 0.99)."""
    if not 0.5 <= p < 1.0:
        raise ValueError(f"t_quantile(p={p!r}); a one-sided bound needs 0.5 <= p < 1")
    if not math.isfinite(df):  # infinitely many degrees of freedom: the normal quantile
        return NormalDist().inv_cdf(p)
    df = max(1, int(df))
    if df <= 3:
        lo, hi = 0.0, 1e9
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
        return 0.5 * (lo + hi)
    z = NormalDist().inv_cdf(p)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) \
        + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)


def _t_cdf(t: float, df: int) -> float:
    """Student-t CDF at t >= 0 for 1, 2 or 3 degrees of freedom."""
    if df == 1:
        return 0.5 + math.atan(t) / math.pi
    if df == 2:
        return 0.5 + t / (2.0 * math.sqrt(2.0 + t * t))
    x = t / math.sqrt(3.0)
    return 0.5 + (x / (1.0 + x * x) + math.atan(x)) / math.pi


def effective_steps(d: np.ndarray) -> np.ndarray:
    """Per column of `d` [n, R]: n divided by the variance inflation of its mean that the column's
    autocorrelation implies (Newey-West long-run variance, Bartlett kernel, the smallest number of
    lags whose cube is at least n); never more than n (a negative autocorrelation does not count as
    extra steps)."""
    n = len(d)
    x = d - d.mean(0)
    var = (x * x).sum(0)
    lags = 1
    while lags ** 3 < n:
        lags += 1
    lags = min(n - 1, lags)
    long_run = var.copy()
    for k in range(1, lags + 1):
        long_run += 2.0 * (1.0 - k / (lags + 1)) * (x[:-k] * x[k:]).sum(0)
    inflation = np.where(var > 0, long_run / np.where(var > 0, var, 1.0), 1.0)
    return n / np.maximum(np.nan_to_num(inflation, nan=1.0, posinf=1.0), 1.0)


def shrunk_mean(d: np.ndarray, confidence: float = CONFIDENCE, serial: bool = True) -> np.ndarray:
    """Column means of `d` [n, R] (consecutive steps) shrunk towards 0 by their one-sided Student-t
    bound: sign(m) x max(|m| - t x se, 0), 0 where the steps' scatter cannot tell the mean from 0
    (n >= 2). From `SERIAL_STEPS` steps on, the standard error and the degrees of freedom are those
    of the column's effective number of steps (`effective_steps`); ``serial=False`` takes the steps
    as independent draws at any n (the plain t-test, for comparison)."""
    n = len(d)
    mean = d.mean(0)
    n_eff = effective_steps(d) if serial and n >= SERIAL_STEPS else np.full(d.shape[1], float(n))
    se = d.std(0, ddof=1) / np.sqrt(n_eff)
    t = np.array([t_quantile(confidence, m - 1.0) for m in n_eff])
    return np.sign(mean) * np.maximum(np.abs(mean) - t * se, 0.0)


def speed_gap(batches: np.ndarray, arrival: np.ndarray, step_s: np.ndarray | None = None,
              confidence: float = CONFIDENCE, serial: bool = True) -> tuple[float, int]:
    """Lower confidence bound on the step-time gain of equalising arrivals, from per-step sizes and
    arrival times [n, R] and step times [n] (None or NaN: the step is the slowest arrival) of one
    interval (module docstring), and the slowest rank by the shrunk means (the rank whose arrival a
    split shortens most); NaN and -1 with fewer than `MIN_STEPS` steps or one rank. `serial`: as in
    `shrunk_mean`."""
    b = np.asarray(batches, dtype=np.float64)
    t = np.asarray(arrival, dtype=np.float64)
    ok = (b > 0).all(1) & (t > 0).all(1) & np.isfinite(t).all(1)
    b, t = b[ok], t[ok]
    n, R = b.shape if b.ndim == 2 else (0, 0)
    if n < MIN_STEPS or R < 2:
        return math.nan, -1
    step = None if step_s is None else np.asarray(step_s, dtype=np.float64)[ok]
    x = np.log(t)
    shrunk = shrunk_mean(x - x.mean(1, keepdims=True), confidence, serial)
    sizes = np.median(b, axis=0)
    per_sample = np.exp(shrunk) / sizes              # relative seconds per sample
    equalised = float(sizes.sum() / (1.0 / per_sample).sum())
    gain = 1.0 - equalised / float(np.exp(shrunk).max())
    timed = step[np.isfinite(step) & (step > 0)] if step is not None else step
    if timed is not None and len(timed):
        # the saving, a fraction of the slowest arrival, as a fraction of the measured step
        gain *= min(1.0, float(t.mean(0).max() / timed.mean()))
    return gain, int(np.argmax(shrunk))


DECISIVE_CONFIDENCE = 0.999
"""One-sided confidence of the bound a change must pass to be followed after one interval (the
serial one of `shrunk_mean` on the steps after the change). Not a setting: a change that ought to be
followed at once is several times the threshold, far beyond this bound; the confidence only keeps
runs of correlated noise from passing it (the scan over where the change fell tries every start)."""


def change_start(d: np.ndarray, way: float, min_steps: int = MIN_STEPS) -> int:
    """Where in `d` [n] (log ratios in step order, finite, n >= `min_steps`) a change `way` (+1: up,
    -1: down) most likely starts: the start whose later steps (at least `min_steps`) lie farthest
    that way in standard errors, on steps winsorised at the 10th and 90th percentiles so that one
    paused step does not hide the start."""
    n = len(d)
    x = np.clip(d, *np.percentile(d, [10.0, 90.0])) if n >= 10 else d
    k = np.arange(n, 0, -1, dtype=np.float64)              # tail lengths for starts 0..n-1
    s1, s2 = np.cumsum(x[::-1])[::-1], np.cumsum((x * x)[::-1])[::-1]
    mean = s1 / k
    var = np.maximum(s2 - k * mean * mean, 0.0) / np.maximum(k - 1.0, 1.0)
    starts = np.arange(max(1, n - min_steps + 1))
    z = way * mean[starts] / np.sqrt(np.maximum(var[starts], 1e-300) / k[starts])
    return int(starts[int(np.argmax(z))])


def decisive_change(d: np.ndarray, threshold: float, factor: float, share: float,
                    min_steps: int = MIN_STEPS) -> int | None:
    """Where in one interval's log ratios `d` [n] (a rank's arrivals over its line's prediction, in
    step order) a change of speed starts that is decisive on its own, or None. The change may fall
    anywhere in the interval: the start is the one whose later steps (at least `min_steps`) are
    farthest from the line in standard errors. It is decisive where those steps (the tail) are
    off the line the same way by a median of more than `factor` x `threshold`, at least `share` of
    them by more than `threshold` (a pause of a few steps, however long, moves neither), and the
    tail's mean, its outlying steps clipped, is beyond `threshold` at the serial bound of
    `DECISIVE_CONFIDENCE` (correlated steps counted as fewer). `threshold`: the log ratio a change must exceed (``CostConfig.shift_threshold``)."""
    d = np.asarray(d, dtype=np.float64)
    if len(d) < min_steps or not np.isfinite(d).all():
        return None
    for way in (1.0, -1.0):                                 # slower, faster
        tau = change_start(d, way, min_steps)
        tail = d[tau:] * way
        middle = float(np.median(tail))
        if middle <= factor * threshold or np.mean(tail > threshold) < share:
            continue
        # the bound on the tail's mean, its pauses clipped to 3 robust standard deviations
        spread = 1.4826 * float(np.median(np.abs(tail - middle)))
        if spread > 0:
            tail = np.clip(tail, middle - 3.0 * spread, middle + 3.0 * spread)
        if float(shrunk_mean(tail[:, None], DECISIVE_CONFIDENCE)[0]) > threshold:
            return tau
    return None
