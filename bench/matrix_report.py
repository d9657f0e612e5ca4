"""Records, table and plots of a benchmark-matrix run (`bench_matrix.py`).

* `write_epochs`: every job's per-epoch records in one CSV;
* `markdown`: the summary table;
* `plot_all`: per workload x condition x seed, ``sizes_W_C_sS.png`` (every rank's local batch size
  over wall time, one panel per policy) and ``curves_W_C_sS.png`` (training loss and test accuracy,
  for charlm validation loss, vs wall time, one line per policy).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

CHARLM_EPOCH = re.compile(r"epoch (\d+): step (\d+) val loss ([\d.naninf]+) sizes \[([\d, ]+)\] elapsed ([\d.]+)s")


def charlm_epochs(run_dir: Path) -> pd.DataFrame:
    """charlm_train.py has no RunLog: its per-epoch lines on stdout."""
    m = CHARLM_EPOCH.findall((run_dir / "stdout.txt").read_text())
    return pd.DataFrame([{"epoch": int(a), "step": int(b), "val_loss": float(c), "batch_size": s.replace(" ", ""),
                          "wall_s": float(t)} for a, b, c, s, t in m])


def write_epochs(runs: pd.DataFrame, path: Path) -> None:
    """All jobs' per-epoch records in one CSV, tagged with workload/condition/policy/seed."""
    frames = []
    for _, r in runs[runs.status == "ok"].iterrows():
        d = Path(r.run_dir)
        e = charlm_epochs(d) if r.workload == "charlm" else pd.read_csv(d / "epochs.csv")
        frames.append(e.assign(workload=r.workload, condition=r.condition, policy=r.policy, seed=r.seed))
    if frames:
        pd.concat(frames, ignore_index=True).to_csv(path, index=False)


def summarize(runs: pd.DataFrame, workloads: Mapping[str, Any]) -> pd.DataFrame:
    """Per (workload, condition, policy): medians over seeds of each metric and of its ratios to the
    default static and the best static of the same seed (both from `runs`, i.e. this matrix run)."""
    ok = runs[runs.status == "ok"].copy()
    rows = []
    for (wname, cname, seed), group in ok.groupby(["workload", "condition", "seed"]):
        w = workloads[wname]
        statics = group[group.policy.str.startswith("static-")]
        default = statics[statics.policy == f"static-{w.default_batch}"]
        if statics.empty or default.empty:
            continue
        sign = -1 if w.metric == "loss" else 1  # best static: fastest to target, then best final metric
        best = statics.assign(_k=list(zip(statics.time_to_target_s, -sign * statics.final))).sort_values("_k").iloc[0]
        for _, r in group.iterrows():
            row = {"workload": wname, "condition": cname, "policy": r.policy, "seed": seed,
                   "best_static": best.policy, "reached": r.reached, "final_sizes": r.final_sizes,
                   "slow_ratio": r.get("slow_ratio", math.nan)}
            for m in ("time_to_target_s", "final", "throughput"):
                row[m] = r[m]
                row[f"{m}/default"] = _ratio(r[m], default[m].iloc[0])
                row[f"{m}/best"] = _ratio(r[m], best[m])
            rows.append(row)
    per_seed = pd.DataFrame(rows)
    if per_seed.empty:
        return per_seed
    num = [c for c in per_seed.columns if c.startswith(("time_to", "final", "throughput")) and c != "final_sizes"]
    agg = {**{c: "median" for c in num}, "slow_ratio": "median", "reached": "sum", "seed": "count",
           "best_static": "first",
           "final_sizes": "last"}
    table = per_seed.groupby(["workload", "condition", "policy"], sort=False).agg(agg).reset_index()
    return table.rename(columns={"seed": "seeds"})


def _ratio(a: float, b: float) -> float:
    if math.isinf(a) and math.isinf(b):
        return math.nan
    return a / b if b and math.isfinite(b) else (0.0 if math.isfinite(a) else math.nan)


COLUMNS = [("workload", "workload"), ("condition", "condition"), ("policy", "policy"),
           ("time_to_target_s", "time to target (s)"), ("time_to_target_s/default", "/default"),
           ("time_to_target_s/best", "/best"), ("final", "final acc (charlm: loss)"), ("final/default", "/default"),
           ("final/best", "/best"), ("throughput", "samples/s"), ("throughput/default", "/default"),
           ("throughput/best", "/best"), ("reached", "reached"), ("seeds", "seeds"), ("best_static", "best static"),
           ("final_sizes", "final sizes")]


def markdown(table: pd.DataFrame) -> str:
    """The summary as a Markdown table (3 significant digits)."""
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r[c]) for c, _ in COLUMNS) + " |" for _, r in table.iterrows()]
    return "\n".join(lines) + "\n"


