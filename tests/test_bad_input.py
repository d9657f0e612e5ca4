"""Bad input: every loader of configuration, policies and checkpoints refuses it clearly, never crashes
with anything but the documented error, and never leaves partial files. Fuzzed with hypothesis: any
value either works or is refused naming its field, and clearly invalid values (generated per field)
are always refused at construction."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamix_hvd import AdvancedConfig, ControllerConfig, PPOConfig
from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.cadence import CadenceConfig
from dynamix_hvd.control.config import POLICY_CONFIGS
from dynamix_hvd.control.controller import POLICY_NAMES
from dynamix_hvd.control.policy_store import PolicyError, load_policy
from dynamix_hvd.control.proposal import ProposalConfig
from dynamix_hvd.control.reward import RewardConfig
from dynamix_hvd.control.rules import RULE_CONFIGS
from dynamix_hvd.data.loader import AdaptiveLoader
from dynamix_hvd.dba.selection import DBAConfig
from dynamix_hvd.optim.lr_scaling import LRCoupling
from dynamix_hvd.stats.noise_scale import StatsConfig
from dynamix_hvd.tools.settings_doc import configs
from launching import launch

FUZZ_EXAMPLES = 400
values = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=5), st.lists(st.integers(-3, 3), max_size=3))
TRIED = {"configs": 0, "policies": 0}
PPO_FIELDS = {f.name for f in dataclasses.fields(PPOConfig)}
FUZZERS = {"test_ppo_config_fuzz", "test_reward_config_fuzz", "test_controller_config_fuzz",
           "test_advanced_config_fuzz", "test_every_nested_config_fuzz", "test_rule_config_fuzz",
           "test_policy_loader_fuzz", "test_stats_config_fuzz"}


@pytest.fixture(scope="module", autouse=True)
def fuzz_counts(request):
    """After the module's tests, in whatever order they ran: when every fuzzer of it ran, each tried
    its examples (printed, and checked: a fuzzer that stopped early fails here)."""
    yield
    ran = {item.originalname for item in request.session.items if item.module is request.module}
    if FUZZERS <= ran:
        print(f"fuzzed inputs tried: {TRIED}")
        assert TRIED["configs"] >= 3 * FUZZ_EXAMPLES // 2 and TRIED["policies"] >= FUZZ_EXAMPLES // 2, TRIED


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
@given(field=st.sampled_from(["progress_weight", "stability_weight", "switch_weight"]), value=values)
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
                                                  "learn": values,
                                                  "ppo": st.one_of(values, st.dictionaries(
                                                      st.sampled_from(["gamma", "seed", "hidden_sizes", "lr"]), values,
                                                      max_size=2)),
                                                  "policy_config": st.one_of(values, st.sampled_from(
                                                      sorted({k for k in POLICY_CONFIGS.values() if k}, key=str)).map(
                                                      lambda kind: kind()))}))
def test_controller_config_fuzz(kwargs):
    TRIED["configs"] += 1
    try:
        ControllerConfig(**kwargs)
    except ValueError as exc:
        assert any(k in str(exc) for k in kwargs) or "batch bounds" in str(exc)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(kwargs=st.fixed_dictionaries({}, optional={
    "batchnorm_min_batch": values, "keep_inputs": values, "resource_period_s": values, "cadence": values,
    "reward": values, "stats": values, "costs": values,
    "multipliers": st.one_of(values, st.lists(values, max_size=3))}))
def test_advanced_config_fuzz(kwargs):
    TRIED["configs"] += 1
    try:
        AdvancedConfig(**kwargs)
    except ValueError as exc:
        assert any(k in str(exc) for k in kwargs)


NESTED = [cls for cls, _ in configs() if cls is not ControllerConfig]
"""Every config reachable from ControllerConfig (policy configs, PPO overrides, advanced and below)."""


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), kind=st.sampled_from(NESTED))
def test_every_nested_config_fuzz(data, kind):
    """Any value of any field of any config reachable from ControllerConfig either builds it or is
    refused, with a ValueError naming the field."""
    name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(kind)]))
    value = data.draw(values, label=name)
    TRIED["configs"] += 1
    try:
        kind(**{name: value})
    except ValueError as exc:
        assert name in str(exc), f"{kind.__name__}({name}={value!r}): {exc}"


JUNK = (None, True, -1, 0, 1.5, math.nan, math.inf, "ab", [1, 2], [], {}, (1.0,), 10**9)


@pytest.mark.parametrize("kind", NESTED, ids=lambda kind: kind.__name__)
def test_every_nested_field_refuses_junk_by_name(kind):
    """Each field of each nested config, given each of a fixed set of wrong-typed or out-of-range
    values, builds or raises a ValueError naming the field (never a TypeError from inside a check)."""
    for f in dataclasses.fields(kind):
        for value in JUNK:
            try:
                kind(**{f.name: value})
            except ValueError as exc:
                assert f.name in str(exc), f"{kind.__name__}({f.name}={value!r}): {exc}"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), policy=st.sampled_from(sorted(RULE_CONFIGS)))
def test_rule_config_fuzz(data, policy):
    """Any value of a rule's field either builds its config or is refused naming the field."""
    kind = RULE_CONFIGS[policy]
    name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(kind)]))
    value = data.draw(values, label=name)
    TRIED["configs"] += 1
    try:
        kind(**{name: value})
    except ValueError as exc:
        assert f"{kind.__name__}.{name}=" in str(exc)


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


