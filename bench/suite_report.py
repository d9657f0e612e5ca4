"""Measures, statistics, tables and figures of a benchmark-suite run (`bench.suite`).

Definitions (all times on the training clock: wall seconds since the ranks started training,
evaluation time excluded and reported separately):

* time to target: training seconds before the first evaluation at or past the target (accuracy
  >= target, loss <= target). Evaluations run every fixed number of samples. A job that never
  reaches it is a *miss*: it counts with its full training time and is flagged.
* time to sustained target: training seconds before the first evaluation at or past the target
  whose next two evaluations are at or past it too (evaluations at the same sample count counted
  once; an evaluation near the end needs only those that follow). It separates reaching the target
  from touching it once while the metric wobbles around it; misses count with the full time.
* final: the metric at the end of the fixed epoch budget; final@T: the last evaluation within the
  fixed wall-time budget T (training seconds).
* idle fraction of a rank: 1 - (its forward+backward time, slowdown included) / its training time;
  "idle" is the mean over ranks, and the per-rank values are in runs.csv.
* throughput: training samples of all ranks / training time. Optimizer steps: steps taken.
* Per cell (workload x condition) the ratios are paired: each job's time over plain Horovod's (plain
  DDP's for the torch.distributed engine's arms, `plain_of`) and
  over the best static's time *of the same seed*; the table gives their median and interquartile
  range (IQR) over seeds. The best static is chosen in hindsight: the static size with the lowest
  median time to target in that cell. A row is *noisy* when its IQR exceeds 10% of its median.
* physical limit: with per-sample speeds s_i, the best split's throughput over the equal split's,
  sum(s_i) / (R min s_i) (`bench.conditions.split_limit`): what any split can gain over plain Horovod.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

PLAIN = "plain-horovod"
PLAIN_DDP = "plain-ddp"


def plain_of(arm: str) -> str:
    """The plain script an arm is read against: plain DDP for the torch.distributed engine's arms."""
    return PLAIN_DDP if arm.endswith("-ddp") else PLAIN


def measure(run_dir: Path, wall_budget_s: float) -> dict[str, Any]:
    """One finished job's numbers, from the records its script wrote (`bench.jobs.records`)."""
    res = json.loads((run_dir / "suite_result.json").read_text())
    evals = pd.read_csv(run_dir / "suite_evals.csv")
    within = evals[evals.train_s <= wall_budget_s]
    idle = {int(r): float(v) for r, v in res["idle_fraction"].items()}
    reached = bool(res["reached"])
    sustained = sustained_time(evals, float(res["target"]), res.get("metric", "accuracy"))
    return {"reached": reached, "missed": not reached,
            "sustained_s": sustained if math.isfinite(sustained) else float(res["train_s"]),
            "sustained_missed": not math.isfinite(sustained),
            "time_to_target_s": float(res["time_to_target_s"]) if reached else float(res["train_s"]),
            "train_s": float(res["train_s"]), "eval_total_s": float(res["eval_total_s"]),
            "final": float(res["final"]), "final_at_budget": float(within.value.iloc[-1]) if len(within) else math.nan,
            "throughput": float(res["throughput"]), "optimizer_steps": int(res["optimizer_steps"]),
            "samples": int(res["samples"]), "idle_mean": sum(idle.values()) / len(idle),
            "idle_per_rank": "/".join(f"{idle[r]:.2f}" for r in sorted(idle)),
            "stalls": sum(len(d.get("stalls", [])) for d in res.get("per_rank", {}).values()),
            "balanced_fraction": balanced_fraction(pd.read_csv(steps)) if (steps := run_dir / "suite_steps.csv").exists()
            else math.nan}


