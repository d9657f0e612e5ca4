"""State features, reward and action application (pure maths, one process)."""
from __future__ import annotations

import math

import pytest
import torch

from dynamix_hvd.control.actions import ActionSpace, BatchBounds, apply_actions
from dynamix_hvd.control.reward import RewardConfig, compute_reward, global_throughput
from dynamix_hvd.control.state import OBS_DIM, GlobalContext, RankReport, build_observation


def report(rank: int, batch: int, compute: float, wait: float, **kw) -> RankReport:
    base = dict(rank=rank, local_batch=batch, steps=10, compute_s=compute, sync_wait_s=wait, data_wait_s=0.001,
                step_s=compute + wait + 0.002, samples_per_s=batch / (compute + wait + 0.002),
                peak_memory_bytes=10**8, mem_used_bytes=10**8, mem_total_bytes=10**9, cpu_util=0.9,
                gpu_util=float("nan"), net_bytes_per_s=1e6, tcp_retrans_per_s=0.0, loss_mean=1.0,
                local_grad_sq=2.0, global_grad_sq=1.0, max_batch=256)
    base.update(kw)
    return RankReport(**base)


def ctx(**kw) -> GlobalContext:
    base = dict(global_batch=64, base_batch=64, noise_scale=128.0, efficiency=0.9, loss_trend=-0.05,
                progress=0.3, world_size=2)
    base.update(kw)
    return GlobalContext(**base)


def test_observation_is_finite_and_marks_the_straggler():
    reports = [report(0, 32, 0.010, 0.020), report(1, 32, 0.030, 0.000)]
    obs = build_observation(reports, ctx())
    assert obs.shape == (2, OBS_DIM) and torch.isfinite(obs).all()
    assert obs[1, 2] > 0 > obs[0, 2], "rank 1 is slower per sample"
    assert obs[0, 3] > obs[1, 3], "rank 0 waits in allreduce"
    assert torch.equal(obs[0, 10:], obs[1, 10:]), "global context is shared"
    nan_ctx = build_observation(reports, ctx(noise_scale=math.nan, loss_trend=math.nan))
    assert torch.isfinite(nan_ctx).all()
    with pytest.raises(ValueError, match="rank order"):
        build_observation(reports[::-1], ctx())


def test_reward_prefers_goodput_and_penalises_idle_and_switching():
    cfg = RewardConfig()
    fast = [report(0, 32, 0.01, 0.0), report(1, 32, 0.01, 0.0)]
    slow = [report(0, 32, 0.02, 0.0), report(1, 32, 0.02, 0.0)]
    ref = global_throughput(fast)
    r_fast = compute_reward(cfg, fast, 1.0, ref, ref, 0.0, [32, 32], [32, 32])
    r_slow = compute_reward(cfg, slow, 1.0, ref, ref, 0.0, [32, 32], [32, 32])
    assert torch.allclose(r_fast, torch.zeros(2), atol=1e-6) and (r_slow < r_fast).all()
    r_switch = compute_reward(cfg, fast, 1.0, ref, ref, 0.0, [32, 32], [64, 16])
    assert (r_switch < r_fast).all()
    waiting = [report(0, 32, 0.01, 0.01), report(1, 32, 0.02, 0.0)]
    r_wait = compute_reward(cfg, waiting, 1.0, ref, ref, 0.0, [32, 32], [32, 32])
    assert r_wait[0] < r_wait[1], "the idle rank gets the idle penalty"
    with pytest.raises(ValueError, match="idle_weight=-1"):
        RewardConfig(idle_weight=-1)


def test_actions_respect_bounds_and_memory_learning():
    space, bounds = ActionSpace(), BatchBounds(world_size=2, min_batch=4, max_batch=100)
    assert apply_actions(space, bounds, [60, 3], [4, 0]) == [100, 4]
    assert apply_actions(space, bounds, [10, 10], [space.keep, 3]) == [10, 12]
    bounds.record_oom(0, 50)
    assert bounds.upper(0) == 40 and apply_actions(space, bounds, [40, 10], [4, 2]) == [40, 10]
    bounds.record_memory(1, 10, 1_000 + 10 * 100, 10_000)
    bounds.record_memory(1, 20, 1_000 + 20 * 100, 10_000)
    assert bounds.upper(1) == 80  # (0.9 * 10000 - 1000) / 100
    with pytest.raises(ValueError, match="impossible batch bounds"):
        BatchBounds(world_size=2, min_batch=10, max_batch=5)
    with pytest.raises(ValueError, match="action 9 of rank 1"):
        apply_actions(space, bounds, [10, 10], [0, 9])
