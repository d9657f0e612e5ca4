"""The controller's state: what each rank reports, and the normalised features the policy sees.

Pure maths: no MPI, no Horovod. One shared policy acts on R + 1 rows: one per rank (its correction of
the proposed share) and one *batch row* (the correction of the proposed global batch, see
:mod:`dynamix_hvd.control.refine`). Row i is [its own features (RANK_FEATURES), the shared features
(GLOBAL_FEATURES: a pooled view of all ranks, then job-wide signals)]; the batch row's own features
are the mean over ranks with the flag set. The critic sees only the shared features, so its value is
one per decision (a centralised critic).

Every feature is batch-independent or a scale-free ratio: speeds come from the fitted cost lines
t_i(b) = a_i + c_i b (:mod:`dynamix_hvd.control.costmodel`), not from time per sample at the current
size (which for a + c b depends on b itself: two identical ranks at 128/32 would look 3.5x apart).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Sequence

import numpy as np
import torch

from .costmodel import CostFit, NetworkFit


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
    peak_memory_bytes: int  # peak over the interval (its kind: StepSeries.memory_kind)
    mem_used_bytes: int     # this process's memory now (CUDA: the allocator's reserved bytes; CPU: RSS)
    mem_total_bytes: int    # this rank's memory budget (`dynamix_hvd.data.memory.memory_budget`)
    cpu_util: float
    gpu_util: float
    net_bytes_per_s: float
    tcp_retrans_per_s: float
    loss_mean: float
    local_grad_sq: float    # mean squared norm of this rank's local mean gradient
    global_grad_sq: float   # mean squared norm of the global mean gradient
    max_batch: int          # this rank's current upper bound (memory)
    allreduce_bytes: int = 0        # gradient bytes one optimizer step allreduces, after compression
    latency_probe_s: float = math.nan  # a single-value allreduce after the previous decision (NaN: none yet)
    memory_floor_bytes: int = 0     # memory in use before training (the part of a peak no batch adds)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GlobalContext:
    """Job-wide signals rank 0 adds to every rank's observation."""

    global_batch: int
    initial_batch: int
    noise_scale: float      # gradient noise scale B_simple (NaN before it is known; clipped definition)
    efficiency: float       # statistical efficiency of the current global batch (Pollux), 0..1
    loss_trend: float       # relative loss change per decision (negative = improving)
    progress: float         # fraction of the training budget done, 0..1
    world_size: int
    noise_point: float = math.nan   # continuous point estimate of the noise scale (NaN: unknown)
    noise_lower: float = math.nan   # its lower confidence bound (NaN: unknown)


RANK_FEATURES = (
    "batch-row flag (0: a rank's row, 1: the row that corrects the global batch)",
    "log2 fitted per-sample cost c_i / mean over ranks (slow rank > 0; 0 before a fit)",
    "fitted fixed-cost share a_i / (a_i + c_i b_i) at the current size",
    "log2 fitted arrival a_i + c_i b_i / the latest rank's (<= 0, clipped at -4)",
    "local batch / its memory bound",
    "fit confidence: relative standard error of c_i, clipped to [0, 1] (1: not identified)",
    "measured allreduce wait / step time",
)
_POOLED = RANK_FEATURES[1:]
JOB_FEATURES = (
    "communication share: fitted allreduce time not hidden by compute / predicted step time",
    "log2 global batch / noise scale (continuous point estimate, clipped to +-6; 0 when unknown)",
    "noise scale known (1) or not yet (0)",
    "log2 lower confidence bound / point estimate of the noise scale (clipped to [-4, 0])",
    "statistical efficiency E(B) from the continuous point estimate (1 when unknown)",
    "loss trend (relative change per decision, clipped to +-1)",
    "training progress 0..1",
    "log2 world size / 6",
    "fraction of ranks whose cost line is identified",
)
GLOBAL_FEATURES = (*(f"max over ranks: {n}" for n in _POOLED), *(f"min over ranks: {n}" for n in _POOLED),
                   *JOB_FEATURES)
