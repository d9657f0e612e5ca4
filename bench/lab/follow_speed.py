"""Following a change of speed, in the simulator: the default against itself without change votes,
and without votes or the one-interval test.

The default policy ("model") drives every job three times with the same simulator seed: as shipped
(change votes, ``CadenceConfig.change_vote_s``, and the cost lines' one-interval test,
``CostConfig.decisive_factor``), without change votes, and without either (every change of speed waits
for a second interval); the oracle (the goodput optimum for the true speeds, which does not see a
change coming) runs it too. Jobs are drawn from both halves of the workload families
(:data:`bench.lab.misspecified.HALVES`) under the conditions of :data:`bench.lab.scenarios.MISSPECIFIED`
where speeds change (a moving straggler, a co-located job, bandwidth bursts, transient stalls) and
none as the control. Ratios are geometric means over jobs of time to target.

    python -m bench.lab.follow_speed --jobs 8 --out bench/results/follow-speed
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from dynamix_hvd.control.costmodel import CostConfig
from dynamix_hvd.control.proposal import ModelPolicy
from .evaluate import gmean_ratio, write_rows
from .misspecified import HALVES, WORLD_SIZES
from .scenarios import ScenarioConfig, misspecify, sample_cluster
from .simulator import ClusterSimulator

CONDITIONS = ("none", "moving", "interference", "bursts", "stalls")
VARIANTS = {"default": (CostConfig(), None), "no votes": (CostConfig(), 0.0),
            "two intervals": (CostConfig(decisive_factor=0.0), 0.0)}
"""name -> (cost model settings, change_vote_s; None: the simulator's default, the live default's)."""


def evaluate(conditions: list[str], jobs: int, seed: int) -> list[dict[str, Any]]:
    """One row per (condition, half, job): each variant's and the oracle's time to target (s)."""
    rows = []
    for half, families in HALVES.items():
        cfg = ScenarioConfig(families=families, world_sizes=WORLD_SIZES)
        for j in range(jobs):
            base = sample_cluster(np.random.default_rng([seed, j, len(half)]), cfg)
            for condition in conditions:
                spec = misspecify(base, condition)
                row: dict[str, Any] = {"condition": condition, "half": half, "job": j, "family": base.name,
                                       "world_size": spec.world_size}
                for name, (costs, votes) in VARIANTS.items():
                    run = spec if votes is None else dataclasses.replace(spec, change_vote_s=votes)
                    sim = ClusterSimulator(run, seed=seed * 1000 + j, costs=costs)
                    res = sim.run_policy(ModelPolicy(hold_flips=True), track_optimum=False)
                    row[name] = res.time_to_target_s if res.reached else res.wall_s
                res = ClusterSimulator(spec, seed=seed * 1000 + j).run_oracle()
                row["oracle"] = res.time_to_target_s if res.reached else res.wall_s
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| condition | families (jobs) | default / no votes | default / two intervals, no votes | "
             "oracle / default |", "|---|---|---|---|---|"]
    for condition in dict.fromkeys(r["condition"] for r in rows):
        for half in HALVES:
            g = [r for r in rows if r["condition"] == condition and r["half"] == half]
            if g:
                lines.append(f"| {condition} | {half} ({len(g)}) | {gmean_ratio(g, 'default', 'no votes'):.3f} | "
                             f"{gmean_ratio(g, 'default', 'two intervals'):.3f} | "
                             f"{gmean_ratio(g, 'oracle', 'default'):.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=8, help="jobs drawn per half (each run under every condition)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated names")
    ap.add_argument("--out", default="bench/results/follow-speed")
    args = ap.parse_args(argv)
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: give at least 1")
    import torch
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = evaluate(conditions, args.jobs, args.seed)
    out = Path(args.out)
    write_rows(out, rows)
    command = " ".join(["python -m bench.lab.follow_speed", *(argv if argv is not None else sys.argv[1:])])
    text = "\n".join([f"`{command}` ({time.perf_counter() - t0:.0f} s); time to target, geometric means over jobs",
                      "", *table(rows)])
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