def targets_markdown(table: pd.DataFrame, workloads: Mapping[str, Any]) -> str:
    """The issue's targets on the heterogeneous conditions: PPO's time to target <= 0.54x the default
    static and <= 1.0x the best static, final accuracy >= the best static's; throughput >= 1.45x the
    equal split (the default static) for speed-split and PPO. r is the slow rank's measured
    per-sample compute time over the fast rank's in the equal split; (1 + r) / 2 bounds any split."""
    def get(w: str, c: str, p: str, col: str) -> float:
        hit = table[(table.workload == w) & (table.condition == c) & (table.policy == p)]
        return float(hit[col].iloc[0]) if len(hit) else math.nan

    def check(v: float, ok: bool) -> str:
        return "n/a" if math.isnan(v) else f"{v:.2f} {'yes' if ok else 'NO'}"

    lines = ["| workload | condition | PPO ttt/default <= 0.54 | PPO ttt/best <= 1.0 | PPO final/best (acc >=, loss <=) 1.0 "
             "| speed-split tput/equal >= 1.45 | PPO tput/equal >= 1.45 | r at equal split | (1+r)/2 |", "|" + "---|" * 9]
    for (w, c), group in table.groupby(["workload", "condition"], sort=False):
        if not c.startswith("hetero"):
            continue
        r = get(w, c, f"static-{workloads[w].default_batch}", "slow_ratio")
        loss = workloads[w].metric == "loss"
        t_def, t_best, f_best = (get(w, c, "ppo", k) for k in ("time_to_target_s/default", "time_to_target_s/best",
                                                                 "final/best"))
        s_tp, p_tp = get(w, c, "speed-split", "throughput/default"), get(w, c, "ppo", "throughput/default")
        lines.append(f"| {w} | {c} | {check(t_def, t_def <= 0.54)} | {check(t_best, t_best <= 1.0)} | "
                     f"{check(f_best, f_best <= 1.0 if loss else f_best >= 1.0)} | {check(s_tp, s_tp >= 1.45)} | "
                     f"{check(p_tp, p_tp >= 1.45)} | {r:.2f} | {(1 + r) / 2:.2f} |")
    return "\n".join(lines) + "\n"


def job_steps(workload: str, run_dir: Path) -> pd.DataFrame:
    """Per-step rows (rank, epoch, step, local_batch, wall_s, loss where recorded) without each
    epoch's last, partial step (it would show as a dip in the sizes plot)."""
    if workload == "charlm":  # wall time approximated by each rank's summed step times
        frames = [pd.read_csv(p) for p in sorted(run_dir.glob("steps_rank*.csv"))]
        steps = pd.concat([f.assign(wall_s=f.step_s.cumsum()) for f in frames], ignore_index=True)
    else:
        from dynamix_hvd.runs.rundir import read_run

        steps = read_run(run_dir).steps
    last = steps.groupby(["rank", "epoch"]).step.transform("max")
    return steps[steps.step < last]


def job_quality(workload: str, run_dir: Path) -> tuple[pd.DataFrame, str]:
    """(wall_s, value) of the job's evaluations and the value's name."""
    if workload == "cnn":
        e = pd.read_csv(run_dir / "evals.csv")
        return e[["wall_s", "accuracy"]].rename(columns={"accuracy": "value"}), "test accuracy"
    if workload == "charlm":
        e = charlm_epochs(run_dir)
        return e[["wall_s", "val_loss"]].rename(columns={"val_loss": "value"}), "validation loss (epoch ends)"
    e = pd.read_csv(run_dir / "epochs.csv").groupby("epoch").agg(wall_s=("wall_s", "max"), value=("accuracy", "first"))
    return e.reset_index(drop=True), "test accuracy (epoch ends)"


def plot_all(runs: pd.DataFrame, out: Path) -> list[Path]:
    """Write both figures for every workload x condition x seed of `runs` (rows with status ok)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (w, c, seed), group in runs[runs.status == "ok"].groupby(["workload", "condition", "seed"]):
        n = len(group)
        cols = max(2, min(4, n))
        fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(3.2 * cols, 2.4 * ((n + cols - 1) // cols)),
                                 squeeze=False, sharey=True)
        fig2, (ax_loss, ax_q) = plt.subplots(1, 2, figsize=(11, 4))
        for i, (ax, (_, r)) in enumerate(zip(axes.flat, group.iterrows())):
            d = Path(r.run_dir)
            steps = job_steps(w, d)
            for rank, s in steps.groupby("rank"):
                ax.step(s.wall_s, s.local_batch, where="post", label=f"rank {rank}")
            ax.set_title(r.policy, fontsize=9)
            ax.set_yscale("log", base=2)
            color = f"C{i % 10}"
            if "loss" in steps and steps.loss.notna().any():
                s0 = steps[steps["rank"] == 0]
                ax_loss.plot(s0.wall_s, s0.loss.rolling(10, min_periods=1).mean(), label=r.policy, lw=1, color=color)
            q, qname = job_quality(w, d)
            ax_q.plot(q.wall_s, q.value, marker=".", label=r.policy, lw=1, color=color)
        for ax in axes.flat[n:]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.supxlabel("wall time (s)" + (" (charlm: summed step time)" if w == "charlm" else ""))
        fig.supylabel("local batch size")
        fig.suptitle(f"{w} / {c} / seed {seed}: batch size per rank")
        fig.tight_layout()
        ax_loss.set(xlabel="wall time (s, evaluations included)", ylabel="training loss (rank 0, 10-step mean)",
                    yscale="log")
        ax_q.set(xlabel="wall time (s, evaluations included)", ylabel=qname)
        ax_q.legend(fontsize=7)
        fig2.suptitle(f"{w} / {c} / seed {seed}")
        fig2.tight_layout()
        for f, name in ((fig, "sizes"), (fig2, "curves")):
            path = out / f"{name}_{w}_{c}_s{seed}.png"
            f.savefig(path, dpi=90)
            plt.close(f)
            written.append(path)
    return written
