"""The learned policy against the proposal where a fitted model is misspecified, in the simulator.

Jobs are drawn from the workload families of each half (the families pretraining used, and the
held-out ones of the policy card), then put under each condition of
:data:`bench.lab.scenarios.MISSPECIFIED` (stalls, a co-located job, a moving straggler, bandwidth
bursts, a noise estimate biased early, and none as the control). Every contender runs the same
job with the same simulator seed to the statistical target: the shipped PPO policy deployed, the
proposal alone ("model"), the rules "goodput" and "speed-split", the user's static sizes, and the
oracle (the goodput optimum for the true speeds, which does not see the interference or bursts
coming). Ratios are geometric means over jobs of time to target, against the proposal's.

    python -m bench.lab.misspecified --jobs 8 --seed 0 --out bench/results/misspecified
    python -m bench.lab.misspecified --jobs 3 --world-sizes 2,8,32,128 --by-world-size \
        --conditions none,moving --out bench/results/misspecified-scale
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.policy import BatchSizePolicy, StaticPolicy
from dynamix_hvd.control.policy_store import DEFAULT_POLICY, load_policy
from dynamix_hvd.control.proposal import ModelPolicy
from dynamix_hvd.control.refine import PPOPolicy
from dynamix_hvd.control.rules import make_baseline
from .evaluate import gmean_ratio, write_rows
from .scenarios import MISSPECIFIED, ScenarioConfig, misspecify, sample_cluster
from .simulator import ClusterSimulator

HALVES = {"tuning": ("mlp", "cnn", "real-cnn", "real-mlp"), "held-out": ("transformer", "real-charlm")}
"""Workload families: those the shipped policy was pretrained on, and the policy card's held-out ones."""
WORLD_SIZES = (2, 2, 4, 8)
CONTENDERS = ("ppo", "model", "goodput", "speed-split", "static", "oracle")


def contenders() -> dict[str, Callable[[], BatchSizePolicy | None]]:
    shipped = load_policy(DEFAULT_POLICY, ActionSpace())[0]
    return {"ppo": lambda: PPOPolicy(shipped, learn=False), "model": ModelPolicy,
            "goodput": lambda: make_baseline("goodput"), "speed-split": lambda: make_baseline("speed-split"),
            "static": StaticPolicy, "oracle": lambda: None}


def evaluate(conditions: list[str], jobs: int, seed: int, world_sizes: tuple[int, ...] = WORLD_SIZES,
             per_size: bool = False) -> list[dict[str, Any]]:
    """One row per (condition, half, job): every contender's time to target (s). Jobs draw their world
    size from `world_sizes`, or with `per_size` there are `jobs` jobs of each size."""
    make = contenders()
    rows = []
    for half, families in HALVES.items():
        cfg = ScenarioConfig(families=families, world_sizes=world_sizes)
        draws = [(j, w) for w in world_sizes for j in range(jobs)] if per_size else [(j, None) for j in range(jobs)]
        for j, size in draws:
            base = sample_cluster(np.random.default_rng([seed, j, len(half)]), cfg, world_size=size)
            for condition in conditions:
                spec = misspecify(base, condition)
                row: dict[str, Any] = {"condition": condition, "half": half, "job": j, "family": base.name,
                                       "world_size": spec.world_size}
                for name in CONTENDERS:
                    sim = ClusterSimulator(spec, seed=seed * 1000 + j)
                    policy = make[name]()
                    res = sim.run_oracle() if policy is None else sim.run_policy(policy, track_optimum=False)
                    row[name] = res.time_to_target_s if res.reached else res.wall_s
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], by_world_size: bool = False) -> list[str]:
    """Per condition and half (and world size): each contender's time over the proposal's (geometric
    mean; < 1 faster), and the fastest of the proposal, PPO, the rules and static (ties: the proposal).
    A run that hit the decision limit first counts with its whole time (censored, as in
    :mod:`bench.lab.evaluate`)."""
    others = [c for c in CONTENDERS if c != "model"]
    key = "| ranks " if by_world_size else ""
    lines = [f"| condition {key}| families (jobs) | " + " | ".join(f"{c} / model" for c in others) + " | fastest |",
             "|" + "---|" * (len(others) + 3 + by_world_size)]
    sizes = sorted({r["world_size"] for r in rows}) if by_world_size else [None]
    cells = [(c, w, h) for c in dict.fromkeys(r["condition"] for r in rows) for w in sizes for h in HALVES]
    for condition, size, half in cells:
        g = [r for r in rows if r["condition"] == condition and r["half"] == half
             and (size is None or r["world_size"] == size)]
        if not g:
            continue
        ratios = {c: gmean_ratio(g, c, "model") for c in others}
        rules = {"model": 1.0, **{c: ratios[c] for c in ("ppo", "goodput", "speed-split", "static")}}
        best = min(rules, key=lambda c: rules[c])  # ties go to the proposal
        ranks = f"| {size} " if by_world_size else ""
        lines.append(f"| {condition} {ranks}| {half} ({len(g)}) | " + " | ".join(f"{ratios[c]:.3f}" for c in others)
                     + f" | {best} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=8, help="jobs drawn per half (each run under every condition)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conditions", default=",".join(MISSPECIFIED), help="comma-separated names")
    ap.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)),
                    help="world sizes the jobs are drawn from (comma-separated; repeat to weight)")
    ap.add_argument("--by-world-size", action="store_true",
                    help="--jobs jobs of each world size, one table row per size (the scale comparison)")
    ap.add_argument("--out", default="bench/results/misspecified")
    args = ap.parse_args(argv)
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    for c in conditions:
        if c not in MISSPECIFIED:
            ap.error(f"unknown condition {c!r} (have: {', '.join(MISSPECIFIED)})")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: give at least 1")
    try:
        world_sizes = tuple(int(w) for w in args.world_sizes.split(","))
    except ValueError:
        ap.error(f"--world-sizes {args.world_sizes!r}: give whole numbers, e.g. 2,8,32")
    if min(world_sizes) < 1:
        ap.error(f"--world-sizes {args.world_sizes!r}: every size must be >= 1")
    import torch
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = evaluate(conditions, args.jobs, args.seed, world_sizes, per_size=args.by_world_size)
    out = Path(args.out)
    write_rows(out, rows)
    command = " ".join(["python -m bench.lab.misspecified", *(argv if argv is not None else sys.argv[1:])])
    text = "\n".join([f"`{command}` ({time.perf_counter() - t0:.0f} s); time to target over the proposal's, "
                      "geometric means", "", *table(rows, args.by_world_size)])
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
