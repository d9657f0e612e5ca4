"""How long may an interval between two decisions last? The cadence's ceiling on long jobs, simulated.

A job's decisions are spread as `target_decisions` (32) over its epochs, so a job of 40 epochs of
45 s decides once an epoch and follows a rank that turns slow a minute or two late.
``CadenceConfig.max_decision_interval_s`` caps an interval inside an epoch at that many seconds of
training. Here simulated jobs of the tuning half's workload families (`bench.lab.scenarios`), each
stretched to about `--job-s` seconds over 40 epochs, run the default proposal with the live cadence
(:class:`~dynamix_hvd.control.cadence.DecisionCadence`, as the controller runs it) under ceilings of
none, 20, 5, 2 and 1 s, each condition with the same simulator seed, twice: as shipped, and with
the global batch held (``ProposalConfig(search_batch=False)``), which leaves the split alone to
follow the speeds (the batch's growth and its check also depend on how often they are decided):

- ``none``: the ranks keep their speeds (what more decisions cost where nothing changes);
- ``drift``: the last rank turns 3x slower at 30% of the job's progress and recovers to 1.5x at 60%;
- ``interference``: a co-located job makes the last rank 3x slower for 60 s every 180 s.

Ratios are geometric means over jobs of time to target against no ceiling (< 1 faster), over all
jobs and over those where the drift costs at least 10% without a ceiling (in many drawn jobs the
allreduce or a fixed per-step cost dominates, and a split gains little)::

    python -m bench.lab.cadence_study --jobs 12 --seed 0 --world-sizes 2,2,4,8 --out bench/results/cadence-ceiling
    python -m bench.lab.cadence_study --jobs 12 --seed 0 --world-sizes 2,2,4,8 --job-s 7200 --epochs 10 \
        --ceilings 60,20 --out bench/results/cadence-ceiling-long-epochs
    python -m bench.lab.cadence_study --jobs 12 --seed 0 --world-sizes 2,2,4,8 --policies default \
        --out bench/results/cadence-growth-check
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from dynamix_hvd.control.proposal import ModelPolicy, ProposalConfig
from .evaluate import gmean_ratio, write_rows
from .scenarios import ScenarioConfig, sample_cluster
from .simulator import ClusterSimulator, ClusterSpec

FAMILIES = ("mlp", "cnn")
"""The tuning half's synthetic workload families (the held-out ones stay out)."""
CEILINGS = (0.0, 20.0, 5.0, 2.0, 1.0)
"""Ceilings tried by default, in seconds (0: none, the reference, always run)."""
CONDITIONS = ("none", "drift", "interference")
POLICIES = {"default": ProposalConfig(), "B held": ProposalConfig(search_batch=False)}
EPOCHS = 40


def long_job(base: ClusterSpec, job_s: float, condition: str, epochs: int = EPOCHS) -> ClusterSpec:
    """`base` stretched to about `job_s` seconds at its initial sizes over `epochs` epochs, its own
    drift, stalls and interference removed, then `condition` applied to its last rank."""
    plain = replace(base, drift=[], stall_prob=0.0, interfere_every_s=0.0, interfere_factor=1.0, move_every=0,
                    burst_every_s=0.0, burst_factor=1.0)
    step = ClusterSimulator(plain, seed=0).expected_step_time(np.asarray(plain.initial_batch, dtype=np.float64))
    target = max(1.0, job_s / float(step)) * sum(plain.initial_batch)
    spec = replace(plain, cadence="live", total_epochs=epochs, target_progress=target,
                   dataset_size=max(1, math.ceil(target / epochs)), max_decisions=1_000_000)
    last = spec.world_size - 1
    if condition == "drift":
        return replace(spec, drift=[(0.3, last, 3.0), (0.6, last, 0.5)])
    if condition == "interference":
        return replace(spec, interfere_every_s=180.0, interfere_s=60.0, interfere_factor=3.0, interfere_rank=last)
    if condition != "none":
        raise ValueError(f"unknown condition {condition!r} (have: {', '.join(CONDITIONS)})")
    return spec


def evaluate(jobs: int, seed: int, job_s: float, world_sizes: tuple[int, ...], epochs: int = EPOCHS,
             ceilings: tuple[float, ...] = CEILINGS, policies: tuple[str, ...] = tuple(POLICIES)) -> list[dict[str, Any]]:
    """One row per (policy, condition, job): time to target (s) and decisions under every ceiling."""
    cfg = ScenarioConfig(families=FAMILIES, world_sizes=world_sizes)
    rows = []
    for j in range(jobs):
        base = sample_cluster(np.random.default_rng([seed, j]), cfg)
        for policy in policies:
            settings = POLICIES[policy]
            for condition in CONDITIONS:
                spec = long_job(base, job_s, condition, epochs)
                row: dict[str, Any] = {"policy": policy, "condition": condition, "job": j, "family": base.name,
                                       "world_size": spec.world_size}
                for ceiling in ceilings:
                    sim = ClusterSimulator(replace(spec, max_decision_interval_s=ceiling), seed=seed * 1000 + j)
                    res = sim.run_policy(ModelPolicy(settings), track_optimum=False)
                    row[f"t_{ceiling:g}"] = res.time_to_target_s if res.reached else res.wall_s
                    row[f"decisions_{ceiling:g}"] = sim.decisions
                rows.append(row)
    return rows