# --- clearly invalid values are rejected at construction, with an error naming the field ------------
NOT_A_NUMBER = st.one_of(st.none(), st.text(max_size=4), st.lists(st.integers(), max_size=2), st.just({}))
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NOT_POSITIVE = st.one_of(NOT_A_NUMBER, NONFINITE, st.booleans(), st.floats(max_value=0.0, allow_nan=False),
                         st.integers(max_value=0))
NEGATIVE = st.one_of(NOT_A_NUMBER, NONFINITE, st.booleans(), st.floats(max_value=-1e-9, allow_nan=False),
                     st.integers(max_value=-1))
OUTSIDE_UNIT = st.one_of(NOT_A_NUMBER, NONFINITE, st.booleans(), st.floats(min_value=1.0 + 1e-9, allow_infinity=False),
                         st.floats(max_value=-1e-9, allow_infinity=False))


def not_an_int(low: int) -> st.SearchStrategy:
    return st.one_of(NOT_A_NUMBER, NONFINITE, st.booleans(), st.integers(max_value=low - 1),
                     st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f) or f >= low))


NOT_A_BOOL = st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=4))
BAD_PPO = {
    "learning_rate": NOT_POSITIVE, "adam_eps": NOT_POSITIVE, "clip_coef": NOT_POSITIVE, "max_grad_norm": NOT_POSITIVE,
    "gamma": OUTSIDE_UNIT, "gae_lambda": OUTSIDE_UNIT, "ent_coef": NEGATIVE, "vf_coef": NEGATIVE,
    "rollout_length": not_an_int(1), "update_epochs": not_an_int(1), "num_minibatches": not_an_int(1),
    "clip_vloss": NOT_A_BOOL, "norm_adv": NOT_A_BOOL,
    "target_kl": NOT_POSITIVE.filter(lambda v: v is not None),
    "hidden_sizes": st.one_of(st.just(()), st.integers(), st.text(min_size=1, max_size=3),
                              st.lists(not_an_int(1), min_size=1, max_size=3).map(tuple)),
    "seed": st.one_of(not_an_int(0), st.integers(min_value=2**63, max_value=2**70)),
}
BAD_WEIGHT = st.one_of(NOT_A_NUMBER, NONFINITE, st.booleans(), st.floats(max_value=-1e-9, allow_nan=False),
                       st.integers(max_value=-1))
