"""Replay the speed-gap test on plain Horovod's recorded steps: how often it finds a gap in noise.

    python -m bench.gap_replay runs/suite/zoo-vgg-tuning runs/suite/zoo-headline

Reads every plain Horovod run under the given suite run folders (``*/CONDITION/plain-horovod_s*/
suite_steps.csv``: each rank's forward+backward seconds per step at equal sizes, no controller
involved), cuts each run's steps (after the first `WARMUP_STEPS`, which the decision core leaves
out too) into consecutive windows of L steps, as if a decision ended every L steps, and applies the
proposal's paired test (`dynamix_hvd.control.speedgap.speed_gap`, with each step's time the longest
rank's whole step) to each window twice: counting effective steps (the shipped test) and taking the
steps as independent draws (the plain t-test). Of each window only the steps the cost model would
keep of an interval are tested (`CostConfig.points_per_interval`, evenly spaced), as the live
proposal does. Printed per half of the workload zoo, condition and L, the share of windows whose
bound passes the split margin, and the share that passes with the window before it, the same rank
the slowest (what leaves the neutral split with `ProposalConfig.split_intervals` 2). Under "none"
every pass is a split of ranks that run the same job at the same sizes (the host may still give one
core less time for a while); under a straggler a pass is a detection. Also per half and condition,
over runs: the lag-1 and lag-10 autocorrelation of the per-step log difference between the two
ranks (the reason independence does not hold) and its mean (a gap that lasts the whole run).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd

from bench.zoo import JOBS
from dynamix_hvd.control.core import WARMUP_STEPS
from dynamix_hvd.control.costmodel import CostConfig, kept_points
from dynamix_hvd.control.proposal import ProposalConfig
from dynamix_hvd.control.speedgap import speed_gap


def plain_runs(folders: list[Path]) -> list[tuple[str, str, str, Path]]:
    """(job, condition, seed, steps file) of every plain Horovod run under the suite run folders."""
    found = []
    for folder in folders:
        for steps in sorted(folder.glob("*/*/plain-horovod_s*/suite_steps.csv")):
            job, condition, run = steps.parts[-4], steps.parts[-3], steps.parts[-2]
            found.append((job, condition, run.rsplit("_s", 1)[1], steps))
    return found


def half_of(workload: str) -> str:
    """The zoo half of a suite workload name ("zoo:lstm-rows:x3" is lstm-rows's)."""
    name = workload.split(":")[1] if workload.startswith("zoo:") else workload
    return JOBS[name].half if name in JOBS else "other"


def per_step(steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sizes and forward+backward seconds [n, R] and the step's seconds [n] (the longest rank's),
    one row per step every rank timed."""
    t = steps.pivot_table(index="step", columns="rank", values="compute_s")
    b = steps.pivot_table(index="step", columns="rank", values="local_batch")
    whole = steps.pivot_table(index="step", columns="rank", values="step_s").max(axis=1)
    ok = (t > 0).all(axis=1) & (b > 0).all(axis=1)
    # the process's first steps pay one-off costs: left out, as the decision core leaves them out
    return b[ok].to_numpy()[WARMUP_STEPS:], t[ok].to_numpy()[WARMUP_STEPS:], whole[ok].to_numpy()[WARMUP_STEPS:]


def windows(b: np.ndarray, t: np.ndarray, step: np.ndarray, length: int, margin: float,
            serial: bool) -> tuple[float, float]:
    """Shares of the windows of `length` steps whose bound on the step's gain passes `margin`, and
    that pass after a passing one with the same slowest rank; NaN with fewer than three windows."""
    count = len(t) // length
    if count < 3:
        return math.nan, math.nan
    kept = kept_points(length, CostConfig().points_per_interval)  # what the cost model keeps of an interval
    cut = [i * length + kept for i in range(count)]
    gaps = [speed_gap(b[w], t[w], step[w], serial=serial) for w in cut]
    passed = [g > margin for g, _ in gaps]
    running = sum(passed[i] and passed[i - 1] and gaps[i][1] == gaps[i - 1][1] for i in range(1, count))
    return float(np.mean(passed)), running / (count - 1)


def autocorrelation(t: np.ndarray, lag: int) -> float:
    """Autocorrelation at `lag` steps of the per-step log difference between rank 1 and rank 0."""
    d = np.log(t[:, 1]) - np.log(t[:, 0])
    x = d - d.mean()
    return float((x[:-lag] * x[lag:]).sum() / (x * x).sum()) if (x * x).sum() > 0 and len(x) > lag else math.nan


def replay(folders: list[Path], lengths: list[int], margin: float) -> pd.DataFrame:
    rows = []
    for job, condition, seed, path in plain_runs(folders):
        b, t, step = per_step(pd.read_csv(path))
        if t.shape[1] != 2:
            continue
        base = {"half": half_of(job), "condition": condition, "job": job, "seed": seed,
                "lag1": autocorrelation(t, 1), "lag10": autocorrelation(t, 10),
                "mean gap": 100.0 * math.expm1(float(np.mean(np.log(t[:, 1] / t[:, 0]))))}
        for length in lengths:
            for test, serial in (("effective steps", True), ("independent", False)):
                share, running = windows(b, t, step, length, margin, serial)
                rows.append({**base, "L": length, "test": test, "pass": share, "two running": running})
    if not rows:
        raise SystemExit(f"no plain Horovod run with two ranks under {', '.join(map(str, folders))}")
    return pd.DataFrame(rows)


def report(frame: pd.DataFrame, margin: float) -> str:
    out = []
    for half, part in frame.groupby("half", sort=False):
        runs = part.drop_duplicates(["job", "condition", "seed"])
        out.append(f"## {half} half ({runs.job.nunique()} jobs, {len(runs)} plain runs)\n")
        for key, what in (("lag1", "lag-1 autocorrelation"), ("lag10", "lag-10 autocorrelation"),
                          ("mean gap", "mean as a percentage (rank 1 slower by)")):
            out.append(f"The ranks' per-step log difference, its {what}, median [range] over runs: " + "; ".join(
                f"{c} {g[key].median():.2f} [{g[key].min():.2f}, {g[key].max():.2f}]" for c, g in runs.groupby("condition")) + "\n")
        table = part.pivot_table(index=["condition", "L"], columns="test", values=["pass", "two running"],
                                 aggfunc="mean", dropna=False)
        out.append(f"Share of windows whose bound passes the margin ({margin:g}); mean over runs:\n")
        out.append("| condition | L (steps) | pass: effective steps | pass: independent | two running: effective steps | two running: independent |")
        out.append("|---|---|---|---|---|---|")
        for (condition, length), row in table.iterrows():
            cells = [row[("pass", "effective steps")], row[("pass", "independent")],
                     row[("two running", "effective steps")], row[("two running", "independent")]]
            out.append(f"| {condition} | {length} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="suite run folders (runs/suite/NAME)")
    ap.add_argument("--lengths", default="8,20,50,130", help="window lengths in steps, comma-separated")
    ap.add_argument("--margin", type=float, default=ProposalConfig().split_margin,
                    help="the split margin a bound must pass (default: ProposalConfig's)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(report(replay(args.folders, lengths, args.margin), args.margin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
