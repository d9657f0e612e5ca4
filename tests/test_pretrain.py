"""Pretraining, calibration, logged transitions and the shipped default policy (one process, no MPI)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from dynamix_hvd.control.actions import ActionSpace
from bench.lab.calibrate import calibrate, load_run, mape, step_table
from dynamix_hvd.control.policy import StaticPolicy
from dynamix_hvd.control.proposal import ModelPolicy
from dynamix_hvd.control.refine import PPOPolicy
from dynamix_hvd.control.policy_store import load_policy
from bench.lab.pretrain import (DEFAULT_POLICY, JobSampler, PretrainConfig, actions_from_sizes, dataclass_parser,
                                  field_docs, finetune_on_transitions, make_learner, pretrain, read_transitions_h5,
                                  rollout, transitions_from_history, write_transitions_h5)
from bench.lab.scenarios import ScenarioConfig, sample_cluster
from bench.lab.simulator import ClusterSimulator, ClusterSpec
from dynamix_hvd.control.state import OBS_DIM
from test_simulator import drive_both, spec

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_command_line_help_comes_from_the_field_docstrings() -> None:
    docs = field_docs(PretrainConfig)
    assert set(docs) == set(PretrainConfig.__dataclass_fields__) and "PPO updates" in docs["updates"]
    args = dataclass_parser(PretrainConfig).parse_args(["--updates", "3", "--families", "cnn"])
    assert PretrainConfig(**vars(args)) == PretrainConfig(updates=3, families="cnn")
    out = subprocess.run([sys.executable, "-m", "bench.lab.pretrain", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--clusters-per-update" in out.stdout and "Simulated jobs per rollout" in out.stdout


def test_calibration_recovers_a_simulated_cluster() -> None:
    """A log from the simulator itself (known alpha, beta, network) with changing sizes: the fit
    recovers the parameters and predicts held-back step times within 10% (jitter is 5%)."""
    truth = spec(3, jitter=0.05, gamma=1.0)
    sim = ClusterSimulator(truth, seed=0, log_steps=True)
    sim.reset()
    rng = np.random.default_rng(0)
    for _ in range(40):
        sim.step_sizes(rng.integers(8, 256, 3).tolist())
    res = calibrate(sim.step_log_frame(), holdout=0.25)
    tp = res.throughput
    assert np.allclose(tp.beta_s, truth.beta_s, rtol=0.15), (tp.beta_s, truth.beta_s)
    assert res.fit["holdout_mape_pct"] < 10 and res.fit["holdout_window_mape_pct"] < 5, res.fit
    assert abs(math.log(res.spec.phi_start / truth.phi_start)) < math.log(2.5)
    assert res.spec.phi_end > 2 * res.spec.phi_start, "noise scale growth is recovered"
    again = ClusterSimulator(ClusterSpec.from_dict(res.spec.to_dict()), seed=1)  # the fitted spec runs
    assert torch.isfinite(again.obs).all() and again.R == 3


@pytest.mark.parametrize("log, max_step_mape, max_window_mape, must_beat_constant", [
    ("charlm_2rank_slow", 25.0, 10.0, True),   # compute grows with the batch
    ("mlp_2rank_slow", 45.0, 30.0, False),     # ms steps: scheduling noise dominates (see tests/data/README.md)
])
def test_calibration_on_real_two_rank_logs(log: str, max_step_mape: float, max_window_mape: float,
                                           must_beat_constant: bool) -> None:
    """Real logs of the example jobs (tests/data/README.md): held-back (last 25%) step-time error below
    the stated bounds; where the batch matters, far better than the best constant predictor fitted on
    the same training steps; the straggler's extra fixed time per step is found."""
    steps, decisions = load_run(DATA / log)
    res = calibrate(steps, decisions, holdout=0.25)
    t = step_table(steps)
    n_train = int(res.fit["train_steps"])
    constant = np.full(len(t["step"]) - n_train, np.median(t["step"][:n_train]))
    baseline = mape(constant, t["step"][n_train:])
    assert res.fit["holdout_mape_pct"] < max_step_mape and res.fit["holdout_window_mape_pct"] < max_window_mape, res.fit
    if must_beat_constant:
        assert res.fit["holdout_mape_pct"] < 0.5 * baseline, (res.fit, baseline)
    else:
        assert res.throughput.alpha_s[1] > res.throughput.alpha_s[0] + 1.5e-3, "the 3 ms straggler is found"
    assert res.spec.world_size == 2 and res.spec.initial_batch == [int(b) for b in t["batches"][0]]
    sim = ClusterSimulator(res.spec, seed=0)  # the calibrated cluster runs in the simulator
    assert torch.isfinite(sim.obs).all()


