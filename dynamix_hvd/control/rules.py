"""The classic batch-size rules, behind the same interface as the PPO policy. Pure: no MPI/Horovod.

Each rule chooses a global batch B and a split over the ranks; all see the same `DecisionInput`
(reports of the last interval, global context with the noise scale, current sizes, bounds), and all
are selectable by name through `make_baseline`. Schedules count decisions (one per epoch by default).
Each rule's parameters are a typed config (``LinearRampConfig``, ...; ``RULE_CONFIGS`` by name), checked
at construction; ``ControllerConfig.policy_config`` takes the one of the chosen rule.

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
from dataclasses import dataclass
from typing import Any, Sequence

from .actions import BatchBounds
from ..data.plan import split_proportional
from .policy import DecisionInput, DecisionOutput
from .proposal import ModelPolicy, ProposalConfig
from .. import validate


def split(micro_batch: int, weights: Sequence[float], bounds: BatchBounds) -> list[int]:
    """Split a global micro-batch in proportion to `weights` into local batches, within each rank's
    bounds (the total may shrink to fit them)."""
    world = len(weights)
    total = max(int(round(micro_batch)), world * bounds.min_batch)
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


@dataclass(frozen=True)
class LinearRampConfig:
    """Parameters of ``linear-ramp``."""

    end: int = 512
    """Global batch at the end of the ramp."""
    ramp: int = 10
    """Decisions over which B grows linearly from the initial batch to `end`."""

    def __post_init__(self) -> None:
        validate.integer("LinearRampConfig.end", self.end, 1)
        validate.integer("LinearRampConfig.ramp", self.ramp, 1)


@dataclass(frozen=True)
class AdaBatchConfig:
    """Parameters of ``adabatch``."""

    every: int = 2
    """Decisions between two doublings of B."""
    end: int = 1024
    """Largest global batch."""

    def __post_init__(self) -> None:
        validate.integer("AdaBatchConfig.every", self.every, 1)
        validate.integer("AdaBatchConfig.end", self.end, 1)


@dataclass(frozen=True)
class IncreaseBatchConfig:
    """Parameters of ``increase-batch``."""

    milestones: tuple[float, ...] = (0.5, 0.75)
    """Training progress (0..1) at which a step LR schedule would divide the LR."""
    factor: float = 5.0
    """B is multiplied by this at each milestone passed."""

    def __post_init__(self) -> None:
        if not isinstance(self.milestones, (tuple, list)) \
                or not all(validate.is_number(m, 0, maximum=1) for m in self.milestones):
            validate.fail("IncreaseBatchConfig.milestones", self.milestones, "a tuple of numbers in [0, 1]")
        object.__setattr__(self, "milestones", tuple(self.milestones))
        validate.number("IncreaseBatchConfig.factor", self.factor, above=0)


@dataclass(frozen=True)
class NoiseScaleConfig:
    """Parameters of ``noise-scale``."""

    scale: float = 1.0
    """B = scale x the measured gradient noise scale."""

    def __post_init__(self) -> None:
        validate.number("NoiseScaleConfig.scale", self.scale, above=0)


@dataclass(frozen=True)
class GoodputConfig:
    """Parameters of ``goodput`` (the rest of its proposal is fixed to AdaptDL's choices)."""

    hysteresis: float = 0.05
    """Switch B only for a predicted goodput gain above this fraction."""
    candidates: int = 32
    """Global batches scored per decision."""

    def __post_init__(self) -> None:
        validate.number("GoodputConfig.hysteresis", self.hysteresis, 0)
        validate.integer("GoodputConfig.candidates", self.candidates, 2)


@dataclass(frozen=True)
class SpeedSplitConfig:
    """Parameters of ``speed-split``."""

    dither: float = 0.04
    """Relative size dither while a rank's cost line is not identified (0: none)."""

    def __post_init__(self) -> None:
        validate.number("SpeedSplitConfig.dither", self.dither, 0, below=0.5, what="a number in [0, 0.5)")


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

    def __init__(self, config: LinearRampConfig | None = None) -> None:
        super().__init__()
        config = config or LinearRampConfig()
        self.end, self.ramp = config.end, config.ramp

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        frac = min(1.0, (self.decisions + 1) / self.ramp)
        return int(self.base + frac * (self.end - self.base)), [1.0] * len(inp.sizes)


class AdaBatch(_Rule):
    name = "adabatch"

    def __init__(self, config: AdaBatchConfig | None = None) -> None:
        super().__init__()
        config = config or AdaBatchConfig()
        self.every, self.end = config.every, config.end

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        return min(self.end, self.base * 2 ** ((self.decisions + 1) // self.every)), [1.0] * len(inp.sizes)


class IncreaseBatch(_Rule):
    name = "increase-batch"

    def __init__(self, config: IncreaseBatchConfig | None = None) -> None:
        super().__init__()
        config = config or IncreaseBatchConfig()
        self.milestones, self.factor = config.milestones, config.factor

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        passed = sum(inp.ctx.progress >= m for m in self.milestones)
        return int(self.base * self.factor**passed), [1.0] * len(inp.sizes)


class NoiseScaleRule(_Rule):
    name = "noise-scale"

    def __init__(self, config: NoiseScaleConfig | None = None) -> None:
        super().__init__()
        self.scale = (config or NoiseScaleConfig()).scale

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        noise = inp.ctx.noise_scale
        global_batch = self.scale * noise if math.isfinite(noise) and noise > 0 else inp.passes * sum(inp.sizes)
        return int(global_batch), [1.0] * len(inp.sizes)


class SpeedSplit(ModelPolicy):
    """Keep B; split it so that every rank arrives at the allreduce together, from the fitted
    per-rank costs a_i + c_i*b (fixed costs included, so no rank is driven to one sample by them)."""

    name = "speed-split"

    def __init__(self, config: SpeedSplitConfig | None = None) -> None:
        dither = (config or SpeedSplitConfig()).dither
        super().__init__(ProposalConfig(search_batch=False, trust=None, dither=dither, dither_decisions=None,
                                        split_margin=0.0, check_growth=False))


class Goodput(ModelPolicy):
    """Pollux/AdaptDL: the B from the initial batch up to the memory bounds that maximises
    predicted goodput (compute, network and overlap fitted jointly; alpha pinned to half the measured time
    while one size was seen; the point estimate of the noise scale), split by fitted cost; switch
    only for a predicted gain above `hysteresis`. No trust region and no dither, as AdaptDL."""

    name = "goodput"

    def __init__(self, config: GoodputConfig | None = None) -> None:
        config = config or GoodputConfig()
        super().__init__(ProposalConfig(hysteresis=config.hysteresis, candidates=config.candidates, trust=None,
                                        noise="point",
                                        dither=0.0, hold_unidentified=0, joint_fit=True, split_margin=0.0,
                                        grow_margin=0.0, confident_growth=False, check_growth=False,
                                        budget_loss=1.0))


BASELINES = {cls.name: cls for cls in (LinearRamp, AdaBatch, IncreaseBatch, NoiseScaleRule, SpeedSplit, Goodput)}
RULE_CONFIGS: dict[str, type] = {
    "linear-ramp": LinearRampConfig, "adabatch": AdaBatchConfig, "increase-batch": IncreaseBatchConfig,
    "noise-scale": NoiseScaleConfig, "goodput": GoodputConfig, "speed-split": SpeedSplitConfig}
"""Each rule's typed config, by rule name."""


def make_baseline(name: str, config: Any = None, **kwargs: Any) -> Any:
    """A baseline rule by name (see the module docstring), with its typed `config` (``RULE_CONFIGS[name]``)
    or that config's fields as keyword arguments; neither: the rule's defaults."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(sorted(BASELINES))}")
    kind = RULE_CONFIGS[name]
    if config is not None and kwargs:
        raise ValueError(f"make_baseline({name!r}): give a {kind.__name__} or its fields, not both")
    if config is not None and type(config) is not kind:
        raise ValueError(f"rule {name!r} takes a {kind.__name__}, not {config!r}")
    return BASELINES[name](config if config is not None else kind(**kwargs))
