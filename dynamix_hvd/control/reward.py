"""The controller's reward. Pure maths: no MPI, no Horovod.

One shared value per decision interval (every rank's row and the batch row get the same number; the
policy's critic is centralised):

    r = progress_weight  * log2(G_measured / G_static)
      - stability_weight * max(0, relative loss increase over the interval)
      - switch_weight    * mean_i |log2(b_i new / b_i old)|

    G_measured = B * E(B) / T_step            statistical progress per wall second, measured
    G_static   = B0 / T_model(b0)             what the cost model predicts the static sizes b0 do

- ``T_step`` is the measured mean step time of the interval: it holds the allreduce (and its overlap
  with compute) once, and nothing else counts communication again;
- ``E(B) = (phi + B0) / (phi + B)`` (Pollux) with phi the *continuous* lower confidence bound of the
  noise scale (:meth:`~dynamix_hvd.stats.noise_scale.GradientStatistics.noise_scale_interval`: no jump
  to 0 or to a cap when the |G|^2 average crosses 0), as the proposal uses it: an uncertain noise scale
  does not pay for a larger batch (``noise="point"``: the estimate); unknown phi gives E = 1;
- ``T_model(b0) = ((max_i a_i + c_i b0_i)^gamma + T_net^gamma)^(1/gamma) + overhead`` from the current
  per-rank cost fits and network fit (:mod:`dynamix_hvd.control.costmodel`), i.e. the static job
  *now*, in the same conditions (a rank that slowed down slows the reference too). Before any fit the
  first interval's measured goodput is the reference;
- E(B) <= 1 for B >= B0 and E(B0) = 1, so a larger batch earns only through a real gain in measured
  progress per second; no term pays for growing B by itself (nor counts the allreduce transfer as
  waiting);
- the stability penalty punishes loss spikes (too large an effective LR after a batch change); the
  switching penalty keeps sizes from hopping between nearly equal configurations.

0 = as fast as the static sizes would be in this interval; log2 makes it scale-free across jobs.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .costmodel import CostFit, NetworkFit
from .state import RankReport
from .. import validate


@dataclass(frozen=True)
class RewardConfig:
    """The reward's weights (policy "ppo"; see `dynamix_hvd.control.reward`)."""

    progress_weight: float = 1.0
    """Weight of log2(measured goodput / the cost model's goodput of the static sizes)."""
    stability_weight: float = 1.0
    """Penalty per unit of relative loss increase over the interval (loss spikes)."""
    switch_weight: float = 0.02
    """Penalty per unit of mean |log2(new size / old size)| (discourages oscillation)."""
    noise: str = "lower"
    """Noise scale in E(B): "lower" (the lower confidence bound) or "point" (the estimate)."""

    def __post_init__(self) -> None:
        if self.noise not in ("lower", "point"):
            raise ValueError(f"RewardConfig.noise={self.noise!r}; choose 'lower' or 'point'")
        for name, value in vars(self).items():
            if name == "noise":
                continue
            validate.number(f"RewardConfig.{name}", value, 0, what="a finite number >= 0 (a reward weight)")


def global_throughput(reports: Sequence[RankReport], passes: int = 1) -> float:
    """Samples per second of the synchronous job: global batch (`passes` micro-batches of the reports'
    sizes per step) over the mean step time."""
    step_s = statistics.fmean(r.step_s for r in reports)
    return passes * sum(r.local_batch for r in reports) / step_s if step_s > 0 else 0.0


def predicted_goodput(fit: CostFit | None, net: NetworkFit | None, sizes: Sequence[int], passes: int = 1) -> float:
    """B / T_model(sizes) from the fits, `passes` micro-batches of `sizes` per step (0 when there is
    no fit for these ranks)."""
    if fit is None or net is None or len(fit.per_sample_s) != len(sizes):
        return 0.0
    step = float(net.step_time(float(fit.arrival(np.asarray(sizes, dtype=np.float64)).max()), passes))
    return passes * sum(sizes) / step if step > 0 and math.isfinite(step) else 0.0


def compute_reward(cfg: RewardConfig, reports: Sequence[RankReport], efficiency: float, static_goodput: float,
                   loss_change: float, old_sizes: Sequence[int], new_sizes: Sequence[int],
                   passes: int = 1) -> torch.Tensor:
    """The shared reward (see the module docstring), repeated for every rank [R]. `efficiency` is
    E(B) of the interval from the continuous noise estimate (`RewardConfig.noise`: its lower bound by
    default); `static_goodput` the reference G_static; `passes` the interval's micro-batches per step."""
    tput = global_throughput(reports, passes)
    eff = efficiency if math.isfinite(efficiency) and efficiency > 0 else 1.0
    shared = 0.0
    if static_goodput > 0 and tput > 0:
        shared += cfg.progress_weight * math.log2(tput * eff / static_goodput)
    if math.isfinite(loss_change):
        shared -= cfg.stability_weight * max(0.0, loss_change)
    switch = statistics.fmean(abs(math.log2(n / o)) for o, n in zip(old_sizes, new_sizes))
    shared -= cfg.switch_weight * switch
    return torch.full((len(reports),), shared, dtype=torch.float32)
