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
- verdict: after the growth has run `settle_frac` of the time before it (and `settle` intervals),
  the judged intervals' losses are compared with the line at their times: their inverse-variance
  weighted mean excess must stay within `z` standard deviations (the judged means' noise and the
  line's extrapolation, floored at `min_rel` of the loss). It is looked at as the judged time
  doubles (an eighth, a quarter, a half and all of `judge_frac` of the reference's span, and at
  least `judged` intervals), so short intervals do not buy more looks at the noise. A failed look
  returns B to the initial batch, and growth stays off for the rest of the job (`banned`); passing
  the last one accepts the growth.

Intervals known only by their mean loss (no per-step losses: a hand-built input) are weighed alike,
their noise taken from the reference's scatter around the line. Growth is not allowed before the
reference exists (without losses, ``controller.record_loss``, there is none, and B never grows past
the initial batch). Pure: no MPI, no Horovod.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from .state import RankReport


@dataclass
class GrowthCheck:
    window: int = 4
    """Fewest intervals at the initial batch the reference line is fitted on (the most recent)."""
    span: float = 0.5
    """The reference also holds every interval at the initial batch that ended within this fraction
    of the training time so far, counted back from now (at most `max_reference` intervals)."""
    max_reference: int = 512
    """Most intervals the reference keeps (the most recent)."""
    settle: int = 1
    """Intervals after a growth that are not judged (the LR and the loss adjust) ..."""
    settle_frac: float = 0.05
    """... and, in training seconds, this fraction of the time before the growth."""
    judged: int = 3
    """Fewest intervals judged before a growth is accepted ..."""
    judge_frac: float = 0.5
    """... and, in training seconds, this fraction of the reference's span."""
    z: float = 2.0
    """Tolerance in standard deviations of the excess loss."""
    min_rel: float = 0.005
    """Floor of that deviation, as a fraction of the loss."""
    elapsed_s: float = 0.0
    reference: list[tuple[float, float, float]] = field(default_factory=list)
    """(mid-interval seconds, mean loss, variance of that mean; NaN: unknown) at the initial batch."""
    trial: list[tuple[float, float, float, float]] = field(default_factory=list)
    """(mid-interval seconds, mean loss, its variance, interval seconds) judged in this episode."""
    grown_at_s: float = math.nan
    """Training seconds when the current episode's growth began."""
    grown_for: int = 0
    """Intervals run above the initial batch in the current episode."""
    verdicts: int = 0
    """Looks taken in the current episode."""
    next_look: float = 0.0
    """Judged seconds at which the next look is due."""
    banned: bool = False
    accepted: bool = False
    last: dict[str, float] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        """The reference exists: growth may be tried."""
        return self.accepted or len(self.reference) >= min(self.window, 3)

    def observe(self, reports: Sequence[RankReport], global_batch: int, initial_batch: int,
                step_losses: Sequence[float] | None = None) -> None:
        """One interval's reports (the batch it ran with) and, where known, its per-step losses (the
        sample-weighted mean over ranks, in step order): advance the clock and judge."""
        seconds = float(np.median([r.step_s * r.steps for r in reports])) if reports else 0.0
        seconds = seconds if math.isfinite(seconds) and seconds > 0 else 0.0
        mid = self.elapsed_s + seconds / 2
        self.elapsed_s += seconds
        loss = _mean_loss(reports)
        var = mean_variance(step_losses)
        if global_batch <= initial_batch:
            self.grown_for = self.verdicts = 0
            self.trial, self.grown_at_s, self.next_look = [], math.nan, 0.0
            if math.isfinite(loss) and mid > 0:
                self.reference.append((mid, loss, var))
                keep = max(self.window, sum(1 for t, _, _ in self.reference if t >= self.elapsed_s * (1 - self.span)))
                self.reference = self.reference[-min(keep, self.max_reference):]
            return
        if self.grown_for == 0:
            self.grown_at_s = self.elapsed_s - seconds
        self.grown_for += 1
        if self.accepted or self.banned:
            return
        if loss == math.inf:  # diverged at the larger batch
            self.banned = True
            return
        settled = self.grown_for > self.settle and mid - self.grown_at_s >= self.settle_frac * self.grown_at_s
        if not settled or not math.isfinite(loss) or len(self.reference) < 2 or mid <= 0:
            return  # nothing to judge with: no verdict either way
        self.trial.append((mid, loss, var, seconds))
        judged_s = sum(p[3] for p in self.trial)
        need_s = self.judge_frac * self.reference_span()
        if self.next_look <= 0:
            self.next_look = max(need_s / 8, 1e-9)
        if judged_s < min(self.next_look, need_s):
            return
        excess, tolerance, predicted = self._judge()
        self.last = {"loss": loss, "predicted_static": predicted, "excess": excess, "tolerance": tolerance,
                     "t": self.elapsed_s, "judged_s": judged_s, "need_s": need_s}
        self.verdicts += 1
        while self.next_look <= judged_s:
            self.next_look *= 2
        if excess > tolerance:
            self.banned = True
        elif judged_s >= need_s and len(self.trial) >= self.judged:
            self.accepted = True

    def reference_span(self) -> float:
        """Seconds from the reference's first interval to the growth (or to now)."""
        end = self.grown_at_s if math.isfinite(self.grown_at_s) else self.elapsed_s
        return max(end - self.reference[0][0], 0.0) if self.reference else 0.0

    def _line(self) -> tuple[np.ndarray, np.ndarray, float, bool]:
        """The reference's weighted line in log seconds: coefficients [intercept, slope] (slope 0 where
        it did not improve: its weighted mean), their covariance, the weights' scale (the variance of a
        mean of unit weight), and whether the weights are the intervals' measured noise."""
        ts = np.log([p[0] for p in self.reference])
        ls = np.array([p[1] for p in self.reference])
        vs = np.array([p[2] for p in self.reference])
        measured = bool(np.all(np.isfinite(vs) & (vs > 0)))
        w = 1.0 / vs if measured else np.ones_like(ls)
        X = np.stack([np.ones_like(ts), ts], 1) if np.ptp(ts) > 0 else np.ones((len(ts), 1))
        XtW = X.T * w
        coef = np.linalg.solve(XtW @ X, XtW @ ls)
        if len(coef) == 2 and coef[1] >= 0:  # a reference that did not improve predicts no improvement
            X, XtW = X[:, :1], XtW[:1]
            coef = np.linalg.solve(XtW @ X, XtW @ ls)
        resid = ls - X @ coef
        dof = max(len(ls) - len(coef), 1)
        chi2 = float((w * resid ** 2).sum()) / dof
        scale = max(chi2, 1.0) if measured else chi2
        cov = np.linalg.inv(XtW @ X) * scale
        if len(coef) == 1:
            coef, cov = np.array([coef[0], 0.0]), np.array([[cov[0, 0], 0.0], [0.0, 0.0]])
        return coef, cov, scale, measured

    def _judge(self) -> tuple[float, float, float]:
        """The judged intervals' weighted mean excess over the reference line, its tolerance, and the
        line's loss at the latest judged interval."""
        coef, cov, scale, measured = self._line()
        ts = np.log([p[0] for p in self.trial])
        ls = np.array([p[1] for p in self.trial])
        vs = np.array([p[2] for p in self.trial])
        ok = measured and bool(np.all(np.isfinite(vs) & (vs > 0)))
        w = 1.0 / vs if ok else np.ones_like(ls)
        g = np.array([1.0, float((w * ts).sum() / w.sum())])
        excess = float((w * (ls - coef[0] - coef[1] * ts)).sum() / w.sum())
        # the judged means' own noise (scaled like the reference's), and the line's at their mean time;
        # intervals without measured noise are each taken as noisy as the reference's scatter
        noise = scale / w.sum() if ok else scale
        sd = math.sqrt(max(noise + float(g @ cov @ g), 0.0))
        tolerance = self.z * max(sd, self.min_rel * abs(float(ls[-1])))
        return excess, tolerance, float(coef[0] + coef[1] * ts[-1])

    def state_dict(self) -> dict[str, Any]:
        return {k: ([list(p) for p in v] if k in ("reference", "trial") else v) for k, v in asdict(self).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in self.__dataclass_fields__:
                if k == "reference":  # (seconds, loss) points of an older checkpoint: noise unknown
                    v = [(float(p[0]), float(p[1]), float(p[2]) if len(p) > 2 else math.nan) for p in v]
                elif k == "trial":
                    v = [tuple(float(x) for x in p) for p in v]
                setattr(self, k, v)


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
