"""Policy files and user config: a missing default policy is an error that says how to fix it; the PPO
fields a user names override the stored ones where they can and are refused, by name, where they
cannot; each policy takes its own typed config; every config turns into plain JSON values and back;
docs/settings.md's reference is the one the dataclasses generate."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.cadence import CadenceConfig
from dynamix_hvd.control.config import (FRESH_PPO, POLICY_CONFIGS, POLICY_NAMES, AdvancedConfig, ControllerConfig,
                                        PPOOverrides, make_policy, policy_config_from)
from dynamix_hvd.control.costmodel import CostConfig
from dynamix_hvd.control.growth import GrowthConfig
from dynamix_hvd.control.policy_store import DEFAULT_POLICY, PolicyError, default_policy_dir, load_policy
from dynamix_hvd.control.proposal import ProposalConfig
from dynamix_hvd.control.reward import RewardConfig
from dynamix_hvd.control.rules import GoodputConfig, IncreaseBatchConfig, LinearRampConfig
from dynamix_hvd.control.ppo import PPOConfig
from dynamix_hvd.control.splitcheck import SplitConfig
from dynamix_hvd.stats.noise_scale import StatsConfig
from dynamix_hvd.tools import settings_doc


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
                                         ({"hidden_sizes": ()}, "ppo.*hidden_sizes"), ([("seed", 1)], "ppo="),
                                         ({"learning_rate": None}, "ppo.*learning_rate=None")])
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
    assert policy_config_from("model", {"growth": {"z": 3.0}}).growth == GrowthConfig(z=3.0)
    for policy, fields, needle in (("static", {"end": 1}, "takes no settings"), ("goodput", {"end": 1}, "unknown field.*'end'"),
                                   ("adabatch", {"every": 0}, "AdaBatchConfig.every=0"), ("nope", {}, "policy='nope'"),
                                   ("ppo", [1], "JSON object")):
        with pytest.raises(ValueError, match=needle):
            policy_config_from(policy, fields)


# --- to_dict / from_dict ------------------------------------------------------------------------------
def _every_policys_config() -> list[ControllerConfig]:
    """A config of every policy with non-default settings at every depth."""
    out = []
    advanced = AdvancedConfig(batchnorm_min_batch=4, cadence=CadenceConfig(decision_budget=0, target_decisions=64),
                              reward=RewardConfig(switch_weight=0.5), stats=StatsConfig(ema_beta=0.9, noise_z=2.0),
                              costs=CostConfig(capacity=128, seen_within=0.2), multipliers=(0.5, 1.0, 2.0))
    samples = {ProposalConfig: ProposalConfig(trust=None, dither_decisions=None, growth=GrowthConfig(z=3.0),
                                              split=SplitConfig(keep=0.25)),
               IncreaseBatchConfig: IncreaseBatchConfig(milestones=(0.3, 0.6, 0.9))}
    for policy in POLICY_NAMES:
        kind = POLICY_CONFIGS[policy]
        settings = None if kind is None else samples.get(kind, kind())
        ppo = PPOOverrides(seed=3, hidden_sizes=(32, 32), target_kl=0) if policy == "ppo" else PPOOverrides()
        out.append(ControllerConfig(policy=policy, policy_config=settings, policy_file=None if policy == "ppo" else "default",
                                    learn=policy == "ppo", total_epochs=7, max_passes=2, ppo=ppo, advanced=advanced))
    return out


@pytest.mark.parametrize("config", _every_policys_config(), ids=lambda c: c.policy)
def test_every_policys_config_round_trips_through_json(config):
    plain = config.to_dict()
    assert json.loads(json.dumps(plain)) == plain, "to_dict holds a value JSON does not keep"
    back = ControllerConfig.from_dict(json.loads(json.dumps(plain)))
    assert back == config and type(back.policy_config) is type(config.policy_config)
    assert ControllerConfig.from_dict(config.resolved().to_dict()) == config.resolved()
    assert ControllerConfig.from_dict({}) == ControllerConfig()


def test_ppo_overrides_set_only_what_is_named():
    assert ControllerConfig(policy="ppo", ppo={"target_kl": None}).ppo.named() == {"target_kl": None}
    assert ControllerConfig(policy="ppo", ppo=PPOOverrides(seed=2)).ppo.named() == {"seed": 2}
    assert ControllerConfig(policy="ppo").ppo.named() == {} and PPOOverrides.of({}) == PPOOverrides()


def test_resolved_spells_out_the_policys_defaults():
    assert ControllerConfig().resolved().policy_config == ProposalConfig()
    assert ControllerConfig(policy="static").resolved().policy_config is None
    assert make_policy(ControllerConfig().resolved()).cfg == make_policy(ControllerConfig()).cfg


@pytest.mark.parametrize("data, needle", [
    ({"max_batchh": 4}, "ControllerConfig has unknown field.*'max_batchh'"),
    ({"advanced": {"cadence": {"budget": 0}}}, "ControllerConfig.advanced.cadence has unknown field.*'budget'"),
    ({"advanced": {"costs": {"capacity": 64, "nope": 1}}}, "ControllerConfig.advanced.costs has unknown field.*'nope'"),
    ({"policy_config": {"growth": {"zz": 1}}}, "ControllerConfig.policy_config.growth has unknown field.*'zz'"),
    ({"policy": "linear-ramp", "policy_config": {"trust": 2}}, "ControllerConfig.policy_config has unknown field.*'trust'"),
    ({"ppo": {"lr": 1}}, "ControllerConfig.ppo has unknown field.*'lr'"),
    ({"advanced": []}, "ControllerConfig.advanced=\\[\\]"),
    ({"advanced": {"cadence": {"decision_budget": 2}}}, "CadenceConfig.decision_budget=2"),
])
def test_from_dict_names_an_unknown_or_bad_key_at_any_depth(data, needle):
    with pytest.raises(ValueError, match=needle):
        ControllerConfig.from_dict(data)


def test_configs_are_frozen():
    for config in (ControllerConfig(), AdvancedConfig(), CadenceConfig(), CostConfig(), ProposalConfig(),
                   GrowthConfig(), SplitConfig(), PPOOverrides(), PPOConfig(), RewardConfig(), StatsConfig()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, dataclasses.fields(config)[0].name, None)


def test_controller_config_has_at_most_twelve_top_level_fields():
    assert len(dataclasses.fields(ControllerConfig)) <= 12


# --- docs/settings.md's reference -------------------------------------------------------------------
def _reference() -> str:
    """docs/settings.md's generated reference."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    return text[text.index(settings_doc.MARKER):]


