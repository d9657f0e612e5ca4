"""State features, reward and the correction actions (pure maths, one process)."""
from __future__ import annotations

import math

import pytest
import torch

import numpy as np

from dynamix_hvd.control.actions import ActionSpace, BatchBounds, compose
from dynamix_hvd.control.costmodel import CostFit, NetworkFit
from dynamix_hvd.control.reward import RewardConfig, compute_reward, predicted_goodput
from dynamix_hvd.stats.noise_scale import statistical_efficiency
from dynamix_hvd.control.state import (GLOBAL_FEATURES, OBS_DIM, RANK_FEATURES, GlobalContext, RankReport,
                                       build_observation)


def report(rank: int, batch: int, compute: float, wait: float, **kw) -> RankReport:
    base = dict(rank=rank, local_batch=batch, steps=10, compute_s=compute, sync_wait_s=wait, data_wait_s=0.001,
                step_s=compute + wait + 0.002, samples_per_s=batch / (compute + wait + 0.002),
                peak_memory_bytes=10**8, mem_used_bytes=10**8, mem_total_bytes=10**9, cpu_util=0.9,
                gpu_util=float("nan"), net_bytes_per_s=1e6, tcp_retrans_per_s=0.0, loss_mean=1.0,
                local_grad_sq=2.0, global_grad_sq=1.0, max_batch=256)
    base.update(kw)
    return RankReport(**base)


def ctx(**kw) -> GlobalContext:
    base = dict(global_batch=64, initial_batch=64, noise_scale=128.0, efficiency=0.9, loss_trend=-0.05,
                progress=0.3, world_size=2)
    base.update(kw)
    return GlobalContext(**base)


def fit(fixed: list[float], per_sample: list[float], rel_se: float = 0.05) -> CostFit:
    a, c = np.array(fixed), np.array(per_sample)
    R = len(a)
    return CostFit(a, c, np.ones(R, dtype=bool), 0.1 * a, rel_se * c, np.full(R, 0.2), np.full(R, 32.0),
                   a + 32 * c)


def test_observation_rows_features_and_batch_independence():
    reports = [report(0, 128, 0.010, 0.020), report(1, 32, 0.030, 0.000)]
    same = fit([0.002, 0.002], [1e-4, 1e-4])
    obs = build_observation(reports, ctx(noise_point=128.0, noise_lower=64.0), same, NetworkFit(0.004, 1.0, 0.0))
    assert obs.shape == (3, OBS_DIM) and OBS_DIM == len(RANK_FEATURES) + len(GLOBAL_FEATURES)
    assert torch.isfinite(obs).all()
    assert obs[0, 1] == obs[1, 1] == 0, "identical ranks at 128/32 have the same fitted speed"
    assert obs[1, 3] < obs[0, 3] == 0, "the rank at 128 arrives last"
    assert obs[:2, 0].tolist() == [0.0, 0.0] and obs[2, 0] == 1.0, "the batch row is flagged"
    assert torch.equal(obs[0, len(RANK_FEATURES):], obs[2, len(RANK_FEATURES):]), "shared part is shared"
    slow = build_observation(reports, ctx(), fit([0.002, 0.002], [1e-4, 3e-4]))
    assert slow[1, 1] > 0 > slow[0, 1], "rank 1 is slower per sample"
    noise = GLOBAL_FEATURES.index("noise scale known (1) or not yet (0)") + len(RANK_FEATURES)
    assert obs[0, noise] == 1.0 and slow[0, noise] == 0.0
    bare = build_observation(reports, ctx(noise_scale=math.nan, loss_trend=math.nan))
    assert torch.isfinite(bare).all() and bare.shape == (3, OBS_DIM)
    with pytest.raises(ValueError, match="rank order"):
        build_observation(reports[::-1], ctx())