BAD_CONTROLLER = {
    "policy": st.one_of(st.text(max_size=8).filter(lambda t: t not in POLICY_NAMES), st.none(), st.integers()),
    # a config of another policy's type (policies "model" and "ppo" take a ProposalConfig), or not a config at all
    "policy_config": st.one_of(st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2), st.just({}),
                               st.sampled_from(sorted(RULE_CONFIGS)).map(lambda name: RULE_CONFIGS[name]()),
                               st.builds(RewardConfig)),
    "policy_file": st.one_of(st.integers(), st.floats(), st.lists(st.text(max_size=2), max_size=2)),
    "learn": NOT_A_BOOL,
    "decide_every_steps": not_an_int(0).filter(lambda v: v is not None),  # None: the automatic cadence
    "min_batch": not_an_int(1), "max_batch": not_an_int(1),
    "max_passes": not_an_int(1),
    "total_epochs": not_an_int(1).filter(lambda v: v is not None),
    "timeout_s": NOT_POSITIVE,
    # nested configs: not a dict (or PPOOverrides), an unknown field, or a known field with a bad value
    "ppo": st.one_of(st.none(), st.text(max_size=4), st.lists(st.integers(), max_size=2), st.integers(),
                     st.booleans(), st.builds(PPOConfig), st.builds(RewardConfig),
                     st.text(min_size=1, max_size=6).filter(lambda t: t not in PPO_FIELDS).map(lambda t: {t: 1}),
                     st.sampled_from(sorted(BAD_PPO)).flatmap(lambda name: BAD_PPO[name].map(lambda v: {name: v}))),
    "advanced": st.one_of(NOT_A_NUMBER, st.integers(), st.builds(RewardConfig), st.builds(StatsConfig)),
}
NOT_A_CONFIG = st.one_of(NOT_A_NUMBER, st.integers(), st.floats(), st.booleans(), st.builds(PPOConfig))
BAD_ADVANCED = {
    "batchnorm_min_batch": not_an_int(1), "keep_inputs": not_an_int(0), "resource_period_s": NEGATIVE,
    # nested configs: anything but the right type
    "cadence": st.one_of(NOT_A_CONFIG, st.builds(StatsConfig)), "reward": st.one_of(NOT_A_CONFIG, st.builds(StatsConfig)),
    "stats": st.one_of(NOT_A_CONFIG, st.builds(RewardConfig)), "costs": st.one_of(NOT_A_CONFIG, st.builds(RewardConfig)),
    "multipliers": st.one_of(st.just(()), st.lists(st.floats(max_value=0.0), min_size=1, max_size=3),
                             st.lists(st.floats(0.1, 4.0).filter(lambda m: m != 1.0), min_size=1, max_size=3),
                             st.lists(st.text(max_size=2), min_size=1, max_size=3),
                             st.just([1.0, math.nan]), st.just([1.0, math.inf]),
                             st.integers(), st.floats(), st.none(), st.text(min_size=1, max_size=3),
                             st.just((1.0, True))),
}
UNIT_OPEN = st.one_of(NOT_A_NUMBER, NONFINITE, st.booleans(), st.floats(min_value=1.0, allow_infinity=False),
                      st.floats(max_value=-1e-9, allow_infinity=False))
BAD_CADENCE = {
    "decision_budget": UNIT_OPEN, "target_decisions": not_an_int(1), "min_decision_steps": not_an_int(1),
    "max_decision_interval_s": NEGATIVE, "free_decisions": not_an_int(0), "unknown_length_per_epoch": not_an_int(1),
    "change_vote_s": NEGATIVE,
    "change_ratio": st.one_of(NOT_A_NUMBER, NONFINITE, st.booleans(), st.floats(max_value=1.0, allow_nan=False)),
}
BAD_STATS = {
    "ema_beta": UNIT_OPEN, "loss_ema_beta": UNIT_OPEN, "max_noise_scale": NOT_POSITIVE,
    "base_batch": not_an_int(1).filter(lambda v: v is not None), "loss_window": not_an_int(2),
    "per_layer": NOT_A_BOOL, "noise_z": NEGATIVE,
}
BAD_DBA = {
    "metric": st.one_of(st.text(max_size=6).filter(lambda t: t not in ("variance", "snr")), st.none(), st.integers()),
    "search": st.one_of(st.text(max_size=6).filter(lambda t: t not in ("greedy", "rank")), st.none()),
    "granularity": st.one_of(st.text(max_size=6).filter(lambda t: t not in ("model", "layer")), st.none()),
    "estimator": st.one_of(st.text(max_size=6).filter(lambda t: t not in ("subset", "importance")), st.none()),
    "engine": st.one_of(st.text(max_size=6).filter(lambda t: t not in ("auto", "ghost", "func")), st.none()),
    "min_subset": not_an_int(2),
    "min_fraction": st.one_of(NOT_A_NUMBER, NONFINITE, st.booleans(), st.floats(min_value=1.0 + 1e-9),
                              st.floats(max_value=-1e-9)),
    "tolerance": UNIT_OPEN,
    "min_cosine": st.one_of(st.text(max_size=3), NONFINITE, st.booleans(), st.floats(min_value=1.0 + 1e-9),
                            st.floats(max_value=-1.0 - 1e-9)),
    "max_noise": NOT_POSITIVE,
    "seed": st.one_of(st.none(), st.text(max_size=3), st.booleans(), st.floats()),
}
BAD_LOADER = {"seed": not_an_int(0), "shuffle": NOT_A_BOOL,
              "last_step": st.one_of(st.text(max_size=6).filter(lambda t: t not in ("partial", "drop")), st.none()),
              "rank": st.one_of(st.integers(max_value=-1), st.integers(min_value=2)),
              "batch_sizes": st.one_of(st.just([]), st.lists(st.integers(max_value=0), min_size=2, max_size=2),
                                       st.just([4, True]), st.just([4, 2.5]))}


