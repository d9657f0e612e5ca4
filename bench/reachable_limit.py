"""The straggler rows' limit with each rank's fixed per-step cost, beside the proportional one.

    python -m bench.reachable_limit bench/results/zoo-headline

`bench.zoo_report`'s attainable limit re-times the plain Horovod run's steps as if split so that
every rank arrives together, assuming a rank's forward+backward time in proportion to its samples
(`bench.suite_report.balanced_fraction`). Where a step has a fixed cost (kernel launches, Python,
the optimizer's per-tensor work), that split is not reachable: the slow rank pays its fixed cost,
slowed with it, whatever it is given. Here each rank's time is a + c b instead: its fixed cost in
samples, k = a / c, comes from a least-squares line through the per-size medians of the default arm's
own steps in the constant 3x run (2x where there is none) of the same job and seed (the ranks run
many sizes there; a slowdown that scales the whole step leaves k as it is, so the same k serves the
changing rows); the
speeds c stay those of the plain run itself, per window of its steps, so the machine's speed
drifting between runs does not move the limit. Per window the best split's compute is the least
M with sum_i (M / c_i - k_i) >= B and every rank given at least one sample, or, for a model with
per-rank BatchNorm, the floor the controller keeps it at (`ControllerConfig.advanced.batchnorm_min_batch`: a rank below it would normalise with
the statistics of a few samples; column "floor"); the rest of the step stays as measured
(`bench.suite_report.balanced_fraction` with `fixed=` and `floor=`).
Printed per straggler row, medians over seeds: both limits and the default's time to target over
plain Horovod's against each (two ranks: rank 0's and rank 1's fixed costs). Only run folders that
still hold the results folder's runs are read (a later run of the same configuration overwrites
them); none left is an error.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd

SKIP_STEPS = 10
"""Each rank's first steps (lazy initialisation, cold caches) are left out of its line."""
MIN_STEPS_PER_SIZE = 5


def fixed_samples(steps: pd.DataFrame) -> dict[int, float]:
    """Per rank, its fixed per-step cost in samples (a / c of a line a + c b through the medians of
    its forward+backward seconds per size); NaN where it ran fewer than two sizes or the slope is
    not positive; 0 where the line's fixed cost is below zero."""
    out: dict[int, float] = {}
    for rank, mine in steps.groupby("rank"):
        mine = mine.sort_values(["epoch", "step"]).iloc[SKIP_STEPS:]
        mine = mine[(mine.local_batch > 0) & (mine.compute_s > 0)]
        per_size = mine.groupby("local_batch").compute_s.agg(["median", "count"])
        per_size = per_size[per_size["count"] >= MIN_STEPS_PER_SIZE]
        if len(per_size) < 2:
            out[int(rank)] = math.nan
            continue
        b = per_size.index.to_numpy(dtype=float)
        c, a = np.polyfit(b, per_size["median"].to_numpy(), 1, w=np.sqrt(per_size["count"].to_numpy()))
        out[int(rank)] = max(a, 0.0) / c if c > 0 else math.nan
    return out


def batch_floor(workload: str) -> int:
    """The fewest samples the shipped default gives a rank of zoo workload `workload` (``zoo:JOB`` or
    ``zoo:JOB:xK``): the controller's per-rank BatchNorm floor where the job's model has per-rank
    batch statistics, else 1."""
    from bench.zoo import JOBS
    from dynamix_hvd.control.config import ControllerConfig
    from dynamix_hvd.control.controller import batchnorm_floor

    job = JOBS[workload.removeprefix("zoo:").split(":")[0]]
    return max(batchnorm_floor(ControllerConfig(), job.model(), [job.batch]).min_batch, 1)


def table(results: Path) -> str:
    from bench.suite_report import balanced_fraction
    from bench.zoo_report import PLAIN, collect, run_steps

    runs = pd.read_csv(results / "runs.csv")
    runs = runs[runs.status == "ok"]
    numbers = collect(results).set_index(["workload", "condition", "arm", "seed"])
    rows_of = runs.set_index(["workload", "condition", "arm", "seed"])
    steps_of: dict[tuple, pd.DataFrame | None] = {}  # (workload, condition, arm, seed) -> per-step records

    def steps(w: str, c: str, arm: str, seed: int) -> pd.DataFrame | None:
        key = (w, c, arm, seed)
        if key not in steps_of:
            steps_of[key] = run_steps(rows_of.loc[key].to_dict()) if key in rows_of.index else None
        return steps_of[key]

    model = next((a for a in runs.arm.unique() if a not in (PLAIN, "split-speed")), None)
    if model is None:
        raise SystemExit(f"{results}: no arm but plain Horovod and the fixed split")
    constant = [c for c in ("slow3x", "slow2x") if c in set(runs.condition)]
    if not constant:
        raise SystemExit(f"{results}: no constant straggler (slow3x or slow2x) to fit the fixed costs on")
    lines = ["| job | condition | fixed cost, samples: rank 0 / rank 1 | floor | limit | reachable limit | default / plain "
             "| / limit | / reachable limit | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    from bench.zoo import JOBS

    for (w, c), group in runs[runs.condition != "none"].groupby(["workload", "condition"], sort=False):
        if str(w).removeprefix("zoo:").split(":")[0] not in JOBS:  # not a zoo job (not this report's kind of row)
            continue
        rows, floor = [], batch_floor(w)
        for seed in sorted(group.seed.unique()):
            plain, mine, fit_on = steps(w, c, PLAIN, seed), steps(w, c, model, seed), steps(w, constant[0], model, seed)
            if plain is None or mine is None or fit_on is None:
                continue
            k = fixed_samples(fit_on)
            until = float(numbers.loc[(w, c, PLAIN, seed), "ttt_s"])
            ratio = float(numbers.loc[(w, c, model, seed), "ttt_s"]) / until
            limit = float(numbers.loc[(w, c, PLAIN, seed), "balanced_to_target"])  # zoo_report's limit
            reachable = balanced_fraction(plain, until_s=until, fixed=k, floor=floor)
            rows.append((k.get(0, math.nan), k.get(1, math.nan), limit, reachable, ratio))
        if not rows:
            continue
        per_seed = np.array(rows)
        k0, k1, limit, reachable, ratio = np.nanmedian(per_seed, axis=0)
        lines.append(f"| {w.removeprefix('zoo:')} | {c} | {k0:.1f} / {k1:.1f} | {floor} | {limit:.2f} | {reachable:.2f} | "
                     f"{ratio:.2f} | {float(np.nanmedian(per_seed[:, 4] / per_seed[:, 2])):.2f} | "
                     f"{float(np.nanmedian(per_seed[:, 4] / per_seed[:, 3])):.2f} | {len(rows)} |")
    if len(lines) == 2:
        raise SystemExit(f"{results}: no straggler row whose run folders still hold this run's steps")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="a zoo suite's results folder (runs.csv; its run folders must exist)")
    args = ap.parse_args(argv)
    print(table(args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
