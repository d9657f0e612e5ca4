"""Discrete batch-size actions and per-rank bounds. Pure maths: no MPI, no Horovod.

The PPO policy corrects the model-based proposal (:mod:`dynamix_hvd.control.proposal`): one action
per rank multiplies that rank's *proposed share*, and one action of the batch row multiplies the
*proposed global batch* (:func:`compose`); the neutral action (1.0) of every row gives exactly the
proposal. Sizes are clipped to [min_batch, max_i], where max_i is the rank's memory bound: the configured
ceiling, lowered for good by an out-of-memory error, and by a fit of peak memory against batch size
within the rank's memory budget (:mod:`dynamix_hvd.data.memory`). Sizes are
per micro-batch: a decision may also accumulate up to `max_passes` of them per optimizer step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .. import validate

DEFAULT_MULTIPLIERS = (0.8, 0.9, 1.0, 1.1, 1.25)
"""Corrections of a rank's proposed share and of the proposed global batch (1.0 = the proposal)."""


@dataclass
class ActionSpace:
    multipliers: tuple[float, ...] = DEFAULT_MULTIPLIERS
    """Factor applied to a rank's proposed share, or (batch row) to the proposed global batch, by each
    action (must include 1.0 = the proposal)."""

    def __post_init__(self) -> None:
        ok = all(validate.is_number(m, above=0) for m in self.multipliers)
        if not ok or 1.0 not in self.multipliers:
            raise ValueError(f"multipliers {self.multipliers} must be positive and include 1.0 (keep)")

    @property
    def n(self) -> int:
        return len(self.multipliers)

    @property
    def keep(self) -> int:
        return self.multipliers.index(1.0)


OOM_SHRINK = 0.8
"""After an out-of-memory step at size s a rank's ceiling is int(0.8 s): a fixed factor (not a setting)
because the failed size says only that s did not fit, not by how much."""


HOST_MARGIN = 2.0
"""Factor on a resident-set slope: at a size the job had not run before, the resident set has come out
up to twice the line through the floor and a smaller size's peak (the allocator keeps what it freed
in pieces that the larger tensors do not reuse). A fixed factor, not a setting: past a cgroup's limit
the kernel kills the process, so the margin only has to be safe, and the fit follows the job's real
peaks as it runs the sizes."""


def memory_limit(points: dict[int, int], latest: int, floor: int, budget: int, precise: bool) -> int | None:
    """The largest size whose predicted peak stays within `budget` bytes, from the peaks measured at
    `points` {size: worst peak in bytes}, the size measured last (`latest`) and the memory in use
    before training (`floor`); None: no evidence.

    A `precise` peak (the CUDA allocator's, per step) is fitted by a line through the smallest and
    largest sizes. A process's resident set is not precise: it keeps memory its allocator no longer
    uses and drifts upward over a run, which flattens such a line. There the latest size's peak bounds
    the memory per sample from above, HOST_MARGIN x (peak - floor) / size, counting what does not grow
    with the batch (gradients, optimizer state, the drift so far) as if it did: extrapolated upward it
    over-predicts, and it follows the drift as the run goes on."""
    if budget <= 0 or latest not in points:
        return None
    if precise and len(points) >= 2:
        (b0, m0), (b1, m1) = min(points.items()), max(points.items())
        slope = (m1 - m0) / (b1 - b0)
        if slope > 0:
            return int((budget - (m0 - slope * b0)) / slope)
    per_sample = HOST_MARGIN * (points[latest] - floor) / latest
    if per_sample <= 0:
        return None
    return int((budget - floor) / per_sample)


