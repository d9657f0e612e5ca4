"""The controller's reward. Pure maths: no MPI, no Horovod.

Per decision interval and per rank:

    r_i = progress_weight   * log2(goodput / goodput_ref)
        + throughput_weight * log2(throughput / throughput_ref)
        - stability_weight  * max(0, relative loss increase)
        - switch_weight     * mean_j |log2(b_j new / b_j old)|
        - idle_weight       * (allreduce wait of rank i / its step time)

Why these terms:
- goodput = global samples/s x statistical efficiency (Pollux). It is statistical progress per unit
  wall time: a bigger batch raises samples/s but each sample is worth less once the batch exceeds the
  gradient noise scale. This is the term that makes training *finish sooner*.
- log-ratios against the first interval (the user's static configuration) make the reward scale-free
  across models and clusters, which is what lets one policy transfer, and make 0 = "as good as static".
- the stability penalty punishes loss spikes (too large an effective LR after a batch change);
- the switching penalty keeps sizes from oscillating between two nearly equal configurations;
- the idle term is per rank: a rank that waits in allreduce is underloaded, so it learns to take
  more samples (straggler balancing) while the shared terms keep the global batch sensible.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from .state import RankReport


@dataclass
class RewardConfig:
    progress_weight: float = 1.0
    """Weight of log2(goodput / reference goodput): statistical progress per wall-clock second."""
    throughput_weight: float = 0.0
    """Weight of log2(samples per second / reference): raw speed, ignoring statistical efficiency."""
    stability_weight: float = 1.0
    """Penalty per unit of relative loss increase over the interval (loss spikes)."""
    switch_weight: float = 0.05
    """Penalty per unit of mean |log2(new size / old size)| (discourages oscillation)."""
    idle_weight: float = 0.5
    """Per-rank penalty on the fraction of its step time spent waiting in allreduce."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"reward weight {name}={value!r} must be a finite number >= 0")


def global_throughput(reports: Sequence[RankReport]) -> float:
    """Samples per second of the synchronous job: global batch over the mean step time."""
    step_s = statistics.fmean(r.step_s for r in reports)
    return sum(r.local_batch for r in reports) / step_s if step_s > 0 else 0.0


def compute_reward(cfg: RewardConfig, reports: Sequence[RankReport], efficiency: float,
                   ref_goodput: float, ref_throughput: float, loss_change: float,
                   old_sizes: Sequence[int], new_sizes: Sequence[int]) -> torch.Tensor:
    """Reward of every rank [R] for the interval just measured (see the module docstring)."""
    tput = global_throughput(reports)
    eff = efficiency if math.isfinite(efficiency) and efficiency > 0 else 1.0
    shared = 0.0
    if ref_goodput > 0 and tput > 0:
        shared += cfg.progress_weight * math.log2(tput * eff / ref_goodput)
    if ref_throughput > 0 and tput > 0:
        shared += cfg.throughput_weight * math.log2(tput / ref_throughput)
    if math.isfinite(loss_change):
        shared -= cfg.stability_weight * max(0.0, loss_change)
    switch = statistics.fmean(abs(math.log2(n / o)) for o, n in zip(old_sizes, new_sizes))
    shared -= cfg.switch_weight * switch
    idle = [r.sync_wait_s / r.step_s if r.step_s > 0 else 0.0 for r in reports]
    return torch.tensor([shared - cfg.idle_weight * i for i in idle], dtype=torch.float32)
