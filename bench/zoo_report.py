"""Tables of a workload-zoo suite run (`python -m bench.suite --config zoo-...`): ratios to plain Horovod,
each beside the attainable limit measured in the same run.

    python -m bench.zoo_report bench/results/zoo-headline      # writes zoo.md there and prints it

Definitions (training seconds, evaluation excluded, as in `bench.suite_report`):

* time to target: the first evaluation at which the median of the last three evaluations is past the
  job's target (one lucky evaluation cannot decide it); a run that never gets there counts with its
  whole training time and is marked ``miss``;
* budget time: training seconds for the job's whole epoch budget; first epoch: training seconds to
  the end of epoch 0 (the start-up tax is there), and beside it, in parentheses, how much longer it took
  than the run's median later epoch (the tax in the run's own units: run-to-run speed drift cancels);
* measured speeds: each rank's median forward+backward seconds per sample in the plain Horovod run of
  the same condition and seed (its slowdown included);
* attainable limit of a condition: the plain Horovod run under the condition, its steps re-timed as
  if split so that every rank arrives together (`bench.suite_report.balanced_fraction`: per window
  of 25 steps, the global batch over the sum of the ranks' speeds measured there, slowdown included,
  plus the rest of the step as measured), over their measured time: the steps up to its time to
  target for the time-to-target ratio, all of them for the budget ratio; 1.00 without a straggler.
  It assumes compute in proportion to samples (a fixed per-step cost on the slow rank makes it
  unreachable, on a fast one easy), ranks computing side by side as fast as in the plain run, and
  plain's global batch (an arm that grows B can pass it); under a slowdown that changes with the
  clock, a faster run spends more of its steps in the slow phase, so there it is strict. In
  parentheses, the two-run limit: the plain no-straggler run (same links) of the same seed, its
  forward+backward seconds scaled by R / sum of the ranks' relative speeds, over the plain run's
  time under the condition; it mixes two runs, so the machine's speed drifting between them (compute
  per sample moved by up to 40% within an hour on this VM) moves it;
* final at equal progress: the metric at the first evaluation at which the arm's training progress
  (base-batch epochs: AdaScale's scale-invariant epochs under dynamix_hvd, epochs under plain Horovod)
  reached plain Horovod's at its end (the arm's last evaluation where it never did);
* spread: the range (max - min) of the last three evaluations, the arm's median over seeds beside
  plain Horovod's (a stability measure: a batch too large for its learning rate swings);
* at plain's machine speed (rows without a straggler): the budget ratio with each run's time scaled
  by plain Horovod's forward+backward seconds per sample over its own, both over the steps at the
  job's batch (identical work), so that the machine's speed drifting between runs (up to 20% here)
  cancels; it assumes the whole step slows with the compute, and it hides a slowdown of the compute
  itself (the helper threads' CPU time, recorded per run, says whether there could be one);
* every ratio is the median over seeds of per-seed paired ratios, with the interquartile range.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from bench.suite_report import balanced_fraction
from dynamix_hvd.control.proposal import ProposalConfig

PLAIN = "plain-horovod"


def smoothed_time(evals: pd.DataFrame, target: float, higher: bool, window: int = 3) -> float:
    """Training seconds at the first evaluation where the median of the last `window` is past target."""
    once = evals.drop_duplicates("samples", keep="last").reset_index(drop=True)
    med = once.value.rolling(window, min_periods=window).median()
    ok = med >= target if higher else med <= target
    hit = once.train_s[ok]
    return float(hit.iloc[0]) if len(hit) else math.inf


def eval_numbers(evals: pd.DataFrame, target: float, higher: bool, train_s: float) -> dict[str, Any]:
    """What a run's evaluations give: (progress, metric) pairs, the spread of the last three, the time
    to target (the whole training time where it was missed)."""
    once = evals.drop_duplicates("samples", keep="last")
    ttt = smoothed_time(evals, target, higher)
    progress = once.progress.tolist() if "progress" in once else [math.nan] * len(once)
    return {"evals": list(zip(progress, once.value.tolist())),
            "spread": float(once.value.tail(3).max() - once.value.tail(3).min()) if len(once) else math.nan,
            "ttt_s": ttt if math.isfinite(ttt) else train_s, "miss": not math.isfinite(ttt)}


def job_numbers(run_dir: Path, target: float | None = None) -> dict[str, Any]:
    res = json.loads((run_dir / "suite_result.json").read_text())
    target = float(res["target"]) if target is None else target
    steps = pd.read_csv(run_dir / "suite_steps.csv")
    ends = steps.groupby("epoch").t_s.max().sort_index()  # each epoch's end, the last rank's
    first = float(ends.iloc[0]) if 0 in ends.index else math.nan
    later = ends.diff().iloc[1:]
    # the start-up tax in this run's own units: the first epoch over a steady one of the same run
    # (the machine's speed drifts between runs by more than the tax, so a raw first epoch hides it)
    excess = first - float(later.median()) if len(later) and math.isfinite(first) else math.nan
    per_sample = (steps.compute_s / steps.local_batch.clip(lower=1)).groupby(steps["rank"]).median()
    # the machine's speed in this run: forward+backward seconds per sample over the steps run at the
    # job's own batch (the first step's), identical work in every arm
    own = steps[steps.local_batch == steps.sort_values("step").local_batch.iloc[0]] if len(steps) else steps
    speed = float((own.compute_s / own.local_batch.clip(lower=1)).median()) if len(own) else math.nan
    evals = eval_numbers(pd.read_csv(run_dir / "suite_evals.csv"), target, res.get("metric", "accuracy") == "accuracy",
                         float(res["train_s"]))
    return {**evals,
            "budget_s": float(res["train_s"]), "first_epoch_s": first, "first_excess_s": excess,
            "compute_per_sample_s": speed,
            "final": float(res["final"]), "speeds": (per_sample.min() / per_sample).tolist(),
            "compute_s": float(steps.groupby("rank").compute_s.sum().median()),
            "balanced_fraction": balanced_fraction(steps),
            "balanced_to_target": balanced_fraction(steps, until_s=evals["ttt_s"])}


def numbers_from_results(run: dict[str, Any], evals: pd.DataFrame, target: float | None = None) -> dict[str, Any]:
    """`job_numbers` from the results folder alone (its runs.csv row and evals.csv), for a run whose
    run folder is gone: no per-step records, so no first-epoch time and no measured speeds; a
    straggler row's limit is runs.csv's whole-run `balanced_fraction` where it has one (unknown
    otherwise)."""
    from bench.suite import WORKLOADS
    from bench.zoo import JOBS

    job = JOBS[str(run["workload"]).removeprefix("zoo:").split(":")[0]]  # zoo:JOB, zoo:JOB:long or zoo:JOB:xK
    if target is None:  # the workload's own target (a longer variant's may differ from the job's)
        target = WORKLOADS[run["workload"]].target if run["workload"] in WORKLOADS else job.target
    mine = evals[(evals.workload == run["workload"]) & (evals.condition == run["condition"])
                 & (evals.arm == run["arm"]) & (evals.seed == run["seed"])]
    return {**eval_numbers(mine, target, job.higher_is_better, float(run["train_s"])),
            "budget_s": float(run["train_s"]), "first_epoch_s": math.nan, "first_excess_s": math.nan,
            "compute_per_sample_s": math.nan,
            "final": float(run["final"]),
            "speeds": [], "compute_s": math.nan,
            "balanced_fraction": float(run.get("balanced_fraction", math.nan)),
            "balanced_to_target": float(run.get("balanced_fraction", math.nan))}


def collect(results: Path, targets: dict[str, float] | None = None) -> pd.DataFrame:
    """One row per finished job; `targets` replaces the target of the workloads it names."""
    targets = targets or {}
    runs = pd.read_csv(results / "runs.csv")
    evals = pd.read_csv(results / "evals.csv") if (results / "evals.csv").exists() else None
    rows = []
    for r in runs[runs.status == "ok"].to_dict("records"):
        key = {k: r[k] for k in ("workload", "condition", "arm", "seed")}
        run_dir = Path(r["run_dir"])
        try:
            if _same_run(run_dir, r) or evals is None:
                rows.append({**key, **job_numbers(run_dir, targets.get(r["workload"]))})
            else:
                rows.append({**key, **numbers_from_results(r, evals, targets.get(r["workload"]))})
        except (OSError, KeyError, ValueError) as exc:
            print(f"skipping {run_dir}: {exc!r}", file=sys.stderr)
    return pd.DataFrame(rows)


def _same_run(run_dir: Path, row: dict[str, Any]) -> bool:
    """Whether `run_dir` still holds the run of this runs.csv row: a later run of the same configuration
    writes to the same folder, so a results directory kept under another name must not read it."""
    try:
        res = json.loads((run_dir / "suite_result.json").read_text())
    except (OSError, ValueError):
        return False
    return math.isclose(float(res.get("train_s", math.nan)), float(row["train_s"]), rel_tol=1e-9)


def _limit_from_none(none: pd.DataFrame, seed: int, plain: pd.Series) -> float:
    """The balanced split's time over plain Horovod's under a condition, from two runs: the plain no-straggler run of
    the same seed with its forward+backward time scaled by R / sum of the measured relative speeds
    (communication and the rest unchanged)."""
    if seed not in none.index or not plain.speeds:
        return math.nan
    T0, C0 = float(none.budget_s[seed]), float(none.compute_s[seed])
    return ((T0 - C0) + C0 * len(plain.speeds) / sum(plain.speeds)) / float(plain.budget_s)


def reference_condition(name: str) -> str:
    """The condition with the same links and no straggler (whose plain run gives the limit). A
    condition `bench.suite` does not define (bench/results/archive.tar.xz has such rows) is read by
    its name: a straggler on links is named LINKS-slow... (``net10-slow3x``: ``net10``); any other
    name that names a slowdown, stalls or interference has the links of "none"; the rest are their
    own reference (no straggler)."""
    from bench.suite import CONDITIONS

    c = CONDITIONS.get(name)
    if c is None:
        if "-slow" in name:
            return name.split("-slow")[0]
        return "none" if name.startswith(("slow", "stalls", "interference")) else name
    for other in CONDITIONS.values():
        if (other.slow_rank < 0 and other.ranks == c.ranks and other.rate_mbit == c.rate_mbit
                and other.rate_schedule == c.rate_schedule and other.delay_ms == c.delay_ms):
            return other.name
    return "none"


def at_progress(evals: list[tuple[float, float]], progress: float) -> float:
    """The metric at the first evaluation at or past `progress` (the last one if none is)."""
    for p, value in evals:
        if math.isfinite(p) and p >= progress - 1e-9:
            return value
    return evals[-1][1] if evals else math.nan


def _med_iqr(values: pd.Series) -> tuple[float, float]:
    """Median and interquartile range (NaN, NaN where there is no value)."""
    v = values.dropna()
    if v.empty:
        return math.nan, math.nan
    return float(v.median()), float(v.quantile(0.75) - v.quantile(0.25))


def _fmt(median: float, iqr: float) -> str:
    return "-" if math.isnan(median) else f"{median:.2f} [{iqr:.2f}]"


def _num(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def figures(jobs: pd.DataFrame) -> pd.DataFrame:
    """One row per job, condition and arm: the limits, each ratio to plain Horovod (median and IQR of
    per-seed ratios) and the metrics, as `headline` prints them."""
    rows = []
    for (w, c), cell in jobs.groupby(["workload", "condition"], sort=False):
        plain = cell[cell.arm == PLAIN].set_index("seed")
        ref = reference_condition(c)
        none = jobs[(jobs.workload == w) & (jobs.condition == ref) & (jobs.arm == PLAIN)].set_index("seed")
        if plain.empty:
            continue
        def per_seed(limit_of) -> pd.Series:  # 1.00 on the rows without a straggler
            return pd.Series({s: float(limit_of(s, p)) if ref != c else 1.0 for s, p in plain.iterrows()})
        # to target: the plain run's steps up to its time to target; budget: all of them
        limit = per_seed(lambda s, p: p.balanced_to_target)
        limit_budget = per_seed(lambda s, p: p.balanced_fraction)
        limit_none = per_seed(lambda s, p: _limit_from_none(none, s, p))
        end = {s: max((p for p, _ in e if math.isfinite(p)), default=math.nan) for s, e in plain.evals.items()}
        for arm, g in cell.groupby("arm", sort=False):
            g = g.set_index("seed")
            ratio = (g.ttt_s / plain.ttt_s).dropna()
            budget = (g.budget_s / plain.budget_s).dropna()
            # without a straggler: the budget ratio with the run's time rescaled by the machine speed
            # its own steps at the job's batch measured against plain Horovod's (identical work)
            adjusted = (budget * plain.compute_per_sample_s / g.compute_per_sample_s).dropna() if ref == c else None
            equal = pd.Series([at_progress(e, end.get(s, math.nan)) for s, e in g.evals.items()], dtype=float)
            (r, r_iqr), (b, b_iqr) = _med_iqr(ratio), _med_iqr(budget)
            a, a_iqr = _med_iqr(adjusted) if adjusted is not None else (math.nan, math.nan)
            rows.append({"workload": w, "condition": c, "arm": arm, "straggler": ref != c,
                         "limit": limit.median(), "limit_two_run": limit_none.median(),
                         "ratio": r, "ratio_iqr": r_iqr, "ratio_to_limit": (ratio / limit.reindex(ratio.index)).median(),
                         "budget": b, "budget_iqr": b_iqr,
                         "budget_to_limit": (budget / limit_budget.reindex(budget.index)).median(),
                         "at_plain_speed": a, "at_plain_speed_iqr": a_iqr,
                         "first_epoch_s": g.first_epoch_s.median(), "first_excess_s": g.first_excess_s.median(),
                         "final": g.final.median(), "final_plain": plain.final.median(), "final_equal": equal.median(),
                         "spread": g.spread.median(), "spread_plain": plain.spread.median(),
                         "misses": int(g.miss.sum()), "runs": len(g)})
    return pd.DataFrame(rows)


def headline(jobs: pd.DataFrame, fig: pd.DataFrame | None = None) -> str:
    """Per job and condition: limit, each arm's time to target and budget time over plain Horovod's
    (`fig`: `figures(jobs)` where already computed)."""
    lines = ["| job | condition | limit (two-run limit) | arm | time to target / plain [IQR] | / limit | budget time / plain "
             "| / its limit | at plain's machine speed | first epoch s (over a later one) | final (plain) | final at equal progress "
             "| spread of last 3 (plain) | misses |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in (figures(jobs) if fig is None else fig).itertuples():
        adjusted = "-" if f.straggler else _fmt(f.at_plain_speed, f.at_plain_speed_iqr)
        lines.append(f"| {f.workload.removeprefix('zoo:')} | {f.condition} | {f.limit:.2f} ({f.limit_two_run:.2f}) | {f.arm} | "
                     f"{_fmt(f.ratio, f.ratio_iqr)} | {f.ratio_to_limit:.2f} | {_fmt(f.budget, f.budget_iqr)} | "
                     f"{f.budget_to_limit:.2f} | {adjusted} | "
                     f"{f.first_epoch_s:.2f} ({f.first_excess_s:+.2f}) | {f.final:.4f} ({f.final_plain:.4f}) | "
                     f"{f.final_equal:.4f} | {f.spread:.4f} ({f.spread_plain:.4f}) | {f.misses}/{f.runs} |")
    return "\n".join(lines)


def in_short(jobs: pd.DataFrame, arm: str = "model", split: str = "split-speed",
             fig: pd.DataFrame | None = None) -> str:
    """One row per job: `arm`'s time to target over plain Horovod's under each condition (median of
    per-seed ratios), with the fixed split's in parentheses and, with a straggler, the ratio to the
    limit; without one, also the budget time's ratio at plain's machine speed. Empty where `arm` did
    not run. `fig`: `figures(jobs)` where already computed."""
    fig = figures(jobs) if fig is None else fig
    if fig.empty or not (fig.arm == arm).any():
        return ""
    conditions = list(dict.fromkeys(fig.condition))
    lines = ["| job | " + " | ".join(conditions) + " |", "|---|" + "---|" * len(conditions)]
    for w, rows in fig.groupby("workload", sort=False):
        cells = []
        for c in conditions:
            mine = rows[(rows.condition == c) & (rows.arm == arm)]
            if mine.empty:
                cells.append("-")
                continue
            f = mine.iloc[0]
            other = rows[(rows.condition == c) & (rows.arm == split)]
            text = _num(f.ratio)
            if not other.empty:
                text += f" ({_num(other.iloc[0].ratio)})"
            if f.straggler:
                text += f", {_num(f.ratio_to_limit)} of the limit"
            elif not math.isnan(f.at_plain_speed):
                text += f"; budget time at plain's speed {_num(f.at_plain_speed)}"
            cells.append(text)
        lines.append(f"| {w.removeprefix('zoo:')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_steps(row: dict[str, Any]) -> pd.DataFrame | None:
    """The per-step records of a runs.csv row's run, None where its folder no longer holds that run."""
    run_dir = Path(row["run_dir"])
    if not (run_dir / "suite_steps.csv").exists() or not _same_run(run_dir, row):
        return None
    return pd.read_csv(run_dir / "suite_steps.csv")


