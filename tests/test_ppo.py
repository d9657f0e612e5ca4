"""PPO learner (dynamix_hvd.control.ppo) and the toy cluster (toy_env): maths, validation,
determinism, checkpoint round trip, and learning a batch-size task whose optimum is known."""
from __future__ import annotations

import copy
import io
import math
import time
from typing import Dict, Iterator, Tuple

import numpy as np
import pytest
import torch

from dynamix_hvd.control.ppo import ActorCritic, PPOConfig, PPOLearner, RolloutBuffer, compute_gae, make_observation
from toy_env import (OBS_DIM_GLOBAL, OBS_DIM_RANK, ToyBatchSizeEnv, ToyBatchSizeVecEnv, ToyClusterConfig,
                                 exhaustive_optimum)

N_ACTIONS = len(ToyClusterConfig().multipliers)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Single-threaded torch: faster on 2 cores and the same floating-point reductions on every run."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_learner(seed: int = 0, **overrides) -> PPOLearner:
    cfg = PPOConfig(seed=seed, **{"rollout_length": 8, "update_epochs": 2, "num_minibatches": 2, **overrides})
    return PPOLearner(OBS_DIM_RANK, OBS_DIM_GLOBAL, N_ACTIONS, cfg)


def drive(learner: PPOLearner, env: ToyBatchSizeEnv, obs: np.ndarray, decisions: int) -> Tuple[np.ndarray, list]:
    """The online loop of a controller: act, step, record, update when ready. Returns last obs and logs."""
    logs = []
    for _ in range(decisions):
        actions, _, _ = learner.act(obs)
        obs, reward, done, _ = env.step(actions.numpy())
        learner.record(reward, done, truncated_obs=obs if done else None)
        if learner.ready():
            logs.append(learner.update(next_obs=obs))
        if done:
            obs = env.reset()
    return obs, logs


# (a) GAE ------------------------------------------------------------------------------------------

def test_gae_matches_hand_computed_example():
    # gamma = lambda = 0.5, so gamma * lambda = 0.25; the episode ends with transition t = 1.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    values = torch.tensor([[0.5, 1.0], [1.0, 0.0], [0.0, 2.0]])
    dones = torch.tensor([0.0, 1.0, 0.0])
    last_value = torch.tensor([2.0, 4.0])
    adv, ret = compute_gae(rewards, values, dones, last_value, gamma=0.5, gae_lambda=0.5)
    # rank 0: t=2: d = 1 + .5*2 - 0 = 2 -> A=2;  t=1 (done): d = 0 - 1 = -1 -> A=-1;
    #         t=0: d = 1 + .5*1 - .5 = 1 -> A = 1 + .25*(-1) = .75
    # rank 1: t=2: d = 1 + .5*4 - 2 = 1 -> A=1;  t=1 (done): d = 2 - 0 = 2 -> A=2;
    #         t=0: d = 0 + .5*0 - 1 = -1 -> A = -1 + .25*2 = -.5
    expected_adv = torch.tensor([[0.75, -0.5], [-1.0, 2.0], [2.0, 1.0]])
    torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, expected_adv + values, rtol=0, atol=1e-6)


def test_gae_limits_td0_and_monte_carlo():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.rand(6, 3, generator=g), torch.rand(6, 3, generator=g)
    last_value, dones, gamma = torch.rand(3, generator=g), torch.zeros(6), 0.9
    nxt = torch.cat([values[1:], last_value[None]])
    adv0, _ = compute_gae(rewards, values, dones, last_value, gamma, 0.0)  # lambda=0: one-step TD error
    torch.testing.assert_close(adv0, rewards + gamma * nxt - values)
    _, ret1 = compute_gae(rewards, values, dones, last_value, gamma, 1.0)  # lambda=1: discounted return
    mc = torch.stack([sum(gamma ** (k - t) * rewards[k] for k in range(t, 6)) + gamma ** (6 - t) * last_value
                      for t in range(6)])
    torch.testing.assert_close(ret1, mc)


