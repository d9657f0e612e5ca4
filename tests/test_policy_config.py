"""Policy files and user config: a missing default policy is an error that says how to fix it, and a
user's PPO config overrides the stored one where it can and is refused, by name, where it cannot."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.config import ControllerConfig, make_policy
from dynamix_hvd.control.policy_store import DEFAULT_POLICY, PolicyError, default_policy_dir, load_policy
from dynamix_hvd.control.ppo import PPOConfig


def test_missing_default_policy_is_an_error_saying_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIX_POLICY_DIR", str(tmp_path))
    with pytest.raises(PolicyError, match="default policy cannot be used.*not found.*DYNAMIX_POLICY_DIR.*policy_file=None"):
        make_policy(ControllerConfig())
    assert make_policy(ControllerConfig(policy_file=None, learn=True)).learner.num_updates == 0


def test_unreadable_default_policy_is_an_error(tmp_path, monkeypatch):
    for suffix in (".pt", ".json"):
        shutil.copy(default_policy_dir() / f"{DEFAULT_POLICY}{suffix}", tmp_path)
    (tmp_path / f"{DEFAULT_POLICY}.pt").write_bytes(b"not a policy")
    monkeypatch.setenv("DYNAMIX_POLICY_DIR", str(tmp_path))
    with pytest.raises(PolicyError, match="default policy cannot be used.*checksum.*Reinstall"):
        make_policy(ControllerConfig())


def test_default_controller_config_keeps_the_stored_ppo_config():
    stored, _ = load_policy(DEFAULT_POLICY, ActionSpace())
    policy = make_policy(ControllerConfig())
    assert policy.learner.config == stored.config
    assert policy.learner.generator.get_state().equal(stored.generator.get_state())


@pytest.mark.parametrize("make", [lambda: PPOConfig(seed=7, ent_coef=0.02),
                                  lambda: dataclasses.replace(ControllerConfig().ppo, seed=7, ent_coef=0.02)])
def test_user_ppo_fields_override_the_stored_ones(make):
    stored, _ = load_policy(DEFAULT_POLICY, ActionSpace())
    learner = make_policy(ControllerConfig(ppo=make())).learner
    assert learner.config == dataclasses.replace(stored.config, seed=7, ent_coef=0.02)
    fresh = load_policy(DEFAULT_POLICY, ActionSpace())[0]
    fresh.generator.manual_seed(7)
    assert learner.generator.get_state().equal(fresh.generator.get_state()), "seed not applied"


def test_learning_rate_override_reaches_the_adam_optimizer():
    learner = make_policy(ControllerConfig(ppo=PPOConfig(learning_rate=2e-3), learn=True)).learner
    assert learner.config.learning_rate == 2e-3
    assert [g["lr"] for g in learner.optimizer.param_groups] == [2e-3]


def test_network_shape_conflict_is_refused_by_name():
    with pytest.raises(PolicyError, match=r"hidden_sizes=\(32,\) \(stored \(64, 64\)\)"):
        make_policy(ControllerConfig(ppo=PPOConfig(hidden_sizes=(32,))))


def test_load_policy_reports_what_it_overrode():
    _, meta = load_policy(DEFAULT_POLICY, ActionSpace(), ppo=PPOConfig(seed=3), ppo_defaults=(PPOConfig(),))
    assert meta["ppo_overrides"] == {"seed": 3}
