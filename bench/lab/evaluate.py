"""Held-out evaluation of a batch-size policy in the simulator (the policy card's table).

Full simulated runs to the statistical target on jobs of workload families *not* used in training,
per job: the best static batch (the initial per-rank sizes scaled by each of STATIC_SCALES, best
time kept: a user who tuned one static batch), policy "model" (the proposal alone), the rules
"speed-split" and "goodput", the PPO policy deployed (``learn=False``), and the goodput oracle.
Ratios are geometric means over jobs of time-to-target; every run of a job uses the same simulator
seed, and all static scales count progress in the same unit (the initial global batch).
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dynamix_hvd.control.policy import BatchSizePolicy, StaticPolicy
from dynamix_hvd.control.proposal import ModelPolicy
from dynamix_hvd.control.rules import make_baseline
from .simulator import ClusterSimulator, ClusterSpec, EpisodeResult

STATIC_SCALES = (0.5, 1.0, 2.0, 4.0)


def _time(result: EpisodeResult) -> float:
    """Time to target; a run that hit the decision budget first counts with its whole (censored) time."""
    return result.time_to_target_s if result.reached else result.wall_s


def scaled_static(spec: ClusterSpec, scale: float) -> ClusterSpec:
    """`spec` started at its initial sizes x `scale` (clipped to its batch bounds), same progress unit."""
    d = spec.to_dict()
    d["initial_batch"] = [int(max(spec.min_batch, min(spec.max_batch, round(b * scale)))) for b in spec.initial_batch]
    d["ref_batch"] = spec.ref_batch or sum(spec.initial_batch)
    return ClusterSpec.from_dict(d)


def evaluate_job(spec: ClusterSpec, ppo: Callable[[], BatchSizePolicy], seed: int) -> dict[str, Any]:
    """Times (s) of every contender on one job."""
    def run(s: ClusterSpec, policy: BatchSizePolicy | None) -> float:
        sim = ClusterSimulator(s, seed=seed)
        return _time(sim.run_oracle() if policy is None else sim.run_policy(policy, track_optimum=False))

    statics = {f: run(scaled_static(spec, f), StaticPolicy()) for f in STATIC_SCALES}
    best_f = min(statics, key=lambda f: statics[f])
    base = scaled_static(spec, 1.0)
    return dict(family=spec.name, world_size=spec.world_size, static_s=statics[1.0], best_static_s=statics[best_f],
                best_static_scale=best_f, model_s=run(base, ModelPolicy()),
                speed_split_s=run(base, make_baseline("speed-split")), goodput_s=run(base, make_baseline("goodput")),
                ppo_s=run(base, ppo()), oracle_s=run(base, None))


CONTENDERS = ("ppo_s", "model_s", "goodput_s", "speed_split_s", "static_s", "best_static_s", "oracle_s")


def write_rows(out: Path, rows: Sequence[dict[str, Any]]) -> None:
    """A study's rows as OUT/runs.csv (OUT created), the columns those of the first row."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def gmean_ratio(rows: Sequence[dict[str, Any]], a: str, b: str) -> float:
    r = [x[a] / x[b] for x in rows if math.isfinite(x[a]) and math.isfinite(x[b]) and x[b] > 0]
    return float(np.exp(np.mean(np.log(r)))) if r else math.nan


def heldout_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: per family (and all), each contender's time / best static's (lower is better)."""
    families = sorted({r["family"] for r in rows})
    groups = [(f, [r for r in rows if r["family"] == f]) for f in families] + [("all", list(rows))]
    names = {"ppo_s": "ppo (shipped, deployed)", "model_s": "model", "goodput_s": "goodput",
             "speed_split_s": "speed-split", "static_s": "initial static", "best_static_s": "best static",
             "oracle_s": "oracle"}
    head = "| family (jobs) | " + " | ".join(names[c] for c in CONTENDERS) + " | ppo / model |"
    lines = [head, "|" + "---|" * (len(CONTENDERS) + 2)]
    for name, g in groups:
        cells = [f"{gmean_ratio(g, c, 'best_static_s'):.3f}" for c in CONTENDERS]
        lines.append(f"| {name} ({len(g)}) | " + " | ".join(cells) + f" | {gmean_ratio(g, 'ppo_s', 'model_s'):.3f} |")
    return lines