def test_every_field_has_bad_values():
    """A field added to a config without a generator of bad values fails here."""
    assert set(BAD_PPO) == {f.name for f in dataclasses.fields(PPOConfig)}
    assert set(BAD_CONTROLLER) == {f.name for f in dataclasses.fields(ControllerConfig)}
    assert set(BAD_ADVANCED) == {f.name for f in dataclasses.fields(AdvancedConfig)}
    assert set(BAD_CADENCE) == {f.name for f in dataclasses.fields(CadenceConfig)}
    assert set(BAD_STATS) == {f.name for f in dataclasses.fields(StatsConfig)}
    assert set(BAD_DBA) == {f.name for f in dataclasses.fields(DBAConfig)}


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(BAD_PPO)))
def test_ppo_config_rejects_bad_values(data, field):
    value = data.draw(BAD_PPO[field], label=field)
    with pytest.raises(ValueError, match=field):
        PPOConfig(**{field: value})


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(f.name for f in dataclasses.fields(RewardConfig))))
def test_reward_config_rejects_bad_values(data, field):
    value = data.draw(BAD_WEIGHT, label=field)
    with pytest.raises(ValueError, match=field):
        RewardConfig(**{field: value})


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(BAD_CONTROLLER)))
def test_controller_config_rejects_bad_values(data, field):
    value = data.draw(BAD_CONTROLLER[field], label=field)
    with pytest.raises(ValueError, match=field):
        ControllerConfig(**{field: value})


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(BAD_ADVANCED)))
def test_advanced_config_rejects_bad_values(data, field):
    value = data.draw(BAD_ADVANCED[field], label=field)
    with pytest.raises(ValueError, match=field):
        AdvancedConfig(**{field: value})


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(BAD_CADENCE)))
def test_cadence_config_rejects_bad_values(data, field):
    value = data.draw(BAD_CADENCE[field], label=field)
    with pytest.raises(ValueError, match=field):
        CadenceConfig(**{field: value})


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(BAD_STATS)))
def test_stats_config_rejects_bad_values(data, field):
    value = data.draw(BAD_STATS[field], label=field)
    with pytest.raises(ValueError, match=field):
        StatsConfig(**{field: value})


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(BAD_DBA)))
def test_dba_config_rejects_bad_values(data, field):
    value = data.draw(BAD_DBA[field], label=field)
    with pytest.raises(ValueError, match=field):
        DBAConfig(**{field: value})


@settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(BAD_LOADER)))
def test_loader_rejects_bad_values(data, field):
    import torch

    kwargs = {"batch_sizes": [4, 4], "rank": 0, field: data.draw(BAD_LOADER[field], label=field)}
    with pytest.raises(ValueError):
        AdaptiveLoader(torch.utils.data.TensorDataset(torch.zeros(20, 1)), **kwargs)


# The LR coupling's warm-up, ProgressScheduler's arguments and the progress budgets (name: (make, bad)).
BAD_LR = {
    "lr_warmup_steps": (lambda v: LRCoupling(v), not_an_int(0).filter(lambda v: v is not None)),
    "per": (lambda v: _progress_scheduler(per=v), st.one_of(
        st.text(max_size=6).filter(lambda t: t not in ("step", "epoch")), st.none(), st.integers())),
    "limit": (lambda v: _progress_scheduler(limit=v), not_an_int(0).filter(lambda v: v is not None)),
    "total_base_steps": (lambda v: _progress_done(total_base_steps=v), NEGATIVE.filter(lambda v: v is not None)),
    "epochs": (lambda v: _progress_done(epochs=v), NEGATIVE.filter(lambda v: v is not None)),
}


