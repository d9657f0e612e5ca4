"""Statistical-efficiency signals: gradient noise scale, AdaScale gain, Pollux efficiency, loss trend.

Pure maths on numbers the data plane already has (torch/numpy only; never imports MPI or Horovod).
Notation: rank i holds a local batch of ``b_i`` samples, ``B = sum(b_i)``; ``|g_i|^2`` is the squared
norm of rank i's *local mean* gradient, ``|G_B|^2`` that of the *global mean* gradient. Estimators
(McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"), unbiased for each rank:

    |G|^2  ~ (B |G_B|^2 - b_i |g_i|^2) / (B - b_i)
    tr(S)  ~ (|g_i|^2 - |G_B|^2) / (1/b_i - 1/B)

Ranks are combined by a ratio of sums (see :func:`pooled_estimate`). Everything is linear in the
squared norms, so per-layer estimates (one column per parameter segment) sum to the total.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Optional, Sequence, Union

import numpy as np

from .. import validate

ArrayLike = Union[float, Sequence[float], np.ndarray]


def _finite_array(name: str, value: ArrayLike, *, nonneg: bool = False) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    bad = ~np.isfinite(arr) | ((arr < 0) if nonneg else False)
    if np.any(bad):
        first = float(arr.flat[int(np.argmax(bad))])
        need = "finite and >= 0" if nonneg else "finite"
        raise ValueError(f"{name} must be {need}, got {name}={first!r}")
    return arr


def _positive(name: str, value: ArrayLike) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    bad = ~(np.isfinite(arr) & (arr > 0))
    if np.any(bad):
        raise ValueError(f"{name} must be finite and > 0, got {name}={float(arr.flat[int(np.argmax(bad))])!r}")
    return arr


@dataclass(frozen=True)
class NoiseEstimate:
    """Unbiased estimates of |G|^2 (true-gradient squared norm) and tr(Sigma) (per-sample gradient
    covariance trace); floats, or arrays with one entry per layer."""

    grad_sq: Union[float, np.ndarray]
    trace_sigma: Union[float, np.ndarray]
    ranks_used: int


def rank_estimate(b: int, B: int, local_sq: ArrayLike, global_sq: ArrayLike) -> Optional[NoiseEstimate]:
    """One rank's unbiased estimate; ``None`` when ``b == B`` (a single contributing rank: the two
    gradients coincide, so there is no small/large pair) or ``b == 0`` (the rank saw no data)."""
    if int(b) != b or int(B) != B or b < 0 or B <= 0 or b > B:
        raise ValueError(f"need integers 0 <= b <= B, B > 0; got b={b!r}, B={B!r}")
    g_small = _finite_array("local_sq", local_sq, nonneg=True)
    g_big = _finite_array("global_sq", global_sq, nonneg=True)
    if b == 0 or b == B:
        return None
    grad_sq = (B * g_big - b * g_small) / (B - b)
    trace = (g_small - g_big) / (1.0 / b - 1.0 / B)
    return NoiseEstimate(_scalar(grad_sq), _scalar(trace), 1)


def pooled_estimate(local_batches: Sequence[int], local_sq: ArrayLike,
                    global_sq: ArrayLike) -> Optional[NoiseEstimate]:
    """Combine the per-rank estimates of all ranks (``local_sq`` shape (R,) or (R, L)).

    Choice: a ratio of sums, i.e. each rank's estimate weighted by its estimator's denominator,
    ``w_i ~ 1/b_i - 1/B`` for tr(Sigma) and ``w_i ~ B - b_i`` for |G|^2. It equals the plain
    average (AdaptDL, McCandlish) when all b_i are equal, stays unbiased for any b_i, gives a rank
    with b_i close to B (tiny denominator, exploding estimate) almost no weight, and is the
    inverse-variance weighting when the cross term 2 G.noise dominates (per-rank variances are then
    ~ 1/(1/b_i - 1/B) and ~ 1/(B - b_i); correlation between ranks ignored). Ranks with b_i == 0
    are left out; ``None`` when no rank has 0 < b_i < B. ``B = sum(local_batches)``.
    """
    b = np.asarray(local_batches)
    if b.ndim != 1 or b.size == 0 or b.dtype.kind not in "iu" or (b < 0).any():
        raise ValueError(f"local_batches must be a non-empty 1-D sequence of ints >= 0, got {local_batches!r}")
    g_small = np.asarray(local_sq, dtype=np.float64)
    g_big = np.asarray(global_sq, dtype=np.float64)
    for name, arr in (("local_sq", g_small), ("global_sq", g_big)):
        if not ((arr >= 0).all() and (arr < np.inf).all()):  # NaN fails both
            _finite_array(name, arr, nonneg=True)
    if g_small.shape[:1] != b.shape or g_small.shape[1:] != g_big.shape:
        raise ValueError(f"local_sq shape {g_small.shape} must be (R,)+global_sq.shape with R={b.size}, "
                         f"global_sq shape {g_big.shape}")
    B = int(b.sum())
    use = (b > 0) & (b < B)
    k = int(use.sum())
    if k == 0:
        return None
    bu = b[use].astype(np.float64)
    gs = g_small[use]
    trace = (gs.sum(axis=0) - k * g_big) / ((1.0 / bu).sum() - k / B)
    grad_sq = (k * B * g_big - np.tensordot(bu, gs, axes=1)) / (k * B - bu.sum())
    return NoiseEstimate(_scalar(grad_sq), _scalar(trace), k)


def _scalar(x: np.ndarray) -> Union[float, np.ndarray]:
    return float(x) if np.ndim(x) == 0 else np.asarray(x)


class BiasCorrectedEMA:
    """Exponential moving average with Adam's start-up correction: after t updates the value is
    ``m_t / (1 - beta^t)``, a weighted mean of the inputs whose weights sum to one (so the EMA of
    unbiased estimates stays unbiased). Works on floats or same-shaped arrays."""

    def __init__(self, beta: float) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta={beta!r} must be in [0, 1)")
        self.beta = beta
        self.count = 0
        self._m: Optional[np.ndarray] = None

    def update(self, x: ArrayLike) -> None:
        x = np.asarray(x, dtype=np.float64)
        if self._m is None:
            self._m = np.zeros_like(x)
        elif self._m.shape != x.shape:
            raise ValueError(f"EMA input shape {x.shape} differs from earlier shape {self._m.shape}")
        self._m = self.beta * self._m + (1.0 - self.beta) * x
        self.count += 1

    def update_many(self, xs: ArrayLike) -> None:
        """Same as calling :meth:`update` on ``xs[0], xs[1], ...`` in order, in one vectorised step."""
        xs = np.asarray(xs, dtype=np.float64)
        if len(xs) == 0:
            return
        if self._m is None:
            self._m = np.zeros_like(xs[0])
        elif self._m.shape != xs.shape[1:]:
            raise ValueError(f"EMA input shape {xs.shape[1:]} differs from earlier shape {self._m.shape}")
        w = (1.0 - self.beta) * self.beta ** np.arange(len(xs) - 1, -1, -1, dtype=np.float64)
        self._m = self.beta ** len(xs) * self._m + np.tensordot(w, xs, axes=1)
        self.count += len(xs)

    @property
    def value(self) -> Union[float, np.ndarray]:
        """Corrected average; NaN before the first update."""
        if self._m is None:
            return math.nan
        return _scalar(self._m / (1.0 - self.beta ** self.count))


def noise_scale(trace_sigma: ArrayLike, grad_sq: ArrayLike, max_value: float = 1e12) -> Union[float, np.ndarray]:
    """B_simple = tr(Sigma)/|G|^2 from smoothed estimates, clipped to [0, max_value]: a negative
    trace (estimation noise) gives 0, |G|^2 <= 0 (no detectable signal) gives ``max_value``."""
    tr = _finite_array("trace_sigma", trace_sigma)
    g2 = _finite_array("grad_sq", grad_sq)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(g2 > 0, np.maximum(tr, 0.0) / np.where(g2 > 0, g2, 1.0), max_value)
    return _scalar(np.minimum(out, max_value))


def adascale_gain(trace_sigma: float, grad_sq: float, batch: ArrayLike, base_batch: float) -> Union[float, np.ndarray]:
    """AdaScale gain r(B) = (tr/B0 + |G|^2) / (tr/B + |G|^2), vectorised over ``batch``; in
    [1, B/B0] for B >= B0. ``r = 1`` when both statistics are 0 (no gradient: nothing to gain)."""
    tr = float(_finite_array("trace_sigma", trace_sigma, nonneg=True))
    g2 = float(_finite_array("grad_sq", grad_sq, nonneg=True))
    bs = _positive("batch", batch)
    b0 = float(_positive("base_batch", base_batch))
    if tr == 0.0 and g2 == 0.0:
        return _scalar(np.ones_like(bs))
    return _scalar((tr / b0 + g2) / (tr / bs + g2))


def statistical_efficiency(noise: float, batch: ArrayLike, base_batch: float, *,
                           unknown: str = "raise") -> Union[float, np.ndarray]:
    """Pollux's statistical efficiency E(B) = (phi + B0) / (phi + B), phi the gradient noise scale:
    progress per sample at global batch B relative to the base batch B0. The one implementation:
    the estimator (`GradientStatistics.efficiency_at`), the proposal's goodput and the reward use it.

    * ``batch``: a scalar (a float comes back) or an array (an array of its shape comes back).
    * B = B0 gives 1; B < B0 gives more than 1 (at most (phi + B0) / phi), not clipped: a smaller batch
      makes more progress per sample; B > B0 falls towards B0 / B as B outgrows phi.
    * phi = +inf gives 1 everywhere (noise dominates: every sample counts fully); phi = 0 gives B0 / B.
    * phi unknown (NaN, negative, -inf), by `unknown`: ``"raise"`` (ValueError naming it), ``"no_gain"``
      (taken as phi = 0: B0 / B, a larger batch makes no more progress per step than B0) or ``"one"``
      (1 everywhere: no statistic yet, every sample counts fully).
    * ``base_batch`` must be finite and > 0 (ValueError). Batch entries that are not finite and > 0:
      ValueError with ``"raise"``, 1 with ``"one"``, NaN with ``"no_gain"``.
    """
    if unknown not in ("raise", "no_gain", "one"):
        raise ValueError(f"unknown={unknown!r}: choose raise, no_gain or one")
    phi = float(np.asarray(noise, dtype=np.float64))
    b0 = float(_positive("base_batch", base_batch))
    if unknown == "raise":
        if math.isnan(phi) or phi < 0:
            raise ValueError(f"noise scale phi must be >= 0 (inf allowed), got phi={noise!r}")
        bs = _positive("batch", batch)
    else:
        bs = np.asarray(batch, dtype=np.float64)
    valid = np.isfinite(bs) & (bs > 0)
    if math.isnan(phi) or phi < 0:
        if unknown == "one":
            return _scalar(np.ones_like(bs))
        phi = 0.0
    if math.isinf(phi):
        out = np.ones_like(bs)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            out = (phi + b0) / (phi + bs)
    if not valid.all():
        out = np.where(valid, out, 1.0 if unknown == "one" else math.nan)
    return _scalar(out)


def batch_at_efficiency(noise: float, efficiency: float, base_batch: float) -> float:
    """The largest global batch B whose statistical efficiency E(B) (see `statistical_efficiency`)
    is at least `efficiency` e: B = (phi + B0) / e - phi, written B0 / e + phi (1 - e) / e (exact for
    a large phi). +inf where phi is +inf or e is at most 0 (every batch qualifies); phi unknown (NaN,
    negative) is taken as 0, as ``"no_gain"`` does (B0 / e). e must be a number at most 1 and
    ``base_batch`` > 0 (ValueError otherwise)."""
    e = float(efficiency)
    if not e <= 1:
        raise ValueError(f"efficiency={efficiency!r}; give a number at most 1")
    b0 = float(_positive("base_batch", base_batch))
    phi = float(noise)
    if math.isnan(phi) or phi < 0:
        phi = 0.0
    if e <= 0 or math.isinf(phi):
        return math.inf
    return b0 / e + phi * (1 - e) / e


class LossStatistics:
    """Loss over a sliding window: mean, sample variance, least-squares slope per step, plus a
    bias-corrected EMA over the whole run. Non-finite losses are counted and ignored."""

    def __init__(self, window: int = 50, ema_beta: float = 0.9) -> None:
        if window < 2:
            raise ValueError(f"loss window={window!r} must be >= 2")
        self.window: Deque[float] = deque(maxlen=window)
        self.ema = BiasCorrectedEMA(ema_beta)
        self.nonfinite = 0

    def update(self, loss: float) -> None:
        loss = float(loss)
        if not math.isfinite(loss):
            self.nonfinite += 1
            return
        self.window.append(loss)
        self.ema.update(loss)

    def stats(self) -> Dict[str, float]:
        """``loss_last, loss_mean, loss_std, loss_slope, loss_rel_change, loss_ema`` (NaN if unknown)."""
        y = np.asarray(self.window, dtype=np.float64)
        nan = math.nan
        if y.size == 0:
            return dict(loss_last=nan, loss_mean=nan, loss_std=nan, loss_slope=nan, loss_rel_change=nan, loss_ema=nan)
        mean = float(y.mean())
        std, slope = nan, nan
        if y.size >= 2:
            std = float(y.std(ddof=1))
            x = np.arange(y.size, dtype=np.float64) - (y.size - 1) / 2.0
            slope = float(np.dot(x, y - mean) / np.dot(x, x))
        rel = slope * (y.size - 1) / abs(mean) if mean != 0 and y.size >= 2 else nan
        return dict(loss_last=float(y[-1]), loss_mean=mean, loss_std=std, loss_slope=slope,
                    loss_rel_change=rel, loss_ema=float(self.ema.value))


@dataclass(frozen=True)
class StatsConfig:
    """Settings of :class:`GradientStatistics`."""

    ema_beta: float = 0.99
    """Smoothing of tr(Sigma) and |G|^2 (separately, then divided); memory ~1/(1-beta) steps. One
    step's estimate is very noisy (~75% relative std with 3 ranks), so ~100 steps give
    ~10%; lower it only if the noise scale moves faster than that."""
    base_batch: Optional[int] = None
    """B0 of the efficiency E(B) and of `snapshot`'s gain; None = the first global batch seen (the
    initial batch). (The gain the controller applies is over the optimizer's ``base_batch_size``, see
    `DecisionCore.base_batch`.)"""
    max_noise_scale: float = 1e12
    """Cap for B_noise when |G|^2 is not (yet) detectably positive."""
    loss_window: int = 50
    """Steps in the sliding window of loss mean/std/slope."""
    loss_ema_beta: float = 0.9
    """Smoothing of the whole-run loss EMA."""
    per_layer: bool = True
    """Keep per-layer (per-segment) EMAs when local_sq has a layer axis."""
    noise_z: float = 1.0
    """Width, in standard errors, of the lower confidence bound on the noise scale that the decision
    core hands to policies and the reward (``noise="lower"``)."""

    def __post_init__(self) -> None:
        for name in ("ema_beta", "loss_ema_beta"):
            validate.number(f"StatsConfig.{name}", getattr(self, name), 0.0, below=1.0, what="a number in [0, 1)")
        if self.base_batch is not None:
            validate.integer("StatsConfig.base_batch", self.base_batch, 1, what="None or an integer >= 1")
        validate.number("StatsConfig.max_noise_scale", self.max_noise_scale, above=0)
        validate.integer("StatsConfig.loss_window", self.loss_window, 2)
        validate.boolean("StatsConfig.per_layer", self.per_layer)
        validate.number("StatsConfig.noise_z", self.noise_z, 0)


#: Keys of :meth:`GradientStatistics.snapshot`, all floats; NaN until the quantity is known.
SNAPSHOT_FIELDS: Dict[str, str] = {
    "steps": "steps recorded (update()/record()) with finite norms and some data",
    "gns_steps": "steps that produced a noise estimate (some rank with 0 < b_i < B)",
    "skipped_nonfinite": "steps ignored because a squared norm was NaN/Inf (or not taken on that step)",
    "global_batch": "B = sum(b_i) of the last step",
    "base_batch": "B0 used for gain and efficiency",
    "grad_sq_global": "last measured |G_B|^2 (biased upward by tr(Sigma)/B)",
    "grad_sq": "smoothed unbiased |G|^2",
    "trace_sigma": "smoothed unbiased tr(Sigma) (sum of per-sample gradient variances)",
    "b_noise": "B_simple = trace_sigma/grad_sq, clipped to [0, max_noise_scale]",
    "log10_b_noise": "log10(1 + b_noise), a bounded feature",
    "efficiency": "Pollux E(B) = (b_noise + B0)/(b_noise + B) at the last B",
    "adascale_gain": "AdaScale r(B) at the last B (the LR multiplier AdaScale would use)",
    "layer_b_noise_min": "smallest per-layer B_simple",
    "layer_b_noise_median": "median per-layer B_simple",
    "layer_b_noise_max": "largest per-layer B_simple",
    "loss_last": "last finite loss",
    "loss_mean": "loss mean over the window",
    "loss_std": "loss sample std over the window",
    "loss_slope": "least-squares loss slope per step over the window",
    "loss_rel_change": "loss_slope * (window length - 1) / |loss_mean| (about -0.1 = 10% drop)",
    "loss_ema": "bias-corrected loss EMA over the run",
}


_EMAS = ("_grad_sq", "_trace", "_layer_grad_sq", "_layer_trace", "_grad_sq_sq", "_trace_sq")


def _ema_state(ema: BiasCorrectedEMA) -> Dict[str, object]:
    """An EMA as plain values: its raw mean (None, a float, or a list per layer) and update count."""
    return {"m": None if ema._m is None else ema._m.tolist(), "count": ema.count}


def _load_ema(ema: BiasCorrectedEMA, state: Dict[str, object]) -> None:
    m = state["m"]
    ema._m = None if m is None else np.asarray(m, dtype=np.float64)
    ema.count = int(state["count"])  # type: ignore[arg-type]


@dataclass
class GradientStatistics:
    """Accumulates the per-step statistics the batch-size controller reads via :meth:`snapshot`."""

    config: StatsConfig = field(default_factory=StatsConfig)

    def __post_init__(self) -> None:
        self._grad_sq = BiasCorrectedEMA(self.config.ema_beta)
        self._trace = BiasCorrectedEMA(self.config.ema_beta)
        self._layer_grad_sq = BiasCorrectedEMA(self.config.ema_beta)
        self._layer_trace = BiasCorrectedEMA(self.config.ema_beta)
        # second moments of the per-step estimates, for the standard errors of the two EMAs
        self._grad_sq_sq = BiasCorrectedEMA(self.config.ema_beta)
        self._trace_sq = BiasCorrectedEMA(self.config.ema_beta)
        self.loss = LossStatistics(self.config.loss_window, self.config.loss_ema_beta)
        self.steps = 0
        self.skipped_nonfinite = 0
        self.global_batch = math.nan
        self.base_batch = float(self.config.base_batch) if self.config.base_batch else math.nan
        self.grad_sq_global = math.nan
        self._pending: list = []

    def record(self, local_batches: Sequence[int], local_sq: ArrayLike, global_sq: ArrayLike,
               loss: Optional[float] = None) -> None:
        """Per-step hot path, O(1): store (a copy of) the step; estimates are computed in bulk,
        vectorised over steps, on the next read. Arguments as in :meth:`update`; errors surface on
        that read. Results equal calling :meth:`update` per step."""
        self._pending.append((tuple(local_batches), np.array(local_sq, dtype=np.float64),
                              np.array(global_sq, dtype=np.float64), loss))
        if len(self._pending) >= 4096:  # bound memory when nobody reads for a long time
            self._flush()

    def record_many(self, local_batches: ArrayLike, local_sq: ArrayLike, global_sq: ArrayLike,
                    losses: Optional[ArrayLike] = None) -> None:
        """Many steps at once, rows in step order: ``local_batches`` [T, R], ``local_sq`` [T, R] or
        [T, R, L], ``global_sq`` [T] or [T, L], ``losses`` [T] (NaN: no loss that step). The same as
        :meth:`record` per step, without a Python call per step."""
        b = np.asarray(local_batches, dtype=np.int64)
        ls, gs = np.asarray(local_sq, dtype=np.float64), np.asarray(global_sq, dtype=np.float64)
        values = None if losses is None else np.asarray(losses, dtype=np.float64)
        if (b.ndim != 2 or ls.shape[:2] != b.shape or gs.ndim == 0 or len(gs) != len(b)
                or (values is not None and values.shape != (len(b),))):
            raise ValueError(f"record_many: local_batches {b.shape}, local_sq {ls.shape}, global_sq {gs.shape}"
                             f"{'' if values is None else f', losses {values.shape}'}; need [T, R], [T, R(, L)], "
                             "[T(, L)] and [T]")
        self._flush()
        if values is not None:
            for v in values[~np.isnan(values)].tolist():
                self.loss.update(v)
        starts = [0, *(np.flatnonzero((b[1:] != b[:-1]).any(1)) + 1).tolist(), len(b)]
        for i, j in zip(starts, starts[1:]):  # runs of steps with the same batch sizes
            self._ingest(tuple(b[i].tolist()), ls[i:j], gs[i:j])

    def update(self, local_batches: Sequence[int], local_sq: ArrayLike, global_sq: ArrayLike,
               loss: Optional[float] = None) -> Optional[NoiseEstimate]:
        """Add one step now. ``local_sq[i]``: squared norm(s) of rank i's local *mean* gradient, shape
        (R,) or (R, L) per layer; ``global_sq``: of the global mean gradient, shape () or (L,).
        Returns the step's pooled estimate (None if no rank has 0 < b_i < B, or the step was
        skipped: NaN/Inf norms, or sum(b_i) == 0)."""
        self.record(local_batches, local_sq, global_sq, loss)
        return self._flush()

    def _flush(self) -> Optional[NoiseEstimate]:
        pending, self._pending = self._pending, []
        for p in pending:
            if p[3] is not None:
                self.loss.update(p[3])
        last, i = None, 0
        while i < len(pending):  # runs of steps with the same batch sizes and shapes
            key = (pending[i][0], np.shape(pending[i][1]))
            j = i + 1
            while j < len(pending) and (pending[j][0], np.shape(pending[j][1])) == key:
                j += 1
            run = pending[i:j]
            last = self._ingest(key[0], np.array([p[1] for p in run], dtype=np.float64),
                                np.array([p[2] for p in run], dtype=np.float64))
            i = j
        return last

    def _ingest(self, b: Sequence[int], ls: np.ndarray, gs: np.ndarray) -> Optional[NoiseEstimate]:
        """``ls``: (T, R[, L]), ``gs``: (T[, L]) for T steps with the same batch sizes ``b``."""
        t = len(ls)
        finite = np.isfinite(ls.reshape(t, -1)).all(1) & np.isfinite(gs.reshape(t, -1)).all(1)
        self.skipped_nonfinite += int(t - finite.sum())
        ls, gs = ls[finite], gs[finite]
        if len(ls) == 0:
            return None
        est = pooled_estimate(b, np.moveaxis(ls, 1, 0), gs)
        if sum(b) == 0:  # nobody had data
            return None
        self.steps += len(ls)
        self.global_batch = float(sum(b))
        if math.isnan(self.base_batch):
            self.base_batch = self.global_batch
        self.grad_sq_global = float(np.sum(gs[-1]))
        if est is None:
            return None
        g2, tr = np.asarray(est.grad_sq), np.asarray(est.trace_sigma)
        g2_steps, tr_steps = g2.reshape(len(ls), -1).sum(1), tr.reshape(len(ls), -1).sum(1)
        self._grad_sq.update_many(g2_steps)
        self._trace.update_many(tr_steps)
        self._grad_sq_sq.update_many(g2_steps ** 2)
        self._trace_sq.update_many(tr_steps ** 2)
        if self.config.per_layer and gs.ndim == 2:
            if self._layer_trace.count and np.shape(self._layer_trace.value) != gs.shape[1:]:
                self._layer_grad_sq = BiasCorrectedEMA(self.config.ema_beta)  # layer set changed
                self._layer_trace = BiasCorrectedEMA(self.config.ema_beta)
            self._layer_grad_sq.update_many(g2)
            self._layer_trace.update_many(tr)
        return NoiseEstimate(_scalar(g2[-1]), _scalar(tr[-1]), est.ranks_used)

    def state_dict(self) -> Dict[str, object]:
        """Plain state for checkpoints (numbers and lists only; the config is not included)."""
        self._flush()
        emas = {k: _ema_state(getattr(self, k)) for k in _EMAS}
        return dict(emas=emas, loss_window=list(self.loss.window), loss_ema=_ema_state(self.loss.ema),
                    loss_nonfinite=self.loss.nonfinite,
                    counters=[self.steps, self.skipped_nonfinite, self.global_batch, self.base_batch,
                              self.grad_sq_global])

    def load_state_dict(self, state: Dict[str, object]) -> None:
        for k, ema in state["emas"].items():  # type: ignore[attr-defined]
            if k not in _EMAS:
                raise ValueError(f"unknown statistic {k!r} in a GradientStatistics state (known: {_EMAS})")
            _load_ema(getattr(self, k), ema)
        self.loss.window.clear()
        self.loss.window.extend(float(x) for x in state["loss_window"])  # type: ignore[attr-defined]
        _load_ema(self.loss.ema, state["loss_ema"])  # type: ignore[arg-type]
        self.loss.nonfinite = int(state.get("loss_nonfinite", 0))  # type: ignore[attr-defined, arg-type]
        steps, skipped, global_batch, base_batch, grad_sq_global = state["counters"]  # type: ignore[misc]
        self.steps, self.skipped_nonfinite = int(steps), int(skipped)
        self.global_batch, self.base_batch, self.grad_sq_global = float(global_batch), float(base_batch), \
            float(grad_sq_global)
        self._pending = []

    @property
    def noise_scale(self) -> float:
        """Current B_simple (NaN before the first estimate)."""
        self._flush()
        if self._trace.count == 0:
            return math.nan
        return float(noise_scale(self._trace.value, self._grad_sq.value, self.config.max_noise_scale))

    def _standard_error(self, ema: BiasCorrectedEMA, ema_sq: BiasCorrectedEMA) -> float:
        """Standard error of a bias-corrected EMA of per-step estimates, from their EMA variance and
        the EMA weights (sum w^2 / (sum w)^2 = (1-b)(1+b^t) / ((1+b)(1-b^t)) after t updates; steps
        treated as independent). Infinite while the second moment is unknown (state from an older
        checkpoint) or rests on one estimate (whose spread says nothing)."""
        if ema_sq.count == 0 or ema.count < 2:
            return math.inf
        beta, t = ema.beta, ema.count
        var = max(0.0, float(ema_sq.value) - float(ema.value) ** 2)
        share = (1 - beta) * (1 + beta ** t) / ((1 + beta) * (1 - beta ** t)) if beta > 0 else 1.0 / t
        return math.sqrt(var * share)

    def noise_scale_interval(self, z: float = 1.0) -> tuple[float, float, float]:
        """(lower, point, upper) estimate of B_noise, continuous in the statistics (no 0/cap jump when
        the |G|^2 average crosses 0): with s_T, s_G the standard errors of tr(Sigma) and |G|^2,

            lower = max(0, tr - z s_T) / max(|G|^2 + z s_G, s_G)
            point = max(0, tr)         / max(|G|^2, s_G)
            upper = (tr + z s_T)       / (|G|^2 - z s_G)     (the cap when that is <= 0)

        all clipped to max_noise_scale; NaN before the first estimate; (0, the plain ratio, the cap)
        while no standard error is known (one estimate). `noise_scale` keeps its
        original definition (the PPO features and the shipped policy's reproduction depend on it)."""
        validate.number("z", z, 0)
        self._flush()
        if self._trace.count == 0:
            return math.nan, math.nan, math.nan
        tr, g2 = float(self._trace.value), float(self._grad_sq.value)
        s_t = self._standard_error(self._trace, self._trace_sq)
        s_g = self._standard_error(self._grad_sq, self._grad_sq_sq)
        cap = self.config.max_noise_scale
        if not math.isfinite(s_g):  # no variance known: the plain ratio, bounded by nothing
            return 0.0, float(noise_scale(tr, g2, cap)), cap

        def ratio(num: float, den: float) -> float:
            return min(cap, max(0.0, num) / den) if den > 0 else (cap if num > 0 else 0.0)

        lower = ratio(tr - z * s_t, max(g2 + z * s_g, s_g))
        point = ratio(tr, max(g2, s_g))
        upper = ratio(tr + z * s_t, g2 - z * s_g) if g2 - z * s_g > 0 else cap
        return lower, point, max(upper, point)

    def efficiency_at(self, batch: ArrayLike) -> Union[float, np.ndarray]:
        """Pollux efficiency for candidate global batch size(s) (NaN before the first estimate)."""
        self._flush()
        if self._trace.count == 0:
            return _scalar(np.full(np.shape(batch), math.nan))
        return statistical_efficiency(self.noise_scale, batch, self.base_batch)

    def gain_at(self, batch: ArrayLike, base_batch: float | None = None) -> Union[float, np.ndarray]:
        """AdaScale gain for candidate global batch size(s) over `base_batch` (default: the estimator's),
        using max(0, .) of the estimates (per-sample statistics: any base is valid)."""
        self._flush()
        if self._trace.count == 0:
            return _scalar(np.full(np.shape(batch), math.nan))
        tr, g2 = max(0.0, float(self._trace.value)), max(0.0, float(self._grad_sq.value))
        return adascale_gain(tr, g2, batch, self.base_batch if base_batch is None else base_batch)

    def layer_table(self) -> Dict[str, np.ndarray]:
        """Per-layer smoothed ``grad_sq``, ``trace_sigma`` (the layer's gradient variance) and ``b_noise``."""
        self._flush()
        if self._layer_trace.count == 0:
            return {}
        tr, g2 = np.asarray(self._layer_trace.value), np.asarray(self._layer_grad_sq.value)
        return dict(grad_sq=g2, trace_sigma=tr, b_noise=np.asarray(noise_scale(tr, g2, self.config.max_noise_scale)))

    def snapshot(self) -> Dict[str, float]:
        """Controller features; see :data:`SNAPSHOT_FIELDS` for the meaning of each key."""
        self._flush()
        nan = math.nan
        b_noise = self.noise_scale
        layers = self.layer_table().get("b_noise", np.zeros(0))
        snap = dict(
            steps=float(self.steps), gns_steps=float(self._trace.count),
            skipped_nonfinite=float(self.skipped_nonfinite), global_batch=self.global_batch,
            base_batch=self.base_batch, grad_sq_global=self.grad_sq_global,
            grad_sq=float(self._grad_sq.value), trace_sigma=float(self._trace.value), b_noise=b_noise,
            log10_b_noise=math.log10(1.0 + b_noise) if not math.isnan(b_noise) else nan,
            efficiency=float(self.efficiency_at(self.global_batch)) if not math.isnan(b_noise) else nan,
            adascale_gain=float(self.gain_at(self.global_batch)) if not math.isnan(b_noise) else nan,
            layer_b_noise_min=float(layers.min()) if layers.size else nan,
            layer_b_noise_median=float(np.median(layers)) if layers.size else nan,
            layer_b_noise_max=float(layers.max()) if layers.size else nan,
        )
        snap.update(self.loss.stats())
        return snap
