"""Learning-rate coupling to the global batch size. Pure maths: no MPI, no Horovod.

When the global batch B moves away from the batch B0 the learning rate was tuned for:
- ``adascale`` (the optimizer's default): the AdaScale gain (Johnson et al. 2020)
  r = (tr(Sigma)/B0 + |G|^2) / (tr(Sigma)/B + |G|^2), which lies in [1, B/B0] for B >= B0: linear
  scaling while gradient noise dominates, none once the gradient signal does. The caller supplies the
  gain (the controller, from its gradient statistics); without one the factor is 1. It is the coupling
  under which the controller's efficiency model E(B) holds, so it is the default wherever B changes.
  AdaScale's gain is derived for SGD; it is applied as it is to every optimizer: SGD with or without
  momentum (as in AdaScale's own experiments: momentum multiplies the effective step by the same
  1/(1 - mu) at every B) and Adam-type ones too. The square-root rule for adaptive optimizers
  (Malladi et al. 2022: LR x sqrt(k) at batch k B, with the betas rescaled) gives sqrt(r) instead,
  with ``adaptive=True``; where B grew on the workload zoo's Adam jobs it trained slower and ended
  worse than the full gain (BENCHMARKS.md, "the learning rate on Adam-type optimizers"), so it is
  not the default.
- ``linear``:   B / B0 (Goyal et al. 2017): right for SGD (with momentum) while B stays below the
  gradient noise scale; above it, it overshoots.
- ``sqrt``:     sqrt(B / B0): the square-root rule for Adam-type optimizers (Adam, AdamW, LAMB).
- ``none``:     factor 1.

`LRCoupling` holds what the coupling keeps between steps: the short warm-up after B grows (the factor
ramps from the last applied value to the new one over a few steps) and the scale-invariant progress
tau = the base iterations the steps were worth (AdaScale's iterations; see `dynamix_hvd.optim.progress`):
the factor applied, or its square where the factor is a square-root rule (``sqrt``, and ``adascale``
on an adaptive optimizer).
"""
from __future__ import annotations

import math
from typing import Any, Literal

from .. import validate

LRRule = Literal["none", "linear", "sqrt", "adascale"]
LR_RULES: tuple[str, ...] = ("none", "linear", "sqrt", "adascale")
WARMUP_EPOCH_FRACTION = 0.03
"""Default warm-up after B grows: this fraction of an epoch's optimizer steps at the new B (at least 2)."""


def lr_factor(rule: str, global_batch: int, base_batch: int, gain: float | None = None,
              adaptive: bool = False) -> float:
    """Multiplier for the base learning rate at global batch `global_batch` (`adaptive`: ``adascale``
    applies the square root of the gain, the square-root rule for Adam-type optimizers)."""
    if rule not in LR_RULES:
        raise ValueError(f"lr rule {rule!r} is not one of {', '.join(LR_RULES)}")
    if global_batch < 1 or base_batch < 1:
        raise ValueError(f"batch sizes must be >= 1 (global_batch={global_batch}, base_batch={base_batch})")
    if rule == "none":
        return 1.0
    if rule == "linear":
        return global_batch / base_batch
    if rule == "sqrt":
        return math.sqrt(global_batch / base_batch)
    if gain is None or not math.isfinite(gain) or gain <= 0:
        # No statistics yet (first steps, or a single rank): fall back to no scaling rather than guess.
        return 1.0
    return math.sqrt(gain) if adaptive else float(gain)


def progress_power(rule: str, adaptive: bool) -> int:
    """A step with LR factor f is worth f ** this many base iterations: 2 where f is a square-root
    rule (one step at k B with LR x sqrt(k) is worth k steps), else 1."""
    return 2 if rule == "sqrt" or (rule == "adascale" and adaptive) else 1


def default_warmup_steps(steps_per_epoch: int) -> int:
    """Warm-up length when none is configured: `WARMUP_EPOCH_FRACTION` of an epoch, at least 2 steps."""
    return max(2, math.ceil(WARMUP_EPOCH_FRACTION * max(1, steps_per_epoch)))


