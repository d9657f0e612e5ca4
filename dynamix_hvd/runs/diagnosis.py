"""Straggler diagnosis of a finished run, from every rank's per-step records (pure: numpy and pandas).

Per optimizer step each rank records its data wait, its forward+backward (compute) and its wait in
the gradient allreduce. A rank *arrives* at the allreduce after data wait + compute; the allreduce
cannot finish before the last arrival, so every other rank waits for it. Per step:

* the slowest rank is the last to arrive; the job's wall time lost to it is its arrival minus the
  next-to-last arrival (what the step would have saved had that rank been as fast as the next one);
* the phase in which it is slow is the phase (data wait, compute, or its own allreduce time: the wait
  left after the last arrival) in which it exceeds the other ranks' median by the most.

Against the equal split: each rank's arrival is fitted as a cost line ``fixed + per_sample x b`` (least
squares over the median arrival at each batch size it ran; through the origin when it ran one size
only). A step with unequal sizes is estimated as it would have run with the same global batch split
equally, ``max_i line_i(B / R)`` plus the step's measured time after the last arrival (allreduce and
update); a step that ran equal sizes counts as measured. Recovered = estimated - measured step time.
Only steps with status ``ok`` that every rank recorded are used.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import pandas as pd

PHASES = ("data wait", "compute", "allreduce")
#: Below this share of the job's step time the last rank's lateness is called noise, not a straggler.
STRAGGLER_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class RankCost:
    """One rank's means per step (seconds), its fitted arrival line and its lateness."""

    rank: int
    batch: float
    data_wait_s: float
    compute_s: float
    allreduce_s: float
    """Own allreduce time: time in ``synchronize()`` minus the wait for the last arrival."""
    sync_wait_s: float
    fixed_s: float
    per_sample_s: float
    slowest_steps: int
    """Steps in which this rank arrived last."""
    cost_s: float
    """Wall time the job lost to this rank: over its slowest steps, its arrival minus the next-to-last."""


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Which rank was slow, in which phase, what it cost, and what the sizes recovered."""

    steps: int
    ranks: list[RankCost]
    slow_rank: int
    phase: str
    phase_excess_s: float
    """Mean per step by which the slow rank exceeds the others' median in `phase`."""
    cost_s: float
    others_wait_s: float
    """Over the steps in which the slow rank arrived last, summed over the other ranks: their wait for it."""
    measured_s: float
    """Sum of the steps' measured times (median over ranks)."""
    equal_split_s: float
    """Estimated sum of the same steps with every global batch split equally."""
    model_measured_s: float
    """The cost lines' estimate of the measured steps (a check of the fit)."""

    @property
    def straggler(self) -> bool:
        return self.cost_s >= STRAGGLER_SHARE * self.measured_s

    @property
    def recovered_s(self) -> float:
        return self.equal_split_s - self.measured_s


def _wide(steps: pd.DataFrame, column: str, index: pd.MultiIndex, ranks: Sequence[int]) -> np.ndarray:
    table = steps.pivot(index=["epoch", "step"], columns="rank", values=column)
    return table.reindex(index=index, columns=list(ranks)).to_numpy(dtype=float)


def fit_line(batch: np.ndarray, arrival: np.ndarray, min_steps: int = 3) -> tuple[float, float]:
    """(fixed, per_sample) of ``arrival = fixed + per_sample x batch``, robust to stalls: least squares
    over the median arrival at each batch size seen in at least `min_steps` steps (all sizes when none
    is), weighted by its count; both terms kept >= 0, through the origin with one size."""
    frame = pd.DataFrame({"b": batch, "t": arrival}).groupby("b").t.agg(["median", "size"])
    if (frame["size"] >= min_steps).any():
        frame = frame[frame["size"] >= min_steps]
    b, t, w = frame.index.to_numpy(float), frame["median"].to_numpy(float), frame["size"].to_numpy(float)
    if len(b) >= 2:
        design = np.stack([np.ones_like(b), b], axis=1) * np.sqrt(w)[:, None]
        fixed, per = np.linalg.lstsq(design, t * np.sqrt(w), rcond=None)[0]
        if fixed >= 0 and per >= 0:
            return float(fixed), float(per)
        if per < 0:
            return float(np.average(t, weights=w)), 0.0
    per = float(np.sum(w * b * t) / np.sum(w * b * b))  # through the origin
    return 0.0, max(0.0, per)


