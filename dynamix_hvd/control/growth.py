"""The online check of a batch growth: does the larger global batch train faster than the initial one did?

The proposal grows B where its model predicts more progress per second (goodput). The model can be
wrong where it matters most: the noise scale, AdaScale's gain under momentum or Adam, a throughput
gain that the machine does not deliver. So once B has grown past the job's initial batch the
measured training loss is compared with what the initial batch was making, in wall time:

- reference: the last `window` decision intervals run at the initial batch, their mean training loss
  against log(training seconds), fitted by a line (diminishing returns; the extrapolation credits
  the initial batch with continued progress, so the check errs towards returning);
- verdict: from `settle` intervals after the growth on, for `judged` intervals, the measured loss at
  time t must not exceed the reference line at t by more than `z` residual standard deviations of
  the reference fit (floored at `min_rel` of the loss). Otherwise B returns to the initial batch and
  never grows again in this job (`banned`); passing every judged interval accepts the growth.

Growth is not allowed before the reference exists (without losses, ``controller.record_loss``,
there is none, and B never grows past the initial batch). Pure: no MPI, no Horovod.
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
    """Intervals at the initial batch the reference line is fitted on."""
    settle: int = 1
    """Intervals after a growth that are not judged (the LR and the loss adjust)."""
    judged: int = 3
    """Intervals judged after settling; passing them all accepts the growth."""
    z: float = 2.0
    """Tolerance in residual standard deviations of the reference fit."""
    min_rel: float = 0.005
    """Floor of that deviation, as a fraction of the loss."""
    elapsed_s: float = 0.0
    reference: list[tuple[float, float]] = field(default_factory=list)
    """(seconds, loss) of the recent intervals at the initial batch."""
    grown_for: int = 0
    """Intervals run above the initial batch in the current episode."""
    verdicts: int = 0
    """Intervals of the current episode judged (with a finite loss against a reference)."""
    banned: bool = False
    accepted: bool = False
    last: dict[str, float] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        """The reference exists: growth may be tried."""
        return self.accepted or len(self.reference) >= min(self.window, 3)

    def observe(self, reports: Sequence[RankReport], global_batch: int, initial_batch: int) -> None:
        """One interval's reports (the batch it ran with): advance the clock and judge."""
        seconds = float(np.median([r.step_s * r.steps for r in reports])) if reports else 0.0
        if math.isfinite(seconds) and seconds > 0:
            self.elapsed_s += seconds
        loss = _mean_loss(reports)
        if global_batch <= initial_batch:
            self.grown_for = self.verdicts = 0
            if math.isfinite(loss) and self.elapsed_s > 0:
                self.reference = (self.reference + [(self.elapsed_s, loss)])[-self.window:]
            return
        self.grown_for += 1
        if self.accepted or self.banned or self.grown_for <= self.settle:
            return
        if loss == math.inf:  # diverged at the larger batch
            self.banned = True
            return
        if not math.isfinite(loss) or len(self.reference) < 2:  # nothing to judge with: no verdict either way
            return
        predicted, tolerance = self._predict(self.elapsed_s, loss)
        self.last = {"loss": loss, "predicted_static": predicted, "tolerance": tolerance, "t": self.elapsed_s}
        self.verdicts += 1
        if loss > predicted + tolerance:
            self.banned = True
        elif self.verdicts >= self.judged:
            self.accepted = True

    def _predict(self, t: float, loss: float) -> tuple[float, float]:
        """The reference line's loss at `t` and the tolerance around it."""
        ts, ls = np.log([p[0] for p in self.reference]), np.array([p[1] for p in self.reference])
        slope, intercept = np.polyfit(ts, ls, 1) if np.ptp(ts) > 0 else (0.0, float(ls.mean()))
        if slope >= 0:  # a reference that did not improve predicts no improvement: its mean and spread
            resid, predicted, dof = ls - ls.mean(), float(ls.mean()), max(len(ts) - 1, 1)
        else:
            resid, predicted, dof = ls - (intercept + slope * ts), float(intercept + slope * math.log(t)), max(len(ts) - 2, 1)
        sd = float(np.sqrt((resid ** 2).sum() / dof))
        return predicted, self.z * max(sd, self.min_rel * abs(loss))

    def state_dict(self) -> dict[str, Any]:
        return {k: ([list(p) for p in v] if k == "reference" else v) for k, v in asdict(self).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in self.__dataclass_fields__:
                setattr(self, k, [tuple(p) for p in v] if k == "reference" else v)


def _mean_loss(reports: Sequence[RankReport]) -> float:
    """Batch-weighted mean of the ranks' finite interval losses (NaN when none; inf when a rank reports
    inf: every loss it recorded in the interval was non-finite, training diverged there)."""
    if any(r.loss_mean == math.inf for r in reports):
        return math.inf
    pairs = [(r.loss_mean, r.local_batch) for r in reports if math.isfinite(r.loss_mean)]
    total = sum(b for _, b in pairs)
    return sum(l * b for l, b in pairs) / total if total > 0 else math.nan