@dataclass
class BatchBounds:
    """Per-rank [min_batch, upper(rank)]: the configured ceiling, an out-of-memory ceiling and a fit.

    After an out-of-memory step at size s the rank's ceiling falls below s for the rest of the run
    (`record_oom`); no memory fit lifts it. The fit (`record_memory`) bounds the size by the rank's
    memory budget and may move either way as peaks at more sizes come in, always under that ceiling.
    """

    world_size: int
    min_batch: int = 1
    max_batch: int = 1024
    memory_safety: float = 0.9
    """Fraction of the memory budget a batch may plan to use at its peak."""
    max_passes: int = 1
    """Micro-batches a decision may accumulate into one optimizer step (gradient accumulation), so
    that the global batch can grow past what memory allows in one pass; 1: none."""
    oom_limit: list[int] = field(default_factory=list)
    """Per rank: the ceiling learned from out-of-memory steps (max_batch until one fails)."""
    fit_limit: list[int] = field(default_factory=list)
    """Per rank: the bound from the fit of peak memory against size (max_batch until fitted)."""
    failed: list[int] = field(default_factory=list)
    """Per rank: the smallest size that ran out of memory (0: none)."""
    _memory: list[dict[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(f"impossible batch bounds: min_batch={self.min_batch}, max_batch={self.max_batch}")
        if not 0 < self.memory_safety <= 1:
            raise ValueError(f"memory_safety={self.memory_safety} must be in (0, 1]")
        validate.integer("max_passes", self.max_passes, 1)
        self.oom_limit = self.oom_limit or [self.max_batch] * self.world_size
        self.fit_limit = self.fit_limit or [self.max_batch] * self.world_size
        self.failed = self.failed or [0] * self.world_size
        self._memory = [dict() for _ in range(self.world_size)]

    @property
    def learned_max(self) -> list[int]:
        """Per rank: what memory allows (the lower of the out-of-memory ceiling and the fit)."""
        return [min(o, f) for o, f in zip(self.oom_limit, self.fit_limit)]

    def upper(self, rank: int) -> int:
        return max(self.min_batch, min(self.max_batch, self.oom_limit[rank], self.fit_limit[rank]))

    def clip(self, rank: int, size: int) -> int:
        return max(self.min_batch, min(self.upper(rank), size))

    def record_oom(self, rank: int, failed_size: int) -> int:
        """Remember that `failed_size` did not fit: the rank stays below it for the rest of the run.
        Returns the rank's new upper bound."""
        self.failed[rank] = min(self.failed[rank] or failed_size, failed_size)
        self.oom_limit[rank] = max(self.min_batch, min(self.oom_limit[rank], int(failed_size * OOM_SHRINK)))
        return self.upper(rank)

    def record_memory(self, rank: int, size: int, peak_bytes: int, budget_bytes: int, floor_bytes: int = 0,
                      precise: bool = True) -> None:
        """Add a peak measured at `size` and refit the rank's memory bound (`memory_limit`) against
        `memory_safety` of its budget; `floor_bytes`: its memory in use before training."""
        if size <= 0 or peak_bytes <= 0:
            return
        points = self._memory[rank]
        points[size] = max(points.get(size, 0), int(peak_bytes))  # a size's worst peak
        limit = memory_limit(points, size, int(floor_bytes), int(self.memory_safety * budget_bytes), precise)
        if limit is not None:
            self.fit_limit[rank] = max(self.min_batch, min(self.max_batch, limit))

    # --- plain state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"oom_limit": list(self.oom_limit), "fit_limit": list(self.fit_limit), "failed": list(self.failed),
                "memory": [sorted(points.items()) for points in self._memory]}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; a checkpoint that kept one bound per rank (``learned_max``)
        restores it as the out-of-memory ceiling, which nothing lifts."""
        if "oom_limit" not in state:
            self.oom_limit = [int(b) for b in state["learned_max"]]
            return
        self.oom_limit = [int(b) for b in state["oom_limit"]]
        self.fit_limit = [int(b) for b in state["fit_limit"]]
        self.failed = [int(b) for b in state["failed"]]
        self._memory = [{int(b): int(m) for b, m in points} for points in state["memory"]]


def apply_actions(space: ActionSpace, bounds: BatchBounds, sizes: Sequence[int],
                  actions: Sequence[int]) -> list[int]:
    """New per-rank sizes: size * multiplier[action], rounded, clipped to the rank's bounds."""
    if len(actions) != len(sizes):
        raise ValueError(f"{len(actions)} actions for {len(sizes)} ranks")
    out = []
    for rank, (b, a) in enumerate(zip(sizes, actions)):
        if not 0 <= int(a) < space.n:
            raise ValueError(f"action {a} of rank {rank} outside 0..{space.n - 1}")
        out.append(bounds.clip(rank, round(b * space.multipliers[int(a)])))
    return out


def compose(space: ActionSpace, bounds: BatchBounds, proposed: Sequence[int], actions: Sequence[int],
            batch_range: tuple[int, int] | None = None) -> list[int]:
    """Sizes from the proposal and R + 1 actions (R share corrections, then the batch row's).

    B = round(sum(proposed) * m_batch) within `batch_range` (the proposal's allowed global batches:
    from the initial one up, its trust region) and the bounds' total range; rank i's share is proposed_i *
    m_i, normalised to B; integers by largest remainder within each rank's bounds, so the sum is B
    whenever the bounds allow it. All actions neutral: exactly `proposed` (clipped to the bounds)."""
    R = len(proposed)
    if len(actions) != R + 1:
        raise ValueError(f"{len(actions)} actions for {R} ranks; need one per rank plus the batch row's")
    for row, a in enumerate(actions):
        if not 0 <= int(a) < space.n:
            raise ValueError(f"action {a} of row {row} outside 0..{space.n - 1}")
    lo = [bounds.min_batch] * R
    hi = [bounds.upper(r) for r in range(R)]
    if all(int(a) == space.keep for a in actions):
        return [bounds.clip(r, int(b)) for r, b in enumerate(proposed)]
    target = round(sum(proposed) * space.multipliers[int(actions[R])])
    if batch_range is not None:
        target = max(batch_range[0], min(batch_range[1], target))
    target = max(sum(lo), min(sum(hi), target))
    weights = [max(float(b), 1e-9) * space.multipliers[int(a)] for b, a in zip(proposed, actions[:R])]
    total_w = sum(weights)
    shares = [target * w / total_w for w in weights]
    sizes = [max(lo[r], min(hi[r], math.floor(x))) for r, x in enumerate(shares)]
    order = sorted(range(R), key=lambda r: shares[r] - math.floor(shares[r]), reverse=True)
    total = sum(sizes)
    while total != target:  # each pass moves at least one sample towards the target, or stops
        step = 1 if total < target else -1
        moved = False
        for r in (order if step > 0 else order[::-1]):
            if total == target:
                break
            if lo[r] <= sizes[r] + step <= hi[r]:
                sizes[r] += step
                total += step
                moved = True
        if not moved:
            break
    return sizes
