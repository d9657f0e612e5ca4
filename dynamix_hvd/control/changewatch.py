"""Has this rank's own speed changed since the last decision? Pure NumPy: no MPI, no Horovod.

Between two decisions every rank checks, every so often (a *change vote*, one small collective), whether
its own compute time per step has moved away from its reference: what it was over the first steps at
the size it runs now (kept across decisions that leave its size alone, and taken again after its own
vote brought a decision). Any rank
that says yes makes the next decision come at once instead of at the cadence's next step, so a rank
that slows down (or recovers) is followed within a fraction of a second rather than an interval later.
The vote only brings the decision forward: whether the split follows is still the decision's own
tests on every rank's per-step times (`speedgap`), so a false alarm costs one decision's time, not a
wrong split.

Only the rank's own compute time counts (forward and backward, without the waits for other ranks),
at its planned size, so that another rank's slowdown, a shorter last step of an epoch or a busy
allreduce do not look like a change of this rank's speed. A pause of a few steps (a garbage
collection, a checkpoint write, a rank descheduled for a second) is not a change: the vote needs
most of the recent window beyond the threshold, the same way, and a median of the window too.
"""
from __future__ import annotations

import math

import numpy as np

REFERENCE_STEPS = 6
"""Steps at the planned size right after a decision whose median is the reference. Not a setting: a
median of six steps is robust to two paused ones, and every step more delays the first vote."""

WINDOW_STEPS = 6
"""The most recent steps a vote compares with the reference."""

SCATTER_FACTOR = 3.0
"""A vote's change must exceed this many robust standard deviations of the reference's steps (besides
the ratio). Not a setting: it only keeps steps that scatter widely from voting on their noise."""

WINDOW_SHARE = 5 / 6
"""Share of the window that must be beyond the threshold, the same way (five of six: a pause of up to
three steps, however long, changes the median but not the share)."""


def reference_time(compute_s: np.ndarray, batch: np.ndarray, planned: float) -> tuple[float, float, int] | None:
    """This rank's reference at its planned size: the median compute time of the first
    `REFERENCE_STEPS` of `compute_s` (oldest first) whose `batch` is `planned`, their scatter (a robust
    standard deviation of their logs) and the index in `compute_s` after the last of them; None where
    fewer ran."""
    at = np.flatnonzero(_usable(compute_s, batch, planned))
    if len(at) < REFERENCE_STEPS:
        return None
    logs = np.log(np.asarray(compute_s, dtype=np.float64)[at[:REFERENCE_STEPS]])
    middle = float(np.median(logs))
    return math.exp(middle), 1.4826 * float(np.median(np.abs(logs - middle))), int(at[REFERENCE_STEPS - 1]) + 1


def own_change(compute_s: np.ndarray, batch: np.ndarray, planned: float, reference_s: float, ratio: float,
               scatter: float = 0.0) -> int:
    """+1 where this rank's compute time per step has risen by more than `ratio` (e.g. 1.25) over
    `reference_s` (its compute time at `planned` before), -1 where it fell by as much, 0 otherwise or
    where fewer than `WINDOW_STEPS` steps ran. Where the reference's steps scatter (`scatter`, a
    standard deviation of log times: short steps on a busy host), the change must also exceed
    `SCATTER_FACTOR` times it, so noise does not vote.

    `compute_s`, `batch`: the rank's steps since the reference was taken, oldest first (compute
    seconds and local batch per step); only the last `WINDOW_STEPS` at `planned` count, and most of
    them must be beyond the bound the same way, as must their median."""
    if not ratio > 1.0:
        raise ValueError(f"own_change(ratio={ratio!r}): need a ratio > 1")
    if not (math.isfinite(reference_s) and reference_s > 0):
        raise ValueError(f"own_change(reference_s={reference_s!r}): need a compute time > 0")
    c = np.asarray(compute_s, dtype=np.float64)[_usable(compute_s, batch, planned)]
    if len(c) < WINDOW_STEPS:
        return 0
    log_ratio = np.log(c[-WINDOW_STEPS:] / reference_s)
    bound = max(math.log(ratio), SCATTER_FACTOR * scatter if math.isfinite(scatter) else math.inf)
    for way in (1, -1):
        beyond = way * log_ratio > bound
        if beyond.mean() >= WINDOW_SHARE - 1e-9 and way * float(np.median(log_ratio)) > bound:
            return way
    return 0


def _usable(compute_s: np.ndarray, batch: np.ndarray, planned: float) -> np.ndarray:
    c = np.asarray(compute_s, dtype=np.float64)
    return (np.asarray(batch, dtype=np.float64) == planned) & np.isfinite(c) & (c > 0)


def vote_every(vote_s: float, step_s: list[float], most: int = 1 << 20) -> int:
    """Loader steps between two change votes: `vote_s` seconds at the ranks' median step time
    `step_s` (at least 2, at most `most`); 0 (no votes) where `vote_s` is 0 or no step time is known."""
    finite = [t for t in step_s if math.isfinite(t) and t > 0]
    if not vote_s > 0 or not finite:
        return 0
    steps = vote_s / float(np.median(finite))
    return most if not steps < most else max(2, math.ceil(steps))


class OwnSpeed:
    """One rank's change watch between decisions: its reference at its planned size (kept while the
    size stays, taken again after `forget`) and its vote. The live controller keeps one per rank
    process; the simulator one per simulated rank."""

    def __init__(self) -> None:
        self.reference: tuple[float, float, float, int] | None = None
        """(planned size, reference seconds, their scatter, the step count after its last step)."""

    def vote(self, compute_s: np.ndarray, batch: np.ndarray, first: int, planned: float, ratio: float) -> int:
        """`own_change` of the steps since the reference; `compute_s`, `batch`: the steps since the
        last decision (oldest first), `first` the step count of their first."""
        if self.reference is None or self.reference[0] != planned:
            found = reference_time(compute_s, batch, planned)
            self.reference = None if found is None else (planned, found[0], found[1], first + found[2])
        if self.reference is None:
            return 0
        _, reference_s, scatter, taken = self.reference
        since = max(0, taken - first)
        return own_change(compute_s[since:], batch[since:], planned, reference_s, ratio, scatter)

    def forget(self) -> None:
        """This rank's speed changed: the next vote takes its reference again."""
        self.reference = None
