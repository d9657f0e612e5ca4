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
- ``goodput``           Pollux/AdaptDL: fit per-rank compute time alpha_i + beta_i*b, pick the B that
                        maximises throughput x statistical efficiency; switch only for > 5% gain.
- ``speed-split``       keep B, split it in proportion to each rank's measured speed (stragglers only).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .actions import BatchBounds
from ..data.plan import split_proportional
from .policy import DecisionInput, DecisionOutput
from .state import RankReport


def rank_speeds(reports: Sequence[RankReport]) -> list[float]:
    """Compute speed of each rank in samples/s (1.0 for all when unknown)."""
    speeds = [r.local_batch / r.compute_s if r.compute_s > 0 else 0.0 for r in reports]
    return speeds if all(s > 0 for s in speeds) else [1.0] * len(reports)


def split(global_batch: int, weights: Sequence[float], bounds: BatchBounds) -> list[int]:
    """Split B in proportion to `weights`, within each rank's bounds (B may shrink to fit them)."""
    world = len(weights)
    total = max(int(round(global_batch)), world * bounds.min_batch)
    total = min(total, sum(bounds.upper(r) for r in range(world)))
    scaled = [max(1, int(round(1000 * w / max(weights)))) for w in weights]
    sizes = list(split_proportional(total, scaled, min_each=bounds.min_batch))
    return [bounds.clip(r, b) for r, b in enumerate(sizes)]


class _Rule:
    name = "rule"

    def __init__(self) -> None:
        self.decisions = 0
        self.base: int | None = None

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:  # (global batch, split weights)
        raise NotImplementedError

    def decide(self, inp: DecisionInput) -> DecisionOutput:
        self.base = self.base or sum(inp.sizes)
        global_batch, weights = self.target(inp)
        self.decisions += 1
        return DecisionOutput(split(global_batch, weights, inp.bounds), {"target_global_batch": global_batch})

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
        global_batch = self.scale * noise if math.isfinite(noise) and noise > 0 else sum(inp.sizes)
        return int(global_batch), [1.0] * len(inp.sizes)


class SpeedSplit(_Rule):
    name = "speed-split"

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        return self.base, rank_speeds(inp.reports)


class Goodput(_Rule):
    """Pollux-style: maximise predicted goodput over candidate global batches, 5% hysteresis."""

    name = "goodput"

    def __init__(self, hysteresis: float = 0.05, candidates: int = 32) -> None:
        super().__init__()
        self.hysteresis, self.candidates = hysteresis, candidates
        self.history: list[list[tuple[int, float]]] = []  # per rank: (batch, compute seconds)

    def _fit(self, rank: int) -> tuple[float, float]:
        """Least-squares alpha + beta * b of the rank's compute time (beta only with one size seen)."""
        points = np.array(self.history[rank])
        if len(np.unique(points[:, 0])) < 2:
            b, t = points[-1]
            return 0.0, t / b
        beta, alpha = np.polyfit(points[:, 0], points[:, 1], 1)
        return max(alpha, 0.0), max(beta, 1e-9)

    def _predict(self, global_batch: int, fits: list[tuple[float, float]], overhead: float, phi: float,
                 base: int) -> tuple[float, list[float]]:
        speeds = [1.0 / beta for _, beta in fits]
        shares = [global_batch * s / sum(speeds) for s in speeds]
        step = max(a + b * n for (a, b), n in zip(fits, shares)) + overhead
        efficiency = (phi + base) / (phi + global_batch) if math.isfinite(phi) else 1.0
        return global_batch / step * efficiency, speeds

    def target(self, inp: DecisionInput) -> tuple[int, list[float]]:
        if len(self.history) != len(inp.reports):
            self.history = [[] for _ in inp.reports]
        for r in inp.reports:
            if r.compute_s > 0:
                self.history[r.rank].append((r.local_batch, r.compute_s))
        current = sum(inp.sizes)
        if any(not h for h in self.history):
            return current, [1.0] * len(inp.sizes)
        fits = [self._fit(r) for r in range(len(inp.reports))]
        overhead = float(np.mean([r.step_s - r.compute_s - r.sync_wait_s for r in inp.reports]))
        overhead = max(overhead, 0.0) + min(r.sync_wait_s for r in inp.reports)  # allreduce + data
        phi = inp.ctx.noise_scale
        lo, hi = len(inp.sizes) * inp.bounds.min_batch, sum(inp.bounds.upper(r) for r in range(len(inp.sizes)))
        grid = np.unique(np.geomspace(lo, hi, self.candidates).astype(int))
        scored = [(self._predict(int(b), fits, overhead, phi, self.base)[0], int(b)) for b in grid]
        best_goodput, best = max(scored)
        now_goodput, speeds = self._predict(current, fits, overhead, phi, self.base)
        if best_goodput < (1 + self.hysteresis) * now_goodput:
            best = current
        return best, speeds


BASELINES = {cls.name: cls for cls in (LinearRamp, AdaBatch, IncreaseBatch, NoiseScaleRule, SpeedSplit, Goodput)}


def make_baseline(name: str, **kwargs: Any) -> Any:
    """A baseline rule by name (see the module docstring); kwargs go to its constructor."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(sorted(BASELINES))}")
    return BASELINES[name](**kwargs)