def _counted():
    import torch

    from dynamix_hvd.optim.progress import ProgressAccounting

    class Counted(torch.optim.SGD, ProgressAccounting):
        def __init__(self) -> None:
            super().__init__([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            self.lr_coupling, self.base_batch_size = LRCoupling(), 8
            self.loader = type("L", (), {"num_samples": 80, "epoch_size": 80})()

    return Counted()


def _progress_scheduler(**kwargs):
    import torch

    from dynamix_hvd.optim.progress import ProgressScheduler

    opt = _counted()
    return ProgressScheduler(torch.optim.lr_scheduler.StepLR(opt, 2), opt, **kwargs)


def _progress_done(**kwargs):
    return _counted().progress_done(**kwargs)


@settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(BAD_LR)))
def test_lr_coupling_and_progress_reject_bad_values(data, field):
    make, bad = BAD_LR[field]
    value = data.draw(bad, label=field)
    with pytest.raises(ValueError, match=field):
        make(value)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(field=st.sampled_from(sorted(f.name for f in dataclasses.fields(StatsConfig))), value=values)
def test_stats_config_fuzz(field, value):
    TRIED["configs"] += 1
    try:
        StatsConfig(**{field: value})
    except ValueError as exc:
        assert field in str(exc)


def test_nested_configs_named_in_the_error():
    for kwargs, needle in ((dict(ppo=PPOConfig()), "ppo=PPOConfig("), (dict(ppo={"gamma": 2}), "ppo: PPOConfig.gamma"),
                           (dict(advanced=AdvancedConfig), "advanced="),
                           (dict(policy="goodput", policy_config=ProposalConfig()),
                            "policy_config=ProposalConfig("),
                           (dict(learn=True), "learn=True applies to policy 'ppo' only, and policy='model'"),
                           (dict(policy="goodput", ppo={"seed": 1}), "ppo={'seed': 1} applies to policy 'ppo' only")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            ControllerConfig(**kwargs)
    with pytest.raises(ValueError, match=re.escape("AdvancedConfig.multipliers=5")):
        AdvancedConfig(multipliers=5)
    for kwargs, needle in ((dict(reward="x"), "AdvancedConfig.reward='x'"), (dict(stats=StatsConfig), "stats="),
                           (dict(cadence={}), "AdvancedConfig.cadence={}")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            AdvancedConfig(**kwargs)
    with pytest.raises(ValueError, match=re.escape("RewardConfig.switch_weight=True")):
        RewardConfig(switch_weight=True)
    with pytest.raises(ValueError, match=re.escape("ProposalConfig.growth={}")):
        ProposalConfig(growth={})
    for beta in (math.nan, 1.5):
        with pytest.raises(ValueError, match="ema_beta"):
            StatsConfig(ema_beta=beta)


@pytest.mark.mpi
def test_corrupt_newest_checkpoint_of_every_kind_falls_back_to_the_previous_good_one(tmp_path):
    from workers.ckpt_fallback import KINDS

    ck = tmp_path / "ck"
    out = launch("mpirun", 2, "ckpt_fallback.py", "--ckpt", str(ck)).stdout
    newest = ck / "step-00000-0000004"
    for kind, (_, reason) in KINDS.items():
        assert out.count(f"KIND-OK {kind} -> step-00000-0000002") == 2, f"{kind} on a rank:\n{out}"
        assert reason in out, f"{kind}: no warning saying {reason!r}:\n{out}"
    warnings = [line for line in out.splitlines() if f"skipping checkpoint {newest}:" in line]
    assert len(warnings) >= 2 * len(KINDS), "a skipped checkpoint was not named in a warning on every rank"
    for case in ("broken", "missing"):
        assert out.count(f"AGREE-OK {case} -> step-00000-0000002") == 2, f"ranks disagreed ({case}):\n{out}"
    # Only rank 1 saw the problem; every rank's warning says which rank and why.
    assert "rank(s) [1]: checkpoint" in out and f"view-broken-rank1/{newest.name} fails its checksum" in out, out
    assert out.count("NONE-USABLE-OK") == 2 and "tried 2, newest first" in out, out