def test_buffer_gae_uses_only_stored_decisions_and_checks_capacity():
    buf = RolloutBuffer(num_steps=4, num_ranks=2, obs_dim=3)
    for t in range(2):
        buf.add(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.tensor([1.0, 2.0]),
                done=t == 1, value=torch.tensor([0.5, 0.5]))
    adv, ret = buf.compute_returns_and_advantages(torch.tensor([9.0, 9.0]), gamma=1.0, gae_lambda=1.0)
    torch.testing.assert_close(ret, torch.tensor([[2.0, 4.0], [1.0, 2.0]]))  # done at t=1: 9s ignored
    buf.add(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.zeros(2), False, torch.zeros(2))
    buf.add(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.zeros(2), False, torch.zeros(2))
    with pytest.raises(RuntimeError, match="full"):
        buf.add(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.zeros(2), False,
                torch.zeros(2))
    buf.reset(num_ranks=5)
    assert buf.pos == 0 and buf.obs.shape == (4, 5, 3) and buf.dones.shape == (4,)


# (b) configuration and API errors ------------------------------------------------------------------

def test_defaults_follow_the_reference():
    cfg = PPOConfig()
    assert (cfg.learning_rate, cfg.adam_eps, cfg.gamma, cfg.gae_lambda, cfg.clip_coef) == (3e-4, 1e-5, 0.99, 0.95, 0.2)
    assert (cfg.vf_coef, cfg.ent_coef, cfg.max_grad_norm, cfg.norm_adv, cfg.clip_vloss) == (0.5, 0.01, 0.5, True, True)
    assert cfg.target_kl is None and PPOConfig(hidden_sizes=[32]).hidden_sizes == (32,)


@pytest.mark.parametrize("field,value", [
    ("learning_rate", 0.0), ("learning_rate", -1e-3), ("adam_eps", 0), ("gamma", 1.5), ("gamma", -0.1),
    ("gae_lambda", 2.0), ("gamma", "0.9"), ("clip_coef", 0.0), ("clip_coef", math.nan), ("vf_coef", -1.0),
    ("ent_coef", True), ("max_grad_norm", math.inf), ("update_epochs", 0), ("update_epochs", 2.0),
    ("num_minibatches", 0), ("rollout_length", -3), ("norm_adv", 1), ("clip_vloss", "yes"), ("target_kl", 0.0),
    ("target_kl", -0.01), ("hidden_sizes", ()), ("hidden_sizes", (64, 0)), ("hidden_sizes", 64), ("seed", -1),
    ("seed", 1.5)])
def test_config_rejects_bad_values_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        PPOConfig(**{field: value})
    assert f"PPOConfig.{field}" in str(err.value) and repr(value) in str(err.value)


