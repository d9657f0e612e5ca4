"""Policies on disk: bit-for-bit round trip, clear errors for mismatched or broken files."""
from __future__ import annotations

import json

import pytest
import torch

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.refine import make_learner
from dynamix_hvd.control.policy_store import PolicyError, list_policies, load_policy, save_policy
from dynamix_hvd.control.ppo import PPOConfig, PPOLearner
from dynamix_hvd.control.state import GLOBAL_FEATURES, OBS_DIM, RANK_FEATURES


def _trained_learner() -> PPOLearner:
    learner = make_learner(ActionSpace(), PPOConfig(rollout_length=4, seed=7))
    obs = torch.randn(3, OBS_DIM, generator=torch.Generator().manual_seed(1))
    for t in range(4):
        learner.act(obs)
        learner.record(torch.tensor([0.1 * t, -0.2, 0.3]))
    learner.update(next_obs=obs)
    return learner


def test_round_trip_is_bit_for_bit(tmp_path):
    learner = _trained_learner()
    pt, js = save_policy(learner, ActionSpace(), "demo", {"trained_on": "unit test"}, directory=tmp_path)
    loaded, meta = load_policy("demo", ActionSpace(), directory=tmp_path)
    for (k, a), (_, b) in zip(learner.net.state_dict().items(), loaded.net.state_dict().items()):
        assert torch.equal(a, b), k
    assert meta["provenance"]["trained_on"] == "unit test" and meta["rank_features"] == list(RANK_FEATURES)
    obs = torch.randn(5, OBS_DIM)
    assert torch.equal(learner.act(obs, deterministic=True)[0], loaded.act(obs, deterministic=True)[0])
    assert [p["name"] for p in list_policies(tmp_path)] == ["demo"]
    assert not list(tmp_path.glob(".*tmp*")), "temporary files left behind"


def test_mismatched_spec_names_the_field(tmp_path):
    save_policy(_trained_learner(), ActionSpace(), "demo", directory=tmp_path)
    with pytest.raises(PolicyError, match="field 'action_multipliers'"):
        load_policy("demo", ActionSpace((0.5, 1.0, 2.0)), directory=tmp_path)
    meta = json.loads((tmp_path / "demo.json").read_text())
    meta["rank_features"] = meta["rank_features"][:-1]
    (tmp_path / "demo.json").write_text(json.dumps(meta))
    with pytest.raises(PolicyError, match="field 'rank_features'"):
        load_policy("demo", ActionSpace(), directory=tmp_path)


def test_corrupt_or_missing_files_are_refused(tmp_path):
    with pytest.raises(PolicyError, match="not found"):
        load_policy("nope", ActionSpace(), directory=tmp_path)
    save_policy(_trained_learner(), ActionSpace(), "demo", directory=tmp_path)
    data = bytearray((tmp_path / "demo.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "demo.pt").write_bytes(bytes(data))
    with pytest.raises(PolicyError, match="checksum"):
        load_policy("demo", ActionSpace(), directory=tmp_path)
    (tmp_path / "demo.json").write_text("{not json")
    with pytest.raises(PolicyError, match="unreadable"):
        load_policy("demo", ActionSpace(), directory=tmp_path)
