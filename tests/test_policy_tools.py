"""Policy tools (bench.lab.policy_tools): list, inspect, validate, compare, on good and broken files."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import pytest
import torch

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.refine import make_learner
from dynamix_hvd.control.policy_store import PolicyError, default_policy_dir, load_policy, save_policy
from bench.lab.policy_tools import (compare_policies, format_result, inspect_policy, list_policy_summaries,
                                      sample_observations, validate_policy)
from dynamix_hvd.control.ppo import PPOConfig, PPOLearner
from dynamix_hvd.control.policy_store import DEFAULT_POLICY
from dynamix_hvd.control.state import GLOBAL_FEATURES, OBS_DIM, RANK_FEATURES


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """A policy directory with a copy of the shipped default and a fresh (untrained) policy."""
    for suffix in (".pt", ".json"):
        shutil.copy(default_policy_dir() / f"{DEFAULT_POLICY}{suffix}", tmp_path / f"{DEFAULT_POLICY}{suffix}")
    fresh = make_learner(ActionSpace(), PPOConfig(seed=3))
    save_policy(fresh, ActionSpace(), "fresh", {"command": "unit test", "num_updates": 0}, directory=tmp_path)
    return tmp_path


def failed(result: dict) -> list[str]:
    return [c["check"] for c in result["checks"] if not c["ok"]]


def test_list_and_inspect(store: Path) -> None:
    rows = list_policy_summaries(store)
    assert [r["name"] for r in rows] == [DEFAULT_POLICY, "fresh"]
    default = rows[0]
    assert default["has_weights"] and default["command"].startswith("python -m bench.lab.pretrain")
    assert default["num_updates"] > 0 and 0 < default["ppo_vs_best_static"] < 1.0, "beats the best static batch"
    info = inspect_policy(DEFAULT_POLICY, store)
    assert info["parameters"] > 1000 and info["rank_features"] == list(RANK_FEATURES)
    assert info["provenance"]["seed"] == 0 and "evaluation" in info["provenance"]
    assert 0 < info["weights_bytes"] < 1_000_000
    assert "parameters:" in format_result(info) and DEFAULT_POLICY in format_result(rows)


def test_validate_good_policies(store: Path) -> None:
    for name in (DEFAULT_POLICY, "fresh"):
        result = validate_policy(name, store)
        assert result["ok"], format_result(result)
        assert len(result["sha256"]) == 64 and abs(sum(result["action_distribution"]) - 1) < 1e-3
    assert "OK" in format_result(validate_policy(store / "fresh.pt"))


def test_validate_reports_each_kind_of_broken_file(store: Path) -> None:
    pt, js = store / "fresh.pt", store / "fresh.json"
    data, meta = pt.read_bytes(), json.loads(js.read_text())

    pt.write_bytes(data[:-10] + b"0123456789")  # corrupted weights
    assert failed(validate_policy("fresh", store)) == ["checksum", "weights load"]

    pt.write_bytes(b"not a torch file")  # garbage that matches its checksum
    js.write_text(json.dumps(meta | {"sha256": None}))
    assert failed(validate_policy("fresh", store)) == ["weights load"]

    pt.write_bytes(data)  # spec of another code version
    js.write_text(json.dumps(meta | {"rank_features": ["old feature"]}))
    result = validate_policy("fresh", store)
    assert failed(result) == ["spec matches this dynamix_hvd", "weights load"]
    assert "rank_features" in format_result(result) and "INVALID" in format_result(result)

    js.write_text("{ not json")
    assert failed(validate_policy("fresh", store)) == ["spec readable"]
    assert [r.get("error") for r in list_policy_summaries(store)] == [None, "unreadable"]

    js.write_text(json.dumps(meta))
    pt.unlink()
    assert failed(validate_policy("fresh", store)) == ["weights present", "weights load"]
    assert failed(validate_policy("missing", store)) == ["spec readable"]
    assert "error" in inspect_policy("missing", store)


def test_compare_policies(store: Path) -> None:
    same = compare_policies(DEFAULT_POLICY, DEFAULT_POLICY, n_states=128, directory=store)
    assert same["agreement_pct"] == 100.0 and abs(same["mean_kl_ab"]) < 1e-6 and same["mean_tv"] < 1e-6
    diff = compare_policies(DEFAULT_POLICY, "fresh", n_states=128, directory=store)
    # the shipped policy's greedy action is the proposal's almost everywhere (policies/default.md), as a
    # fresh one's is, so the comparison must see the difference in the distributions themselves
    assert diff["mean_kl_ab"] > 0.02 and diff["mean_kl_ba"] > 0.02 and diff["mean_tv"] > 0.05, diff
    neutral = diff["multipliers"].index(1.0)
    probs_b = diff["mean_probs_b"]
    assert abs(sum(probs_b) - 1) < 1e-3 and probs_b[neutral] > 0.5 and all(
        p < 0.2 for i, p in enumerate(probs_b) if i != neutral), "untrained = biased to neutral (the proposal)"
    fresh, _ = load_policy("fresh", ActionSpace(), store)
    with torch.no_grad():
        greedy = fresh.net.actor(sample_observations(128, seed=0)).argmax(-1)
    assert (greedy == neutral).all(), "a fresh policy's greedy action is the proposal on every state"
    with pytest.raises(PolicyError):
        compare_policies(DEFAULT_POLICY, "missing", directory=store)


def test_sample_observations_are_diverse_and_deterministic() -> None:
    a, b = sample_observations(200, seed=1), sample_observations(200, seed=1)
    assert a.shape == (200, OBS_DIM) and torch.equal(a, b) and torch.isfinite(a).all()
    assert (a.std(0)[:6] > 0.01).all(), "per-rank features vary across states"


# --- the command line (python -m bench.lab.policy_tools) ---------------------------------------------
@pytest.fixture()
def policy_cli(capsys: pytest.CaptureFixture[str]):
    """``python -m bench.lab.policy_tools ARGS`` in this process; exit code and output as a CompletedProcess."""
    import subprocess

    from bench.lab.policy_tools import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


def _learner() -> PPOLearner:
    learner = make_learner(ActionSpace(), PPOConfig(rollout_length=2, seed=3))
    learner.act(torch.randn(2, OBS_DIM, generator=torch.Generator().manual_seed(0)))
    return learner


def test_policy_list_inspect_validate(tmp_path: Path, policy_cli):
    empty = policy_cli("list", "--dir", str(tmp_path), "--json")
    assert empty.returncode == 0 and json.loads(empty.stdout) == []
    save_policy(_learner(), ActionSpace(), "good", {"trained_on": "test"}, directory=tmp_path)
    save_policy(PPOLearner(len(RANK_FEATURES), len(GLOBAL_FEATURES), 3), ActionSpace((0.5, 1.0, 2.0)), "other",
                directory=tmp_path)
    listing = policy_cli("list", "--dir", str(tmp_path))
    assert listing.returncode == 0 and "good" in listing.stdout and "other" in listing.stdout
    inspect = policy_cli("inspect", "good", "--dir", str(tmp_path), "--json")
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["provenance"]["trained_on"] == "test"
    ok = policy_cli("validate", "good", "--dir", str(tmp_path))
    assert ok.returncode == 0 and ok.stdout.startswith("policy good: OK"), ok.stdout + ok.stderr
    spec = tmp_path / "other.json"
    spec.write_text(json.dumps(json.loads(spec.read_text()) | {"rank_features": ["made_up"]}))
    bad = policy_cli("validate", "other", "--dir", str(tmp_path))
    assert bad.returncode == 1 and "[FAIL] spec matches this dynamix_hvd" in bad.stdout, bad.stdout
    assert "'rank_features'" in bad.stdout
    weights = tmp_path / "good.pt"
    weights.write_bytes(weights.read_bytes()[:-10] + b"0123456789")
    corrupt = policy_cli("validate", str(weights))
    assert corrupt.returncode == 1 and "[FAIL] checksum" in corrupt.stdout, corrupt.stdout
    assert policy_cli("validate").returncode == 2
