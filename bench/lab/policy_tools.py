"""Policy tools: list, inspect, validate, compare stored PPO policies. Pure: no MPI, no Horovod.

    python -m bench.lab.policy_tools list | inspect NAME | validate NAME | compare NAME OTHER [--dir D] [--json]

Every function takes a policy name (looked up in the policy directory, see
:func:`policy_store.default_policy_dir`) or a path, and returns plain dicts (JSON-ready) that
:func:`format_result` turns into text; none of them raises for a broken policy file except
:func:`compare_policies` (which needs two loadable ones) — :func:`validate_policy` reports instead.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.policy_store import PolicyError, list_policies, load_policy, read_spec, resolve
from dynamix_hvd.control.state import OBS_DIM


def _space(meta: Optional[dict[str, Any]] = None) -> ActionSpace:
    mult = (meta or {}).get("action_multipliers")
    try:
        return ActionSpace(tuple(mult)) if mult else ActionSpace()
    except (TypeError, ValueError):
        return ActionSpace()


def list_policy_summaries(directory: Optional[Path] = None) -> list[dict[str, Any]]:
    """One row per policy in ``directory``: name, weights present, created, command, updates, and the
    held-out evaluation's ``ppo_vs_best_static`` (time-to-target / the best static batch's; < 1 is better)."""
    rows = []
    for meta in list_policies(directory):
        prov = meta.get("provenance") or {}
        ev = prov.get("evaluation") or {}
        rows.append({"name": meta["name"], "has_weights": meta.get("has_weights", False),
                     "created": prov.get("created"), "command": prov.get("command"),
                     "num_updates": prov.get("num_updates"), "ppo_vs_best_static": ev.get("ppo_vs_best_static"),
                     "error": meta.get("error")})
    return rows


def inspect_policy(name_or_path: str | os.PathLike, directory: Optional[Path] = None) -> dict[str, Any]:
    """Spec, provenance, PPO settings, file sizes and parameter count (weights are loaded if they can be)."""
    pt, js = resolve(name_or_path, directory)
    out: dict[str, Any] = {"name": pt.stem, "weights": str(pt), "spec_file": str(js),
                           "weights_bytes": pt.stat().st_size if pt.exists() else None}
    try:
        meta = read_spec(name_or_path, directory)
    except PolicyError as exc:
        return out | {"error": str(exc)}
    out.update({k: meta.get(k) for k in ("format_version", "kind", "rank_features", "global_features",
                                         "action_multipliers", "ppo_config", "sha256", "provenance")})
    try:
        learner, _ = load_policy(name_or_path, _space(meta), directory)
        out["parameters"] = int(sum(p.numel() for p in learner.net.parameters()))
        out["hidden_sizes"] = list(learner.config.hidden_sizes)
    except PolicyError as exc:
        out["load_error"] = str(exc)
    return out


def sample_observations(n: int = 256, seed: int = 0) -> torch.Tensor:
    """``[n, OBS_DIM]`` realistic observations: simulated jobs (random clusters and workloads) driven by
    random actions, so states away from the static configuration are covered too."""
    from .scenarios import ScenarioConfig, sample_cluster
    from .simulator import ClusterSimulator

    rng = np.random.default_rng(seed)
    scenario = ScenarioConfig(families=("mlp", "cnn", "transformer"), world_sizes=(1, 2, 3, 4, 8))
    rows: list[torch.Tensor] = []
    while sum(len(r) for r in rows) < n:
        sim = ClusterSimulator(sample_cluster(rng, scenario), seed=int(rng.integers(2**31)))
        rows.append(sim.reset(float(rng.uniform(0, 0.8))))
        for _ in range(int(rng.integers(1, 8))):
            rows.append(sim.step(rng.integers(0, sim.actions.n, sim.R + 1).tolist())[0])
    return torch.cat(rows)[:n]


def validate_policy(name_or_path: str | os.PathLike, directory: Optional[Path] = None,
                    sample_obs: Optional[torch.Tensor] = None) -> dict[str, Any]:
    """Run every check and report each: spec readable, spec matches this code, weights present,
    checksum, weights load, forward pass on sample observations (finite values, probabilities sum to 1).
    ``ok`` is True only if all pass."""
    pt, js = resolve(name_or_path, directory)
    checks: list[dict[str, Any]] = []
    out: dict[str, Any] = {"name": pt.stem, "weights": str(pt), "spec_file": str(js), "checks": checks}

    def check(name: str, ok: bool, detail: str = "") -> bool:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return ok

    try:
        meta = read_spec(name_or_path, directory)
        check("spec readable", True, str(js))
    except PolicyError as exc:
        check("spec readable", False, str(exc))
        return out | {"ok": False}
    space = _space(meta)
    from dynamix_hvd.control.policy_store import check_spec
    try:
        check_spec(meta, space, str(js))
        check("spec matches this dynamix_hvd", True)
    except PolicyError as exc:
        check("spec matches this dynamix_hvd", False, str(exc))
    if check("weights present", pt.exists(), str(pt)):
        digest = hashlib.sha256(pt.read_bytes()).hexdigest()
        out["sha256"] = digest
        want = meta.get("sha256")
        check("checksum", want is None or want == digest,
              "no checksum recorded" if want is None else f"recorded {want[:12]}..., file {digest[:12]}...")
    try:
        learner, _ = load_policy(name_or_path, space, directory)
        check("weights load", True)
    except PolicyError as exc:
        check("weights load", False, str(exc))
        return out | {"ok": False}
    obs = sample_observations(64) if sample_obs is None else sample_obs
    with torch.no_grad():
        probs = torch.softmax(learner.net.actor(obs), -1)
        values = learner.net.get_value(obs)
    finite = bool(torch.isfinite(probs).all() and torch.isfinite(values).all())
    sums = bool(torch.allclose(probs.sum(-1), torch.ones(len(obs)), atol=1e-4))
    check("forward pass", finite and sums and probs.shape == (len(obs), space.n),
          f"{len(obs)} observations of {OBS_DIM} features -> probabilities {tuple(probs.shape)}, "
          f"mean value {float(values.mean()):+.3f}")
    out["action_distribution"] = [round(float(p), 4) for p in probs.mean(0)]
    return out | {"ok": all(c["ok"] for c in checks)}


def compare_policies(a: str | os.PathLike, b: str | os.PathLike, n_states: int = 512, seed: int = 0,
                     directory: Optional[Path] = None) -> dict[str, Any]:
    """Action distributions of two policies on the same simulated states: agreement of the greedy
    actions (%), mean KL(a || b) and KL(b || a) in nats, mean total-variation distance, and each
    policy's mean action probabilities. Raises PolicyError if either does not load."""
    la, meta_a = load_policy(a, _space(read_spec(a, directory)), directory)
    lb, meta_b = load_policy(b, _space(read_spec(b, directory)), directory)
    if meta_a["action_multipliers"] != meta_b["action_multipliers"]:
        raise PolicyError(f"policies have different actions: {meta_a['action_multipliers']} vs "
                          f"{meta_b['action_multipliers']}")
    obs = sample_observations(n_states, seed)
    with torch.no_grad():
        lpa, lpb = torch.log_softmax(la.net.actor(obs), -1), torch.log_softmax(lb.net.actor(obs), -1)
    pa, pb = lpa.exp(), lpb.exp()
    return {"a": str(a), "b": str(b), "states": n_states, "seed": seed,
            "agreement_pct": float(100 * (pa.argmax(-1) == pb.argmax(-1)).float().mean()),
            "mean_kl_ab": float((pa * (lpa - lpb)).sum(-1).mean()),
            "mean_kl_ba": float((pb * (lpb - lpa)).sum(-1).mean()),
            "mean_tv": float(0.5 * (pa - pb).abs().sum(-1).mean()),
            "multipliers": list(meta_a["action_multipliers"]),
            "mean_probs_a": [round(float(x), 4) for x in pa.mean(0)],
            "mean_probs_b": [round(float(x), 4) for x in pb.mean(0)]}


