"""When the controller decides. Pure: no MPI, no Horovod.

Every rank asks at every step end and must get the same answer, or the control plane's collectives
stop matching. So the answer depends only on what every rank shares: the number of decisions so far,
the steps since the last one, the epoch and step, and the shared plan (sizes and the epoch's length).
Nothing else is remembered, which keeps a rank that joined after an elastic reset, or a job restored
from a checkpoint, deciding at the same steps as the others.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from .. import validate

UNKNOWN_LENGTH_PER_EPOCH = 4
"""Default of `CadenceConfig.unknown_length_per_epoch`."""

FREE_DECISIONS = 4
"""Default of `CadenceConfig.free_decisions`."""


@dataclass(frozen=True)
class CadenceConfig:
    """When the automatic cadence (``ControllerConfig.decide_every_steps=None``) decides, and what
    deciding may cost."""

    decision_budget: float = 0.01
    """With decide_every_steps=None: the share of training time decisions may take once the first
    `free_decisions` (which find the split) are made. Every rank waits while rank 0 decides, so on
    short steps a decision costs several steps: rank 0 measures each decision and the step time and
    spaces the next at least decision time / (budget x step time) steps later, epoch ends included;
    only a recheck (the interval after a first sign of a large speed gap) comes sooner. 0: no limit."""
    target_decisions: int = 32
    """With ``decide_every_steps=None``: the decisions a job of `total_epochs` epochs aims for."""
    min_decision_steps: int = 8
    """With ``decide_every_steps=None``: fewest steps between two decisions inside an epoch (the cost
    fits and the noise scale need a few steps per interval), the length of the ramp's first two
    intervals and of a recheck's (optimizer steps there)."""
    max_decision_interval_s: float = 20.0
    """With ``decide_every_steps=None``: the longest an interval inside an epoch may last, in seconds
    of training at the ranks' median step time, so that a long job (32 decisions over days, or epochs
    of many minutes) still follows a rank whose speed changes within about two intervals; the decision
    budget's spacing and `min_decision_steps` still come first. 0: no ceiling (target_decisions alone
    spreads them)."""
    free_decisions: int = FREE_DECISIONS
    """The job's first decisions, which find the split, are not held back by the decision budget."""
    unknown_length_per_epoch: int = UNKNOWN_LENGTH_PER_EPOCH
    """In-epoch decisions per epoch once ramped up when the job's length (total_epochs) is not known."""
    change_vote_s: float = 0.25
    """With ``decide_every_steps=None``: about how many seconds of training pass between two change
    votes (one small collective: has any rank's own compute time per step, at its current size, moved
    by more than `change_ratio` from its first steps at that size?). A yes brings the next decision
    forward, once `min_decision_steps` and a quarter of the decision budget's spacing have run since
    the last one, so a rank whose speed changes is followed within about a second, not an interval
    later. No votes under gradient accumulation or token budgets. 0: no votes (decisions on the
    cadence alone)."""
    change_ratio: float = 1.25
    """How far a rank's compute time per step must move (this factor up or down, over most of the
    last few steps) for its change vote to say yes."""

    def __post_init__(self) -> None:
        validate.number("CadenceConfig.decision_budget", self.decision_budget, 0, below=1,
                        what="a share of training time in [0, 1) (0: no limit)")
        validate.integer("CadenceConfig.target_decisions", self.target_decisions, 1)
        validate.integer("CadenceConfig.min_decision_steps", self.min_decision_steps, 1)
        validate.number("CadenceConfig.max_decision_interval_s", self.max_decision_interval_s, 0,
                        what="a finite number of seconds >= 0 (0: no ceiling)")
        validate.integer("CadenceConfig.free_decisions", self.free_decisions, 0)
        validate.integer("CadenceConfig.unknown_length_per_epoch", self.unknown_length_per_epoch, 1)
        validate.number("CadenceConfig.change_vote_s", self.change_vote_s, 0,
                        what="a finite number of seconds >= 0 (0: no change votes)")
        validate.number("CadenceConfig.change_ratio", self.change_ratio, above=1,
                        what="a factor > 1 (e.g. 1.25: a change of 25%)")