def test_short_pretraining_keeps_the_weights_that_scored_best() -> None:
    cfg = PretrainConfig(updates=25, clusters_per_update=4, horizon=16, eval_every=5, eval_windows=6,
                         eval_clusters=0, seed=1)
    learner, curve, selection = pretrain(cfg, log=lambda *a: None)
    assert curve[0]["update"] == 0 and len(curve) == 26
    evals = {int(r["update"]): r["eval_reward"] for r in curve if math.isfinite(r["eval_reward"])}
    assert sorted(evals) == [0, 5, 10, 15, 20, 25]
    best = max(u for u in evals if evals[u] == max(evals.values()))  # the latest of equals
    assert selection == {"selected_update": best, "selected_eval_reward": evals[best]}
    # the returned weights are those: the same validation jobs score the same reward again
    sampler, rng = JobSampler(cfg), np.random.default_rng(cfg.seed + 10_000)
    specs = [sampler(rng) for _ in range(cfg.eval_windows)]
    sims = [ClusterSimulator(s, seed=77 + i) for i, s in enumerate(specs)]
    assert rollout(learner, sims, [0.0] * len(sims), cfg.horizon, deterministic=True) == pytest.approx(evals[best])
    # so it is never worse there than the untrained policy, which deploys the proposal
    assert evals[best] >= evals[0]
    assert any(math.isfinite(r["train_reward"]) for r in curve[1:])
    assert curve[-1]["entropy"] < math.log(ActionSpace().n)


def test_default_policy_loads_and_beats_static_in_the_simulator() -> None:
    learner, meta = load_policy(DEFAULT_POLICY, ActionSpace())
    prov = meta["provenance"]
    assert prov["command"].startswith("python -m bench.lab.pretrain") and prov["num_updates"] > 0
    assert (REPO / "policies" / f"{DEFAULT_POLICY}.md").exists()
    assert (REPO / "policies" / f"{DEFAULT_POLICY}.pt").stat().st_size < 1_000_000
    rng = np.random.default_rng(2024)  # jobs the policy was not evaluated on during training
    scenario = ScenarioConfig(world_sizes=(2, 4, 8), static_decisions=(30.0, 80.0))
    ratios, proposal = [], []
    for i in range(10):
        s = sample_cluster(rng, scenario)
        sim = ClusterSimulator(s, seed=i)
        static = sim.run_policy(StaticPolicy(), track_optimum=False).time_to_target_s
        policy = sim.run_policy(PPOPolicy(learner, learn=False), track_optimum=False).time_to_target_s
        ratios.append(static / policy)
        proposal.append(static / sim.run_policy(ModelPolicy(), track_optimum=False).time_to_target_s)
    geomean = float(np.exp(np.mean(np.log(ratios))))
    # measured 1.25 for the policy and 1.26 for the proposal alone (with change votes; 1.29 both without):
    # the policy no slower than static on any job beyond 1% (0.998 on one where static is already the
    # best and the proposal ties it), and no slower than the proposal it refines
    assert geomean > 1.2 and min(ratios) > 0.99, ratios
    assert geomean >= 0.98 * float(np.exp(np.mean(np.log(proposal)))), (ratios, proposal)