def balanced_fraction(steps: pd.DataFrame, until_s: float = math.inf, window: int = 25,
                      fixed: Mapping[int, float] | None = None, floor: int = 1) -> float:
    """The time a run's steps would take at the split that makes every rank arrive together, over the
    time they took, from the run's own per-step records (each rank's samples and forward+backward
    seconds per step); only the steps that ended by `until_s` training seconds (e.g. its time to
    target). Read on a plain Horovod run it is that row's attainable limit; on an adaptive run, how
    far its own splits were from balanced.

    Per window of `window` steps of an epoch (a slowdown that changes during the run changes between
    windows; per-step noise is no speed difference a split could use, so medians), rank i's speed is
    its median samples over its median forward+backward seconds, its slowdown included; the
    balanced split's compute is the window's samples over the sum of the speeds (every rank busy for
    the same time), and the rest of a step (allreduce, optimizer, data: the median step minus the
    slowest rank's median compute) stays as measured. A rank that trained no samples has no speed
    and no share. Measured in the run it is read against, so the machine's speed drifting between
    runs cannot move it. Assumed: each rank's compute scales with its samples (on the slow rank a
    fixed per-step cost makes the limit unreachable, on a fast one it makes it easy), the ranks
    compute as fast side by side as they did when the fast ones waited, and the global batch is the
    run's own (an arm that grows it can pass the limit).

    `fixed` (rank -> samples) charges each rank a fixed per-step cost instead: rank i's compute is
    c_i (b + k_i), so the balanced compute is the least M with sum_i (M / c_i - k_i) >= the window's
    samples and every rank given at least `floor` samples (1, or the per-rank floor the controller
    keeps for a model with BatchNorm; at most an equal share), M = max((B + sum k) / sum (1 / c),
    max c (floor + k)): a rank whose balanced share falls below the floor sets M at the floor, and the
    others then need less (`bench.reachable_limit`); NaN where a working rank's k is not known."""
    if steps.empty or steps["rank"].nunique() < 2:
        return 1.0
    steps = steps[steps.t_s <= until_s] if "t_s" in steps else steps
    balanced = taken = 0.0
    for _, part in steps.groupby([steps.epoch, steps.step // window]):
        per_rank = part.groupby("rank").agg(b=("local_batch", "median"), c=("compute_s", "median"),
                                            step=("step_s", "median"), n=("step", "count"))
        working = per_rank[(per_rank.b > 0) & (per_rank.c > 0)]
        if working.empty:
            continue
        n = int(per_rank.n.min())
        step = float(per_rank.step.max())
        rest = max(step - float(working.c.max()), 0.0)
        if fixed is None:
            compute = float(working.b.sum()) / float((working.b / working.c).sum())
        else:
            k = np.array([fixed.get(int(r), math.nan) for r in working.index])
            per_sample = working.c.to_numpy() / (working.b.to_numpy() + k)
            samples = float(working.b.sum())
            least = min(max(floor, 1), samples / len(k))  # never more than an equal share of the window's samples
            compute = max((samples + k.sum()) / (1.0 / per_sample).sum(), float((per_sample * (least + k)).max()))
        balanced += n * (compute + rest)
        taken += n * step
    return balanced / taken if taken > 0 else math.nan


def sustained_time(evals: pd.DataFrame, target: float, metric: str, following: int = 2) -> float:
    """Training seconds at the first evaluation past `target` whose next `following` evaluations are
    past it too (inf: never)."""
    once = evals.drop_duplicates("samples", keep="first").reset_index(drop=True)
    ok = (once.value >= target) if metric == "accuracy" else (once.value <= target)
    for i in range(len(once)):
        if ok.iloc[i:i + 1 + following].all():
            return float(once.train_s.iloc[i])
    return math.inf


def iqr(values: pd.Series) -> float:
    return float(values.quantile(0.75) - values.quantile(0.25)) if len(values) else math.nan


def best_static(cell: pd.DataFrame, metric: str) -> str | None:
    """The static arm of a cell with the lowest median time to target (then the best median final)."""
    statics = cell[cell.arm.str.startswith("static-")]
    if statics.empty:
        return None
    med = statics.groupby("arm").agg(t=("time_to_target_s", "median"), f=("final", "median"))
    med["f"] = -med.f if metric == "accuracy" else med.f
    return str(med.sort_values(["t", "f"]).index[0])


RECORDED = ("time_to_target_s", "missed", "final", "final_at_budget", "idle_mean", "throughput", "optimizer_steps",
            "eval_total_s", "physical_limit")
"""The measures of runs.csv that `summarize` reads."""


def summarize(runs: pd.DataFrame, metrics: Mapping[str, str]) -> pd.DataFrame:
    """Per (workload, condition, arm): medians and IQRs over seeds, paired ratios, misses, noise flag.
    A workload that `metrics` does not name (one `bench.suite` does not define) is read as an accuracy."""
    if runs.empty or "status" not in runs:
        return pd.DataFrame()
    ok = runs[runs.status == "ok"].copy()
    for column in RECORDED:  # a row recorded without this measure: unknown
        if column not in ok:
            ok[column] = False if column == "missed" else math.nan
    rows = []
    for (w, c), cell in ok.groupby(["workload", "condition"], sort=False):
        best = best_static(cell, metrics.get(w, "accuracy"))
        ref = {name: cell[cell.arm == name].set_index("seed").time_to_target_s
               for name in (PLAIN, PLAIN_DDP, best) if name}
        for arm, group in cell.groupby("arm", sort=False):
            g = group.set_index("seed")
            base = plain_of(arm)
            plain_sustained = cell[cell.arm == base].set_index("seed").get("sustained_s")
            ratio = {k: (g.time_to_target_s / v).dropna() for k, v in ref.items()}
            if base != PLAIN:
                ratio[PLAIN] = ratio.pop(base, pd.Series(dtype=float))  # "vs_plain": its own engine's plain
            sustained = (g.sustained_s / plain_sustained).dropna() if plain_sustained is not None \
                and "sustained_s" in g else pd.Series(dtype=float)
            t = g.time_to_target_s
            row = {"workload": w, "condition": c, "arm": arm, "seeds": len(g), "missed": int(g.missed.sum()),
                   "ttt_median": t.median(), "ttt_iqr": iqr(t),
                   "vs_plain": ratio[PLAIN].median() if PLAIN in ratio else math.nan,
                   "vs_plain_iqr": iqr(ratio[PLAIN]) if PLAIN in ratio else math.nan,
                   "vs_best_static": ratio[best].median() if best in ratio else math.nan,
                   "sustained_vs_plain": sustained.median() if len(sustained) else math.nan,
                   "sustained_vs_plain_iqr": iqr(sustained) if len(sustained) else math.nan,
                   "sustained_missed": int(g.sustained_missed.sum()) if "sustained_missed" in g else 0,
                   "best_static": best or "", "final": g.final.median(), "final_iqr": iqr(g.final),
                   "final_at_budget": g.final_at_budget.median(), "idle": g.idle_mean.median(),
                   "throughput": g.throughput.median(), "optimizer_steps": g.optimizer_steps.median(),
                   "eval_s": g.eval_total_s.median(), "physical_limit": str(g.physical_limit.iloc[0]),
                   "slow_mode": str(g.slow_mode.iloc[0]) if "slow_mode" in g else ""}
            row["noisy"] = bool(row["ttt_iqr"] > 0.1 * row["ttt_median"]) if row["ttt_median"] > 0 else False
            rows.append(row)
    return pd.DataFrame(rows)


def _f(v: Any, digits: int = 3) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.{digits}g}"
    return str(v)


def cell_table(cell: pd.DataFrame) -> str:
    head = ["arm", "time to target s (median [IQR])", "/ plain (its engine's) [IQR]", "/ best static",
            "sustained / plain [IQR]", "final", "final@T", "idle", "samples/s", "optimizer steps", "eval s",
            "missed", "noisy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in cell.iterrows():
        miss = f"**{r.missed}/{r.seeds}**" if r.missed else f"0/{r.seeds}"
        lines.append(f"| {r.arm}{' (best static)' if r.arm == r.best_static else ''} | "
                     f"{_f(r.ttt_median)} [{_f(r.ttt_iqr, 2)}] | {_f(r.vs_plain)} [{_f(r.vs_plain_iqr, 2)}] | "
                     f"{_f(r.vs_best_static)} | {_f(r.get('sustained_vs_plain', math.nan))} "
                     f"[{_f(r.get('sustained_vs_plain_iqr', math.nan), 2)}]"
                     f"{f' ({r.sustained_missed} missed)' if r.get('sustained_missed', 0) else ''} | {_f(r.final, 4)} | {_f(r.final_at_budget, 4)} | {_f(r.idle, 2)} | "
                     f"{_f(r.throughput)} | {_f(r.optimizer_steps)} | {_f(r.eval_s, 2)} | {miss} | "
                     f"{'yes' if r.noisy else ''} |")
    return "\n".join(lines) + "\n"


def _resummarized(record: Mapping[str, Any] | None) -> str:
    """The sentence on a `--summarize-only` pass ("" for a run's own summary)."""
    if not record:
        return ""
    text = (f" Re-measured from the job directories by `{record['command']}` on {record['date']} "
            f"(commit {record['git_commit'][:12]})")
    if record.get("as_recorded"):
        text += (f"; {len(record['as_recorded'])} jobs keep the numbers runs.csv recorded (their job directories "
                 "are gone or their workload is not defined in bench.suite)")
    return text + "."


def summary_markdown(table: pd.DataFrame, runs: pd.DataFrame, info: Mapping[str, Any]) -> str:
    """summary.md: the machine, then per workload x condition the table and its two figures."""
    out = [f"# Benchmark suite: {info['config']['name']}\n",
           f"`{info['command']}`, {info['date']}, {info.get('wall_s', '?')} s. Machine: {info['cpu']}, "
           f"{info['cores']} cores, {info['memory_mib']} MiB; load average before {info['load_before'][0]:.2f}, "
           f"after {info.get('load_after', [math.nan])[0]:.2f}. Python {info['python']}, torch {info['torch']}, "
           f"Horovod {info['horovod']}, dynamix_hvd {info['dynamix_hvd']}, commit {info['git_commit'][:12]}"
           f"{' (uncommitted changes)' if info.get('git_dirty') else ''}."
           + _resummarized(info.get("resummarized")) + "\n",
           "Times are training seconds (evaluation excluded, its total is the 'eval s' column). Ratios are "
           "paired by seed (median [IQR]); **k/n missed**: k runs never reached the target and count with "
           "their full time. sustained: time to the first evaluation past the target whose next two are "
           "past it too. final: metric after the epoch budget; final@T: at the wall-time budget. "
           "Definitions: `bench/suite_report.py`.\n"]
    commits = sorted({str(c) for c in runs.get("git_commit", pd.Series(dtype=str)).fillna("unknown")})
    if len(commits) > 1:
        out.append(f"The jobs ran in parts (`--resume`) at commits {', '.join(commits)} (runs.csv `git_commit`).\n")
    if table.empty:
        out.append("No job finished.\n")
    for (w, c), cell in (table.groupby(["workload", "condition"], sort=False) if not table.empty else ()):
        describe = info["config"].get("conditions", {}).get(c, c)
        out.append(f"## {w} / {c}\n\n{describe}. Physical limit (best split / equal split): "
                   f"**{cell.physical_limit.iloc[0]}**x"
                   + (". The slowed rank SLEEPS instead of spinning (more ranks than cores)."
                      if cell.slow_mode.iloc[0] == "sleep" else ".") + "\n")
        out.append(cell_table(cell))
        out.append(f"![metric vs time](plots/metric_{w}_{c}.png) ![batch sizes](plots/sizes_{w}_{c}.png)\n")
    bad = runs[runs.status != "ok"] if "status" in runs else runs
    if len(bad):
        out.append("## Jobs without a result\n\n" + "\n".join(
            f"- {r.workload}/{r.condition}/{r.arm} seed {r.seed}: {r.status}" for _, r in bad.iterrows()) + "\n")
    if info.get("pending"):
        out.append(f"## Not run yet ({len(info['pending'])} jobs: the --budget-min was reached; "
                   "rerun the same command with --resume)\n\n" + "\n".join(f"- {k}" for k in info["pending"]) + "\n")
    return "\n".join(out)


def write_raw(runs: pd.DataFrame, out: Path) -> None:
    """evals.csv (every evaluation of every job) and sizes.csv (each rank's batch size when it changed)."""
    evals, sizes = [], []
    for _, r in runs[runs.status == "ok"].iterrows() if "status" in runs else []:
        d, tag = Path(r.run_dir), {"workload": r.workload, "condition": r.condition, "arm": r.arm, "seed": r.seed}
        evals.append(pd.read_csv(d / "suite_evals.csv").assign(**tag))
        steps = pd.read_csv(d / "suite_steps.csv").sort_values(["rank", "step"])
        changed = steps.local_batch != steps.groupby("rank").local_batch.shift()
        sizes.append(steps[changed][["rank", "step", "t_s", "local_batch"]].assign(**tag))
    for frames, name in ((evals, "evals.csv"), (sizes, "sizes.csv")):
        if frames:
            pd.concat(frames, ignore_index=True).to_csv(out / name, index=False)


def plot_cells(runs: pd.DataFrame, out: Path) -> list[Path]:
    """Per workload x condition: metric vs training time (every arm, every seed) and the batch size
    of each rank over time (one panel per arm, lowest seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    ok = runs[runs.status == "ok"] if "status" in runs else runs.iloc[0:0]
    for (w, c), cell in ok.groupby(["workload", "condition"], sort=False):
        arms = list(dict.fromkeys(cell.arm))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, arm in enumerate(arms):
            for j, (_, r) in enumerate(cell[cell.arm == arm].iterrows()):
                if not (Path(r.run_dir) / "suite_evals.csv").exists():  # its job directory is gone
                    continue
                e = pd.read_csv(Path(r.run_dir) / "suite_evals.csv")
                ax.plot(e.train_s, e.value, color=f"C{i % 10}", lw=2 if arm == PLAIN else 1,
                        ls="--" if arm == PLAIN else "-", alpha=0.8, label=arm if j == 0 else None)
        ax.set(xlabel="training time (s, evaluation excluded)", ylabel="test metric", title=f"{w} / {c}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        written.append(out / f"metric_{w}_{c}.png")
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)

        cols = min(4, len(arms))
        rows = (len(arms) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False, sharey=True)
        for ax, arm in zip(axes.flat, arms):
            r = cell[cell.arm == arm].sort_values("seed").iloc[0]
            if not (Path(r.run_dir) / "suite_steps.csv").exists():
                ax.set_title(f"{arm}: no records", fontsize=8)
                continue
            steps = pd.read_csv(Path(r.run_dir) / "suite_steps.csv")
            for rank, s in steps.groupby("rank"):
                ax.step(s.t_s, s.local_batch, where="post", label=f"rank {rank}", lw=1)
            ax.set_title(f"{arm} (seed {r.seed})", fontsize=8)
            ax.set_yscale("log", base=2)
        for ax in axes.flat[len(arms):]:
            ax.axis("off")
        if axes.flat[0].get_legend_handles_labels()[0]:
            axes.flat[0].legend(fontsize=7)
        fig.supxlabel("training time (s)")
        fig.supylabel("local batch size")
        fig.suptitle(f"{w} / {c}: batch size per rank")
        fig.tight_layout()
        written.append(out / f"sizes_{w}_{c}.png")
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    return written
