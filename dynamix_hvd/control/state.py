"""The controller's state: what each rank reports, and the normalised features the policy sees.

Pure maths: no MPI, no Horovod. One shared policy is applied to every rank (as DYNAMIX describes), so
the observation of rank i is [its own features, the global context]; both are scaled to be O(1) and
mostly scale-free (ratios, logs, fractions), so a policy transfers across models and clusters.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Sequence

import torch


@dataclass
class RankReport:
    """One rank's measurements over one decision interval (sent to rank 0)."""

    rank: int
    local_batch: int
    steps: int
    compute_s: float        # mean forward+backward per step
    sync_wait_s: float      # mean allreduce wait per step
    data_wait_s: float      # mean data wait per step
    step_s: float           # mean wall time per step
    samples_per_s: float    # local samples / wall time over the interval
    peak_memory_bytes: int
    mem_used_bytes: int
    mem_total_bytes: int
    cpu_util: float
    gpu_util: float
    net_bytes_per_s: float
    tcp_retrans_per_s: float
    loss_mean: float
    local_grad_sq: float    # mean squared norm of this rank's local mean gradient
    global_grad_sq: float   # mean squared norm of the global mean gradient
    max_batch: int          # this rank's current upper bound (memory)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GlobalContext:
    """Job-wide signals rank 0 adds to every rank's observation."""

    global_batch: int
    base_batch: int
    noise_scale: float      # gradient noise scale B_simple (NaN before it is known)
    efficiency: float       # statistical efficiency of the current global batch (Pollux), 0..1
    loss_trend: float       # relative loss change per decision (negative = improving)
    progress: float         # fraction of the training budget done, 0..1
    world_size: int


RANK_FEATURES = (
    "log2 local batch / base local batch",
    "local batch / its memory bound",
    "log2 compute time per sample / mean over ranks (slow rank > 0)",
    "allreduce wait / step time",
    "data wait / step time",
    "compute / step time",
    "memory used / memory total",
    "CPU utilisation",
    "GPU utilisation (0 when unknown)",
    "compute time / slowest rank's compute time",
)
GLOBAL_FEATURES = (
    "log2 global batch / base global batch",
    "log2 noise scale / global batch (clipped to +-6; 0 when unknown)",
    "statistical efficiency of the global batch",
    "loss trend (relative change per decision, clipped to +-1)",
    "training progress 0..1",
    "log2 world size / 10",
    "log10(1 + network MB/s) / 4",
    "log10(1 + TCP retransmits/s) / 3",
)
OBS_DIM = len(RANK_FEATURES) + len(GLOBAL_FEATURES)


def _finite(x: float, default: float = 0.0) -> float:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else default


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else 0.0


def rank_features(reports: Sequence[RankReport], base_local_batch: float) -> torch.Tensor:
    """[R, len(RANK_FEATURES)] features of every rank."""
    per_sample = [_ratio(r.compute_s, r.local_batch) for r in reports]
    mean_ps = statistics.fmean(per_sample) or 1.0
    slowest = max((r.compute_s for r in reports), default=0.0)
    rows = []
    for r, ps in zip(reports, per_sample):
        rows.append([
            math.log2(max(r.local_batch, 1) / base_local_batch),
            _ratio(r.local_batch, r.max_batch),
            math.log2(ps / mean_ps) if ps > 0 else 0.0,
            _ratio(r.sync_wait_s, r.step_s),
            _ratio(r.data_wait_s, r.step_s),
            _ratio(r.compute_s, r.step_s),
            _ratio(r.mem_used_bytes, r.mem_total_bytes),
            _finite(r.cpu_util),
            _finite(r.gpu_util),
            _ratio(r.compute_s, slowest),
        ])
    return torch.tensor(rows, dtype=torch.float32)


def global_features(ctx: GlobalContext, reports: Sequence[RankReport]) -> torch.Tensor:
    noise = 0.0
    if math.isfinite(ctx.noise_scale) and ctx.noise_scale > 0:
        noise = max(-6.0, min(6.0, math.log2(ctx.noise_scale / ctx.global_batch)))
    net_mb = statistics.fmean(_finite(r.net_bytes_per_s) for r in reports) / 1e6
    retrans = statistics.fmean(_finite(r.tcp_retrans_per_s) for r in reports)
    return torch.tensor([
        math.log2(ctx.global_batch / ctx.base_batch),
        noise,
        _finite(ctx.efficiency, 1.0),
        max(-1.0, min(1.0, _finite(ctx.loss_trend))),
        ctx.progress,
        math.log2(max(ctx.world_size, 1)) / 10.0,
        math.log10(1.0 + net_mb) / 4.0,
        math.log10(1.0 + retrans) / 3.0,
    ], dtype=torch.float32)


def build_observation(reports: Sequence[RankReport], ctx: GlobalContext) -> torch.Tensor:
    """[R, OBS_DIM]: row i = rank i's features followed by the shared global context."""
    if [r.rank for r in reports] != list(range(len(reports))):
        raise ValueError(f"reports must be in rank order 0..R-1, got ranks {[r.rank for r in reports]}")
    per_rank = rank_features(reports, base_local_batch=ctx.base_batch / max(len(reports), 1))
    shared = global_features(ctx, reports).expand(len(reports), -1)
    obs = torch.cat([per_rank, shared], dim=1)
    return torch.nan_to_num(obs, nan=0.0, posinf=0.0, neginf=0.0)


def report_field_names() -> list[str]:
    return [f.name for f in fields(RankReport)]