class DecisionCadence:
    """``every`` None: at every epoch end and inside epochs every ceil(epoch steps / per epoch) steps,
    per epoch = ceil(target_decisions / total_epochs) (`unknown_length_per_epoch` without
    total_epochs), at least `min_steps` apart and none in an epoch's last half-interval; the job's
    first intervals ramp up to that: min_steps, min_steps again, twice that, ... ``every`` k > 0:
    every k steps, and at an epoch end at least k/2 steps after the last decision; 0: at epoch ends
    only.

    ``spacing`` (default cadence only, after the first `free_decisions`): no decision, epoch ends
    included, sooner than this many steps after the last one. The controller's rank 0 sets it from the
    decision budget (a decision's cost against the step time) and sends it with every decision, so it
    is shared like the rest (restored from the decision history with a checkpoint, and from the shared
    state after an elastic reset).

    ``recheck`` (default cadence only; 0: none): the last decision saw a first interval of evidence
    for leaving the neutral split (a speed gap beyond the margin) that a second must confirm, so the
    next decision comes this many steps after it (the controller gives `min_steps` optimizer steps'
    worth of loader steps; at the epoch's end where that falls in its last half-recheck) rather than a
    whole interval later: ahead of the interval and the spacing, and not at an epoch end that comes
    sooner (an interval too short to test would waste it). A rank that became slower is then balanced
    an interval sooner for one decision more. Rank 0 sends the request with the decision, like the
    spacing.

    ``ceiling`` (default cadence only; 0: none): the most steps an in-epoch interval may span, so that
    a long job (few decisions spread over many epochs, or epochs of many minutes) still decides every
    so many seconds and follows a rank whose speed changes within about two intervals. Rank 0 sets it
    from ``CadenceConfig.max_decision_interval_s`` and the step time (`interval_ceiling`) and sends
    it with every decision, like the spacing; the spacing wins where the two disagree (the decision
    budget is a bound, the ceiling a wish), and no interval is shorter than `min_steps`.

    ``changed`` (default cadence only): a change vote at this step said a rank's speed moved
    (`changewatch`); the decision comes now, ahead of the interval, once `min_steps` steps and a
    quarter of the spacing have run since the last one (every rank got the vote's answer, so they
    agree): a change of speed is worth more than the budget, but votes on noise could not take more
    than four times it."""

    def __init__(self, every: int | None, target_decisions: int, min_steps: int, total_epochs: int | None, *,
                 free_decisions: int = FREE_DECISIONS, unknown_length_per_epoch: int = UNKNOWN_LENGTH_PER_EPOCH) -> None:
        self.every, self.target, self.min_steps, self.total_epochs = every, target_decisions, min_steps, total_epochs
        self.free_decisions, self.unknown_length_per_epoch = free_decisions, unknown_length_per_epoch
        self._key: tuple | None = None
        self._interval = 0
        self._epoch_steps = 0

    @classmethod
    def from_config(cls, every: int | None, config: CadenceConfig, total_epochs: int | None) -> "DecisionCadence":
        """The cadence of ``decide_every_steps=every`` with the automatic cadence's `config`."""
        return cls(every, config.target_decisions, config.min_decision_steps, total_epochs,
                   free_decisions=config.free_decisions, unknown_length_per_epoch=config.unknown_length_per_epoch)

    def due(self, *, epoch_end: bool, steps_since: int, decisions: int, epoch: int, step: int,
            sizes: Sequence[int], epoch_length: Callable[[], int], spacing: int = 0,
            recheck: int = 0, ceiling: int = 0, changed: bool = False) -> bool:
        """`epoch_length()` is the epoch's length under the current sizes; it is read only when the
        epoch, the number of decisions, the sizes or the ceiling changed (reading it replans the
        epoch's rest)."""
        k = self.every
        if k is not None:
            # An epoch end right after an in-epoch decision (under k/2 steps of records) waits, so no
            # decision rests on one or two noisy steps.
            return (epoch_end and steps_since >= (k + 1) // 2) or (k > 0 and steps_since >= k)
        if changed and steps_since >= max(self.min_steps, spacing // 4):
            return True
        if recheck > 0:
            # After `recheck` steps; where that falls in the epoch's last half-recheck, at its end (so
            # neither decision rests on a few steps); an epoch end before it waits.
            if epoch_end or steps_since < recheck:
                return epoch_end and steps_since >= recheck
            return self._plan(epoch, decisions, sizes, epoch_length, ceiling) - step >= recheck // 2
        if decisions >= self.free_decisions and steps_since < spacing:
            return False
        if epoch_end:
            return True
        epoch_steps = self._plan(epoch, decisions, sizes, epoch_length, ceiling)
        # No decision in the last half-interval of an epoch: its end decides anyway.
        return steps_since >= self._interval and epoch_steps - step >= self._interval // 2

    def _plan(self, epoch: int, decisions: int, sizes: Sequence[int], epoch_length: Callable[[], int],
              ceiling: int = 0) -> int:
        """The epoch's length, and the interval, replanned when the epoch, the decisions, the sizes or
        the ceiling changed."""
        key = (epoch, decisions, tuple(sizes), ceiling)
        if key != self._key:
            self._key = key
            self._epoch_steps = epoch_length()
            per_epoch = -(-self.target // self.total_epochs) if self.total_epochs else self.unknown_length_per_epoch
            # The first split matters most and later decisions mostly confirm it: the first intervals
            # are short and double until the spacing that spreads target_decisions over the job. The
            # first two are both min_steps: a split needs two intervals of evidence (a paired test
            # on each), and every step before it runs at the straggler's pace.
            ramp = self.min_steps * 2 ** min(max(decisions - 1, 0), 30)
            spread = -(-self._epoch_steps // per_epoch)
            if ceiling > 0:
                spread = min(spread, ceiling)
            self._interval = min(ramp, max(self.min_steps, spread))
        return self._epoch_steps


def interval_ceiling(max_interval_s: float, step_s: Sequence[float]) -> int:
    """Steps in `max_interval_s` seconds at the median of the ranks' step times `step_s`, at most
    2**20 (0: no ceiling, where `max_interval_s` is 0 or no step time is known)."""
    finite = [t for t in step_s if math.isfinite(t) and t > 0]
    if not max_interval_s > 0 or not finite:
        return 0
    steps = max_interval_s / statistics.median(finite)
    return 1 << 20 if not steps < 1 << 20 else max(1, math.ceil(steps))