def format_result(result: Any) -> str:
    """Human-readable text of any of the dicts (or list of dicts) above."""
    if isinstance(result, list):
        if not result:
            return "(no policies)"
        keys = list(result[0])
        return "\n".join(["\t".join(keys)] + ["\t".join(_fmt(r.get(k)) for k in keys) for r in result])
    if isinstance(result, dict) and "checks" in result:
        lines = [f"policy {result['name']}: {'OK' if result.get('ok') else 'INVALID'}"]
        lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}" + (f": {c['detail']}" if c["detail"] else "")
                  for c in result["checks"]]
        return "\n".join(lines)
    if isinstance(result, dict):
        return "\n".join(f"{k}: {_fmt(v)}" for k, v in result.items())
    return str(result)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)
    return str(v)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: one action, its result as text (or JSON); exit 1 when a check fails, 2 on misuse."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.lab.policy_tools", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("action", choices=["list", "inspect", "validate", "compare"],
                    help="list: policies in the directory; inspect: NAME's spec, provenance and size; "
                         "validate: run every check on NAME (exit 1 if one fails); "
                         "compare: action distributions of NAME and OTHER on the same simulated states")
    ap.add_argument("name", nargs="?", help="policy name in the directory, or a path (inspect/validate/compare)")
    ap.add_argument("other", nargs="?", help="the second policy (compare only)")
    ap.add_argument("--dir", default=None, help="policy directory (default $DYNAMIX_POLICY_DIR or policies/)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    args = ap.parse_args(argv)

    def fail(message: str, code: int) -> int:
        print(f"policy_tools: error: {message}", file=sys.stderr)
        return code

    if args.action != "list" and not args.name:
        return fail(f"policy {args.action} needs a policy NAME", 2)
    directory = Path(args.dir) if args.dir else None
    try:
        if args.action == "list":
            result: Any = list_policy_summaries(directory)
        elif args.action == "inspect":
            result = inspect_policy(args.name, directory)
        elif args.action == "validate":
            result = validate_policy(args.name, directory)
        else:
            if not args.other:
                return fail("policy compare needs two policies: NAME OTHER", 2)
            result = compare_policies(args.name, args.other, directory=directory)
    except PolicyError as exc:
        return fail(str(exc), 1)
    print(json.dumps(result, indent=2, default=str) if args.json else format_result(result))
    failed = args.action == "validate" and not result.get("ok")
    failed |= args.action == "inspect" and ("error" in result or "load_error" in result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
