"""The online check of a batch growth: does the larger global batch train faster than the initial one did?

The proposal grows B where its model predicts more progress per second (goodput). The model can be
wrong where it matters most: the noise scale, AdaScale's gain under momentum or Adam, a throughput
gain that the machine does not deliver. So once B has grown past the job's initial batch the
measured training loss is compared with what the initial batch was making, in wall time.

The check is stated in training seconds, not in decision intervals, so that it asks the same of a
growth whether the controller decides every second or every minute:

- reference: the intervals run at the initial batch in the latest `span` of the training time so
  far (at least the last `window`), their mean training loss against log(seconds), fitted by a line
  (diminishing returns; the extrapolation credits the initial batch with continued progress, so the
  check errs towards returning). Each interval's mean carries its own noise, from the scatter of its
  per-step losses (successive differences, which a slow trend hardly moves), and the fit weighs the
  intervals by it; where the means scatter around the line more than that noise explains (the line
  is a poor model, or the steps are correlated) the variance is scaled up by the excess;
- verdict: B holds while a growth is judged (one change at a time, as a split is judged); after
  the growth has run `settle` intervals and `settle_frac` of the time before it,
  the judged intervals' losses are compared with the line at their times: their inverse-variance
  weighted mean excess must stay within `z` standard deviations (the judged means' noise and the
  line's extrapolation, floored at `min_rel` of the loss). It is looked at as the judged time
  doubles (an eighth, a quarter, a half and all of `judge_frac` of the reference's span, and at
  least `judged` intervals), so short intervals do not buy more looks at the noise, and a look with
  a share f of that evidence asks for z / sqrt(f) (O'Brien-Fleming's boundary: all the looks
  together return a level growth about as rarely as one at the end). A failed look
  returns B to the initial batch, and growth stays off for the rest of the job (`banned`); passing
  the last one accepts the growth.

With a training budget the proposal starts a growth only where the verdict can come before the
budget ends (:meth:`GrowthCheck.verdict_seconds`, the settling and judging time at the earliest):
a growth late in the job would otherwise run unjudged to its end.

An interval with too few per-step losses borrows the measured intervals' noise per second of
training; where none has them (a hand-built input: means only), all are weighed alike, their noise
taken from the reference's scatter around the line. Growth is not allowed before the
reference exists (without losses, ``controller.record_loss``, there is none, and B never grows past
the initial batch). Pure: no MPI, no Horovod.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from .state import RankReport
from .. import validate


@dataclass(frozen=True)
class GrowthConfig:
    """Settings of the growth check (:class:`GrowthCheck`)."""

    window: int = 4
    """Fewest intervals at the initial batch the reference line is fitted on (the most recent)."""
    span: float = 0.5
    """The reference also holds every interval at the initial batch that began within this fraction
    of the training time so far, counted back from now."""
    max_reference: int = 256
    """Most intervals the reference (and the judged intervals) keep apart; beyond, the two neighbours
    of the shortest joint length are merged into one, so many short intervals still span the same time."""
    settle: int = 1
    """Intervals after the growth that are not judged (the LR rises with B; the loss adjusts), and
    at least `settle_frac` of the time."""
    settle_frac: float = 0.05
    """Training time after the growth that is not judged, as a fraction of the time before it (and
    at least `settle` intervals)."""
    judged: int = 3
    """Fewest intervals judged before a growth is accepted (and at least `judge_frac` of the time)."""
    judge_frac: float = 0.5
    """Training time judged before a growth is accepted, as a fraction of the reference's span (and at
    least `judged` intervals)."""
    z: float = 2.5
    """Tolerance in standard deviations of the excess loss at the last look (one-sided, about 0.6% per
    look where the line and the noise are right; a short reference, the cadence's first intervals of
    a few dozen steps, is less right than that)."""
    min_rel: float = 0.005
    """Floor of the excess loss's standard deviation, as a fraction of the loss."""

    def __post_init__(self) -> None:
        for name in ("window", "max_reference"):
            validate.integer(f"GrowthConfig.{name}", getattr(self, name), 1)
        for name in ("settle", "judged"):
            validate.integer(f"GrowthConfig.{name}", getattr(self, name), 0)
        validate.number("GrowthConfig.span", self.span, 0, maximum=1, what="a fraction in [0, 1]")
        validate.number("GrowthConfig.settle_frac", self.settle_frac, 0)
        validate.number("GrowthConfig.judge_frac", self.judge_frac, 0)
        validate.number("GrowthConfig.z", self.z, above=0)
        validate.number("GrowthConfig.min_rel", self.min_rel, 0)