def balance(results: Path) -> str:
    """Per job, condition and arm: how far each run's own splits were from balanced, the time its steps
    would take at the split that makes every rank arrive together over the time they took
    (`bench.suite_report.balanced_fraction` read on the run itself; 1: balanced all along), per seed
    and their median. Less noisy than time to target: the machine's speed cancels within the run."""
    from bench.suite_report import balanced_fraction

    runs = pd.read_csv(results / "runs.csv")
    per: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for r in runs[runs.status == "ok"].to_dict("records"):
        steps = run_steps(r)
        if steps is not None:
            key = (str(r["workload"]).removeprefix("zoo:"), r["condition"], r["arm"])
            per.setdefault(key, []).append((int(r["seed"]), balanced_fraction(steps)))
    lines = ["| job | condition | arm | balanced / taken, per seed | median |", "|---|---|---|---|---|"]
    for (w, c, arm), values in per.items():
        values.sort()
        lines.append(f"| {w} | {c} | {arm} | {', '.join(f's{s} {v:.3f}' for s, v in values)} | "
                     f"{float(np.median([v for _, v in values])):.3f} |")
    return "\n".join(lines)


def rank_steps(results: Path) -> str:
    """Per run (its folder still on disk, holding that run): each rank's median samples and forward+backward ms per
    step after the first epoch, the median step, and the median rest of a step (the step minus the
    slower rank's compute in the same step: data, the allreduce's wait, the optimizer)."""
    runs = pd.read_csv(results / "runs.csv")
    lines = ["| job | condition | arm | seed | per rank: samples, forward+backward ms | step ms | rest ms |",
             "|---|---|---|---|---|---|---|"]
    for r in runs[runs.status == "ok"].to_dict("records"):
        steps = run_steps(r)
        if steps is None:
            continue
        steps = steps[steps.epoch >= 1] if (steps.epoch >= 1).any() else steps
        ranks = steps.groupby("rank").agg(b=("local_batch", "median"), c=("compute_s", "median"))
        by_step = steps.groupby(["epoch", "step"]).agg(step=("step_s", "max"), c=("compute_s", "max"))
        per_rank = ", ".join(f"{v.b:.0f} in {1e3 * v.c:.2f}" for _, v in ranks.iterrows())
        lines.append(f"| {str(r['workload']).removeprefix('zoo:')} | {r['condition']} | {r['arm']} | {r['seed']} | "
                     f"{per_rank} | {1e3 * by_step.step.median():.2f} | {1e3 * (by_step.step - by_step.c).median():.2f} |")
    return "\n".join(lines)


