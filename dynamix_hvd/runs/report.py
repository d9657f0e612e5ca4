"""A one-page PNG report of a finished run (``dynamix-hvd plot RUN_DIR``).

Header with the run's metadata, then four panels against wall time: batch size per rank (shaded by
the default policy's phase, see ``dynamix-hvd explain``), loss (and test accuracy), allreduce wait
per rank (the straggler signal: a slow rank makes the *others* wait), and throughput per rank; below them the straggler diagnosis (`dynamix_hvd.runs.diagnosis`): where each
rank's step time went, which rank was slow, in which phase, and what the sizes recovered against the
equal split. Uses matplotlib's Agg backend, so no display is needed.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .progress import format_sizes
from ..data.memory import MemoryBudget
from .diagnosis import Diagnosis, diagnose
from .explain import phase_spans
from .rundir import RunData, read_run


def nominal_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """Steps without each epoch's smaller leftover step, so batch-size lines show planned sizes."""
    last = steps.groupby(["rank", "epoch"]).step.transform("max")
    prev_global = steps.sort_values(["rank", "epoch", "step"]).groupby(["rank", "epoch"]).global_batch.shift(1)
    partial = (steps.step == last) & (steps.global_batch < prev_global.reindex(steps.index))
    return steps[~partial.fillna(False)]


def _smooth(values: pd.Series, n: int) -> pd.Series:
    return values.rolling(max(1, n), min_periods=1, center=True).mean()


def header_text(run: RunData) -> str:
    m = run.meta
    e = run.epochs
    last = e[e.epoch == e.epoch.max()] if len(e) else e
    sizes = format_sizes([int(b) for b in last.sort_values("rank").batch_size]) if len(last) else "?"
    first = e[e.epoch == e.epoch.min()] if len(e) else e
    start = format_sizes([int(b) for b in first.sort_values("rank").batch_size]) if len(first) else "?"
    acc = m.get("final_accuracy")
    lines = [
        f"dynamix_hvd run  {run.path}   created {m.get('created', '?')}",
        f"{m.get('world_size', '?')} ranks on {', '.join(m.get('hosts', [])) or '?'} via {m.get('launcher', '?')}"
        f"{'  (Slurm job ' + str(m['slurm_job_id']) + ')' if m.get('slurm_job_id') else ''}   "
        f"policy {m.get('policy', '?')}   epochs {m.get('epochs', '?')}   decisions {m.get('decisions', '?')}",
        f"batch sizes {start} -> {sizes}   wall time {m.get('wall_time_s', math.nan):.1f} s"
        + (f"   final accuracy {acc:.4f}" if isinstance(acc, (int, float)) else ""),
        f"dynamix_hvd {m.get('dynamix_hvd', '?')}, horovod {m.get('horovod', '?')}, torch {m.get('torch', '?')}",
    ]
    budgets = m.get("memory_budgets") or []
    if any(budgets):
        lines.append("memory budget " + "; ".join(
            f"rank {r}: {MemoryBudget(**b).describe()}" for r, b in enumerate(budgets) if b))
    return "\n".join(lines)


