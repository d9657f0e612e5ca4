"""LR schedules that follow training progress, not raw optimizer steps. Pure: torch only, no MPI/Horovod.

When the global batch B changes, a step no longer means the same amount of training: a step at B
with LR factor r (the AdaScale gain, or B/B0 under the linear rule) does about r steps' worth of work
at the base batch B0. The weighted optimizer therefore counts progress in base iterations, its
``scale_invariant_steps`` tau (the sum of the factors applied, AdaScale's scale-invariant
iterations), and in base-batch-equivalent epochs (tau x B0 / samples per epoch). A schedule written
for T base steps or E epochs stays right when B changes if it is a function of tau: `ProgressScheduler`
steps any torch LR scheduler ``floor(tau) - done`` times after each optimizer step (per-epoch
schedulers: once per base-equivalent epoch), and training of T base steps ends when
``optimizer.progress_done(T)`` (AdaScale: when tau reaches T).

Usage::

    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ..., loader)
    sched = ProgressScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.1), opt)
    while not opt.progress_done(total_base_steps):
        ...; loss.backward(); opt.step(); sched.step()   # sched.step() after every optimizer step
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Literal, Protocol

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from .lr_scaling import LRCoupling
from .. import validate

_EPS = 1e-9  # tau is a float sum: 2.9999999999 base steps are 3


class ProgressOptimizer(Protocol):
    """What `ProgressScheduler` reads (`dynamix_hvd.WeightedDistributedOptimizer` provides it)."""

    @property
    def scale_invariant_steps(self) -> float: ...

    @property
    def scale_invariant_epochs(self) -> float: ...


def whole(progress: float) -> int:
    """Completed units of a float progress count (tolerating the sum's rounding)."""
    return math.floor(progress + _EPS * max(1.0, abs(progress)))


def _budget(name: str, value: Any) -> float:
    return float(validate.number(name, value, 0))


class ProgressAccounting:
    """The weighted optimizer's progress surface (a mixin: it reads ``lr_coupling``, the LR coupling
    that sums the applied factors, ``base_batch_size`` and ``loader.epoch_size``)."""

    lr_coupling: LRCoupling
    base_batch_size: int
    loader: Any

    @property
    def scale_invariant_steps(self) -> float:
        """Training progress in base iterations: the sum of the LR factors applied (AdaScale's tau)."""
        return self.lr_coupling.scale_invariant_steps

    @property
    def scale_invariant_epochs(self) -> float:
        """Progress in epochs at the base batch: tau x base_batch_size / epoch size (samples, or tokens
        when the loader plans by token budgets)."""
        return self.lr_coupling.scale_invariant_steps * self.base_batch_size / self.loader.epoch_size

    def progress_done(self, total_base_steps: float | None = None, *, epochs: float | None = None) -> bool:
        """True once the budget is reached: `total_base_steps` base iterations (AdaScale's T), or
        `epochs` base-equivalent epochs; give exactly one."""
        if (total_base_steps is None) == (epochs is None):
            raise ValueError(f"give total_base_steps or epochs, one of them (got total_base_steps="
                             f"{total_base_steps!r}, epochs={epochs!r})")
        if total_base_steps is not None:
            done, total = self.scale_invariant_steps, _budget("total_base_steps", total_base_steps)
        else:
            done, total = self.scale_invariant_epochs, _budget("epochs", epochs)
        return done >= total - _EPS * max(1.0, total)


class ProgressScheduler:
    """Drive `scheduler` by the optimizer's progress: ``per="step"`` steps it once per base iteration
    (tau), ``per="epoch"`` once per base-batch-equivalent epoch. Call `step()` after every optimizer
    step (skipped ones included: they make no progress), never ``scheduler.step()`` yourself.

    `limit`: never step `scheduler` more than this many times in all (default for OneCycleLR:
    ``total_steps - 1``, the step at which it reaches its floor; one more step would move the LR off
    the floor and the next raises, so optimizer steps past the schedule's end keep the floor). The
    last optimizer step may overshoot a budget by up to its factor. ReduceLROnPlateau follows a
    metric, not progress, and is refused.
    """

    def __init__(self, scheduler: LRScheduler, optimizer: ProgressOptimizer, *,
                 per: Literal["step", "epoch"] = "step", limit: int | None = None) -> None:
        if isinstance(scheduler, ReduceLROnPlateau) or not isinstance(scheduler, LRScheduler):
            raise TypeError(f"scheduler={type(scheduler).__name__}: give a torch LR scheduler that is a function of "
                            "the step count (StepLR, OneCycleLR, LambdaLR, SequentialLR, ...); ReduceLROnPlateau "
                            "follows a metric, step it yourself")
        # built on the user's optimizer before wrapping is fine: the wrapper shares its parameter groups
        shared = getattr(scheduler.optimizer, "param_groups", None)
        if scheduler.optimizer is not optimizer and not (
                shared is not None and len(shared) == len(optimizer.param_groups)
                and all(a is b for a, b in zip(shared, optimizer.param_groups))):
            raise ValueError("scheduler was built on a different optimizer than `optimizer` (one that does not "
                             "share its parameter groups)")
        if not hasattr(optimizer, "scale_invariant_steps"):
            raise TypeError(f"optimizer {type(optimizer).__name__} counts no progress; wrap it with "
                            "dynamix_hvd.WeightedDistributedOptimizer")
        if per not in ("step", "epoch"):
            raise ValueError(f"per={per!r}; choose 'step' (one scheduler step per base iteration) or 'epoch'")
        if limit is None and getattr(scheduler, "total_steps", None) is not None:
            limit = max(0, int(scheduler.total_steps) - 1)
        if limit is not None:
            validate.integer("limit", limit, 0, what="an integer >= 0 or None")
        self.scheduler, self.optimizer, self.per, self.limit = scheduler, optimizer, per, limit
        self._built_on_inner = scheduler.optimizer is not optimizer
        self.done = 0
        """Scheduler steps taken so far."""

    @property
    def progress(self) -> float:
        """Base iterations (per="step") or base-equivalent epochs (per="epoch") done so far."""
        if self.per == "step":
            return float(self.optimizer.scale_invariant_steps)
        return float(self.optimizer.scale_invariant_epochs)

    def step(self) -> int:
        """Catch the scheduler up with the progress; returns how many times it was stepped now."""
        target = whole(self.progress)
        if self.limit is not None:
            target = min(target, self.limit)
        n = max(0, target - self.done)
        with warnings.catch_warnings():
            if self._built_on_inner:  # torch counts steps of the optimizer it was built on, never stepped itself
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            for _ in range(n):
                self.scheduler.step()
        self.done += n
        return n

    def get_last_lr(self) -> list[float]:
        """The scheduler's base LR of each group (the optimizer multiplies it by the rule's factor)."""
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.done = int(state["done"])