"""The shared part of every row: the pooled view of all ranks, then the job-wide features."""
OBS_DIM = len(RANK_FEATURES) + len(GLOBAL_FEATURES)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else 0.0


def _log2_clip(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, math.log2(x))) if x > 0 and math.isfinite(x) else 0.0


def rank_features(reports: Sequence[RankReport], fit: CostFit | None) -> torch.Tensor:
    """[R, len(RANK_FEATURES)] features of every rank (flag 0)."""
    R = len(reports)
    b = np.array([max(r.local_batch, 1) for r in reports], dtype=np.float64)
    if fit is not None and len(fit.per_sample_s) == R:
        a, c = fit.split_coefficients(borrowed=False)  # the features the shipped policy was trained on
        rel = np.log2(c / c.mean())
        arrival = fit.arrival(b, split=True, borrowed=False)
        fixed_share = a / arrival
        late = np.maximum(np.log2(arrival / arrival.max()), -4.0)
        conf = np.where(fit.identified, np.clip(fit.per_sample_se / fit.per_sample_s, 0.0, 1.0), 1.0)
    else:
        rel = fixed_share = late = np.zeros(R)
        conf = np.ones(R)
    rows = [[0.0, float(rel[i]), float(fixed_share[i]), float(late[i]), _ratio(r.local_batch, r.max_batch),
             float(conf[i]), _ratio(r.sync_wait_s, r.step_s)] for i, r in enumerate(reports)]
    return torch.tensor(rows, dtype=torch.float32)


def job_features(ctx: GlobalContext, reports: Sequence[RankReport], fit: CostFit | None,
                 net: NetworkFit | None) -> list[float]:
    comm = 0.0
    if fit is not None and net is not None and len(fit.per_sample_s) == len(reports):
        micro = np.array([r.local_batch for r in reports], dtype=np.float64)
        passes = max(1, round(ctx.global_batch / max(micro.sum(), 1.0)))  # micro-batches per step
        arrival = float(fit.arrival(micro).max())
        step = float(net.step_time(arrival, passes))
        comm = _ratio(max(float(net.sync_time(arrival)) - arrival, 0.0), step)
    point, lower = ctx.noise_point, ctx.noise_lower
    known = math.isfinite(point) and point > 0
    eff = (point + ctx.initial_batch) / (point + ctx.global_batch) if known else 1.0
    return [comm,
            _log2_clip(ctx.global_batch / point, -6.0, 6.0) if known else 0.0,
            1.0 if known else 0.0,
            _log2_clip(lower / point, -4.0, 0.0) if known and lower > 0 else (-4.0 if known else 0.0),
            eff,
            max(-1.0, min(1.0, ctx.loss_trend)) if math.isfinite(ctx.loss_trend) else 0.0,
            ctx.progress,
            math.log2(max(ctx.world_size, 1)) / 6.0,
            float(np.mean(fit.identified)) if fit is not None else 0.0]


def build_observation(reports: Sequence[RankReport], ctx: GlobalContext, fit: CostFit | None = None,
                      net: NetworkFit | None = None) -> torch.Tensor:
    """[R + 1, OBS_DIM]: rows 0..R-1 the ranks, row R the batch row (see the module docstring)."""
    if [r.rank for r in reports] != list(range(len(reports))):
        raise ValueError(f"reports must be in rank order 0..R-1, got ranks {[r.rank for r in reports]}")
    own = torch.nan_to_num(rank_features(reports, fit), nan=0.0, posinf=0.0, neginf=0.0)
    batch_row = own.mean(0, keepdim=True)
    batch_row[0, 0] = 1.0
    pooled = torch.cat([own[:, 1:].max(0).values, own[:, 1:].min(0).values])
    shared = torch.cat([pooled, torch.tensor(job_features(ctx, reports, fit, net), dtype=torch.float32)])
    obs = torch.cat([torch.cat([own, batch_row]), shared.expand(len(reports) + 1, -1)], dim=1)
    return torch.nan_to_num(obs, nan=0.0, posinf=0.0, neginf=0.0)


def report_field_names() -> list[str]:
    return [f.name for f in fields(RankReport)]
