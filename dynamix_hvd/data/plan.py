"""Epoch plans for unequal local batch sizes. Pure maths: no MPI, no Horovod.

Every rank builds the same plan from (dataset size, seed, epoch, local batch sizes), so no
communication is needed to agree on who reads which sample, and every rank knows every other rank's
sample count for every micro-batch (the optimizer needs the global count to weight gradients exactly).

Layout of an epoch: one permutation of the dataset, consumed front to back. A planned step is one
micro-batch: with local batches b = (b_0, ..., b_{R-1}) it takes the next M = sum(b) samples of the
permutation (the global micro-batch) and gives rank i the contiguous block of b_i samples after ranks
0..i-1. Changing b at a step boundary just plans the rest of the permutation with the new sizes, so
nothing is lost or repeated. (An optimizer step of p passes takes p planned steps: B = p M.)

The end of an epoch (`last_step`):
- ``"partial"`` (default, exact coverage): when r = N mod M samples remain, they form one more step,
  split in proportion to b with at least one sample per rank. When r < R (fewer samples than ranks)
  they are folded into the previous step instead, so no rank ever gets an empty batch; that step is
  then larger than M by fewer than R samples.
- ``"drop"``: the r < M leftover samples are skipped this epoch (like ``drop_last``). Reshuffling
  makes them different samples each epoch. Every step then has exactly the planned sizes.
"""
from __future__ import annotations

import bisect
import math
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
    """One synchronous step: samples order[start:start+sum(counts)], rank i gets counts[i] of them
    (and, where per-sample lengths are known, tokens[i] tokens)."""

    start: int
    counts: tuple[int, ...]
    tokens: tuple[int, ...] | None = None

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
    micro_batch = sum(sizes)
    remaining = num_samples - cursor
    full, rest = divmod(remaining, micro_batch)
    steps = [PlannedStep(cursor + k * micro_batch, sizes) for k in range(full)]
    if rest == 0 or last_step == "drop":
        return steps
    if rest >= world:
        steps.append(PlannedStep(cursor + full * micro_batch, split_proportional(rest, sizes)))
    elif steps:
        last = steps.pop()
        steps.append(PlannedStep(last.start, split_proportional(micro_batch + rest, sizes)))
    else:
        raise ValueError(f"only {rest} samples left for {world} ranks; each rank needs at least one "
                         "(use a dataset with at least as many samples as ranks)")
    return steps


# --- variable-length samples: token counts and token budgets ------------------------------------------
#
# With per-sample lengths (valid tokens), a step can also be planned by a token budget per rank: rank i
# takes the next samples of the permutation while their tokens stay within its budget (at least one
# sample, so a sample longer than the budget goes alone). Every rank computes the same plan from the
# same lengths, so every rank knows every rank's token count of every step without a collective.
# The epoch's last step splits what is left in proportion to the budgets, by tokens (at least one
# sample per rank; fewer samples than ranks are folded into the previous step), or is dropped.


def validate_lengths(lengths: Sequence[int], num_samples: int) -> torch.Tensor:
    """Per-sample token counts as an int64 tensor, or ValueError naming the offending value."""
    try:
        out = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"lengths must be a sequence of integers, one per sample ({exc})") from None
    if out.dim() != 1 or len(out) != num_samples:
        raise ValueError(f"lengths has shape {tuple(out.shape)}; give one token count per sample "
                         f"({num_samples} samples)")
    if out.is_floating_point() or out.is_complex() or out.dtype == torch.bool:
        raise ValueError(f"lengths has dtype {out.dtype}; token counts must be integers")
    if num_samples and int(out.min()) < 1:
        i = int(torch.argmin(out))
        raise ValueError(f"sample {i} has length {int(out[i])}; every sample needs at least one token")
    return out.to(torch.int64)


