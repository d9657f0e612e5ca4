"""A data loader whose per-rank batch sizes can differ and change between steps.

Wraps ``torch.utils.data.DataLoader`` (collation, workers, pinning stay PyTorch's) with a batch
sampler built from the shared epoch plan (`dynamix_hvd.data.plan`): every rank runs the same number of
steps, rank i reads b_i samples per step, and the epoch covers every sample exactly once.

Ordering hazard: a DataLoader with workers prefetches batches. When sizes change mid-epoch, batches
prefetched under the old sizes must not be used, so the loader drops its DataLoader iterator and
starts a new one at the first sample not yet handed out. The cursor only advances over batches
actually handed to the training loop, which is what makes a change lossless.

A step ends when the training loop asks for the next batch (or the epoch runs out): only then do the
step-end callbacks run. A checkpoint taken inside the loop body, after ``optimizer.step()``, is
therefore taken before its step ended; the state records how many of the callbacks had started, and
a loader resumed from it runs the rest before it hands out its first batch, as the uninterrupted
run did at that point.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .metrics import StepTracker
from .plan import (LastStep, PlannedStep, epoch_permutation, plan_steps, plan_token_steps, sortish_order,
                   token_cumsum, validate_batch_sizes, validate_lengths, with_tokens)
from .. import validate

Budget = Literal["samples", "tokens"]
DEFAULT_SORT_WINDOW = 1024


@dataclass(frozen=True)
class _Plan:
    """An epoch's plan from some cursor on, with what it was planned for."""

    epoch: int
    sizes: tuple[int, ...]
    last_step: str
    order: tuple[Any, ...]      # the loader's epoch order it was planned on (identity)
    steps: list[PlannedStep]
    index: dict[int, int]       # a step's start (and the plan's end) -> its position in `steps`