def diagnose(steps: pd.DataFrame) -> Diagnosis | None:
    """Diagnose a run's per-step records (the ``/steps`` table of trace.h5); None when fewer than two
    ranks recorded a common step."""
    if "status" in steps:
        steps = steps[steps.status.astype(str) == "ok"]
    steps = steps.drop_duplicates(["rank", "epoch", "step"], keep="last")
    ranks = sorted(int(r) for r in steps["rank"].unique())
    if len(ranks) < 2:
        return None
    index = pd.MultiIndex.from_frame(steps[["epoch", "step"]].drop_duplicates().sort_values(["epoch", "step"]))
    cols = {c: _wide(steps, c, index, ranks)
            for c in ("local_batch", "data_wait_s", "compute_s", "sync_wait_s", "step_s")}
    full = np.all(np.isfinite(np.stack(list(cols.values()))), axis=(0, 2))
    if not full.any():
        return None
    b, d, c, w, t = (cols[k][full] for k in ("local_batch", "data_wait_s", "compute_s", "sync_wait_s", "step_s"))
    n, r = b.shape
    arrival = d + c
    last = arrival.max(axis=1)
    own_allreduce = np.clip(w - (last[:, None] - arrival), 0.0, None)
    order = np.argsort(arrival, axis=1)
    slowest = order[:, -1]
    lost = last - arrival[np.arange(n), order[:, -2]]
    cost = np.bincount(slowest, weights=lost, minlength=r)
    k = int(np.argmax(cost))
    others = [j for j in range(r) if j != k]
    excess = {p: float(np.mean(x[:, k] - np.median(x[:, others], axis=1)))
              for p, x in zip(PHASES, (d, c, own_allreduce))}
    phase = max(excess, key=lambda p: excess[p])

    lines = [fit_line(b[:, i], arrival[:, i]) for i in range(r)]
    step_time = np.median(t, axis=1)
    tail = np.clip(step_time - last, 0.0, None)
    fixed = np.array([f for f, _ in lines])
    per = np.array([p for _, p in lines])
    equal = np.max(fixed + per * (b.sum(axis=1, keepdims=True) / r), axis=1) + tail
    unequal = b.max(axis=1) - b.min(axis=1) > 1
    equal_split = np.where(unequal, equal, step_time)
    model = np.max(fixed + per * b, axis=1) + tail

    rank_costs = [RankCost(rank=ranks[i], batch=float(b[:, i].mean()), data_wait_s=float(d[:, i].mean()),
                           compute_s=float(c[:, i].mean()), allreduce_s=float(own_allreduce[:, i].mean()),
                           sync_wait_s=float(w[:, i].mean()), fixed_s=lines[i][0], per_sample_s=lines[i][1],
                           slowest_steps=int(np.sum(slowest == i)), cost_s=float(cost[i])) for i in range(r)]
    return Diagnosis(steps=n, ranks=rank_costs, slow_rank=ranks[k], phase=phase, phase_excess_s=excess[phase],
                     cost_s=float(cost[k]), others_wait_s=float(np.sum(last[slowest == k, None] - arrival[slowest == k][:, others])),
                     measured_s=float(step_time.sum()), equal_split_s=float(equal_split.sum()),
                     model_measured_s=float(model.sum()))


def format_diagnosis(diag: Diagnosis | None) -> str:
    """The diagnosis as the text block of ``dynamix-hvd summarize``."""
    if diag is None:
        return "straggler diagnosis: needs per-step records of at least two ranks"
    head = (f"straggler diagnosis over {diag.steps} steps (arrival at the allreduce = data wait + compute; "
            f"allreduce = own time in synchronize() after the last arrival)")
    table = pd.DataFrame([{
        "rank": rc.rank, "batch": round(rc.batch, 1), "data_wait_ms": rc.data_wait_s * 1e3,
        "compute_ms": rc.compute_s * 1e3, "allreduce_ms": rc.allreduce_s * 1e3,
        "sync_wait_ms": rc.sync_wait_s * 1e3, "line_ms": f"{rc.fixed_s * 1e3:.2f}+{rc.per_sample_s * 1e3:.3f}/sample",
        "last_in_steps": rc.slowest_steps, "cost_s": rc.cost_s} for rc in diag.ranks])
    with pd.option_context("display.width", 200, "display.float_format", "{:.2f}".format):
        text = table.to_string(index=False)
    share = diag.cost_s / diag.measured_s if diag.measured_s > 0 else math.nan
    if diag.straggler:
        verdict = (f"slowest rank: {diag.slow_rank}, in {diag.phase} (+{diag.phase_excess_s * 1e3:.2f} ms per step "
                   f"over the other ranks' median); it cost the job {diag.cost_s:.2f} s of {diag.measured_s:.2f} s "
                   f"of steps ({share:.0%}); the other ranks waited {diag.others_wait_s:.2f} s for it in all")
    else:
        verdict = (f"no straggler: the last rank to arrive cost the job {diag.cost_s:.2f} s of "
                   f"{diag.measured_s:.2f} s of steps ({share:.0%}, under {STRAGGLER_SHARE:.0%}); most often "
                   f"rank {diag.slow_rank}, in {diag.phase}")
    rec = diag.recovered_s
    pct = rec / diag.equal_split_s if diag.equal_split_s > 0 else math.nan
    against = (f"against the equal split: the same steps with each global batch split equally would take an "
               f"estimated {diag.equal_split_s:.2f} s, measured {diag.measured_s:.2f} s: "
               f"{'recovered' if rec >= 0 else 'lost'} {abs(rec):.2f} s ({abs(pct):.0%}) "
               f"(the cost lines put the measured steps at {diag.model_measured_s:.2f} s)")
    return "\n".join([head, text, verdict, against])
