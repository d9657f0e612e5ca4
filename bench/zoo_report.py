"""Tables of a workload-zoo suite run (`python -m bench.suite --config zoo-...`): ratios to plain Horovod,
each beside the attainable limit measured in the same run.

    python -m bench.zoo_report bench/results/zoo-headline      # writes zoo.md there and prints it

Definitions (training seconds, evaluation excluded, as in `bench.suite_report`):

* time to target: the first evaluation at which the median of the last three evaluations is past the
  job's target (one lucky evaluation cannot decide it); a run that never gets there counts with its
  whole training time and is marked ``miss``;
* budget time: training seconds for the job's whole epoch budget; first epoch: training seconds to
  the end of epoch 0 (the start-up tax is there);
* measured speeds: each rank's median forward+backward seconds per sample in the plain Horovod run of
  the same condition and seed (its slowdown included);
* attainable limit of a condition: the plain no-straggler run's time of the same seed x R / sum of
  the ranks' relative speeds (the balanced split's throughput on this machine), over the plain run's
  time under the condition; 1.00 without a straggler;
* every ratio is the median over seeds of per-seed paired ratios, with the interquartile range.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

PLAIN = "plain-horovod"


def smoothed_time(evals: pd.DataFrame, target: float, higher: bool, window: int = 3) -> float:
    """Training seconds at the first evaluation where the median of the last `window` is past target."""
    once = evals.drop_duplicates("samples", keep="last").reset_index(drop=True)
    med = once.value.rolling(window, min_periods=window).median()
    ok = med >= target if higher else med <= target
    hit = once.train_s[ok]
    return float(hit.iloc[0]) if len(hit) else math.inf


def job_numbers(run_dir: Path) -> dict[str, float]:
    res = json.loads((run_dir / "suite_result.json").read_text())
    evals = pd.read_csv(run_dir / "suite_evals.csv")
    steps = pd.read_csv(run_dir / "suite_steps.csv")
    higher = res.get("metric", "accuracy") == "accuracy"
    ttt = smoothed_time(evals, float(res["target"]), higher)
    first = steps[steps.epoch == 0].groupby("rank").t_s.max().max() if (steps.epoch == 0).any() else math.nan
    per_sample = (steps.compute_s / steps.local_batch.clip(lower=1)).groupby(steps["rank"]).median()
    return {"ttt_s": ttt if math.isfinite(ttt) else float(res["train_s"]), "miss": not math.isfinite(ttt),
            "budget_s": float(res["train_s"]), "first_epoch_s": float(first),
            "final": float(res["final"]), "speeds": (per_sample.min() / per_sample).tolist()}


def collect(results: Path) -> pd.DataFrame:
    runs = pd.read_csv(results / "runs.csv")
    rows = []
    for r in runs[runs.status == "ok"].to_dict("records"):
        try:
            rows.append({**{k: r[k] for k in ("workload", "condition", "arm", "seed")}, **job_numbers(Path(r["run_dir"]))})
        except (OSError, KeyError, ValueError) as exc:
            print(f"skipping {r['run_dir']}: {exc!r}", file=sys.stderr)
    return pd.DataFrame(rows)


def _med_iqr(values: pd.Series) -> str:
    v = values.dropna()
    if v.empty:
        return "-"
    return f"{v.median():.2f} [{v.quantile(0.75) - v.quantile(0.25):.2f}]"


def headline(jobs: pd.DataFrame) -> str:
    """Per job and condition: limit, each arm's time to target and budget time over plain Horovod's."""
    lines = ["| job | condition | limit | arm | time to target / plain [IQR] | / limit | budget time / plain "
             "| first epoch s | final (plain) | misses |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (w, c), cell in jobs.groupby(["workload", "condition"], sort=False):
        plain = cell[cell.arm == PLAIN].set_index("seed")
        none = jobs[(jobs.workload == w) & (jobs.condition == "none") & (jobs.arm == PLAIN)].set_index("seed")
        if plain.empty:
            continue
        limit = pd.Series({s: (none.budget_s.get(s, math.nan) * len(p.speeds) / sum(p.speeds)) / p.budget_s
                           if c != "none" else 1.0 for s, p in plain.iterrows()})
        for arm, g in cell.groupby("arm", sort=False):
            g = g.set_index("seed")
            ratio = (g.ttt_s / plain.ttt_s).dropna()
            budget = (g.budget_s / plain.budget_s).dropna()
            lines.append(f"| {w.removeprefix('zoo:')} | {c} | {limit.median():.2f} | {arm} | {_med_iqr(ratio)} | "
                         f"{(ratio / limit.reindex(ratio.index)).median():.2f} | {_med_iqr(budget)} | "
                         f"{g.first_epoch_s.median():.2f} | {g.final.median():.4f} ({plain.final.median():.4f}) | "
                         f"{int(g.miss.sum())}/{len(g)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a suite results directory (bench/results/NAME)")
    args = ap.parse_args(argv)
    results = Path(args.results)
    jobs = collect(results)
    if jobs.empty:
        print(f"no finished jobs in {results / 'runs.csv'}")
        return 1
    machine = json.loads((results / "machine.json").read_text()) if (results / "machine.json").exists() else {}
    text = (f"# {results.name}\n\n`{machine.get('command', '?')}`; {machine.get('date', '?')}; {machine.get('cpu', '?')}, "
            f"{machine.get('cores', '?')} cores; commit {str(machine.get('git_commit', '?'))[:12]}\n\n"
            + headline(jobs) + "\n")
    (results / "zoo.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
