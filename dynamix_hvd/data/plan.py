"""Epoch plans for unequal per-rank batch sizes. Pure maths: no MPI, no Horovod.

Every rank builds the same plan from (dataset size, seed, epoch, batch sizes), so no communication is
needed to agree on who reads which sample, and every rank knows every other rank's sample count for
every step (the optimizer needs the global count B to weight gradients exactly).

Layout of an epoch: one permutation of the dataset, consumed front to back. A step with batch sizes
b = (b_0, ..., b_{R-1}) takes the next B = sum(b) samples of the permutation and gives rank i the
contiguous block of b_i samples after ranks 0..i-1. Changing b at a step boundary just plans the rest
of the permutation with the new sizes, so nothing is lost or repeated.

The end of an epoch (`last_step`):
- ``"partial"`` (default, exact coverage): when r = N mod B samples remain, they form one more step,
  split in proportion to b with at least one sample per rank. When r < R (fewer samples than ranks)
  they are folded into the previous step instead, so no rank ever gets an empty batch; that step is
  then larger than B by fewer than R samples.
- ``"drop"``: the r < B leftover samples are skipped this epoch (like ``drop_last``). Reshuffling
  makes them different samples each epoch. Every step then has exactly the planned sizes.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

LastStep = Literal["partial", "drop"]


def validate_batch_sizes(batch_sizes: Sequence[int], world_size: int | None = None) -> tuple[int, ...]:
    """Return batch sizes as a tuple of ints, or raise ValueError naming the offending value."""
    sizes = tuple(batch_sizes)
    if world_size is not None and len(sizes) != world_size:
        raise ValueError(f"got {len(sizes)} batch sizes {list(sizes)} for a world of {world_size} ranks; "
                         "give exactly one local batch size per rank")
    if not sizes:
        raise ValueError("batch_sizes is empty; give one local batch size per rank")
    out = []
    for rank, b in enumerate(sizes):
        try:
            value = operator.index(b)  # accepts int and numpy/torch integers, refuses 3.5 and "3"
        except TypeError:
            value = None
        if value is None or isinstance(b, bool):
            raise ValueError(f"batch size of rank {rank} is {b!r}; it must be a positive integer")
        if value < 1:
            raise ValueError(f"batch size of rank {rank} is {value}; it must be >= 1")
        out.append(value)
    return tuple(out)


def split_proportional(total: int, weights: Sequence[int], min_each: int = 1) -> tuple[int, ...]:
    """Split `total` into integers proportional to `weights`, each >= `min_each`, summing to `total`.

    Largest-remainder rounding; ties go to the lower rank so every caller gets the same answer.
    """
    n = len(weights)
    if total < min_each * n:
        raise ValueError(f"cannot split {total} samples over {n} ranks with at least {min_each} each")
    wsum = sum(weights)
    quotas = [total * w / wsum for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(n), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    for i in range(n):  # lift ranks below the minimum, taking from the currently largest
        while counts[i] < min_each:
            donor = max(range(n), key=lambda j: (counts[j], -j))
            counts[donor] -= 1
            counts[i] += 1
    return tuple(counts)


@dataclass(frozen=True)
class PlannedStep:
    """One synchronous step: samples order[start:start+sum(counts)], rank i gets counts[i] of them."""

    start: int
    counts: tuple[int, ...]

    @property
    def global_count(self) -> int:
        return sum(self.counts)

    @property
    def end(self) -> int:
        return self.start + self.global_count

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Positions [lo, hi) in the epoch's permutation that `rank` reads in this step."""
        lo = self.start + sum(self.counts[:rank])
        return lo, lo + self.counts[rank]


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The epoch's sample order: identical on every rank for the same (seed, epoch)."""
    if not shuffle:
        return torch.arange(num_samples)
    gen = torch.Generator()
    # Mix epoch into the seed so consecutive epochs (and consecutive seeds) give unrelated orders.
    gen.manual_seed((int(seed) * 1_000_003 + int(epoch) * 7_919 + 0x5EED) % (2**63))
    return torch.randperm(num_samples, generator=gen)


def plan_steps(num_samples: int, cursor: int, batch_sizes: Sequence[int],
               last_step: LastStep = "partial") -> list[PlannedStep]:
    """Plan the rest of an epoch from position `cursor` of the permutation with `batch_sizes`."""
    sizes = validate_batch_sizes(batch_sizes)
    world = len(sizes)
    if not 0 <= cursor <= num_samples:
        raise ValueError(f"cursor {cursor} outside the epoch [0, {num_samples}]")
    if last_step not in ("partial", "drop"):
        raise ValueError(f"last_step={last_step!r}; choose 'partial' or 'drop'")
    global_batch = sum(sizes)
    remaining = num_samples - cursor
    full, rest = divmod(remaining, global_batch)
    steps = [PlannedStep(cursor + k * global_batch, sizes) for k in range(full)]
    if rest == 0 or last_step == "drop":
        return steps
    if rest >= world:
        steps.append(PlannedStep(cursor + full * global_batch, split_proportional(rest, sizes)))
    elif steps:
        last = steps.pop()
        steps.append(PlannedStep(last.start, split_proportional(global_batch + rest, sizes)))
    else:
        raise ValueError(f"only {rest} samples left for {world} ranks; each rank needs at least one "
                         "(use a dataset with at least as many samples as ranks)")
    return steps