def _section(cls: type) -> str:
    text = _reference()
    start = text.index(f"### `{cls.__name__}`\n")
    end = text.find("\n### ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_settings_reference_is_current():
    """docs/settings.md's reference is what `dynamix-hvd settings` writes from the dataclasses now:
    run it after changing a config field, its default or its docstring."""
    path = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
    assert path.read_text() == settings_doc.current(path), "docs/settings.md is not current: run `dynamix-hvd settings`"


def test_settings_reference_matches_the_dataclasses():
    """Every field of every config reachable from ControllerConfig is a row of its class's table, in
    order, with its default as Python and the docstring written under it."""
    names = {cls.__name__: cls for cls, _ in settings_doc.configs()}
    assert {ControllerConfig, AdvancedConfig, CadenceConfig, CostConfig, ProposalConfig, GrowthConfig, SplitConfig,
            PPOOverrides, PPOConfig, RewardConfig, StatsConfig, *(k for k in POLICY_CONFIGS.values() if k)} <= set(names.values())
    for cls in names.values():
        rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", _section(cls), flags=re.M)
        fields = dataclasses.fields(cls)
        assert [name for name, _ in rows] == [f.name for f in fields], cls.__name__
        defaults = cls()
        for (name, shown), f in zip(rows, fields):
            assert eval(shown.replace("\\|", "|"), dict(names)) == getattr(defaults, name), f"{cls.__name__}.{name}: {shown}"
    assert "Width, in standard errors, of the lower confidence bound" in _section(StatsConfig)


def test_settings_check_fails_on_a_stale_reference(tmp_path):
    stale = tmp_path / "settings.md"
    text = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    stale.write_text(text.replace("| `noise_z` | `1.0` |", "| `noise_z` | `2.0` |"))
    assert settings_doc.main([str(stale), "--check"]) == 1
    assert settings_doc.main([str(stale)]) == 0 and stale.read_text() == text
    (tmp_path / "none.md").write_text("# no marker\n")
    assert settings_doc.main([str(tmp_path / "none.md")]) == 2


# --- the settings in a run's records ---------------------------------------------------------------
def test_changed_settings_name_what_differs_from_the_defaults():
    from dynamix_hvd.control.config import changed_settings, settings_line

    assert changed_settings(ControllerConfig().resolved().to_dict()) == {}
    assert settings_line(ControllerConfig().to_dict()) == "settings: the defaults"
    assert settings_line(ControllerConfig(policy="static").to_dict()) == "settings: policy='static'"
    config = ControllerConfig(total_epochs=9, policy_config=ProposalConfig(growth=GrowthConfig(z=3.0)),
                              advanced=AdvancedConfig(cadence=CadenceConfig(decision_budget=0)))
    assert changed_settings(config.to_dict()) == {"total_epochs": 9, "policy_config.growth.z": 3.0,
                                                  "advanced.cadence.decision_budget": 0}
    ramp = ControllerConfig(policy="linear-ramp", policy_config=LinearRampConfig(end=64)).resolved().to_dict()
    assert changed_settings(ramp) == {"policy": "linear-ramp", "policy_config.end": 64}
    assert changed_settings({**ControllerConfig().to_dict(), "newer": 1}) == {"newer": 1}


def test_run_records_hold_every_setting_and_summarize_names_the_changed_ones(tmp_path, capsys):
    """RunLog writes the controller's config_dict into meta.json; `dynamix-hvd summarize` prints the
    settings that differ from the defaults in one line."""
    from types import SimpleNamespace

    import torch

    from dynamix_hvd.data.loader import AdaptiveLoader
    from dynamix_hvd.data.synthetic import teacher_classification
    from dynamix_hvd.runs.runlog import RunLog
    from dynamix_hvd.tools.cli import main

    config = ControllerConfig(total_epochs=1, max_batch=64, advanced=AdvancedConfig(batchnorm_min_batch=4)).resolved()
    controller = SimpleNamespace(history=[], memory_budget=None, config_dict=config.to_dict)
    train, _ = teacher_classification(40, seed=0)
    loader = AdaptiveLoader(train, [10], rank=0)
    run = RunLog(tmp_path, loader, controller=controller, gather=lambda o: [o])
    loader.set_epoch(0)
    for _ in loader:
        loader.tracker.step_started()
        loader.tracker.synchronized()
        loader.tracker.step_finished(lr=0.1)
        run.step(torch.tensor(1.0))
    run.end_epoch()
    run.finish()
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert ControllerConfig.from_dict(meta["controller_config"]) == config
    capsys.readouterr()
    assert main(["summarize", str(tmp_path)]) == 0
    assert "settings: total_epochs=1, max_batch=64, advanced.batchnorm_min_batch=4\n" in capsys.readouterr().out