def critical_batch(results: Path) -> str:
    """Per job: samples to target E(B) of static runs at several global batches B (AdaScale LR), the
    critical batch from E(B) = E_min (1 + B / B_crit) (McCandlish et al.: a line in B, B_crit =
    intercept / slope), against the controller's noise-scale estimate over the same runs (median of
    its decisions in the first half of each run, before the target: the point estimate and the lower
    bound). With several seeds, the line through every seed's points, each seed's own B_crit beside
    it (inf: E(B) did not rise with B, nan: under two batches reached the target), and the
    estimate's error against the pooled B_crit."""
    import numpy as np

    def fitted(points: list[tuple[int, float]]) -> float:
        if len({B for B, _ in points}) < 2:
            return math.nan
        slope, intercept = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
        return intercept / slope if slope > 0 else math.inf

    runs = pd.read_csv(results / "runs.csv")
    lines = ["| job | seeds | B: samples to target (median over seeds) | measured B_crit: pooled (per seed) "
             "| noise scale (point) | lower bound | estimate / measured |",
             "|---|---|---|---|---|---|---|"]
    statics = runs[(runs.status == "ok") & runs.arm.astype(str).str.startswith("static-")]
    for w, g in statics.groupby("workload", sort=False):
        points: dict[int, list[tuple[int, float]]] = {}
        noise, lower = [], []
        for r in g.to_dict("records"):
            run_dir = Path(r["run_dir"])
            if not _same_run(run_dir, r):
                continue
            res = json.loads((run_dir / "suite_result.json").read_text())
            evals = pd.read_csv(run_dir / "suite_evals.csv").drop_duplicates("samples", keep="last")
            t = smoothed_time(evals, float(res["target"]), res.get("metric", "accuracy") == "accuracy")
            B = int(str(r["arm"]).split("-")[-1]) * 2
            if math.isfinite(t):
                points.setdefault(int(r["seed"]), []).append((B, float(evals[evals.train_s <= t].samples.max())))
            decisions = run_dir / "decisions.csv"
            if decisions.exists():
                d = pd.read_csv(decisions)
                n = max(1, len(d) // 2)  # the first half of the run: before the target
                noise += d.noise_point.head(n).dropna().tolist()
                lower += d.noise_lower.head(n).dropna().tolist()
        pooled = [p for seed in sorted(points) for p in points[seed]]
        by_B: dict[int, list[float]] = {}
        for B, E in pooled:
            by_B.setdefault(B, []).append(E)
        pts = ", ".join(f"{B}: {np.median(E):.0f}" for B, E in sorted(by_B.items()))
        crit = fitted(pooled)
        per_seed = " (" + ", ".join(f"{fitted(points[s]):.0f}" for s in sorted(points)) + ")" if len(points) > 1 else ""
        est = float(np.median(noise)) if noise else math.nan
        low = float(np.median(lower)) if lower else math.nan
        err = est / crit if math.isfinite(crit) and crit > 0 else math.nan
        lines.append(f"| {w.removeprefix('zoo:')} | {len(points)} | {pts} | {crit:.0f}{per_seed} | {est:.0f} | "
                     f"{low:.0f} | x{err:.2f} |")
    return "\n".join(lines)


def first_gaps(results: Path) -> str:
    """Per condition, from the run folders still on disk: the decisions whose interval was the first at the
    neutral split to pass the split margin (``gap_intervals`` 1), their measured gap bounds, and how many
    the next decision's interval confirmed (``gap_intervals`` 2); what `ProposalConfig.recheck_gap` is
    set between. Also the decisions at 4 or more passing intervals running (where a margin raised by
    one failed split gives way), and the runs whose split check failed a split and whose raised margin
    gave way to a lasting gap. Empty when no run has its decisions."""
    runs = pd.read_csv(results / "runs.csv")
    found: dict[str, list[tuple[float, bool]]] = {}
    lasting: dict[str, list[int]] = {}  # per condition: decisions at 4+ intervals running, runs failed, runs lifted
    for r in runs[runs.status == "ok"].to_dict("records"):
        decisions = Path(r["run_dir"]) / "decisions.csv"
        if not decisions.exists() or not _same_run(decisions.parent, r):
            continue
        d = pd.read_csv(decisions)
        if "gap_intervals" not in d:
            continue
        # rows without a bound tested nothing (an interval waiting for more steps, a restored start)
        tested = d[pd.to_numeric(d["gap_bound"], errors="coerce").notna()]
        runs_of = tested["gap_intervals"].tolist()
        for k, (n, gap) in enumerate(zip(runs_of, tested["gap_bound"])):
            if n == 1:
                found.setdefault(str(r["condition"]), []).append((float(gap), k + 1 < len(runs_of) and runs_of[k + 1] == 2))
        checks = [ast.literal_eval(c) for c in d.get("split_check", pd.Series(dtype=object)).dropna()]  # a dict's repr
        lifted = d.get("margin_lifted", pd.Series(dtype=object)).astype(str).eq("True").any()
        counts = lasting.setdefault(str(r["condition"]), [0, 0, 0])
        counts[0] += int((d["gap_intervals"] >= 4).sum())
        counts[1] += any(c.get("failures", 0) > 0 for c in checks)
        counts[2] += bool(lifted)
    if not found:
        return ""
    threshold = ProposalConfig().recheck_gap
    lines = [f"| condition | first passing intervals | confirmed by the next | gap bounds (min-max) | at least {threshold:g} "
             "| decisions at 4+ running | runs with a failed split | runs whose raised margin gave way |",
             "|---|---|---|---|---|---|---|---|"]
    for cond, items in found.items():
        gaps = [g for g, _ in items]
        at4, failed, lifted = lasting[cond]
        lines.append(f"| {cond} | {len(items)} | {sum(c for _, c in items)} | {min(gaps):.3f}-{max(gaps):.3f} "
                     f"| {sum(g >= threshold for g in gaps)} | {at4} | {failed} | {lifted} |")
    return "\n".join(lines)


def equal_rank_splits(results: Path) -> str:
    """Per job and arm under conditions without a straggler (run folders still on disk, holding those runs): the
    controller's decisions, how many put a rank more than one sample off the mean (an uneven split
    between equal ranks; one sample off is rounding), and where: decision number, sizes and the
    recorded intervals of measured gap that led to it. Empty when no run has its decisions."""
    from bench.suite import CONDITIONS

    runs = pd.read_csv(results / "runs.csv")
    rows: dict[tuple[str, str], list[int]] = {}
    where: dict[tuple[str, str], list[str]] = {}
    for r in runs[runs.status == "ok"].to_dict("records"):
        cond = CONDITIONS.get(str(r["condition"]))
        decisions = Path(r["run_dir"]) / "decisions.csv"
        if cond is None or cond.slow_rank >= 0 or not decisions.exists() or not _same_run(decisions.parent, r):
            continue
        d = pd.read_csv(decisions)
        sizes = [json.loads(str(x)) for x in d["sizes"]]
        # every arm here starts equal: a rank more than one sample off the mean is a split, one off is rounding
        apart = [max(abs(x - sum(b) / len(b)) for x in b) for b in sizes]  # per decision
        off = [k for k, away in enumerate(apart) if away > 1]
        rounding = sum(1 for away in apart if 0 < away <= 1)
        key = (str(r["workload"]).removeprefix("zoo:"), str(r["arm"]))
        total = rows.setdefault(key, [0, 0, 0])
        total[0], total[1], total[2] = total[0] + len(sizes), total[1] + len(off), total[2] + rounding
        gaps = d["gap_intervals"] if "gap_intervals" in d else pd.Series([math.nan] * len(d))
        if off:
            k = off[0]
            evidence = "" if pd.isna(gaps.iloc[k]) else f" after {gaps.iloc[k]:g} interval(s)"
            where.setdefault(key, []).append(f"s{r['seed']} decision {k}: {sizes[k]}{evidence}")
    if not rows:
        return ""
    lines = ["| job | arm | decisions | uneven (a rank > 1 sample off the mean) | within one sample | where it first split |",
             "|---|---|---|---|---|---|"]
    for (w, arm), (n, off, rounding) in rows.items():
        lines.append(f"| {w} | {arm} | {n} | {off} | {rounding} | {'; '.join(where.get((w, arm), [])) or '-'} |")
    return "\n".join(lines)


def _decision_tables(results: Path):
    """(runs.csv row, its decisions.csv) of every finished run whose folder still holds it, in
    workload, condition, arm, seed order."""
    runs = pd.read_csv(results / "runs.csv")
    for r in runs[runs.status == "ok"].sort_values(["workload", "condition", "arm", "seed"]).to_dict("records"):
        decisions = Path(r["run_dir"]) / "decisions.csv"
        if decisions.exists() and _same_run(decisions.parent, r):
            yield r, pd.read_csv(decisions)


def batch_growth(results: Path) -> str:
    """Per run of an arm that decides (run folders still on disk, holding those runs): where its global
    batch first grew past the initial one (decision, epoch, from -> to), the goodput gain predicted
    there (its record's throughput is the interval before it, at the old B), the samples per second
    measured in the (up to) three intervals after it over the three up to it, the largest and the last B, and the epochs of the decisions where the late-growth
    rule held B (``growth_late``; in runs that predate that column, ``may_grow`` false after it was
    true, with no growth before); with the run's final metric. Empty when no run has its decisions."""
    lines = []
    for r, d in _decision_tables(results):
        if "global_batch" not in d or d.empty:
            continue
        B = d["global_batch"].tolist()
        grown = [k for k, b in enumerate(B) if b > B[0]]
        first = grown[0] if grown else None  # a record's sizes are those the decision chose
        if "growth_late" in d:
            held = d.index[d["growth_late"].astype(str).eq("True")].tolist()
        else:  # may_grow false after it was true (not the first decisions' wait), before any growth
            may = d["may_grow"].astype(str).eq("True").tolist()
            held = [k for k in range(len(d)) if not may[k] and any(may[:k]) and (first is None or k <= first)]
        if first is None:
            growth = "-"
        else:
            row = d.iloc[first]
            predicted = float(row["predicted_goodput"]) / float(row["goodput_now"])
            tput = d["throughput"].astype(float)
            measured = float(tput.iloc[first + 1:first + 4].median() / tput.iloc[max(first - 2, 0):first + 1].median())
            growth = (f"decision {first} (epoch {int(row['epoch'])}): {B[first - 1] if first else B[0]} -> {B[first]}, predicted "
                      f"{predicted:.2f}x goodput, measured {measured:.2f}x samples/s")
        epochs = ", ".join(str(int(e)) for e in d["epoch"].iloc[held]) or "-"
        lines.append(f"| {str(r['workload']).removeprefix('zoo:')} | {r['condition']} | {r['arm']} | {r['seed']} "
                     f"| {growth} | {max(B)} / {B[-1]} | {epochs} | {float(r['final']):.4f} |")
    if not lines:
        return ""
    return "\n".join(["| job | condition | arm | seed | first growth | largest / last B | epochs where the late "
                      "rule held B | final |", "|---|---|---|---|---|---|---|---|", *lines])


def change_votes(results: Path) -> str:
    """Per condition and job, over the runs of arms that decide (run folders still on disk): decisions,
    how many a change vote brought forward (``changed_by`` not empty) and how many of those changed
    the split. Without a slow rank every such vote is a false alarm."""
    rows: dict[tuple[str, str], list[int]] = {}
    for r, d in _decision_tables(results):
        if "changed_by" not in d or d.empty:
            continue
        voted = d["changed_by"].astype(str).str.strip().ne("[]") & d["changed_by"].notna()
        sizes = d["sizes"].astype(str).tolist()
        moved = sum(1 for k in d.index[voted] if k > 0 and sizes[k] != sizes[k - 1])
        n = rows.setdefault((str(r["condition"]), str(r["workload"]).removeprefix("zoo:")), [0, 0, 0, 0])
        n[0] += 1
        n[1] += len(d)
        n[2] += int(voted.sum())
        n[3] += moved
    if not rows:
        return ""
    lines = ["| condition | job | runs | decisions | brought forward by a change vote | of which moved the split |",
             "|---|---|---|---|---|---|"]
    for (cond, job), (k, total, voted, moved) in sorted(rows.items()):
        lines.append(f"| {cond} | {job} | {k} | {total} | {voted} | {moved} |")
    return "\n".join(lines)


def follow(results: Path, workload: str, condition: str, seed: int = 0) -> str:
    """One run of the default under a changing slowdown, decision by decision: when each change of the
    slow rank's speed came (seconds of training; the schedule's budget fractions located on the run's
    own steps) and the first decision after it, when it came, whether a change vote brought it and
    the sizes it set (needs the run folder)."""
    runs = pd.read_csv(results / "runs.csv")
    pick = runs[(runs.workload == workload) & (runs.condition == condition) & (runs.arm == "model")
                & (runs.seed == seed) & (runs.status == "ok")]
    if pick.empty:
        return f"no finished run of the default for {workload} / {condition} / seed {seed}"
    folder = Path(pick.iloc[0]["run_dir"])
    info = json.loads((folder / "suite_result.json").read_text())
    steps = pd.read_csv(folder / "suite_steps.csv")
    steps = steps[steps["rank"] == 0].reset_index(drop=True)
    done = steps["global_batch"].cumsum() / steps["global_batch"].sum()
    d = pd.read_csv(folder / "decisions.csv")
    at = [float(steps["t_s"].iloc[min(int(n), len(steps)) - 1]) for n in d["total_steps"]]
    lines = [f"{workload}, {condition}, seed {seed}: `{folder.name}`", "",
             "| change at | to | first decision after it | after | brought by a vote | sizes |", "|---|---|---|---|---|---|"]
    for frac, factor in _pairs(str(info.get("slow_schedule") or "")):
        k = int(np.argmax(done.to_numpy() >= frac)) if info.get("slow_clock") == "budget" else \
            int(np.argmax(steps["t_s"].to_numpy() >= frac))
        t = float(steps["t_s"].iloc[k])
        nxt = next((i for i, a in enumerate(at) if a > t), None)
        if nxt is None:
            lines.append(f"| {t:.2f} s | {factor:g}x | - | - | - | - |")
            continue
        moved = next((i for i in range(nxt, len(d)) if d["sizes"].iloc[i] != d["sizes"].iloc[max(i - 1, 0)]), nxt)
        voted = str(d["changed_by"].iloc[nxt]).strip() not in ("[]", "nan")
        lines.append(f"| {t:.2f} s | {factor:g}x | {at[nxt]:.2f} s (decision {nxt}) | {at[nxt] - t:.2f} s | "
                     f"{'yes' if voted else 'no'} | {d['sizes'].iloc[nxt]} (moved at decision {moved}, {at[moved]:.2f} s) |")
    return "\n".join(lines)


def _pairs(text: str) -> list[tuple[float, float]]:
    return sorted((float(a), float(b)) for a, b in (p.split(":") for p in text.split(",") if p.strip()))


def paired_arms(jobs: pd.DataFrame, a: str, b: str) -> str:
    """Per job and condition, arms `a` and `b` against plain Horovod run beside them: medians over
    seeds of the per-seed time-to-target and budget-time ratios, the finals' medians, and per seed
    a's final over b's (in points of the metric, positive where a ended better) and both arms'
    time-to-target ratios (the spread behind the medians)."""
    from bench.zoo import JOBS

    twice = jobs[jobs.duplicated(["workload", "condition", "arm", "seed"])]
    if len(twice):
        r = twice.iloc[0]
        raise ValueError(f"{r['workload']} {r['condition']} {r['arm']} seed {r['seed']} is in two of the results "
                         "folders: give folders that add different seeds")
    lines = []
    for (w, c), g in jobs.groupby(["workload", "condition"], sort=False):
        by = {arm: g[g.arm == arm].set_index("seed") for arm in ("plain-horovod", a, b)}
        seeds = sorted(set(by["plain-horovod"].index) & set(by[a].index) & set(by[b].index))
        if not seeds:
            continue
        higher = JOBS[str(w).removeprefix("zoo:").split(":")[0]].higher_is_better
        unit = 100.0 if higher else 1.0  # accuracy in points; a loss as it is

        def ratios(arm: str, col: str) -> list[float]:
            return [by[arm].at[s, col] / by["plain-horovod"].at[s, col] for s in seeds]

        def ratio(arm: str, col: str) -> float:
            return float(np.median(ratios(arm, col)))

        def final(arm: str) -> float:
            return float(np.median([by[arm].at[s, "final"] for s in seeds]))

        diff = [(by[a].at[s, "final"] - by[b].at[s, "final"]) * unit * (1 if higher else -1) for s in seeds]
        lines.append(f"| {str(w).removeprefix('zoo:')} | {c} | {len(seeds)} | {ratio(a, 'ttt_s'):.2f} / {ratio(b, 'ttt_s'):.2f} "
                     f"| {ratio(a, 'budget_s'):.2f} / {ratio(b, 'budget_s'):.2f} "
                     f"| {final('plain-horovod'):.4f} / {final(a):.4f} / {final(b):.4f} "
                     f"| {', '.join(f'{d:+.{2 if higher else 4}f}' for d in diff)} "
                     f"| {', '.join(f'{r:.2f}' for r in ratios(a, 'ttt_s'))}; {', '.join(f'{r:.2f}' for r in ratios(b, 'ttt_s'))} |")
    if not lines:
        return ""
    return "\n".join([f"| job | condition | seeds | time to target / plain: {a} / {b} | budget time / plain: {a} / {b} "
                      f"| final: plain / {a} / {b} | {a} - {b} final, per seed (accuracy in points; a loss as it is, lower counts +) "
                      f"| time to target / plain per seed: {a}; {b} |",
                      "|---|---|---|---|---|---|---|---|", *lines])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a suite results directory (bench/results/NAME)")
    ap.add_argument("--critical", action="store_true",
                    help="the critical-batch table of a zoo-critical run instead of the headline")
    ap.add_argument("--steps", action="store_true",
                    help="per run, each rank's samples and forward+backward time per step, the step and its rest "
                         "(needs the run folders) instead of the headline")
    ap.add_argument("--first-gaps", action="store_true",
                    help="per condition, the first intervals at the neutral split that passed the split margin, "
                         "their gap bounds and how many the next interval confirmed (needs the run folders)")
    ap.add_argument("--balance", action="store_true",
                    help="per run, its steps' time at the balanced split over the time they took (how closely "
                         "its splits followed the ranks' speeds; needs the run folders) instead of the headline")
    ap.add_argument("--growth", action="store_true",
                    help="per run of a deciding arm, where its global batch first grew (predicted and measured gain) "
                         "and where the late-growth rule held it (needs the run folders) instead of the headline")
    ap.add_argument("--votes", action="store_true",
                    help="per condition and job, the decisions a change vote brought forward and how many of them "
                         "moved the split (needs the run folders) instead of the headline")
    ap.add_argument("--follow", nargs=2, metavar=("WORKLOAD", "CONDITION"),
                    help="one run of the default under a changing slowdown (seed 0), each change of speed and the "
                         "first decision after it (needs the run folder) instead of the headline")
    ap.add_argument("--pair", nargs=2, metavar=("A", "B"),
                    help="arms A and B side by side against plain Horovod, per job and condition (time to "
                         "target, budget time, finals) instead of the headline; with --also, over several runs")
    ap.add_argument("--also", action="append", default=[], metavar="RESULTS",
                    help="with --pair: another results directory whose runs join RESULTS's (e.g. more seeds)")
    ap.add_argument("--target", action="append", default=[], metavar="WORKLOAD=VALUE",
                    help="time to target at VALUE instead of the workload's own target (repeatable), e.g. "
                         "zoo:lstm-rows:long=0.96 for a target reached late in a longer job")
    args = ap.parse_args(argv)
    targets = {}
    for item in args.target:
        name, _, value = item.partition("=")
        try:
            targets[name] = float(value)
        except ValueError:
            ap.error(f"--target {item!r}: give WORKLOAD=VALUE with a number, e.g. zoo:lstm-rows:long=0.96")
    results = Path(args.results)
    def paired() -> str:
        jobs = pd.concat([collect(Path(r), targets) for r in (results, *args.also)], ignore_index=True)
        return paired_arms(jobs, *args.pair)

    # each option: (its file, its title after the folder's name, the table)
    reports = {"critical": ("critical.md", "measured critical batch against the noise-scale estimate",
                            lambda: critical_batch(results)),
               "first_gaps": ("first_gaps.md", "first passing intervals of the speed-gap test",
                              lambda: first_gaps(results)),
               "balance": ("balance.md", "each run's steps at the balanced split over their time",
                           lambda: balance(results)),
               "growth": ("growth.md", "batch growth per run", lambda: batch_growth(results)),
               "follow": ("follow.md", "following a changing slowdown, decision by decision",
                          lambda: follow(results, *args.follow)),
               "votes": ("votes.md", "decisions brought forward by change votes", lambda: change_votes(results)),
               "pair": ("paired.md", "{} and {} against plain Horovod".format(*(args.pair or ("", ""))), paired),
               "steps": ("steps.md", "per-rank steps", lambda: rank_steps(results))}
    for option, (name, title, table) in reports.items():
        if getattr(args, option):
            folders = ", ".join(Path(r).name for r in (results, *args.also)) if option == "pair" else results.name
            text = f"# {folders}: {title}\n\n" + table()
            (results / name).write_text(text + "\n")
            print(text)
            return 0
    jobs = collect(results, targets)
    if jobs.empty:
        print(f"no finished jobs in {results / 'runs.csv'}")
        return 1
    machine = json.loads((results / "machine.json").read_text()) if (results / "machine.json").exists() else {}
    fig = figures(jobs)
    text = (f"# {results.name}\n\n`{machine.get('command', '?')}`; {machine.get('date', '?')}; {machine.get('cpu', '?')}, "
            f"{machine.get('cores', '?')} cores; commit {str(machine.get('git_commit', '?'))[:12]}"
            + "".join(f"; target of {w}: {v:g}" for w, v in targets.items()) + "\n\n"
            + headline(jobs, fig) + "\n")
    short = in_short(jobs, fig=fig)
    if short:
        text += ("\n## In short: the default over plain Horovod\n\nTime to target, median of per-seed ratios; in "
                 "parentheses the fixed speed-proportional split's; with a straggler, the default's ratio to the "
                 "limit; without one, the budget time's ratio at plain's machine speed.\n\n" + short + "\n")
    splits = equal_rank_splits(results)
    if splits:
        text += "\n## Equal ranks: decisions off the neutral split\n\n" + splits + "\n"
    (results / "zoo.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
