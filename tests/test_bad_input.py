"""Bad input: every loader of configuration, policies and checkpoints refuses it clearly, never crashes
with anything but the documented error, and never leaves partial files. Fuzzed with hypothesis."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.controller import ControllerConfig
from dynamix_hvd.control.policy_store import PolicyError, load_policy
from dynamix_hvd.rl.ppo import PPOConfig
from dynamix_hvd.control.reward import RewardConfig
from launching import launch

FUZZ_EXAMPLES = 400
values = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=5), st.lists(st.integers(-3, 3), max_size=3))
TRIED = {"configs": 0, "policies": 0}


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(field=st.sampled_from(["learning_rate", "gamma", "gae_lambda", "rollout_length", "update_epochs",
                              "num_minibatches", "clip_coef", "ent_coef", "vf_coef", "max_grad_norm",
                              "target_kl", "hidden_sizes", "seed", "norm_adv"]), value=values)
def test_ppo_config_fuzz(field, value):
    TRIED["configs"] += 1
    try:
        PPOConfig(**{field: value})
    except ValueError as exc:
        assert field in str(exc)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(field=st.sampled_from(["progress_weight", "throughput_weight", "stability_weight", "switch_weight",
                              "idle_weight"]), value=values)
def test_reward_config_fuzz(field, value):
    TRIED["configs"] += 1
    try:
        RewardConfig(**{field: value})
    except ValueError as exc:
        assert field in str(exc)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(kwargs=st.fixed_dictionaries({}, optional={"policy": values, "decide_every_steps": values,
                                                  "min_batch": values, "max_batch": values,
                                                  "timeout_s": values, "total_epochs": values,
                                                  "learn": values, "multipliers": st.lists(values, max_size=3)}))
def test_controller_config_fuzz(kwargs):
    TRIED["configs"] += 1
    try:
        ControllerConfig(**kwargs)
    except ValueError as exc:
        assert any(k in str(exc) for k in kwargs) or "batch bounds" in str(exc)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.one_of(st.binary(max_size=200),
                      st.dictionaries(st.sampled_from(["format_version", "kind", "rank_features", "global_features",
                                                       "action_multipliers", "sha256"]), values).map(
                          lambda d: json.dumps(d).encode())),
       weights=st.binary(max_size=300))
def test_policy_loader_fuzz(tmp_path, spec, weights):
    TRIED["policies"] += 1
    (tmp_path / "p.json").write_bytes(spec)
    (tmp_path / "p.pt").write_bytes(weights)
    with pytest.raises(PolicyError):
        load_policy("p", ActionSpace(), directory=tmp_path)


def test_report_fuzz_counts():
    print(f"fuzzed inputs tried: {TRIED}")
    assert TRIED["configs"] >= 3 * FUZZ_EXAMPLES // 2 and TRIED["policies"] >= FUZZ_EXAMPLES // 2


def test_corrupt_checkpoint_falls_back_to_the_previous_good_one(tmp_path):
    out = launch("mpirun", 2, "ckpt_fallback.py", "--ckpt", str(tmp_path / "ck")).stdout
    assert "FALLBACK-OK" in out and "fails its checksum" in out, out