def write_report(run_dir: str | os.PathLike, path: str | os.PathLike | None = None, dpi: int = 110) -> Path:
    """Render `run_dir`'s report to `path` (default RUN_DIR/report.png); returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = read_run(run_dir)
    steps = run.steps.sort_values(["rank", "wall_s"])
    ranks = sorted(steps["rank"].unique()) if len(steps) else []
    colors = plt.get_cmap("tab10")
    smooth_n = max(1, len(steps) // max(1, len(ranks)) // 60)
    fig = plt.figure(figsize=(12, 12.5))
    fig.text(0.07, 0.99, header_text(run), va="top", ha="left", family="monospace", fontsize=9.5)
    grid = fig.add_gridspec(3, 2, hspace=0.38, wspace=0.22, left=0.07, right=0.93, top=0.895, bottom=0.05,
                            height_ratios=[1, 1, 0.75])

    ax = fig.add_subplot(grid[0, 0])
    nominal = nominal_steps(steps)
    for r in ranks:
        s = nominal[nominal["rank"] == r]
        ax.step(s.wall_s, s.local_batch, where="post", color=colors(r % 10), label=f"rank {r}")
    d = run.decisions
    shaded = False
    if "wall_s" in d and len(d["wall_s"]):
        for t in d["wall_s"][np.isfinite(d["wall_s"])]:
            ax.axvline(t, color="0.8", lw=0.6, zorder=0)
        shaded = shade_phases(ax, run.history, d["wall_s"], float(steps.wall_s.max()) if len(steps) else math.nan)
    ax.set(title="local batch size per rank (grey: decisions" + ("; shading: phases)" if shaded else ")"),
           xlabel="wall time (s)", ylabel="samples per step")
    ax.legend(fontsize=8, loc="best")

    ax = fig.add_subplot(grid[0, 1])
    if len(steps):
        per_step = steps.assign(w=steps.loss * steps.local_batch).groupby(["epoch", "step"]).agg(
            wall_s=("wall_s", "max"), w=("w", "sum"), n=("local_batch", "sum")).sort_values("wall_s")
        loss = per_step.w / per_step.n
        ax.plot(per_step.wall_s, loss, color="0.75", lw=0.6, label="loss per step")
        ax.plot(per_step.wall_s, _smooth(loss, 4 * smooth_n + 1), color="tab:blue", label="loss (smoothed)")
    ax.set(title="training loss and test accuracy", xlabel="wall time (s)", ylabel="cross-entropy")
    if "accuracy" in run.epochs and len(run.epochs):
        acc = run.epochs.groupby("epoch").agg(wall_s=("wall_s", "max"), accuracy=("accuracy", "mean"))
        ax2 = ax.twinx()
        ax2.plot(acc.wall_s, acc.accuracy, "o-", color="tab:red", label="test accuracy (epoch end)")
        ax2.set_ylabel("accuracy", color="tab:red")
        ax2.set_ylim(0, 1)
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="center right")

    ax = fig.add_subplot(grid[1, 0])
    for r in ranks:
        s = steps[steps["rank"] == r]
        ax.plot(s.wall_s, _smooth(s.sync_wait_s * 1e3, smooth_n), color=colors(r % 10), lw=1,
                label=f"rank {r}: mean {s.sync_wait_s.mean() * 1e3:.2f} ms")
    ax.set(title="allreduce wait per rank (time in synchronize())", xlabel="wall time (s)", ylabel="ms per step")
    ax.legend(fontsize=8, loc="best")

    ax = fig.add_subplot(grid[1, 1])
    for r in ranks:
        s = steps[steps["rank"] == r]
        ax.plot(s.wall_s, _smooth(s.samples_per_s, smooth_n), color=colors(r % 10), lw=1, label=f"rank {r}")
    ax.set(title="throughput per rank", xlabel="wall time (s)", ylabel="samples/s")
    ax.legend(fontsize=8, loc="best")

    draw_diagnosis(fig.add_subplot(grid[2, :]), diagnose(run.steps))
    out = Path(path) if path else run.path / "report.png"
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


PHASE_COLORS = {"even": None, "judging split": "tab:orange", "split": "tab:green", "judging growth": "tab:purple",
                "grown": "tab:blue", "split and grown": "tab:cyan"}
"""Shading of each phase on the batch-size panel (even: none)."""


def shade_phases(ax: Any, history: Sequence[dict[str, Any]], times: np.ndarray, end: float) -> bool:
    """Shade the stretches of training by the default policy's phase; False where the run's policy
    records no phases."""
    spans = phase_spans(history, [float(t) for t in times])
    if not spans:
        return False
    labelled = set()
    for start, stop, phase in spans:
        color = PHASE_COLORS.get(phase)
        if color is None:
            continue
        stop = stop if math.isfinite(stop) else end
        if not math.isfinite(stop) or stop <= start:
            continue
        ax.axvspan(start, stop, color=color, alpha=0.12, lw=0, zorder=0,
                   label=None if phase in labelled else phase)
        labelled.add(phase)
    return True


def draw_diagnosis(ax: Any, diag: Diagnosis | None) -> None:
    """Stacked bars per rank of the mean step (data wait, compute, own allreduce, wait for the last
    arrival), titled with the verdict and the estimate against the equal split."""
    if diag is None:
        ax.set_axis_off()
        ax.set_title("straggler diagnosis: needs per-step records of at least two ranks")
        return
    phases = [("data wait", "tab:orange", lambda rc: rc.data_wait_s),
              ("compute", "tab:blue", lambda rc: rc.compute_s),
              ("own allreduce", "tab:green", lambda rc: rc.allreduce_s),
              ("waiting for the last arrival", "0.8", lambda rc: max(0.0, rc.sync_wait_s - rc.allreduce_s))]
    labels = [f"{rc.rank}\n~{rc.batch:.0f}" for rc in diag.ranks]
    left = np.zeros(len(diag.ranks))
    for name, color, value in phases:
        width = np.array([value(rc) * 1e3 for rc in diag.ranks])
        ax.barh(labels, width, left=left, color=color, label=name)
        left += width
    ax.invert_yaxis()
    share = diag.cost_s / diag.measured_s if diag.measured_s > 0 else math.nan
    verdict = (f"slowest rank {diag.slow_rank}, in {diag.phase}: cost the job {diag.cost_s:.2f} s ({share:.0%})"
               if diag.straggler else f"no straggler (the last arrival cost {share:.0%} of the step time)")
    rec = diag.recovered_s
    ax.set_title(f"straggler diagnosis: {verdict}; against the equal split "
                 f"{'recovered' if rec >= 0 else 'lost'} {abs(rec):.2f} s "
                 f"(estimated {diag.equal_split_s:.2f} s, measured {diag.measured_s:.2f} s)", fontsize=10)
    ax.set(xlabel="ms per step (mean over the run)", ylabel="rank, mean batch", xlim=(0, 1.3 * max(left.max(), 1e-3)))
    ax.legend(fontsize=8, loc="center right")


def summary_table(run: RunData) -> pd.DataFrame:
    """One row per epoch: wall time at its end, each rank's median batch size in it, loss (mean over the
    epoch's steps, sample-weighted), test accuracy, throughput (sum over ranks), allreduce wait per rank."""
    rows: list[dict[str, Any]] = []
    for epoch, e in run.epochs.sort_values(["epoch", "rank"]).groupby("epoch"):
        weighted = e.dropna(subset=["loss_mean"])
        row: dict[str, Any] = {
            "epoch": int(epoch), "wall_s": round(float(e.wall_s.max()), 2),
            "sizes": format_sizes([int(b) for b in e.batch_size]),
            "loss": (weighted.loss_mean * weighted.samples).sum() / max(1, weighted.samples.sum()),
            "samples/s": round(float(e.samples_per_s.sum())),
            "allreduce_wait_ms": "/".join(f"{w * 1e3:.2f}" for w in e.sync_wait_s)}
        if "accuracy" in e:
            row["accuracy"] = float(e.accuracy.mean())
        rows.append(row)
    return pd.DataFrame(rows)
