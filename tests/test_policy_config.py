"""Policy files and user config: a missing default policy is an error that says how to fix it; the PPO
fields a user names override the stored ones where they can and are refused, by name, where they
cannot; each policy takes its own typed config; README's settings reference matches the dataclass."""
from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.config import (FRESH_PPO, POLICY_CONFIGS, POLICY_NAMES, AdvancedConfig, ControllerConfig,
                                        make_policy, policy_config_from)
from dynamix_hvd.control.policy_store import DEFAULT_POLICY, PolicyError, default_policy_dir, load_policy
from dynamix_hvd.control.proposal import ProposalConfig
from dynamix_hvd.control.reward import RewardConfig
from dynamix_hvd.control.rules import GoodputConfig, LinearRampConfig
from dynamix_hvd.control.ppo import PPOConfig
from dynamix_hvd.stats.noise_scale import StatsConfig


def test_missing_default_policy_is_an_error_saying_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIX_POLICY_DIR", str(tmp_path))
    with pytest.raises(PolicyError, match="default policy cannot be used.*not found.*DYNAMIX_POLICY_DIR.*policy_file=None"):
        make_policy(ControllerConfig(policy="ppo"))
    assert make_policy(ControllerConfig(policy="ppo", policy_file=None, learn=True)).learner.num_updates == 0


def test_unreadable_default_policy_is_an_error(tmp_path, monkeypatch):
    for suffix in (".pt", ".json"):
        shutil.copy(default_policy_dir() / f"{DEFAULT_POLICY}{suffix}", tmp_path)
    (tmp_path / f"{DEFAULT_POLICY}.pt").write_bytes(b"not a policy")
    monkeypatch.setenv("DYNAMIX_POLICY_DIR", str(tmp_path))
    with pytest.raises(PolicyError, match="default policy cannot be used.*checksum.*Reinstall"):
        make_policy(ControllerConfig(policy="ppo"))


def test_ppo_controller_config_keeps_the_stored_ppo_config():
    stored, _ = load_policy(DEFAULT_POLICY, ActionSpace())
    policy = make_policy(ControllerConfig(policy="ppo"))
    assert policy.learner.config == stored.config
    assert policy.learner.generator.get_state().equal(stored.generator.get_state())


@pytest.mark.parametrize("ppo", [{"seed": 7, "ent_coef": 0.02},
                                 {"seed": 7, "ent_coef": 0.02, "learning_rate": 1e-4}])  # a field equal to the stored one
def test_user_ppo_fields_override_the_stored_ones(ppo):
    stored, _ = load_policy(DEFAULT_POLICY, ActionSpace())
    learner = make_policy(ControllerConfig(policy="ppo", ppo=ppo)).learner
    assert learner.config == dataclasses.replace(stored.config, seed=7, ent_coef=0.02)
    fresh = load_policy(DEFAULT_POLICY, ActionSpace())[0]
    fresh.generator.manual_seed(7)
    assert learner.generator.get_state().equal(fresh.generator.get_state()), "seed not applied"


def test_a_named_ppo_field_applies_even_at_a_default_value():
    """The fields named in ControllerConfig.ppo win, whatever their value: PPOConfig's own defaults
    (gamma 0.99, rollout_length 32) override the stored 0.9 and 16 when named, and only then."""
    stored, _ = load_policy(DEFAULT_POLICY, ActionSpace())
    assert (stored.config.gamma, stored.config.rollout_length) != (PPOConfig().gamma, PPOConfig().rollout_length)
    named = make_policy(ControllerConfig(policy="ppo", ppo={"gamma": PPOConfig().gamma, "rollout_length": 32})).learner
    assert named.config == dataclasses.replace(stored.config, gamma=PPOConfig().gamma, rollout_length=32)
    assert make_policy(ControllerConfig(policy="ppo", ppo={})).learner.config == stored.config


def test_fresh_policy_settings_are_fresh_ppo_then_the_named_fields():
    assert make_policy(ControllerConfig(policy="ppo", policy_file=None, learn=True)).learner.config == FRESH_PPO
    learner = make_policy(ControllerConfig(policy="ppo", policy_file=None, learn=True, ppo={"gamma": 0.5, "hidden_sizes": [32]})).learner
    assert learner.config == dataclasses.replace(FRESH_PPO, gamma=0.5, hidden_sizes=(32,))


def test_learning_rate_override_reaches_the_adam_optimizer():
    learner = make_policy(ControllerConfig(policy="ppo", ppo={"learning_rate": 2e-3}, learn=True)).learner
    assert learner.config.learning_rate == 2e-3
    assert [g["lr"] for g in learner.optimizer.param_groups] == [2e-3]