def check_warmup_steps(steps: Any) -> int | None:
    if steps is not None:
        validate.integer("lr_warmup_steps", steps, 0,
                         what=f"an integer >= 0 (0: no warm-up) or None (the default: {WARMUP_EPOCH_FRACTION:.0%} "
                              "of an epoch, at least 2 steps)")
    return steps


class LRCoupling:
    """The per-step LR factor with its warm-up after an increase of B, and the progress tau.

    Each step: `plan` gives the factor to apply (changing nothing), and `commit` records it once the
    step really happened (a skipped step makes no progress and does not advance a ramp).

    Warm-up: when B grows and the rule's factor f_new exceeds the last applied factor f_old, step j of
    the next k applies f_old + (f_new - f_old) * j / k (step k applies f_new; k = 0 or 1: no ramp). The
    ramp follows the current target, so a gain that changes during it is tracked; a target below
    f_old (B or the gain fell) applies at once; B growing again restarts the ramp from the factor
    last applied.

    Progress: ``scale_invariant_steps`` (tau) adds what each step was worth in base iterations: for
    ``adascale`` AdaScale's scale-invariant iteration count (sum of the gains r_t, whether the LR took
    r_t or, on an adaptive optimizer, sqrt(r_t)), for ``linear`` and ``sqrt`` the samples seen / B0,
    for ``none`` the raw step count.
    """

    def __init__(self, warmup_steps: int | None = None, adaptive: bool = False) -> None:
        self.warmup_steps = check_warmup_steps(warmup_steps)
        self.adaptive = validate.boolean("adaptive", adaptive)
        self.scale_invariant_steps = 0.0
        self.last_batch: int | None = None
        self.last_factor: float | None = None
        self.ramp_from = 1.0
        self.ramp_length = 0    # 0: no ramp in progress
        self.ramp_done = 0
        self._pending: tuple[int, float, float, int, int] | None = None
        self._pending_progress = 1.0

    def plan(self, rule: str, global_batch: int, base_batch: int, gain: float | None,
             steps_per_epoch: int) -> float:
        """The factor for a step at `global_batch` (`steps_per_epoch`: optimizer steps per epoch at it,
        for the default warm-up length)."""
        target = lr_factor(rule, global_batch, base_batch, gain, self.adaptive)
        start, length, done = self.ramp_from, self.ramp_length, self.ramp_done
        if (self.last_batch is not None and self.last_factor is not None and global_batch > self.last_batch
                and target > self.last_factor):
            k = self.warmup_steps if self.warmup_steps is not None else default_warmup_steps(steps_per_epoch)
            start, length, done = self.last_factor, (k if k > 1 else 0), 0
        factor = target
        if length:
            done += 1
            if target > start:
                factor = start + (target - start) * min(1.0, done / length)
            if done >= length or target <= start:
                length, done = 0, 0
        self._pending = (global_batch, factor, start, length, done)
        self._pending_progress = factor ** progress_power(rule, self.adaptive)
        return factor

    def commit(self) -> None:
        """The planned step happened: advance the ramp and add its factor to the progress."""
        if self._pending is None:
            raise RuntimeError("LRCoupling.commit() without a plan() for this step")
        (self.last_batch, self.last_factor, self.ramp_from, self.ramp_length,
         self.ramp_done), self._pending = self._pending, None
        self.scale_invariant_steps += self._pending_progress

    def state_dict(self) -> dict[str, Any]:
        """Plain values (warm-up configuration excluded: it belongs to the constructor)."""
        return {"scale_invariant_steps": self.scale_invariant_steps, "last_batch": self.last_batch,
                "last_factor": self.last_factor, "ramp_from": self.ramp_from, "ramp_length": self.ramp_length,
                "ramp_done": self.ramp_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_invariant_steps = float(state["scale_invariant_steps"])
        self.last_batch = None if state["last_batch"] is None else int(state["last_batch"])
        self.last_factor = None if state["last_factor"] is None else float(state["last_factor"])
        self.ramp_from = float(state["ramp_from"])
        self.ramp_length, self.ramp_done = int(state["ramp_length"]), int(state["ramp_done"])
        self._pending = None
