"""Cluster simulator (bench.lab.simulator): the live controller's interface, physics invariants, the
goodput optimum, statistics, and speed at 1024 ranks. One process, no MPI."""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Sequence

import numpy as np
import pytest
import torch

from dynamix_hvd.control import wire
from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.config import ControllerConfig
from dynamix_hvd.control.core import DecisionCore
from dynamix_hvd.control.policy import DecisionInput, DecisionOutput, StaticPolicy
from bench.lab.scenarios import FAMILIES, ScenarioConfig, sample_cluster
from bench.lab.simulator import ClusterSimulator, ClusterSpec
from dynamix_hvd.control.state import OBS_DIM


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def spec(R: int = 3, **kw: Any) -> ClusterSpec:
    """A small heterogeneous GPU cluster: rank 0 fast ... rank R-1 slow."""
    base = dict(alpha_s=[2e-3] * R, beta_s=[1e-4 * (1 + r) for r in range(R)], initial_batch=[32] * R,
                phi_start=300.0, phi_end=3000.0, target_progress=32 * R * 20 * 60, dataset_size=32 * R * 20 * 10,
                steps_per_decision=20, jitter=0.05, model_bytes=2e7, bandwidth_Bps=1e9)
    base.update(kw)
    return ClusterSpec(**base)


class Recorder:
    """A policy that records what it is handed and returns preset sizes."""

    name = "recorder"

    def __init__(self) -> None:
        self.inputs: list[DecisionInput] = []
        self.next_sizes: list[int] = []

    def decide(self, inp: DecisionInput) -> DecisionOutput:
        self.inputs.append(inp)
        return DecisionOutput(list(self.next_sizes))

    def after_decision(self) -> dict[str, float]:
        return {}


def drive_both(sim: ClusterSimulator, schedule: Sequence[Sequence[int]]) -> tuple[DecisionCore, list[dict]]:
    """Feed every simulated interval, as the arrays the controller's ranks send, to a fresh decision
    core configured as the live controller's; returns it and its history records."""
    s = sim.spec
    cfg = ControllerConfig(policy="static", total_epochs=sim.total_epochs, min_batch=s.min_batch, max_batch=s.max_batch)
    core = DecisionCore(sim.R, sum(sim.sizes), Recorder(), reward=cfg.advanced.reward, stats=cfg.advanced.stats,
                        min_batch=cfg.min_batch, max_batch=cfg.max_batch, total_epochs=cfg.total_epochs,
                        fit_warmup=True, costs=cfg.advanced.costs)  # as the simulator's core: its first steps have no one-off costs
    decisions = []
    for sizes in schedule:
        core.policy.next_sizes = list(sizes)
        rows = np.stack([wire.encode_report(i) for i in sim.inputs])  # what rank 0 gathers
        decisions.append(core.decide(wire.decode_reports(rows), list(sim.sizes), sim.epoch, done=sim.budget_done).record())
        inp = core.policy.inputs[-1]
        assert torch.equal(inp.obs, sim.obs), "observation differs from the controller's"
        if sim.last_reward is None:
            assert inp.reward is None
        else:
            assert torch.equal(inp.reward, sim.last_reward), "reward differs from the controller's"
        assert core.bounds.learned_max == sim.bounds.learned_max
        assert core.stats.noise_scale == sim.stats.noise_scale
        sim.step_sizes(sizes)
    return core, decisions


def test_same_observations_rewards_and_bounds_as_the_live_controller() -> None:
    sim = ClusterSimulator(spec(3, drift=[(0.3, 1, 2.0)]), seed=5)
    sim.reset()
    rng = np.random.default_rng(0)
    schedule = [[int(b) for b in rng.integers(8, 128, 3)] for _ in range(12)]
    _, decisions = drive_both(sim, schedule)
    assert decisions[0]["reward"] is None and decisions[1]["reward"] is not None
    assert all(math.isfinite(d["noise_scale"]) for d in decisions)
    assert sim.obs.shape == (4, OBS_DIM) and torch.isfinite(sim.obs).all()