def test_reward_is_progress_over_the_predicted_static_and_does_not_pay_for_a_bigger_batch():
    cfg = RewardConfig()
    balanced = fit([0.0, 0.0], [3e-4, 3e-4])
    net = NetworkFit(0.002, 1.0, 0.0)
    static = predicted_goodput(balanced, net, [32, 32])
    assert static == pytest.approx(64 / (32 * 3e-4 + 0.002))
    as_static = [report(0, 32, 32 * 3e-4, 0.0, step_s=32 * 3e-4 + 0.002)] * 2
    r0 = compute_reward(cfg, [as_static[0], report(1, 32, 32 * 3e-4, 0.0, step_s=32 * 3e-4 + 0.002)], 1.0,
                        static, 0.0, [32, 32], [32, 32])
    assert torch.allclose(r0, torch.zeros(2), atol=1e-6), "as fast as static: 0"
    # twice the batch on a compute-bound, balanced job: samples/s up by the saved allreduce only, and
    # E(B) < 1 since the noise scale is not infinite; growing B by itself earns nothing
    step2 = 64 * 3e-4 + 0.002
    eff = statistical_efficiency(64.0, 128, 64, unknown="one")
    big = [report(r, 64, 64 * 3e-4, 0.0, step_s=step2) for r in range(2)]
    r_big = compute_reward(cfg, big, eff, static, 0.0, [64, 64], [64, 64])
    assert (r_big < 0).all() and torch.equal(r_big, r_big[:1].expand(2)), "one shared value"
    assert statistical_efficiency(math.nan, 128, 64, unknown="one") == 1.0
    assert statistical_efficiency(0.0, 128, 64, unknown="one") == 0.5
    r_switch = compute_reward(cfg, as_static, 1.0, static, 0.0, [32, 32], [64, 16])
    r_spike = compute_reward(cfg, as_static, 1.0, static, 0.2, [32, 32], [32, 32])
    assert (r_switch < r0).all() and (r_spike < r0).all()
    with pytest.raises(ValueError, match="switch_weight=-1"):
        RewardConfig(switch_weight=-1)


def test_corrections_compose_around_the_proposal_within_bounds():
    space, bounds = ActionSpace(), BatchBounds(world_size=3, min_batch=4, max_batch=100)
    keep = space.keep
    assert compose(space, bounds, [60, 30, 10], [keep] * 4) == [60, 30, 10], "neutral = the proposal"
    up = space.multipliers.index(1.25)
    out = compose(space, bounds, [60, 30, 10], [keep, keep, keep, up])
    assert out == [75, 38, 12], out
    shift = compose(space, bounds, [40, 40, 20], [up, space.multipliers.index(0.8), keep, keep])
    assert sum(shift) == 100 and shift[0] > 40 > shift[1], shift
    capped = compose(space, bounds, [100, 90, 90], [keep, keep, keep, up])
    assert max(capped) <= 100 and sum(capped) == 300, "the bounds cap B"
    low = compose(space, bounds, [5, 5, 5], [0, 0, 4, 0])
    assert min(low) >= 4 and sum(low) == 12
    down = space.multipliers.index(0.8)
    held = compose(space, bounds, [60, 30, 10], [keep, keep, keep, down], batch_range=(100, 150))
    assert sum(held) == 100, "never below the proposal's floor (the initial global batch)"
    assert sum(compose(space, bounds, [60, 30, 10], [keep, keep, keep, up], batch_range=(50, 110))) == 110
    with pytest.raises(ValueError, match="one per rank plus the batch row"):
        compose(space, bounds, [10, 10, 10], [keep] * 3)
    with pytest.raises(ValueError, match="action 9 of row 1"):
        compose(space, bounds, [10, 10, 10], [0, 9, 0, 0])


def test_bounds_and_memory_learning():
    bounds = BatchBounds(world_size=2, min_batch=4, max_batch=100)
    bounds.record_oom(0, 50)
    assert bounds.upper(0) == 40 and bounds.clip(0, 60) == 40
    bounds.record_memory(1, 10, 1_000 + 10 * 100, 10_000)
    bounds.record_memory(1, 20, 1_000 + 20 * 100, 10_000)
    assert bounds.upper(1) == 80  # (0.9 * 10000 - 1000) / 100
    with pytest.raises(ValueError, match="impossible batch bounds"):
        BatchBounds(world_size=2, min_batch=10, max_batch=5)
