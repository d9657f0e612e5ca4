"""Policies on disk: ``policies/NAME.pt`` (weights and learner state) + ``NAME.json`` (spec, provenance).

A policy only makes sense for the observation and action layout it was trained with, so the JSON
records both, and loading refuses a policy whose spec differs from the running code's, naming the
field. Files are written to a temporary name and renamed, so a crash never leaves half a policy.

Where policies live: $DYNAMIX_POLICY_DIR if set; else the policies shipped inside the installed
package (the top-level ``policies/`` folder is package data ``dynamix_hvd.policies`` in the wheel and
the sdist, found with ``importlib.resources``); else, in a source checkout, the repository's
``policies/``. The PPO fields a user names override the stored config where that is possible and
are refused, naming the fields, where it is not (``load_policy(..., ppo={field: value})``).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import importlib.resources
import io
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .actions import ActionSpace
from .ppo import PPOConfig, PPOLearner
from .state import GLOBAL_FEATURES, RANK_FEATURES

FORMAT_VERSION = 2
"""2: PPO refining the model-based proposal (R + 1 rows, central critic, share/batch corrections);
1: the old per-rank multipliers of each rank's own batch (refused with an error naming the file)."""
DEFAULT_POLICY = "default"
"""The policy shipped in policies/ and used by the controller unless told otherwise."""
POLICY_DIR_ENV = "DYNAMIX_POLICY_DIR"
POLICY_PACKAGE = "dynamix_hvd.policies"
"""The installed copy of the top-level policies/ folder (package data)."""
FIXED_PPO_FIELDS = ("hidden_sizes",)
"""PPOConfig fields a stored policy fixes (they shape its network); all others can be overridden."""
_DEFAULT_FIX = ("Reinstall dynamix_hvd (its wheel and sdist ship policies/ as package data), set "
                f"${POLICY_DIR_ENV} to a folder holding {DEFAULT_POLICY}.pt and {DEFAULT_POLICY}.json, pass "
                "ControllerConfig(policy=\"ppo\", policy_file=PATH), or start an untrained policy on purpose with "
                "ControllerConfig(policy=\"ppo\", policy_file=None, learn=True).")


class PolicyError(ValueError):
    """A policy file is missing, unreadable, corrupt, or does not fit this code's spec."""


def default_policy_dir() -> Path:
    """$DYNAMIX_POLICY_DIR, else the installed package data, else the repository's ``policies/``."""
    env = os.environ.get(POLICY_DIR_ENV)
    if env:
        return Path(env)
    try:
        shipped = importlib.resources.files(POLICY_PACKAGE)
    except ModuleNotFoundError:  # a source checkout: the package data is the repository's folder
        return Path(__file__).resolve().parents[2] / "policies"
    if not isinstance(shipped, Path):
        raise PolicyError(f"the shipped policies ({POLICY_PACKAGE}) are not a folder on disk ({shipped!r}); "
                          f"install dynamix_hvd unzipped or set ${POLICY_DIR_ENV}")
    return shipped


def current_spec(actions: ActionSpace) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "kind": "ppo",
            "rank_features": list(RANK_FEATURES), "global_features": list(GLOBAL_FEATURES),
            "action_multipliers": list(actions.multipliers)}


