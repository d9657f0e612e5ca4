"""The online check of an uneven split: did leaving the neutral split shorten the measured step?

The proposal leaves the neutral split (the job's initial sizes scaled to B) when its fitted per-rank
cost lines predict that an arrival-equalising split shortens the step by more than the split margin
and a paired test on each of the last intervals' steps measures a speed gap that large
(:mod:`dynamix_hvd.control.speedgap`). A gap in compute can be real and still not shorten the step
(ranks that share cores, a step the allreduce dominates, a transient slowdown), and the uneven split
then costs time instead of saving it. So the measured step is the judge, as the growth check judges
a larger batch by the loss:

- reference: the wall time per step of the last `window` intervals run at the neutral split, at the
  global batch the split keeps (a different B is a different step and resets the reference);
- verdict: the mean step of the first `judged` intervals at the split must be shorter than the
  reference by at least `keep` of the gain the cost model predicts for the sizes that ran (the first
  intervals may run a partial split: a rank's growth bounded by the trust region, the dither).
  Otherwise the split is undone and from then on (a new world starts afresh) leaving neutral needs a
  predicted gain of `raise_by` times the one that failed (at most `max_margin`), so a real 2x or 3x
  straggler that appears later is still split at once. A smaller gap that lasts is split too: the
  raised margin gives way once the measured gap has passed the configured margin in
  `split_intervals x raise_by^failures` tested neutral intervals running (`outweighed`), so each failed
  split doubles the evidence the next one needs and a gap that is real but does not pay (ranks that
  share cores) costs few trials.

A rank that changed speed (the cost model's lines found it in two intervals off its line,
:mod:`dynamix_hvd.control.costmodel`) makes steps before and after the change incomparable: while a
change is pending (one interval off its line) intervals are neither reference nor trial; once
confirmed, the reference starts again from the confirming interval where it ran neutral (a split
taken next is judged against it), and a split under trial stays unjudged (no neutral step at the new
speeds exists; the cost lines now follow the new ones).

Not used with token budgets (the cost model's points carry squared lengths): length bucketing makes
an interval's step time follow the lengths it drew, so two intervals do not compare. The proposal
holds B while a split is judged; an interval at another B (memory, a failed growth)
ends the trial without a verdict. Pure: no MPI, no Horovod.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from .state import RankReport
from .. import validate


@dataclass(frozen=True)
class SplitConfig:
    """Settings of the split check (:class:`SplitCheck`)."""

    window: int = 2
    """Intervals at the neutral split the reference step time is the mean of."""
    judged: int = 2
    """Intervals at the split whose mean step is judged."""
    keep: float = 0.5
    """Fraction of the predicted step-time gain the measured gain must reach."""
    raise_by: float = 2.0
    """After a failed split, the margin becomes this multiple of the predicted gain that failed."""
    max_margin: float = 0.25
    """Upper end of that margin (a 2x straggler predicts ~33%, a 3x one ~50%: both are still split)."""

    def __post_init__(self) -> None:
        for name in ("window", "judged"):
            validate.integer(f"SplitConfig.{name}", getattr(self, name), 1)
        validate.number("SplitConfig.keep", self.keep, 0, maximum=1, what="a fraction in [0, 1]")
        validate.number("SplitConfig.raise_by", self.raise_by, 1)
        validate.number("SplitConfig.max_margin", self.max_margin, 0, below=1, what="a fraction in [0, 1)")


def _setting(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"`SplitConfig.{name}` of this check.")


@dataclass
class SplitCheck:
    """The check's state; its settings are `config` (read through the same names: ``check.keep``)."""

    config: SplitConfig = field(default_factory=SplitConfig)
    """The check's settings."""
    reference: list[float] = field(default_factory=list)
    """Mean step seconds of the recent neutral intervals at `reference_batch`."""
    reference_batch: int = 0
    trial: list[float] = field(default_factory=list)
    """Mean step seconds of the intervals run at the split being judged."""
    trial_predicted: list[float] = field(default_factory=list)
    """The cost model's predicted step-time gain of each of those intervals' sizes over neutral."""
    trial_gain: float = 0.0
    """Predicted step-time gain of the split being judged (0: no trial)."""
    margin: float = 0.0
    """Predicted gain a split must exceed from now on (0: the proposal's own margin)."""
    failures: int = 0
    last: dict[str, float] = field(default_factory=dict)

    window = _setting("window")
    judged = _setting("judged")
    keep = _setting("keep")
    raise_by = _setting("raise_by")
    max_margin = _setting("max_margin")

    def observe(self, reports: Sequence[RankReport], neutral_ran: bool, global_batch: int,
                predicted_gain: float = 0.0, first_interval: bool = False, speed_changed: bool = False,
                speed_pending: bool = False) -> bool:
        """One interval's reports; `neutral_ran`: it ran at the neutral split; `global_batch`: samples per
        step it ran with; `predicted_gain`: the cost model's step-time gain of its sizes over the neutral
        split; `speed_changed`: some rank's speed changed in it; `speed_pending`: it may have (one
        interval off a line). True when a split under trial has just failed (back towards neutral now,
        within the proposal's trust region)."""
        steps = [r.step_s for r in reports if math.isfinite(r.step_s) and r.step_s > 0 and r.steps > 0]
        if speed_changed:  # steps before the change compare with none after it
            self._end_trial()
            fresh = neutral_ran and bool(steps) and not first_interval
            self.reference = [float(np.median(steps))] if fresh else []
            self.reference_batch = global_batch if fresh else self.reference_batch
            return False
        # a restored process's first interval: start-up costs inflate it; a pending change: the
        # interval may hold two speeds
        if not steps or first_interval or speed_pending:
            return False
        step = float(np.median(steps))
        if neutral_ran:
            self._end_trial()
            if global_batch != self.reference_batch:
                self.reference, self.reference_batch = [], global_batch
            self.reference = (self.reference + [step])[-self.window:]
            return False
        if self.trial_gain <= 0:
            return False
        if global_batch != self.reference_batch or not self.reference:
            self._end_trial()  # another B: nothing to compare with
            return False
        self.trial.append(step)
        self.trial_predicted.append(float(predicted_gain) if math.isfinite(predicted_gain) else 0.0)
        if len(self.trial) < self.judged:
            return False
        ref, now, predicted = float(np.mean(self.reference)), float(np.mean(self.trial)), float(np.mean(self.trial_predicted))
        measured = 1.0 - now / ref
        self.last = {"reference_step_s": ref, "split_step_s": now, "measured_gain": measured,
                     "predicted_gain": predicted, "split_gain": self.trial_gain}
        failed = measured < self.keep * predicted
        if failed:
            self.failures += 1
            self.margin = min(self.max_margin, max(self.margin, self.raise_by * self.trial_gain))
        self._end_trial()
        return failed

    def outweighed(self, run: int, split_intervals: int) -> bool:
        """A raised margin is outweighed by `run` tested neutral intervals running whose measured gap
        passed the configured margin, the same rank slower, when they are `split_intervals` times
        `raise_by` per failure: the proposal's own margin then applies, and `lift` drops the raised
        one once a split is taken on it (until the next failure)."""
        return self.margin > 0 and run >= math.ceil(split_intervals * self.raise_by ** self.failures)

    def lift(self) -> None:
        self.margin = 0.0

    def _end_trial(self) -> None:
        self.trial, self.trial_predicted, self.trial_gain = [], [], 0.0

    @property
    def judging(self) -> bool:
        """A split is under trial (the proposal holds B until the verdict)."""
        return self.trial_gain > 0

    def start(self, split_gain: float) -> None:
        """The decision just left the neutral split for one predicted to shorten the slowest arrival by
        `split_gain` (what the proposal's margin is compared with): judge it."""
        if self.trial_gain <= 0:
            self._end_trial()
            self.trial_gain = float(split_gain)

    def state_dict(self) -> dict[str, Any]:
        """The check's state (not its settings: a restored job uses the settings it is given)."""
        return {k: v for k, v in asdict(self).items() if k in _STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in _STATE:
                setattr(self, k, v)


_STATE = ("reference", "reference_batch", "trial", "trial_predicted", "trial_gain", "margin", "failures", "last")
