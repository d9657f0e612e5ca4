"""Balance and decision cost of a suite run, from its job directories (the balance and decision-cost goals).

Run: ``python -m bench.suite_balance NAME`` (NAME: a configuration already run with ``bench.suite``,
whose job directories are under ``runs/suite/NAME``). Per adaptive job (one with decisions.csv):

* decisions, their summed ``overhead_s`` (gather + decide + broadcast, as each decision records it)
  and that sum's share of the job's training time (``suite_result.json`` ``train_s``);
* balance: per-rank compute time summed over windows of ``--window`` steps (after the first
  ``--skip`` steps, i.e. the first decisions), the fastest rank's over the slowest's; the median and
  worst window, and the share of windows under 0.9 (the "no starvation" goal);
* time to the first `--samples` training samples (rank 0's ``t_s`` in ``suite_steps.csv`` at the first
  step whose cumulative global batch reaches it; evaluations excluded): the early phase, before and
  during the first decisions, where a job that trains the same samples in the same order (same B)
  gains or loses against plain Horovod independently of evaluation noise.

Static jobs get the balance columns too (the reference: what a fixed split gives).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def balance(job: Path, window: int, skip: int) -> tuple[float, float, float] | None:
    ranks = sorted(job.glob("steps_rank*.csv"))
    if len(ranks) < 2:
        return None
    columns = [[float(r["compute_s"]) for r in csv.DictReader(p.open())] for p in ranks]
    steps = list(zip(*columns))[skip:]
    ratios = []
    for k in range(0, len(steps) - window + 1, window):
        totals = [sum(col) for col in zip(*steps[k:k + window])]
        if max(totals) > 0:
            ratios.append(min(totals) / max(totals))
    if not ratios:
        return None
    return statistics.median(ratios), min(ratios), sum(r < 0.9 for r in ratios) / len(ratios)


def time_to_samples(job: Path, samples: int) -> float | None:
    path = job / "suite_steps.csv"
    if not path.exists():
        return None
    seen = 0
    for row in csv.DictReader(path.open()):
        if row["rank"] == "0":
            seen += int(row["global_batch"])
            if seen >= samples:
                return float(row["t_s"])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="suite configuration whose job directories to read")
    ap.add_argument("--runs", default=str(REPO / "runs" / "suite"), help="root of the job directories")
    ap.add_argument("--window", type=int, default=50, help="steps per balance window (default 50)")
    ap.add_argument("--skip", type=int, default=25, help="first steps left out (default 25)")
    ap.add_argument("--samples", type=int, default=8000, help="samples of the early-phase time (default 8000)")
    args = ap.parse_args(argv)
    root = Path(args.runs, args.name)
    jobs = sorted(p.parent for p in root.glob("*/*/*/suite_result.json"))
    if not jobs:
        ap.error(f"no job directories under {root}: run `python -m bench.suite --config {args.name}` first")
    print(f"{'job':<40}{'decisions':>10}{'decide s':>10}{'% train':>9}{'balance med':>13}{'worst':>8}{'<0.9':>7}{'t@' + str(args.samples):>9}")
    for job in jobs:
        train_s = json.loads((job / "suite_result.json").read_text())["train_s"]
        name = "/".join(job.parts[-3:])
        dec = job / "decisions.csv"
        if dec.exists():
            rows = list(csv.DictReader(dec.open()))
            spent = sum(float(r.get("overhead_s") or 0) + float(r.get("learn_s") or 0) for r in rows)
            cost = f"{len(rows):>10}{spent:>10.2f}{100 * spent / train_s:>8.2f}%"
        else:
            cost = f"{'':>10}{'':>10}{'':>9}"
        b = balance(job, args.window, args.skip)
        bal = f"{b[0]:>13.3f}{b[1]:>8.3f}{100 * b[2]:>6.0f}%" if b else f"{'(no per-rank steps)':>28}"
        t = time_to_samples(job, args.samples)
        print(f"{name:<40}{cost}{bal}{'-' if t is None else f'{t:.2f}':>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