def test_cpu_cluster_learns_memory_bounds_from_oom() -> None:
    s = spec(2, gpu=False, mem_base_bytes=[1e9, 1e9], mem_per_sample_bytes=[1e7, 1e8], mem_total_bytes=[1e10, 1e10])
    sim = ClusterSimulator(s, seed=1)
    sim.reset()
    assert sim.capacity.tolist() == [900, 90]
    sim.step_sizes([200, 200])
    # as the live optimizer: redo the step at 0.8x until it fits (200 -> 160 -> 128 -> 102 -> 81)
    assert sim.ooms == 4 and sim.sizes[1] == 81 and sim.bounds.upper(1) == 81 and sim.bounds.upper(0) == 1024
    gpu = ClusterSimulator(spec(2, mem_per_sample_bytes=[1e7, 1e8], mem_total_bytes=[1e10, 1e10]), seed=1)
    gpu.step_sizes([16, 16])  # peak memory at two sizes: the controller's CUDA fit sets the bounds
    assert all(gpu.bounds.upper(r) <= c for r, c in enumerate(gpu.capacity)), "fitted bounds within memory"
    assert gpu.bounds.upper(1) < 90 <= gpu.bounds.upper(0)


def test_step_time_physics_and_straggler_signal() -> None:
    sim = ClusterSimulator(spec(4, jitter=0.0), seed=2)
    sim.reset()
    for rep in sim.reports:
        assert rep.sync_wait_s >= 0 and rep.step_s >= rep.compute_s + rep.sync_wait_s
    waits = [r.sync_wait_s for r in sim.reports]
    assert np.argmin(waits) == 3 and np.argmax(waits) == 0, "the slowest rank waits least, the fastest most"
    assert sim.obs[3, 1] > 0 > sim.obs[0, 1], "the fitted per-sample cost marks the slow rank"
    t_small, t_big = sim.expected_step_time(np.array([32] * 4)), sim.expected_step_time(np.array([64] * 4))
    assert t_small < t_big < 2 * t_small, "fixed costs amortise over bigger batches"
    d = ClusterSimulator(spec(4, drift=[(0.5, 0, 2.0)]), seed=3)
    d.reset()
    before = d.reports[0].compute_s
    while d.progress < 0.6 * d.spec.target_progress:
        d.step_sizes([32] * 4)
    assert 1.7 < d.reports[0].compute_s / before < 2.3, "rank 0 became twice as slow half-way"


def test_noise_scale_estimate_tracks_the_truth_and_grows() -> None:
    sim = ClusterSimulator(spec(4), seed=4)
    sim.reset()
    estimates, truths, losses = [], [], []
    while not sim.done:
        sim.step_sizes([32] * 4)
        estimates.append(sim.ctx.noise_scale)
        truths.append(sim.phi())
        losses.append(sim.reports[0].loss_mean)
    ratio = np.array(estimates[10:]) / np.array(truths[10:])
    assert 0.6 < np.median(ratio) < 1.6
    assert estimates[-1] > 3 * estimates[5], "noise scale grows as training progresses"
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), "loss falls"
    assert math.isfinite(sim.time_to_target) and 55 <= sim.decisions <= 62, "static reaches the target on schedule"


def test_batch_jump_spikes_the_loss_and_costs_progress() -> None:
    calm, jump = ClusterSimulator(spec(2, loss_noise=0.0), seed=6), ClusterSimulator(spec(2, loss_noise=0.0), seed=6)
    calm.reset(0.2), jump.reset(0.2)
    calm.step_sizes([32, 32])
    jump.step_sizes([128, 128])
    assert jump.ctx.loss_trend > 0 > calm.ctx.loss_trend, "the loss rises after a 4x batch (2x LR) jump"
    assert jump._spike > 0 and calm._spike == 0 and torch.isfinite(jump.last_reward).all()
    assert jump.progress - 0.2 * jump.spec.target_progress < 4 * (calm.progress - 0.2 * calm.spec.target_progress)


def test_adascale_spike_follows_the_gain_of_the_true_statistics() -> None:
    """Under "adascale" the LR ratio of a 4x jump is r = (phi/B + 1) / (phi/4B + 1) (between 1 and 4:
    near linear while B is far below phi), not sqrt(4)."""
    runs = {}
    for rule in ("adascale", "sqrt"):
        sim = ClusterSimulator(spec(2, loss_noise=0.0, lr_rule=rule), seed=6, log_steps=True)
        sim.reset(0.2)
        phi = sim.phi()
        sim.step_sizes([128, 128])
        runs[rule] = (sim, phi)
    sim, phi = runs["adascale"]
    r = (phi / 64 + 1) / (phi / 256 + 1)
    decay = math.exp(-sim.spec.steps_per_decision / sim.spec.spike_steps)
    assert 2 < r < 4 and sim._spike == pytest.approx(sim.spec.spike_coef * math.log2(r) * decay, rel=1e-6)
    assert runs["sqrt"][0]._spike < sim._spike, "phi ~ 475 >> B: r ~ 3 > sqrt(4), adascale spikes more"
    assert sim.step_log[-1]["lr"] == pytest.approx(r, rel=1e-9), "the logged LR factor: the gain over B0 = 64"