def sortish_order(order: torch.Tensor, lengths: torch.Tensor, window: int, seed: int, epoch: int) -> torch.Tensor:
    """Bucket by length: cut the epoch's permutation into windows of `window` samples and sort each by
    length, ascending or descending at random per window, so consecutive samples (one step's batch)
    have similar lengths while the epoch stays a shuffle at the scale of windows. Same on every rank."""
    if window <= 1:
        return order
    gen = torch.Generator()
    gen.manual_seed((int(seed) * 999_983 + int(epoch) * 104_729 + 0xB0C) % (2**63))
    flips = torch.rand(math.ceil(len(order) / window), generator=gen) < 0.5
    parts = []
    for k, lo in enumerate(range(0, len(order), window)):
        chunk = order[lo:lo + window]
        key = lengths[chunk]
        # stable sort on (length, position) so ties keep the permutation's order on every platform
        idx = torch.sort(key, stable=True, descending=bool(flips[k])).indices
        parts.append(chunk[idx])
    return torch.cat(parts) if parts else order


def token_cumsum(lengths_in_order: torch.Tensor) -> list[int]:
    """c[k] = tokens of the first k samples of the epoch's order (c[0] = 0), as a list: planning
    reads it with bisect, once per rank and step, and the loader keeps it for the whole epoch."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths_in_order, 0)]).tolist()


def with_tokens(steps: Sequence[PlannedStep], cum: Sequence[int]) -> list[PlannedStep]:
    """`steps` (planned by sample counts) with each rank's token count, from the epoch order's
    cumulative lengths `cum`."""
    c = cum
    return [PlannedStep(s.start, s.counts, _tokens(c, s.start, s.counts)) for s in steps]


def _split_by_tokens(c: list[int], lo: int, hi: int, budgets: Sequence[int]) -> tuple[int, ...]:
    """Samples [lo, hi) as contiguous blocks whose tokens are in proportion to `budgets`, >= 1 each."""
    world, share = len(budgets), sum(budgets)
    total = c[hi] - c[lo]
    cuts, acc = [lo], 0
    for k in range(1, world):
        acc += budgets[k - 1]
        cut = bisect.bisect_left(c, c[lo] + total * acc / share, lo, hi)
        cuts.append(min(max(cut, cuts[-1] + 1), hi - (world - k)))
    cuts.append(hi)
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))


def plan_token_steps(cum: Sequence[int], cursor: int, budgets: Sequence[int],
                     last_step: LastStep = "partial") -> list[PlannedStep]:
    """Plan the rest of an epoch from position `cursor` with per-rank token budgets; `cum` is
    `token_cumsum` of the epoch's order. Steps carry each rank's token count in ``tokens``."""
    budgets = validate_batch_sizes(budgets)
    world = len(budgets)
    num_samples = len(cum) - 1
    if not 0 <= cursor <= num_samples:
        raise ValueError(f"cursor {cursor} outside the epoch [0, {num_samples}]")
    if last_step not in ("partial", "drop"):
        raise ValueError(f"last_step={last_step!r}; choose 'partial' or 'drop'")
    # Greedy fill with one searchsorted per rank and step, on the host.
    c = cum
    steps: list[PlannedStep] = []
    pos, need = cursor, sum(budgets)
    while pos < num_samples:
        counts, p = [], pos
        if c[num_samples] - c[pos] >= need:
            for b in budgets:
                if p >= num_samples:
                    break
                end = bisect.bisect_right(c, c[p] + b, lo=p + 1) - 1  # largest end with c[end] <= c[p] + b
                end = min(max(end, p + 1), num_samples)
                counts.append(end - p)
                p = end
        if len(counts) == world:  # a full step
            steps.append(PlannedStep(pos, tuple(counts), _tokens(c, pos, counts)))
            pos = p
            continue
        rest = num_samples - pos  # the epoch's last, partial step
        if last_step == "drop":
            break
        if rest >= world:
            counts_t = _split_by_tokens(c, pos, num_samples, budgets)
            steps.append(PlannedStep(pos, counts_t, _tokens(c, pos, counts_t)))
        elif steps:
            last = steps.pop()
            counts_t = _split_by_tokens(c, last.start, num_samples, budgets)
            steps.append(PlannedStep(last.start, counts_t, _tokens(c, last.start, counts_t)))
        else:
            raise ValueError(f"only {rest} samples left for {world} ranks; each rank needs at least one "
                             "(use a dataset with at least as many samples as ranks)")
        break
    return steps


def _tokens(c: list[int], start: int, counts: Sequence[int]) -> tuple[int, ...]:
    out, lo = [], start
    for b in counts:
        out.append(c[lo + b] - c[lo])
        lo += b
    return tuple(out)
