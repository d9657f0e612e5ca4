"""Functional check of runs at many ranks: did every decision reach every rank, did any rank starve,
and how long did a decision take at each world size.

Run: ``python -m bench.scale_report RUN_DIR [RUN_DIR ...]`` on job directories of the suite (e.g.
``runs/suite/scale-functional/cnn-scale/*/model_s0`` after ``python -m bench.suite --config
scale-functional``). Reads each job's ``decisions.csv`` (rank 0's decisions and their ``overhead_s``:
gather, decide and broadcast, as every rank waits for it) and ``steps_rank*.csv`` (what each rank
ran). Per job it prints a row; it exits 1 if a check fails:

* every rank recorded the same steps, and at every step the ranks' local batches sum to the global
  batch each of them recorded (a rank that missed a decision would run the old size);
* every decision's sizes were run by the ranks at some later step (sizes at an epoch's last, partial
  step aside);
* no rank starved: every rank trained on at least one sample in every step.

One micro-batch per step is assumed (``max_passes=1``, the default): with accumulation a recorded step
is a micro-batch and the global batch counts every micro-batch of the optimizer step.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def check(run: Path) -> tuple[dict, list[str]]:
    decisions = list(csv.DictReader((run / "decisions.csv").open()))
    per_rank = {int(p.stem.removeprefix("steps_rank")): list(csv.DictReader(p.open()))
                for p in run.glob("steps_rank*.csv")}
    world = len(per_rank)
    problems: list[str] = [] if per_rank else ["no per-rank step records (steps_rank*.csv) in the job directory"]
    steps: dict[tuple[int, int], dict[int, tuple[int, int]]] = defaultdict(dict)
    for rank, rows in per_rank.items():
        for r in rows:
            steps[(int(r["epoch"]), int(r["step"]))][rank] = (int(r["local_batch"]), int(r["global_batch"]))
    counts = sorted({len(rows) for rows in per_rank.values()})
    if len(counts) > 1:
        problems.append(f"ranks recorded different numbers of steps: {counts}")
    ran: list[list[int]] = []
    for key in sorted(steps):
        seen = steps[key]
        if len(seen) != world:
            problems.append(f"step {key}: only ranks {sorted(seen)} recorded it")
            continue
        sizes = [seen[r][0] for r in range(world)]
        if any(g != sum(sizes) for _, g in seen.values()):
            problems.append(f"step {key}: local batches {sizes} do not sum to the global batches "
                            f"{sorted({g for _, g in seen.values()})} the ranks recorded")
        if min(sizes) < 1:
            problems.append(f"step {key}: a rank trained on no sample ({sizes})")
        ran.append(sizes)
    distinct = {tuple(s) for s in ran}
    unrun = [d["decision"] for d in decisions[:-1] if tuple(json.loads(d["sizes"])) not in distinct]
    if unrun:
        problems.append(f"decisions {unrun} were never run by the ranks")
    latency = [float(d["overhead_s"]) for d in decisions if d.get("overhead_s")]
    slow_share = [s[-1] / sum(s) for s in ran]
    row = {"run": str(run), "ranks": world, "decisions": len(decisions), "steps": counts[0] if counts else 0,
           "latency_median_s": statistics.median(latency) if latency else float("nan"),
           "latency_max_s": max(latency) if latency else float("nan"),
           "smallest_local_batch": min(min(s) for s in ran) if ran else 0,
           "last_rank_share_median": statistics.median(slow_share) if slow_share else float("nan")}
    return row, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="job directories (with decisions.csv and steps_rank*.csv)")
    args = ap.parse_args(argv)
    print("| ranks | decisions | steps per rank | decision latency s: median / max | smallest local batch "
          "| last rank's share of B (median) | checks |")
    print("|---|---|---|---|---|---|---|")
    failed = False
    for run in map(Path, args.runs):
        row, problems = check(run)
        failed |= bool(problems)
        print(f"| {row['ranks']} | {row['decisions']} | {row['steps']} | {row['latency_median_s']:.4f} / "
              f"{row['latency_max_s']:.4f} | {row['smallest_local_batch']} | {row['last_rank_share_median']:.3f} "
              f"| {'passed' if not problems else '; '.join(problems[:3])} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
