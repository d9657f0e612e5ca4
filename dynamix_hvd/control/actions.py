"""Discrete batch-size actions and per-rank bounds. Pure maths: no MPI, no Horovod.

The PPO policy corrects the model-based proposal (:mod:`dynamix_hvd.control.proposal`): one action
per rank multiplies that rank's *proposed share*, and one action of the batch row multiplies the
*proposed global batch* (:func:`compose`); the neutral action (1.0) of every row gives exactly the
proposal. Sizes are clipped to [min_batch, max_i], where max_i is the rank's memory bound: the configured
ceiling, lowered by what was learned from an out-of-memory error or from a fit of peak device memory
against batch size (only on CUDA, where the allocator's peak is a per-step measurement). Sizes are
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


@dataclass
class BatchBounds:
    """Per-rank [min_batch, max_batch[i]] with memory learning."""

    world_size: int
    min_batch: int = 1
    max_batch: int = 1024
    memory_safety: float = 0.9
    """Fraction of device memory a batch may plan to use."""
    max_passes: int = 1
    """Micro-batches a decision may accumulate into one optimizer step (gradient accumulation), so
    that the global batch can grow past what memory allows in one pass; 1: none."""
    learned_max: list[int] = field(default_factory=list)
    _memory: list[dict[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(f"impossible batch bounds: min_batch={self.min_batch}, max_batch={self.max_batch}")
        if not 0 < self.memory_safety <= 1:
            raise ValueError(f"memory_safety={self.memory_safety} must be in (0, 1]")
        validate.integer("max_passes", self.max_passes, 1)
        if not self.learned_max:
            self.learned_max = [self.max_batch] * self.world_size
        self._memory = [dict() for _ in range(self.world_size)]

    def upper(self, rank: int) -> int:
        return max(self.min_batch, min(self.max_batch, self.learned_max[rank]))

    def clip(self, rank: int, size: int) -> int:
        return max(self.min_batch, min(self.upper(rank), size))

    def record_oom(self, rank: int, failed_size: int) -> int:
        """Remember that `failed_size` did not fit; returns the new bound (a bit below it)."""
        self.learned_max[rank] = max(self.min_batch, min(self.learned_max[rank], int(failed_size * 0.8)))
        return self.learned_max[rank]

    def record_memory(self, rank: int, size: int, peak_bytes: int, total_bytes: int) -> None:
        """Fit peak = a + c * size from two or more sizes and bound size by the memory budget."""
        self._memory[rank][size] = peak_bytes
        points = sorted(self._memory[rank].items())
        if len(points) < 2 or total_bytes <= 0:
            return
        (b0, m0), (b1, m1) = points[0], points[-1]
        per_sample = (m1 - m0) / (b1 - b0)
        if per_sample <= 0:
            return
        fitted = int((self.memory_safety * total_bytes - (m0 - per_sample * b0)) / per_sample)
        self.learned_max[rank] = max(self.min_batch, min(self.max_batch, fitted))


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
