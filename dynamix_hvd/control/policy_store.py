"""Policies on disk: ``policies/NAME.pt`` (weights and learner state) + ``NAME.json`` (spec, provenance).

A policy only makes sense for the observation and action layout it was trained with, so the JSON
records both, and loading refuses a policy whose spec differs from the running code's, naming the
field. Files are written to a temporary name and renamed, so a crash never leaves half a policy.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from .actions import ActionSpace
from ..rl.ppo import PPOLearner
from .state import GLOBAL_FEATURES, RANK_FEATURES

FORMAT_VERSION = 1
DEFAULT_POLICY = "default"
"""The policy shipped in policies/ and used by the controller unless told otherwise."""
POLICY_DIR_ENV = "DYNAMIX_POLICY_DIR"


class PolicyError(ValueError):
    """A policy file is missing, unreadable, corrupt, or does not fit this code's spec."""


def default_policy_dir() -> Path:
    """$DYNAMIX_POLICY_DIR, else the repository's ``policies/`` folder."""
    return Path(os.environ.get(POLICY_DIR_ENV, Path(__file__).resolve().parents[2] / "policies"))


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
    for key, want in current_spec(actions).items():
        got = meta.get(key, "<missing>")
        if got != want:
            raise PolicyError(f"policy {source} does not match this dynamix_hvd: field '{key}' is {got!r}, "
                              f"expected {want!r}. Retrain it, or use a policy made for this version.")


def load_policy(name_or_path: str | os.PathLike, actions: ActionSpace,
                directory: Path | None = None) -> tuple[PPOLearner, dict[str, Any]]:
    """Load and validate a policy; returns the learner and its JSON metadata."""
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