def test_optimum_matches_brute_force_and_beats_static() -> None:
    s = spec(2, mem_per_sample_bytes=[4e8, 4e8], mem_total_bytes=[1e9 + 4e8 * 40] * 2, jitter=0.0)
    sim = ClusterSimulator(s, seed=0)
    grid = np.array(list(itertools.product(range(1, 41), range(1, 41))))
    best = grid[int(np.argmax(sim.goodput(grid)))]
    opt = np.array(sim.optimum_sizes())
    assert sim.goodput(opt) >= 0.999 * sim.goodput(best), (opt, best)
    static = sim.run_policy(StaticPolicy())
    oracle = sim.run_oracle()
    assert oracle.time_to_target_s < static.time_to_target_s and 0 < static.mean_goodput_ratio <= 1.0


def test_sampled_clusters_are_valid_and_runs_are_deterministic() -> None:
    rng = np.random.default_rng(0)
    for family in FAMILIES:
        for R in (1, 2, 5, 64):
            s = sample_cluster(rng, ScenarioConfig(families=(family,)), world_size=R)
            assert s.world_size == R and s.name == family
            sim = ClusterSimulator(s, seed=1)
            obs, reward, _, _ = sim.step([ActionSpace().keep] * (R + 1))
            assert obs.shape == (R + 1, OBS_DIM) and torch.isfinite(obs).all() and torch.isfinite(reward).all()
            assert ClusterSpec.from_dict(s.to_dict()) == s
    a, b = ClusterSimulator(spec(3), seed=9), ClusterSimulator(spec(3), seed=9)
    for act in ([4, 4, 4, 2], [0, 2, 3, 4]):
        oa, ra, _, _ = a.step(act)
        ob, rb, _, _ = b.step(act)
        assert torch.equal(oa, ob) and torch.equal(ra, rb)
    with pytest.raises(ValueError, match="one entry per rank"):
        ClusterSpec(alpha_s=[0.0, 0.0], beta_s=[1e-3], initial_batch=[8, 8])


def test_1024_ranks_simulate() -> None:
    """The simulator scales to 1024 ranks (its speed is a benchmark's business, not a unit test's)."""
    s = sample_cluster(np.random.default_rng(1), world_size=1024)
    s.steps_per_decision = 20
    sim = ClusterSimulator(s, seed=0)
    for _ in range(20):
        obs, reward, _, _ = sim.step(np.random.default_rng(0).integers(0, 5, 1025).tolist())
    assert obs.shape == (1025, OBS_DIM) and reward.shape == (1024,)
    assert np.isfinite(obs).all() and np.isfinite(reward).all()
    assert math.isfinite(sim.ctx.noise_scale)


def test_accumulation_past_memory_pays_on_a_communication_bound_job() -> None:
    """Memory caps each rank at 32 while the allreduce dominates (200 MB at 1 GB/s): with max_passes the
    proposal accumulates micro-batches, B grows past one pass and the job reaches its target faster;
    the core sees the steps as what they are (p micro-batches each)."""
    from dynamix_hvd.control.proposal import ModelPolicy

    times = {}
    for max_passes in (1, 4):
        s = spec(2, max_batch=32, max_passes=max_passes, model_bytes=2e8, phi_start=3000.0, phi_end=30000.0,
                 target_progress=64 * 20 * 200)
        sim = ClusterSimulator(s, seed=1)
        result = sim.run_policy(ModelPolicy())
        assert result.reached and max(result.final_sizes) <= 32
        times[max_passes] = result.time_to_target_s
        # against the one-pass optimum: equal without accumulation, above it with
        assert (result.mean_goodput_ratio > 2.0) if max_passes > 1 else (0.95 < result.mean_goodput_ratio <= 1.0)
        assert sim.passes == max_passes, "the proposal goes to the accumulation it may use"
        assert sim.inputs[0].steps.micro_batches == [sim.passes] * len(sim.inputs[0].steps.local_batch)
        assert sim.inputs[0].steps.local_batch[0] == sim.passes * sim.sizes[0]
    assert times[4] < 0.5 * times[1], times