def test_transitions_round_trip_append_and_spec_check(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    obs, acts, rews = rng.normal(size=(5, 3, OBS_DIM)), rng.integers(0, 5, (5, 3)), rng.normal(size=(5, 3))
    path = write_transitions_h5(tmp_path / "run.h5", obs, acts, rews, attrs={"job": "unit"})
    write_transitions_h5(path, obs[:2], acts[:2], rews[:2], append=True)
    data = read_transitions_h5(path)
    assert data["obs"].shape == (7, 3, OBS_DIM) and data["actions"].dtype == np.int64
    assert np.allclose(data["rewards"][5:], rews[:2])
    with pytest.raises(ValueError, match="cannot append"):
        write_transitions_h5(path, obs[:, :2], acts[:, :2], rews[:, :2], append=True)
    with pytest.raises(ValueError, match="need obs"):
        write_transitions_h5(tmp_path / "bad.h5", obs[:, :, :5], acts, rews)
    import h5py

    with h5py.File(path, "a") as f:
        f.attrs["rank_features"] = "[\"something else\"]"
    with pytest.raises(ValueError, match="other state features"):
        read_transitions_h5(path)


def test_transitions_rebuilt_from_controller_history_match_the_simulator() -> None:
    """The real controller's history (driven by simulated intervals) gives back the observations the
    policy saw, its actions (nearest multipliers of the size changes) and the rewards, shifted by one."""
    sim = ClusterSimulator(spec(2), seed=3)
    sim.reset()
    sizes = [[32, 32], [40, 25], [50, 20], [50, 20], [25, 10]]
    observations: list[torch.Tensor] = []
    orig = sim.step_sizes

    def record(new_sizes):  # the observation each decision saw
        observations.append(sim.obs.clone())
        return orig(new_sizes)

    sim.step_sizes = record  # type: ignore[method-assign]
    _, history = drive_both(sim, sizes)
    obs, acts, rews = transitions_from_history(history, total_epochs=sim.total_epochs)
    assert obs.shape == (4, 3, OBS_DIM) and acts.shape == (4, 3) and rews.shape == (4, 3)
    assert np.allclose(obs, torch.stack(observations[:4]).numpy(), atol=1e-5)
    assert np.allclose(rews[0], [*history[1]["reward"], np.mean(history[1]["reward"])])
    # a static log: the nearest corrections relative to the previous sizes (decision 1: [32, 32] -> [40, 25],
    # shares x1.25 and x0.8, batch x1)
    assert acts[1].tolist() == actions_from_sizes([32, 32], [40, 25]) == [4, 0, 2]
    assert actions_from_sizes([40, 25], [50, 20]) == [3, 0, 3]


def test_finetuning_moves_the_policy_towards_better_logged_actions() -> None:
    learner = make_learner(PretrainConfig(seed=0))
    rng = np.random.default_rng(1)
    obs = rng.normal(size=(64, 4, OBS_DIM)).astype(np.float32)
    acts = rng.choice([0, 4], size=(64, 4))
    rews = np.where(acts == 4, 1.0, -1.0).astype(np.float32)  # x2 was good, x0.5 bad
    x = torch.as_tensor(obs.reshape(-1, OBS_DIM))
    with torch.no_grad():
        before = torch.softmax(learner.net.actor(x), -1).mean(0)
    stats = finetune_on_transitions(learner, [{"obs": obs, "actions": acts, "rewards": rews}], steps=200, kl_coef=0.1, lr=1e-3)
    with torch.no_grad():
        after = torch.softmax(learner.net.actor(x), -1).mean(0)
    # from the neutral-biased start, probability moves to the good correction, much more than to the bad one
    assert after[4] > before[4] + 0.1 and after[4] - before[4] > 2 * (after[0] - before[0]), (before, after)
    assert stats["transitions"] == 256 and math.isfinite(stats["kl"])