def _setting(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"`GrowthConfig.{name}` of this check.")


@dataclass
class GrowthCheck:
    """The check's state; its settings are `config` (read through the same names: ``check.z``)."""

    config: GrowthConfig = field(default_factory=GrowthConfig)
    """The check's settings."""
    elapsed_s: float = 0.0
    reference: list[tuple[float, float, float, float]] = field(default_factory=list)
    """(mid-interval seconds, mean loss, variance of that mean (NaN: unknown), interval seconds) at
    the initial batch."""
    trial: list[tuple[float, float, float, float]] = field(default_factory=list)
    """The same for the intervals judged in this episode."""
    grown_at_s: float = math.nan
    """Training seconds when the current episode's growth began."""
    grown_for: int = 0
    """Intervals run above the initial batch in the current episode."""
    verdict_intervals: int = 0
    """Intervals judged in the current episode."""
    next_look: float = 0.0
    """Judged seconds at which the next look is due."""
    banned: bool = False
    accepted: bool = False
    last: dict[str, float] = field(default_factory=dict)
    budget_origin: list[float] | None = None
    """(training seconds, budget share done) at the first interval that came with a training budget:
    the origin of the rate at which the budget is spent (a check started late, after an elastic
    reset or mid-job, counts from there)."""

    window = _setting("window")
    span = _setting("span")
    max_reference = _setting("max_reference")
    settle = _setting("settle")
    settle_frac = _setting("settle_frac")
    judged = _setting("judged")
    judge_frac = _setting("judge_frac")
    z = _setting("z")
    min_rel = _setting("min_rel")

    @property
    def ready(self) -> bool:
        """The reference exists: growth may be tried."""
        return self.accepted or len(self.reference) >= min(self.window, 3)

    @property
    def judging(self) -> bool:
        """A growth is under judgement (the proposal holds B meanwhile: one change at a time)."""
        return self.grown_for > 0 and not (self.accepted or self.banned)

    def verdict_seconds(self, interval_s: float | None = None) -> float:
        """Training seconds from a growth that starts now to its last look, at the earliest, with
        decision intervals of `interval_s` seconds (None: the reference's median interval): the
        settling time, then the judged time (at least `judged` intervals)."""
        if interval_s is None:
            interval_s = self.typical_interval_s()
        interval_s = max(float(interval_s), 0.0) if math.isfinite(interval_s) else 0.0
        settle = max(self.settle * interval_s, self.settle_frac * self.elapsed_s)
        return settle + max(self.judge_frac * self.reference_span(), self.judged * interval_s)

    def typical_interval_s(self) -> float:
        """The median length of the reference's intervals in seconds (0 without a reference; merged
        intervals count as one)."""
        return float(np.median([p[3] for p in self.reference])) if self.reference else 0.0

    def seconds_left(self, budget_left: float) -> float:
        """Training seconds the budget still holds at the rate it was spent since `budget_origin`; NaN
        where unknown (no budget, or none of it spent since the origin)."""
        if self.budget_origin is None or not math.isfinite(budget_left):
            return math.nan
        t0, done0 = self.budget_origin
        spent, seconds = (1.0 - budget_left) - done0, self.elapsed_s - t0
        if budget_left <= 0:
            return 0.0
        return seconds * budget_left / spent if spent > 0 and seconds > 0 else math.nan

    def observe(self, reports: Sequence[RankReport], global_batch: int, initial_batch: int,
                step_losses: Sequence[float] | None = None, budget_left: float = math.nan) -> None:
        """One interval's reports (the batch it ran with) and, where known, its per-step losses (the
        sample-weighted mean over ranks, in step order) and the training budget still to run after it:
        advance the clock and judge."""
        seconds = float(np.median([r.step_s * r.steps for r in reports])) if reports else 0.0
        seconds = seconds if math.isfinite(seconds) and seconds > 0 else 0.0
        mid = self.elapsed_s + seconds / 2
        self.elapsed_s += seconds
        if self.budget_origin is None and math.isfinite(budget_left):
            self.budget_origin = [self.elapsed_s, 1.0 - budget_left]
        loss = _mean_loss(reports)
        point = (mid, loss, mean_variance(step_losses), seconds)
        if global_batch <= initial_batch:
            self.grown_for = self.verdict_intervals = 0
            self.trial, self.grown_at_s, self.next_look = [], math.nan, 0.0
            if math.isfinite(loss) and seconds > 0:
                self._add_reference(point)
            return
        if self.grown_for == 0:
            self.grown_at_s = self.elapsed_s - seconds
        self.grown_for += 1
        if self.accepted or self.banned:
            return
        if loss == math.inf:  # diverged at the larger batch
            self.banned = True
            return
        # B holds while judged (the proposal), so the growth is the episode's only rise of B
        settled = self.grown_for > self.settle and mid - self.grown_at_s >= self.settle_frac * max(self.grown_at_s, 0.0)
        if not settled or not math.isfinite(loss) or seconds <= 0 or len(self.reference) < 2:
            return  # nothing to judge with: no verdict either way
        self.trial.append(point)
        judged_n = self.verdict_intervals = self.verdict_intervals + 1
        self.trial = _merged(self.trial, self.max_reference)
        judged_s = sum(p[3] for p in self.trial)
        need_s = self.judge_frac * self.reference_span()
        if self.next_look <= 0:
            self.next_look = max(need_s / 8, 1e-9)
        if judged_s < min(self.next_look, need_s):
            return
        # the share of the evidence a verdict needs that is in; an earlier look asks for more
        # (O'Brien-Fleming: z / sqrt(share)), so the looks together return a level growth about as
        # rarely as one look at the end would
        share = min(judged_s / need_s if need_s > 0 else 1.0, judged_n / max(self.judged, 1), 1.0)
        verdict = self._judge(self.z / math.sqrt(share))
        if verdict is None:  # the line could not be fitted: no verdict either way
            return
        excess, tolerance, predicted = verdict
        self.last = {"loss": loss, "predicted_static": predicted, "excess": excess, "tolerance": tolerance,
                     "t": self.elapsed_s, "judged_s": judged_s, "need_s": need_s}
        while self.next_look <= judged_s:
            self.next_look *= 2
        if excess > tolerance:
            self.banned = True
        elif judged_s >= need_s and judged_n >= self.judged:
            self.accepted = True

    def _add_reference(self, point: tuple[float, float, float, float]) -> None:
        """Append an interval at the initial batch; keep those that began within the latest `span` of
        the run (at least `window`), merging the two neighbours of the shortest joint length while
        more than `max_reference` remain."""
        self.reference.append(point)
        since = self.elapsed_s * (1 - self.span)
        keep = max(self.window, sum(1 for p in self.reference if p[0] - p[3] / 2 >= since))
        self.reference = _merged(self.reference[-keep:], self.max_reference)

    def reference_span(self) -> float:
        """Seconds from the start of the reference's first interval to the growth (or to now)."""
        end = self.grown_at_s if math.isfinite(self.grown_at_s) else self.elapsed_s
        return max(end - (self.reference[0][0] - self.reference[0][3] / 2), 0.0) if self.reference else 0.0

    def _noise(self, points: Sequence[tuple[float, float, float, float]]) -> tuple[np.ndarray, bool]:
        """Variances of the intervals' mean losses: measured, or where an interval's is not (too few
        per-step losses), the measured ones' median per second of training over its seconds; and
        whether any was measured (otherwise all ones: the scale comes from the scatter)."""
        var = np.array([p[2] for p in points])
        secs = np.array([p[3] for p in points])
        known = np.isfinite(var) & (var > 0)
        pool = [p[2] * p[3] for p in (*self.reference, *self.trial) if math.isfinite(p[2]) and p[2] > 0]
        if not pool:
            return np.ones(len(points)), False
        return np.where(known, var, float(np.median(pool)) / np.maximum(secs, 1e-12)), True

    def _line(self) -> tuple[np.ndarray, np.ndarray, float, bool] | None:
        """The reference's weighted line in log seconds: coefficients [intercept, slope] (slope 0 where
        it did not improve: its weighted mean), their covariance, the weights' scale (how much more the
        means scatter around the line than their noise says, at least 1; without measured noise, the
        variance of one mean), and whether the noise was measured. None where it cannot be fitted."""
        ts = np.log([p[0] for p in self.reference])
        ls = np.array([p[1] for p in self.reference])
        var, measured = self._noise(self.reference)
        w = 1.0 / var
        X = np.stack([np.ones_like(ts), ts], 1) if np.ptp(ts) > 0 else np.ones((len(ts), 1))
        try:
            XtW = X.T * w
            coef = np.linalg.solve(XtW @ X, XtW @ ls)
            if len(coef) == 2 and coef[1] >= 0:  # a reference that did not improve predicts no improvement
                X, XtW = X[:, :1], XtW[:1]
                coef = np.linalg.solve(XtW @ X, XtW @ ls)
            resid = ls - X @ coef
            chi2 = float((w * resid ** 2).sum()) / max(len(ls) - len(coef), 1)
            scale = max(chi2, 1.0) if measured else chi2
            cov = np.linalg.inv(XtW @ X) * scale
        except np.linalg.LinAlgError:
            return None
        if len(coef) == 1:
            coef, cov = np.array([coef[0], 0.0]), np.array([[cov[0, 0], 0.0], [0.0, 0.0]])
        if not (np.isfinite(coef).all() and np.isfinite(cov).all() and math.isfinite(scale)):
            return None
        return coef, cov, scale, measured

    def _judge(self, z: float) -> tuple[float, float, float] | None:
        """The judged intervals' weighted mean excess over the reference line, its tolerance at `z`
        standard deviations, and the line's loss at the latest judged interval (None: no line)."""
        line = self._line()
        if line is None:
            return None
        coef, cov, scale, _ = line
        ts = np.log([p[0] for p in self.trial])
        ls = np.array([p[1] for p in self.trial])
        var, _ = self._noise(self.trial)
        w = 1.0 / var
        g = np.array([1.0, float((w * ts).sum() / w.sum())])
        excess = float((w * (ls - coef[0] - coef[1] * ts)).sum() / w.sum())
        # the judged mean's own noise, scaled like the reference's, and the line's at its mean time
        sd = math.sqrt(max(scale / float(w.sum()) + float(g @ cov @ g), 0.0))
        tolerance = z * max(sd, self.min_rel * abs(float(ls[-1])))
        if not (math.isfinite(excess) and math.isfinite(tolerance)):
            return None
        return excess, tolerance, float(coef[0] + coef[1] * ts[-1])

    def state_dict(self) -> dict[str, Any]:
        """The check's state (not its settings: a restored job uses the settings it is given)."""
        return {k: ([list(p) for p in v] if k in ("reference", "trial") else v) for k, v in asdict(self).items()
                if k != "config"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in self.__dataclass_fields__ and k != "config":  # settings are the job's, not state
                if k in ("reference", "trial"):  # an older checkpoint's (seconds, loss): noise and length unknown
                    v = [(float(p[0]), float(p[1]), float(p[2]) if len(p) > 2 else math.nan,
                          float(p[3]) if len(p) > 3 else 0.0) for p in v]
                setattr(self, k, v)
        if self.grown_for > 0 and not math.isfinite(self.grown_at_s):  # an older checkpoint, mid-growth
            self.grown_at_s = self.elapsed_s


def _merged(points: list[tuple[float, float, float, float]], limit: int) -> list[tuple[float, float, float, float]]:
    """`points` (mid-seconds, mean loss, its variance, seconds) with the two neighbours of the shortest
    joint length merged (seconds-weighted) while more than `limit` remain."""
    points = list(points)
    while len(points) > max(limit, 2):
        i = int(np.argmin([a[3] + b[3] for a, b in zip(points, points[1:])]))
        (m0, l0, v0, s0), (m1, l1, v1, s1) = points[i:i + 2]
        s = s0 + s1
        points[i:i + 2] = [((m0 * s0 + m1 * s1) / s, (l0 * s0 + l1 * s1) / s, (v0 * s0 ** 2 + v1 * s1 ** 2) / s ** 2, s)]
    return points


def mean_variance(step_losses: Sequence[float] | None) -> float:
    """Variance of the mean of an interval's per-step losses, from their successive differences (a
    slow trend adds little to them): sum((l[k+1] - l[k])^2) / (2 (n - 1)) / n over the finite losses;
    NaN with fewer than three."""
    if step_losses is None:
        return math.nan
    x = np.asarray(step_losses, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 3:
        return math.nan
    return float((np.diff(x) ** 2).sum() / (2 * (len(x) - 1)) / len(x))


def _mean_loss(reports: Sequence[RankReport]) -> float:
    """Batch-weighted mean of the ranks' finite interval losses (NaN when none; inf when a rank reports
    inf: every loss it recorded in the interval was non-finite, training diverged there)."""
    if any(r.loss_mean == math.inf for r in reports):
        return math.inf
    pairs = [(r.loss_mean, r.local_batch) for r in reports if math.isfinite(r.loss_mean)]
    total = sum(b for _, b in pairs)
    return sum(l * b for l, b in pairs) / total if total > 0 else math.nan