def test_learner_api_errors():
    with pytest.raises(ValueError, match="n_actions"):
        PPOLearner(3, 3, 0)
    learner = make_learner()
    with pytest.raises(ValueError, match=r"\[R, 6\]"):
        learner.act(torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="act"):
        learner.record(1.0)
    with pytest.raises(RuntimeError, match="at least one"):
        learner.update()
    learner.act(torch.zeros(3, 6), deterministic=True)  # greedy decisions are never recorded
    with pytest.raises(RuntimeError, match="act"):
        learner.record(1.0)
    with pytest.raises(ValueError, match="finite"):
        learner.act(torch.full((3, 6), math.nan))
    learner.act(torch.zeros(3, 6))
    with pytest.raises(ValueError, match="3 entries"):
        learner.record([1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        learner.record([1.0, math.nan, 3.0])
    learner.record([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="next_obs"):
        learner.update()  # not done: needs the next observation to bootstrap
    with pytest.raises(ValueError, match=r"\[3, 6\]"):
        learner.update(next_obs=torch.zeros(2, 6))
    learner.act(torch.zeros(4, 6))  # the world grew to 4 ranks in the middle of a rollout
    with pytest.raises(ValueError, match="world size changed from 3 to 4"):
        learner.record(0.0)
    learner.reset_rollout(num_ranks=4)
    learner.act(torch.zeros(4, 6))
    learner.record(0.0, done=True)
    logs = learner.update()  # done: bootstrap value is 0, next_obs not needed
    assert logs["num_transitions"] == 4 and learner.num_updates == 1


def test_network_init_and_observation_layout():
    net = ActorCritic(3, 3, 5, (64, 64), torch.Generator().manual_seed(0))
    actor_out, critic_out = net.actor[-1], net.critic[-1]
    assert isinstance(net.actor[1], torch.nn.Tanh)
    # orthogonal init: rows (out 5 < in 64) are orthonormal up to the gain
    torch.testing.assert_close(actor_out.weight @ actor_out.weight.T, 0.01 ** 2 * torch.eye(5), atol=1e-7, rtol=0)
    torch.testing.assert_close(critic_out.weight @ critic_out.weight.T, torch.ones(1, 1))
    w0 = net.actor[0].weight  # 64 x 6: columns orthonormal, gain sqrt(2)
    torch.testing.assert_close(w0.T @ w0, 2.0 * torch.eye(6), atol=1e-5, rtol=0)
    obs = make_observation(torch.ones(4, 3), torch.tensor([7.0, 8.0, 9.0]))
    assert obs.shape == (4, 6) and torch.equal(obs[:, 3:], torch.tensor([[7.0, 8.0, 9.0]]).expand(4, 3))
    action, logprob, entropy, value = net.get_action_and_value(obs, generator=torch.Generator().manual_seed(0))
    assert action.shape == logprob.shape == entropy.shape == value.shape == (4,)
    assert torch.all(entropy > math.log(5) - 1e-3)  # 0.01 policy-head gain: almost uniform at start


def test_update_logs_and_target_kl_early_stop():
    env = ToyBatchSizeEnv(seed=0)
    learner = make_learner(update_epochs=6, target_kl=1e-9, learning_rate=1e-2)
    _, logs = drive(learner, env, env.reset(), 8)
    keys = {"policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance", "grad_norm"}
    assert len(logs) == 1 and keys <= logs[0].keys()
    assert all(math.isfinite(logs[0][k]) for k in keys) and logs[0]["epochs"] == 1  # stopped after epoch 1
    assert logs[0]["num_transitions"] == 8 * 3 and learner.buffer.pos == 0


# (c) determinism and checkpoints ----------------------------------------------------------------------

def weights(learner: PPOLearner) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in learner.net.state_dict().items()}


def assert_same_weights(a: PPOLearner, b: PPOLearner) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # bit-identical


def test_same_seed_same_data_gives_bit_identical_weights():
    runs = []
    for seed in (3, 3, 4):
        learner, env = make_learner(seed), ToyBatchSizeEnv(seed=11)
        drive(learner, env, env.reset(), 40)  # 5 updates
        runs.append(learner)
    assert runs[0].num_updates == 5
    assert_same_weights(runs[0], runs[1])
    assert not torch.equal(weights(runs[0])["actor.0.weight"], weights(runs[2])["actor.0.weight"])


def test_learner_leaves_global_rng_alone():
    before = torch.random.get_rng_state()
    learner, env = make_learner(seed=1), ToyBatchSizeEnv(seed=1)
    drive(learner, env, env.reset(), 10)
    assert torch.equal(torch.random.get_rng_state(), before)  # the training job's own RNG stream is untouched


def test_state_dict_round_trip_continues_bit_for_bit():
    learner, env = make_learner(seed=5), ToyBatchSizeEnv(seed=2)
    obs, _ = drive(learner, env, env.reset(), 21)  # 2 updates + 5 decisions in the buffer
    learner.act(obs)  # a pending decision whose reward is not recorded yet
    blob = io.BytesIO()
    torch.save(learner.state_dict(), blob)
    state = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
    restored = PPOLearner.from_state_dict(state)
    other = make_learner(seed=99, hidden_sizes=(8,))  # different seed and sizes: all replaced on load
    other.load_state_dict(state)
    results = []
    for lrn in (learner, restored, other):  # each continues on its own copy of the same cluster
        env_copy = copy.deepcopy(env)
        obs2, reward, done, _ = env_copy.step(lrn._pending["action"].numpy())
        lrn.record(reward, done)
        obs2, logs = drive(lrn, env_copy, obs2, 20)
        results.append((lrn, logs, lrn.act(obs2)[0]))
    assert restored.global_step == learner.global_step == 42 and restored.num_updates == learner.num_updates == 5
    for lrn, logs, actions in results[1:]:
        assert_same_weights(results[0][0], lrn)
        assert logs == results[0][1] and torch.equal(actions, results[0][2])
        assert torch.equal(lrn.generator.get_state(), learner.generator.get_state())
    with pytest.raises(ValueError, match="obs_dim_rank"):
        PPOLearner(2, 3, N_ACTIONS).load_state_dict(state)


# (d) the toy cluster and learning it -----------------------------------------------------------------

def test_toy_optimum_matches_exhaustive_search_and_closed_form():
    cfg = ToyClusterConfig(num_ranks=2, max_batch=(90, 140), speed_range=(30.0, 300.0), noise_scale_range=(50, 800))
    env = ToyBatchSizeEnv(cfg, seed=4)
    for _ in range(4):
        env.reset()
        best, g = env.optimum()
        ex_best, ex_g = exhaustive_optimum(env.speeds, env.phi, cfg.overhead_s, env.ref_batch, cfg.min_batch, env.caps)
        assert g == pytest.approx(ex_g, rel=1e-12) and env.goodput(best) == pytest.approx(g)
    env = ToyBatchSizeEnv(ToyClusterConfig(num_ranks=3), seed=0)
    env.reset(speeds=[100.0, 200.0, 300.0], noise_scale=1920.0)  # the module docstring's worked example
    assert env.best_batch.tolist() == [40, 80, 120] and env.best_goodput == pytest.approx(240 / 0.45 * 2016 / 2160)
    env = ToyBatchSizeEnv(ToyClusterConfig(num_ranks=3, speed_range=(100.0, 200.0)), seed=0)
    env.reset(noise_scale=1500.0)  # uncapped, far from min_batch: B* ~ sqrt(c * S * phi)
    closed = math.sqrt(env.config.overhead_s * env.speeds.sum() * env.phi)
    assert env.best_batch.sum() == pytest.approx(closed, rel=0.05)
    obs, reward, done, info = env.step(np.full(3, 2))  # x1: nothing changes
    assert obs.shape == (3, OBS_DIM_RANK + OBS_DIM_GLOBAL) and 0 < reward <= 1 and not done
    assert reward == pytest.approx(info["goodput"] / info["optimum"])


def evaluate(learner: PPOLearner, num_ranks: int, clusters: int, seed: int, last: int = 4) -> np.ndarray:
    """Greedy policy from the initial batches; per cluster, mean fraction of optimum over the last decisions."""
    env = ToyBatchSizeVecEnv(clusters, ToyClusterConfig(num_ranks=num_ranks), seed=seed)
    obs, fractions, done = env.reset(), [], False
    while not done:
        obs, _, done, info = env.step(learner.act(obs, deterministic=True)[0].numpy())
        fractions.append(info["fraction"])
    return np.mean(fractions[-last:], axis=0)


def keep_initial(num_ranks: int, clusters: int, seed: int) -> float:
    """Baseline: mean fraction of optimum when every rank keeps the initial batch (same clusters as evaluate)."""
    env = ToyBatchSizeVecEnv(clusters, ToyClusterConfig(num_ranks=num_ranks), seed=seed)
    env.reset()
    return float(np.mean([e.goodput() / e.best_goodput for e in env.envs]))


def test_ppo_learns_goodput_optimal_batch_sizes():
    """Each update is one 24-decision episode of 8 clusters (every row of the observation is one rank of
    one cluster); episodes cycle through 2, 3 and 4 ranks, so the world size changes between rollouts.
    Stop once a validation set reaches 93% of optimum for every R (at most 120 updates), then score the
    greedy policy on 64 unseen clusters per R."""
    cfg = PPOConfig(seed=0, gamma=0.9, learning_rate=1e-3, rollout_length=24)
    learner = PPOLearner(OBS_DIM_RANK, OBS_DIM_GLOBAL, N_ACTIONS, cfg)
    envs = [ToyBatchSizeVecEnv(8, ToyClusterConfig(num_ranks=r), seed=0) for r in (2, 3, 4)]
    before = {r: evaluate(learner, r, 64, seed=999).mean() for r in (2, 3, 4)}
    hold = {r: keep_initial(r, 64, seed=999) for r in (2, 3, 4)}
    start, episodes, validation = time.perf_counter(), 0, 0.0
    env = envs[0]
    obs = env.reset()
    while learner.num_updates < 120 and validation < 0.93:
        actions, _, _ = learner.act(obs)
        obs, rewards, done, _ = env.step(actions.numpy())
        learner.record(rewards, done, truncated_obs=obs if done else None)
        if learner.ready():
            learner.update(next_obs=obs)
            if learner.num_updates % 12 == 0:
                validation = min(evaluate(learner, r, 16, seed=777).mean() for r in (2, 3, 4))
        if done:
            episodes += 1
            env = envs[episodes % 3]
            obs = env.reset()
    after = {r: evaluate(learner, r, 64, seed=999) for r in (2, 3, 4)}
    print(f"\nPPO toy: {learner.num_updates} updates, {learner.global_step} decisions "
          f"({learner.global_step * 8} cluster-decisions), {time.perf_counter() - start:.1f} s; fraction of optimum "
          + ", ".join(f"R={r}: untrained {before[r]:.3f}, keep initial batches {hold[r]:.3f}, trained {f.mean():.3f} "
                      f"(worst cluster {f.min():.3f})" for r, f in after.items()))
    assert all(after[r].mean() >= 0.90 for r in (2, 3, 4))
