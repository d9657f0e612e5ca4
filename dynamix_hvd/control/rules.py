"""The classic batch-size rules, behind the same interface as the PPO policy. Pure: no MPI/Horovod.

Each rule chooses a global batch B and a split over the ranks; all see the same `DecisionInput`
(reports of the last interval, global context with the noise scale, current sizes, bounds), and all
are selectable by name through `make_baseline`. Schedules count decisions (one per epoch by default).

- ``static``            keep the sizes (the reference).
- ``linear-ramp``       Megatron's --rampup-batch-size: B grows linearly from B0 to `end` over `ramp`.
- ``adabatch``          AdaBatch: double B every `every` decisions, up to `end`.
- ``increase-batch``    Smith et al. 2018: where a step LR schedule would divide the LR by `factor`
                        (at the progress `milestones`), multiply B by `factor` instead.
- ``noise-scale``       B follows the measured gradient noise scale B_simple (times `scale`).
- ``goodput``           Pollux/AdaptDL: fitted per-rank costs, network and overlap; the B from the initial
                        batch up that maximises throughput x statistical efficiency; > 5% gain to switch.
- ``speed-split``       keep B, split it so that all ranks arrive at the allreduce together.

``goodput`` and ``speed-split`` are the model-based proposal (:mod:`dynamix_hvd.control.proposal`)
with other settings: one implementation of the cost fits and of the split.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .actions import BatchBounds
from ..data.plan import split_proportional
from .policy import DecisionInput, DecisionOutput
from .proposal import ModelPolicy, ProposalConfig


def split(global_batch: int, weights: Sequence[float], bounds: BatchBounds) -> list[int]:
    """Split B in proportion to `weights`, within each rank's bounds (B may shrink to fit them)."""
    world = len(weights)
    total = max(int(round(global_batch)), world * bounds.min_batch)
    total = min(total, sum(bounds.upper(r) for r in range(world)))
    scaled = [max(1, int(round(1000 * w / max(weights)))) for w in weights]
    sizes = list(split_proportional(total, scaled, min_each=bounds.min_batch))
    return [bounds.clip(r, b) for r, b in enumerate(sizes)]


def accumulation(global_batch: float, bounds: BatchBounds, world: int, current: int) -> int:
    """Micro-batches per step for a rule's target B: the fewest that fit B into the memory bounds,
    up to ``bounds.max_passes``; `current` when accumulation is not the controller's (max_passes 1)."""
    if bounds.max_passes == 1:
        return current
    one_pass = sum(bounds.upper(r) for r in range(world))
    return max(1, min(bounds.max_passes, math.ceil(global_batch / one_pass)))


class _Rule:
    name = "rule"

    def __init__(self) -> None:
        self.decisions = 0
        self.base: int | None = None

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:  # (global batch, split weights)
        raise NotImplementedError

    def decide(self, inp: DecisionInput) -> DecisionOutput:
        self.base = self.base or inp.passes * sum(inp.sizes)
        global_batch, weights = self.target(inp)
        self.decisions += 1
        passes = accumulation(global_batch, inp.bounds, len(weights), inp.passes)
        micro = split(math.ceil(global_batch / passes), weights, inp.bounds)
        return DecisionOutput(micro, {"target_global_batch": global_batch, "passes": passes}, passes)

    def after_decision(self) -> dict[str, float]:
        return {}

    def reset_world(self, world_size: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"decisions": self.decisions, "base": self.base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decisions, self.base = state["decisions"], state["base"]


class LinearRamp(_Rule):
    name = "linear-ramp"

    def __init__(self, end: int = 512, ramp: int = 10) -> None:
        super().__init__()
        self.end, self.ramp = end, ramp

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        frac = min(1.0, (self.decisions + 1) / self.ramp)
        return int(self.base + frac * (self.end - self.base)), [1.0] * len(inp.sizes)


class AdaBatch(_Rule):
    name = "adabatch"

    def __init__(self, every: int = 2, end: int = 1024) -> None:
        super().__init__()
        self.every, self.end = every, end

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        return min(self.end, self.base * 2 ** ((self.decisions + 1) // self.every)), [1.0] * len(inp.sizes)


class IncreaseBatch(_Rule):
    name = "increase-batch"

    def __init__(self, milestones: Sequence[float] = (0.5, 0.75), factor: float = 5.0) -> None:
        super().__init__()
        self.milestones, self.factor = tuple(milestones), factor

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        passed = sum(inp.ctx.progress >= m for m in self.milestones)
        return int(self.base * self.factor**passed), [1.0] * len(inp.sizes)


class NoiseScaleRule(_Rule):
    name = "noise-scale"

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        noise = inp.ctx.noise_scale
        global_batch = self.scale * noise if math.isfinite(noise) and noise > 0 else inp.passes * sum(inp.sizes)
        return int(global_batch), [1.0] * len(inp.sizes)


class SpeedSplit(ModelPolicy):
    """Keep B; split it so that every rank arrives at the allreduce together, from the fitted
    per-rank costs a_i + c_i*b (fixed costs included, so no rank is driven to one sample by them)."""

    name = "speed-split"

    def __init__(self, dither: float = 0.04) -> None:
        super().__init__(ProposalConfig(search_batch=False, trust=None, dither=dither, dither_decisions=None,
                                        split_margin=0.0, check_growth=False))


class Goodput(ModelPolicy):
    """Pollux/AdaptDL: the B from the initial global batch up to the memory bounds that maximises
    predicted goodput (compute, network and overlap fitted jointly; alpha pinned to half the measured time
    while one size was seen; the point estimate of the noise scale), split by fitted cost; switch
    only for a predicted gain above `hysteresis`. No trust region and no dither, as AdaptDL."""

    name = "goodput"

    def __init__(self, hysteresis: float = 0.05, candidates: int = 32) -> None:
        super().__init__(ProposalConfig(hysteresis=hysteresis, candidates=candidates, trust=None, noise="point",
                                        dither=0.0, hold_unidentified=0, joint_fit=True, split_margin=0.0,
                                        grow_margin=0.0, confident_growth=False, check_growth=False))


BASELINES = {cls.name: cls for cls in (LinearRamp, AdaBatch, IncreaseBatch, NoiseScaleRule, SpeedSplit, Goodput)}


def make_baseline(name: str, **kwargs: Any) -> Any:
    """A baseline rule by name (see the module docstring); kwargs go to its constructor."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(sorted(BASELINES))}")
    return BASELINES[name](**kwargs)