def sensitive(rows: list[dict[str, Any]], policy: str) -> set[int]:
    """Jobs whose time to target under the drift, without a ceiling, is at least 10% longer than
    without it: where following a changing rank can matter."""
    t = {(r["condition"], r["job"]): r["t_0"] for r in rows if r["policy"] == policy}
    return {j for (c, j), v in t.items() if c == "drift" and v >= 1.1 * t[("none", j)]}


def table(rows: list[dict[str, Any]], ceilings: tuple[float, ...] = CEILINGS) -> list[str]:
    capped = [c for c in ceilings if c > 0]
    lines = ["| policy | condition | jobs | " + " | ".join(f"{c:g} s / none" for c in capped)
             + " | decisions: none / " + " / ".join(f"{c:g} s" for c in capped) + " (median) |",
             "|" + "---|" * (len(capped) + 4)]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        hit = sensitive(rows, policy)
        for condition, only in [(c, False) for c in CONDITIONS] + [("drift", True), ("interference", True)]:
            g = [r for r in rows if r["condition"] == condition and r["policy"] == policy
                 and (not only or r["job"] in hit)]
            if not g:
                continue
            ratios = " | ".join(f"{gmean_ratio(g, f't_{c:g}', 't_0'):.3f}" for c in capped)
            decisions = " / ".join(f"{np.median([r[f'decisions_{c:g}'] for r in g]):.0f}" for c in ceilings)
            label = f"{condition}, where the drift costs 10%+" if only else condition
            lines.append(f"| {policy} | {label} | {len(g)} | {ratios} | {decisions} |")
    return lines


def revision() -> str:
    """The checkout's commit (and "modified" where its tracked files differ from it), for the record."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), *args], capture_output=True,
                                  text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    commit = git("rev-parse", "--short=12", "HEAD") or "commit unknown"
    return f"commit {commit}" + (" (modified)" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=8, help="simulated jobs (each under every condition)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--job-s", type=float, default=1800.0,
                    help="each job's length at its initial sizes, in simulated seconds")
    ap.add_argument("--world-sizes", default="2,4,8", help="world sizes the jobs are drawn from")
    ap.add_argument("--epochs", type=int, default=EPOCHS, help="each job's epochs (total_epochs)")
    ap.add_argument("--ceilings", default=",".join(f"{c:g}" for c in CEILINGS if c > 0),
                    help="ceilings to try, in seconds, comma-separated (no ceiling is always run)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"policies to run, comma-separated (of: {', '.join(POLICIES)})")
    ap.add_argument("--out", default="bench/results/cadence-ceiling")
    args = ap.parse_args(argv)
    policies = tuple(p.strip() for p in args.policies.split(","))
    if not policies or any(p not in POLICIES for p in policies):
        ap.error(f"--policies {args.policies!r}: choose from {', '.join(POLICIES)}")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: give at least 1")
    if not args.job_s > 0:
        ap.error(f"--job-s {args.job_s}: give a positive number of seconds")
    try:
        world_sizes = tuple(int(w) for w in args.world_sizes.split(","))
    except ValueError:
        ap.error(f"--world-sizes {args.world_sizes!r}: give whole numbers, e.g. 2,4,8")
    try:
        ceilings = (0.0, *sorted({float(c) for c in args.ceilings.split(",") if float(c) > 0}, reverse=True))
    except ValueError:
        ap.error(f"--ceilings {args.ceilings!r}: give numbers of seconds, e.g. 20,5")
    if args.epochs < 1:
        ap.error(f"--epochs {args.epochs}: give at least 1")
    if min(world_sizes) < 2:
        ap.error(f"--world-sizes {args.world_sizes!r}: every size must be >= 2 (a rank to slow down)")
    import torch
    torch.set_num_threads(1)
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = evaluate(args.jobs, args.seed, args.job_s, world_sizes, args.epochs, ceilings, policies)
    out = Path(args.out)
    write_rows(out, rows)
    command = " ".join(["python -m bench.lab.cadence_study", *(argv if argv is not None else sys.argv[1:])])
    text = "\n".join([f"`{command}` ({time.perf_counter() - t0:.0f} s, {started}, {revision()}); time to "
                      "target under each ceiling over no ceiling, geometric means over jobs", "",
                      *table(rows, ceilings)])
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