def test_network_shape_conflict_is_refused_by_name():
    with pytest.raises(PolicyError, match=r"hidden_sizes=\(32,\) \(stored \(64, 64\)\)"):
        make_policy(ControllerConfig(policy="ppo", ppo={"hidden_sizes": (32,)}))
    assert make_policy(ControllerConfig(policy="ppo", ppo={"hidden_sizes": [64, 64]})).learner.config.hidden_sizes == (64, 64)


def test_load_policy_reports_what_it_overrode():
    _, meta = load_policy(DEFAULT_POLICY, ActionSpace(), ppo={"seed": 3, "gamma": 0.9})  # gamma: the stored value
    assert meta["ppo_overrides"] == {"seed": 3}


@pytest.mark.parametrize("ppo, needle", [({"lr": 1e-3}, "unknown field.*'lr'"), ({"gamma": 2.0}, "ppo.*gamma"),
                                         ({"hidden_sizes": ()}, "ppo.*hidden_sizes"), ([("seed", 1)], "ppo=")])
def test_bad_ppo_settings_are_refused_at_construction(ppo, needle):
    with pytest.raises(ValueError, match=needle):
        ControllerConfig(policy="ppo", ppo=ppo)


# --- the policy's typed config ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_takes_its_own_config_type_and_no_other(policy):
    kind = POLICY_CONFIGS[policy]
    if kind is not None:
        assert ControllerConfig(policy=policy, policy_file=None, policy_config=kind()).policy_config == kind()
    for other in {k for k in POLICY_CONFIGS.values() if k is not None and k is not kind}:
        with pytest.raises(ValueError, match=f"policy_config={other.__name__}.*does not fit policy='{policy}'"):
            ControllerConfig(policy=policy, policy_config=other())
    with pytest.raises(ValueError, match="policy_config"):
        ControllerConfig(policy=policy, policy_config={"end": 4})


def test_policy_configs_reach_the_policy():
    ramp = make_policy(ControllerConfig(policy="linear-ramp", policy_config=LinearRampConfig(end=96, ramp=2)))
    assert (ramp.end, ramp.ramp) == (96, 2)
    assert make_policy(ControllerConfig(policy="goodput", policy_config=GoodputConfig(candidates=8))).cfg.candidates == 8
    assert make_policy(ControllerConfig(policy="model", policy_config=ProposalConfig(trust=3.0))).cfg.trust == 3.0
    ppo = make_policy(ControllerConfig(policy="ppo", policy_config=ProposalConfig(trust=3.0)))
    assert ppo.model.cfg.trust == 3.0


def test_policy_config_from_plain_fields():
    assert policy_config_from("linear-ramp", {"end": 64}) == LinearRampConfig(end=64)
    assert policy_config_from("increase-batch", {"milestones": [0.5]}).milestones == (0.5,)
    assert policy_config_from("ppo", {}) is None and policy_config_from("static", {}) is None
    for policy, fields, needle in (("static", {"end": 1}, "takes no settings"), ("goodput", {"end": 1}, "no field.*'end'"),
                                   ("adabatch", {"every": 0}, "AdaBatchConfig.every=0"), ("nope", {}, "policy='nope'"),
                                   ("ppo", [1], "JSON object")):
        with pytest.raises(ValueError, match=needle):
            policy_config_from(policy, fields)


# --- README's settings reference ----------------------------------------------------------------------
def _reference() -> str:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("### Settings")
    return text[start:text.index("\n#", start + 1)]


def test_readme_settings_reference_matches_the_dataclass():
    """Every top-level field of ControllerConfig is a row of README's reference, in order, with its
    default as Python; every nested config's fields are named there."""
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", _reference(), flags=re.M)
    fields = dataclasses.fields(ControllerConfig)
    assert [name for name, _ in rows] == [f.name for f in fields]
    names = {cls.__name__: cls for cls in (AdvancedConfig, ProposalConfig, RewardConfig, StatsConfig, PPOConfig)}
    defaults = ControllerConfig()
    for (name, shown), f in zip(rows, fields):
        assert eval(shown, dict(names)) == getattr(defaults, name), f"README shows {name} = {shown}"
    nested = [AdvancedConfig, ProposalConfig, RewardConfig, StatsConfig, PPOConfig,
              *(k for k in POLICY_CONFIGS.values() if k is not None and k is not ProposalConfig)]
    for cls in nested:
        line = next((l for l in _reference().splitlines() if f"`{cls.__name__}`" in l), "")
        missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in line]
        assert line and not missing, f"README's reference lacks {cls.__name__} or its fields {missing}"