class AdaptiveLoader:
    """Iterate one rank's batches of an epoch under per-rank batch sizes `batch_sizes`.

    Args:
        dataset: map-style dataset (``__len__`` and ``__getitem__``), the same on every rank.
        batch_sizes: local batch size of every rank, in rank order.
        rank: this process's rank (``hvd.rank()``).
        seed: shuffling seed, the same on every rank.
        shuffle: reshuffle every epoch (deterministically from seed and epoch).
        last_step: end-of-epoch policy, see `dynamix_hvd.data.plan` ("partial" keeps every sample).
        lengths: per-sample token counts (the tokens the loss counts), for variable-length data. Then
            every step knows every rank's token count (``current_step.tokens``) without a collective,
            which the optimizer's token-weighted mean uses.
        budget: what `batch_sizes` count: "samples" (default) or "tokens" (needs `lengths`): each rank's
            step then takes the next samples while their tokens stay within its budget (at least one
            sample), so a slow rank can be given fewer tokens; the controller and the step records
            then count tokens too.
        sort_window: bucket by length: sort each window of this many samples of the epoch's
            permutation by length (0: no sorting; default 1024 with ``budget="tokens"``, else 0), so a
            step's samples have similar lengths and little padding.
        loader_kwargs: passed to ``DataLoader`` (num_workers, collate_fn, pin_memory, ...).
    """

    def __init__(self, dataset: Dataset, batch_sizes: Sequence[int], rank: int, *, seed: int = 0,
                 shuffle: bool = True, last_step: LastStep = "partial",
                 device: torch.device | None = None, lengths: Sequence[int] | None = None,
                 budget: Budget = "samples", sort_window: int | None = None, **loader_kwargs: Any) -> None:
        sizes = validate_batch_sizes(batch_sizes)
        if budget not in ("samples", "tokens"):
            raise ValueError(f"AdaptiveLoader budget={budget!r}; choose 'samples' or 'tokens'")
        if budget == "tokens" and lengths is None:
            raise ValueError("AdaptiveLoader budget='tokens' needs lengths= (each sample's token count)")
        if sort_window is None:
            sort_window = DEFAULT_SORT_WINDOW if budget == "tokens" else 0
        validate.integer("AdaptiveLoader sort_window", sort_window, 0)
        if sort_window > 1 and lengths is None:
            raise ValueError(f"AdaptiveLoader sort_window={sort_window} sorts by length and needs lengths=")
        if not 0 <= rank < len(sizes):
            raise ValueError(f"rank {rank} outside a world of {len(sizes)} ranks (batch_sizes={list(sizes)})")
        for bad in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
            if bad in loader_kwargs:
                raise ValueError(f"AdaptiveLoader plans batches itself; do not pass {bad}="
                                 f"{loader_kwargs[bad]!r}")
        validate.integer("AdaptiveLoader seed", seed, 0)
        validate.boolean("AdaptiveLoader shuffle", shuffle)
        self.dataset = dataset
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if self.num_samples < len(sizes):
            raise ValueError(f"dataset has {self.num_samples} samples for {len(sizes)} ranks; "
                             "every rank needs at least one sample per epoch")
        self.lengths = None if lengths is None else validate_lengths(lengths, self.num_samples)
        self.budget: Budget = budget
        self.sort_window = sort_window
        # (epoch, order, token cumsum, squared-length cumsum with token budgets)
        self._order: tuple[int, torch.Tensor, list[int] | None, list[int] | None] | None = None
        # The epoch's plan under the current sizes (see `_plan_left`), and the epoch's size with token
        # budgets: each recomputed only when what it depends on changed.
        self._plan: _Plan | None = None
        self._epoch_tokens: tuple[torch.Tensor, int, int] | None = None  # (lengths, its version, sum)
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.last_step: LastStep = last_step
        self.loader_kwargs = loader_kwargs
        self.tracker = StepTracker(rank=rank, device=device)
        self.epoch = 0
        self._sizes = sizes
        self._cursor = 0          # permutation position of the first sample not yet handed out
        self._step = 0            # steps handed out in this epoch
        self._generation = 0      # bumped by set_batch_sizes, so a running iterator replans
        self._current: PlannedStep | None = None
        self._resumed = False     # set by load_state_dict: the next set_epoch(same epoch) keeps the cursor
        # Step-end callbacks started for the step handed out last (None: no step awaits its end), and
        # the same for a step restored by load_state_dict, whose remaining callbacks are still to run.
        self._ends_started: int | None = None
        self._restored_ends: int | None = None
        # Called on every rank at the same points: after each step's batch was used (when the next
        # one is asked for) and at the end of the epoch. A callback may call set_batch_sizes().
        self.step_end_callbacks: list[Callable[["AdaptiveLoader", bool], None]] = []
        self.remaining_steps()  # validate the policy and sizes up front

    # --- configuration ----------------------------------------------------------------------------
    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def world_size(self) -> int:
        return len(self._sizes)

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Use new per-rank sizes from the next step on (now if between epochs). Same world size."""
        sizes = validate_batch_sizes(batch_sizes, self.world_size)
        if sizes != self._sizes:
            self._sizes = sizes
            self._generation += 1

    def redo_current_step(self, batch_sizes: Sequence[int], group: Sequence[PlannedStep] = ()) -> None:
        """Serve the samples of the step just handed out again, split with new sizes (after a failure).
        `group`: the steps of one optimizer step that ends with the current one (its micro-batches),
        all of which are served again."""
        steps = list(group) or [self.current_step]
        if steps[-1] is not self.current_step or len(steps) > self._step:
            raise ValueError("group must be the last steps handed out in this epoch, ending with the current one")
        sizes = validate_batch_sizes(batch_sizes, self.world_size)
        self._cursor = steps[0].start
        self._step -= len(steps)
        self._sizes = sizes
        self._generation += 1

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (reshuffled from seed and epoch). Right after
        `load_state_dict`, the restored epoch instead continues where the checkpoint left it."""
        if self._resumed and int(epoch) == self.epoch:
            self._resumed = False
            return
        self._finish_step()  # a restored step that had not ended ends in the epoch it belongs to
        self._resumed = False
        self.epoch = int(epoch)
        self._cursor = 0
        self._step = 0

    # --- what the optimizer needs -------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps handed out so far in the current epoch."""
        return self._step

    @property
    def epochs_done(self) -> float:
        """Epochs handed out so far, fractional: the current epoch's number plus the share of its
        samples handed out."""
        return self.epoch + self._cursor / max(self.num_samples, 1)

    @property
    def current_step(self) -> PlannedStep:
        """The step whose batch was handed out last: every rank's sample count in it."""
        if self._current is None:
            raise RuntimeError("no batch has been handed out yet; iterate the loader before stepping")
        return self._current

    @property
    def global_micro_batch(self) -> int:
        """The global micro-batch: the sum of the local batches, in the loader's unit (samples, or
        tokens with ``budget="tokens"``); an optimizer step of p passes takes p of them (the global
        batch)."""
        return sum(self._sizes)

    @property
    def epoch_size(self) -> int:
        """One epoch in the loader's unit: samples, or tokens with ``budget="tokens"`` (the sum of
        `lengths`, summed again only when `lengths` is replaced or changed in place)."""
        if self.budget != "tokens":
            return self.num_samples
        lengths = self.lengths
        assert lengths is not None
        cached = self._epoch_tokens
        if cached is None or cached[0] is not lengths or cached[1] != lengths._version:
            cached = self._epoch_tokens = (lengths, lengths._version, int(lengths.sum()))
        return cached[2]

    def units(self, step: PlannedStep) -> tuple[int, ...]:
        """Every rank's share of `step` in the loader's unit (what `batch_sizes` count)."""
        if self.budget == "tokens":
            assert step.tokens is not None
            return step.tokens
        return step.counts

    # --- iteration -----------------------------------------------------------------------------------
    def _epoch_order(self) -> tuple[torch.Tensor, list[int] | None]:
        """The epoch's sample order and, with lengths, its cumulative token counts (cached per epoch,
        with the cumulative squared lengths where budgets count tokens)."""
        if self._order is None or self._order[0] != self.epoch:
            order = epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle)
            cum = sq_cum = None
            if self.lengths is not None:
                order = sortish_order(order, self.lengths, self.sort_window, self.seed, self.epoch)
                cum = token_cumsum(self.lengths[order])
                if self.budget == "tokens":
                    sq_cum = token_cumsum(self.lengths[order] ** 2)
            self._order = (self.epoch, order, cum, sq_cum)
        return self._order[1], self._order[2]

    def _plan_left(self) -> tuple[list[PlannedStep], int]:
        """The epoch's plan under the current sizes and where the cursor is in it: ``steps[i:]`` are
        the steps left. Planned when the epoch, the sizes, the end-of-epoch policy or the epoch's order
        changed, or the cursor is at no planned step's start (a resumed state); read otherwise. A plan
        made from a later step's start would be the same steps: planning is greedy from the cursor."""
        self._epoch_order()
        plan = self._plan
        if (plan is not None and plan.sizes is self._sizes and plan.order is self._order
                and plan.epoch == self.epoch and plan.last_step == self.last_step):
            i = plan.index.get(self._cursor)
            if i is not None:
                return plan.steps, i
        _, _, cum, _ = self._order  # type: ignore[misc]
        if self.budget == "tokens":
            assert cum is not None
            steps = plan_token_steps(cum, self._cursor, self._sizes, self.last_step)
        else:
            steps = plan_steps(self.num_samples, self._cursor, self._sizes, self.last_step)
            if cum is not None:
                steps = with_tokens(steps, cum)
        index = {s.start: k for k, s in enumerate(steps)}
        index[steps[-1].end if steps else self._cursor] = len(steps)  # the epoch's end: nothing left
        self._plan = _Plan(self.epoch, self._sizes, self.last_step, self._order, steps, index)
        return steps, 0

    def remaining_steps(self) -> list[PlannedStep]:
        """The steps of the current epoch not handed out yet, under the current sizes."""
        steps, i = self._plan_left()
        return steps[i:]

    @property
    def steps_left(self) -> int:
        """How many steps of the current epoch are not handed out yet, under the current sizes
        (``len(remaining_steps())``, without copying the plan)."""
        steps, i = self._plan_left()
        return len(steps) - i

    def __len__(self) -> int:
        """Steps of the current epoch under the current sizes: those handed out plus those left.
        Constant through an epoch whose sizes do not change, as a DataLoader's length is (training
        scripts use it mid-epoch, e.g. for LR warm-up by fraction of the epoch)."""
        return self._step + self.steps_left

    def _local_sq_tokens(self, step: PlannedStep) -> int:
        """With token budgets, the sum of this rank's squared sample lengths in `step` (what attention
        costs grow with; the cost model fits it beside the tokens); 0 otherwise."""
        sq_cum = self._order[3] if self._order is not None else None
        if sq_cum is None:
            return 0
        lo, hi = step.rank_range(self.rank)
        return sq_cum[hi] - sq_cum[lo]

    def _indices(self, order: torch.Tensor, step: PlannedStep) -> list[int]:
        lo, hi = step.rank_range(self.rank)
        return order[lo:hi].tolist()

    def _end_step(self, epoch_end: bool, start: int = 0) -> None:
        """Run the step-end callbacks from index `start` on (each counts as started before it runs, so
        a checkpoint written by one of them resumes after it)."""
        i = start
        while i < len(self.step_end_callbacks):
            self._ends_started = i = i + 1
            self.step_end_callbacks[i - 1](self, epoch_end)
        self._ends_started = None

    def _finish_step(self) -> None:
        """The rest of the step-end callbacks of a step restored before it ended."""
        start, self._restored_ends = self._restored_ends, None
        if start is not None:
            self._end_step(not self.remaining_steps(), start)

    def __iter__(self) -> Iterator[Any]:
        self._finish_step()
        order, _ = self._epoch_order()
        epoch_end = False
        while not epoch_end:
            steps = self.remaining_steps()
            if not steps:
                break
            generation = self._generation
            loader = DataLoader(self.dataset, batch_sampler=[self._indices(order, s) for s in steps],
                                **self.loader_kwargs)
            batches = iter(loader)
            for planned in steps:
                self.tracker.batch_requested()
                batch = next(batches)
                self._current = planned
                self._cursor = planned.end
                self._step += 1
                units = self.units(planned)
                self.tracker.batch_ready(self.epoch, self._step - 1, units[self.rank], sum(units),
                                         planned.tokens, self._local_sq_tokens(planned))
                self._ends_started = 0
                yield batch
                epoch_end = planned is steps[-1] and self._cursor == planned.end  # not rewound
                self._end_step(epoch_end)
                if epoch_end or self._generation != generation:
                    break  # sizes changed at this step boundary: replan from the cursor
            del batches, loader  # shuts down workers holding batches planned with the old sizes
        self.epoch += 1
        self._cursor = 0
        self._step = 0

    # --- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self._cursor, "step": self._step,
                "batch_sizes": list(self._sizes), "seed": self.seed, "num_samples": self.num_samples,
                "step_ends_started": self._ends_started, "budget": self.budget}

    def load_state_dict(self, state: dict[str, Any], batch_sizes: Sequence[int] | None = None,
                        rank: int | None = None) -> None:
        """Resume mid-epoch; `batch_sizes` (and `rank`) may give a new world's sizes (after a restart
        or an elastic reset). A step saved before it ended gets the rest of its step-end callbacks
        before the next batch."""
        if rank is not None:
            self.rank = self.tracker.rank = int(rank)
        if state["num_samples"] != self.num_samples:
            raise ValueError(f"checkpoint was taken on {state['num_samples']} samples, this dataset has "
                             f"{self.num_samples}")
        if state.get("budget", "samples") != self.budget:
            raise ValueError(f"checkpoint's batch sizes count {state.get('budget', 'samples')}, this loader's "
                             f"count {self.budget} (budget=)")
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self._order = None
        self._cursor = state["cursor"]
        self._step = state["step"]
        if batch_sizes is not None:
            self._sizes = validate_batch_sizes(batch_sizes)
            if not 0 <= self.rank < len(self._sizes):
                raise ValueError(f"rank {self.rank} outside the new world of {len(self._sizes)} ranks")
        else:
            self._sizes = validate_batch_sizes(state["batch_sizes"], self.world_size)
        started = state.get("step_ends_started")  # absent in states from before step-end tracking
        self._ends_started = self._restored_ends = None if started is None else int(started)
        self._generation += 1
        self._resumed = True