def resolve(name_or_path: str | os.PathLike, directory: Path | None = None) -> tuple[Path, Path]:
    """(weights .pt, spec .json) for a policy name in `directory` or a path with or without suffix."""
    p = Path(name_or_path)
    if p.suffix in (".pt", ".json"):
        p = p.with_suffix("")
    elif not p.is_absolute() and p.parent == Path("."):
        p = (directory or default_policy_dir()) / p.name
    return p.with_suffix(".pt"), p.with_suffix(".json")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_policy(learner: PPOLearner, actions: ActionSpace, name_or_path: str | os.PathLike,
                provenance: dict[str, Any] | None = None, directory: Path | None = None) -> tuple[Path, Path]:
    """Write NAME.pt and NAME.json; returns their paths."""
    pt, js = resolve(name_or_path, directory)
    pt.parent.mkdir(parents=True, exist_ok=True)
    state = learner.state_dict()
    state["buffer"] = None  # rollouts are training state, not part of a shipped policy
    state["pending"] = None
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    meta = current_spec(actions) | {
        "ppo_config": state["config"] | {"hidden_sizes": list(state["config"]["hidden_sizes"])},
        "sha256": hashlib.sha256(data).hexdigest(),
        "provenance": {"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                       **(provenance or {})},
    }
    _atomic_write(pt, data)
    _atomic_write(js, (json.dumps(meta, indent=2) + "\n").encode())
    return pt, js


def read_spec(name_or_path: str | os.PathLike, directory: Path | None = None) -> dict[str, Any]:
    _, js = resolve(name_or_path, directory)
    try:
        meta = json.loads(js.read_text())
    except FileNotFoundError:
        raise PolicyError(f"policy spec {js} not found (a policy is NAME.pt + NAME.json)") from None
    except (OSError, ValueError) as exc:  # ValueError covers bad JSON and bytes that are not UTF-8
        raise PolicyError(f"policy spec {js} is unreadable: {exc}") from None
    if not isinstance(meta, dict):
        raise PolicyError(f"policy spec {js} must hold a JSON object, not {type(meta).__name__}")
    return meta


def check_spec(meta: dict[str, Any], actions: ActionSpace, source: str) -> None:
    """Raise PolicyError naming the first field where `meta` differs from this code's spec."""
    version = meta.get("format_version", "<missing>")
    if version != FORMAT_VERSION:
        raise PolicyError(f"policy {source} has format_version {version!r}; this dynamix_hvd reads format "
                          f"{FORMAT_VERSION} (PPO refining the model-based proposal). Retrain it with "
                          "python -m bench.lab.pretrain, or use a policy made for this version.")
    for key, want in current_spec(actions).items():
        got = meta.get(key, "<missing>")
        if got != want:
            raise PolicyError(f"policy {source} does not match this dynamix_hvd: field '{key}' is {got!r}, "
                              f"expected {want!r}. Retrain it, or use a policy made for this version.")


def load_policy(name_or_path: str | os.PathLike, actions: ActionSpace, directory: Path | None = None,
                ppo: Mapping[str, Any] | None = None) -> tuple[PPOLearner, dict[str, Any]]:
    """Load and validate a policy; returns the learner and its JSON metadata.

    `ppo` names the PPOConfig fields the user set, {field: value}: each overrides the stored config,
    except the fields in FIXED_PPO_FIELDS where they differ from it, which are refused (PolicyError
    naming them). Fields not named keep their stored values. The applied changes are listed in
    ``meta["ppo_overrides"]``.
    """
    try:
        learner, meta = _load(name_or_path, actions, directory)
    except PolicyError as exc:
        if str(name_or_path) == DEFAULT_POLICY:
            raise PolicyError(f"the default policy cannot be used: {exc}. {_DEFAULT_FIX}") from None
        raise
    if ppo:
        meta["ppo_overrides"] = apply_ppo_overrides(learner, ppo, str(resolve(name_or_path, directory)[1]))
    return learner, meta


def apply_ppo_overrides(learner: PPOLearner, ppo: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Apply the fields named in `ppo` that differ from the learner's stored config; returns them."""
    stored = learner.config
    wanted = dataclasses.replace(stored, **ppo)  # checks the names and values; normalises them
    changes = {k: getattr(wanted, k) for k in ppo if getattr(wanted, k) != getattr(stored, k)}
    fixed = [k for k in changes if k in FIXED_PPO_FIELDS]
    if fixed:
        detail = ", ".join(f"{k}={changes[k]!r} (stored {getattr(stored, k)!r})" for k in fixed)
        raise PolicyError(f"policy {source} was trained with a different network: {detail}. Drop "
                          "these from ControllerConfig(ppo=...), or train a policy with them.")
    if changes:
        learner.config = dataclasses.replace(stored, **changes)
        for group in learner.optimizer.param_groups:
            group["lr"], group["eps"] = learner.config.learning_rate, learner.config.adam_eps
        if "seed" in changes:
            learner.generator.manual_seed(learner.config.seed)
    return changes


def _load(name_or_path: str | os.PathLike, actions: ActionSpace,
          directory: Path | None) -> tuple[PPOLearner, dict[str, Any]]:
    pt, js = resolve(name_or_path, directory)
    meta = read_spec(name_or_path, directory)
    check_spec(meta, actions, str(js))
    try:
        data = pt.read_bytes()
    except OSError as exc:
        raise PolicyError(f"policy weights {pt} unreadable: {exc}") from None
    if meta.get("sha256") not in (None, hashlib.sha256(data).hexdigest()):
        raise PolicyError(f"policy weights {pt} do not match the checksum in {js} (corrupt or replaced)")
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
        learner = PPOLearner.from_state_dict(state)
    except Exception as exc:  # any unpickling/shape error means the file is not a usable policy
        raise PolicyError(f"policy weights {pt} could not be loaded: {exc}") from None
    want = (len(RANK_FEATURES), len(GLOBAL_FEATURES), actions.n)
    got = (learner.obs_dim_rank, learner.obs_dim_global, learner.n_actions)
    if got != want:
        raise PolicyError(f"policy {pt} has (rank features, global features, actions) = {got}, expected {want}")
    if not learner.central_critic:
        raise PolicyError(f"policy {pt} has a per-row critic; this dynamix_hvd expects a central critic")
    return learner, meta


def list_policies(directory: Path | None = None) -> list[dict[str, Any]]:
    """Name, creation time and provenance of every policy spec in `directory`."""
    d = directory or default_policy_dir()
    out = []
    for js in sorted(d.glob("*.json")):
        try:
            meta = json.loads(js.read_text())
        except (OSError, ValueError):
            meta = {"error": "unreadable"}
        out.append({"name": js.stem, "has_weights": js.with_suffix(".pt").exists(), **meta})
    return out
