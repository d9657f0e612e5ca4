"""The benchmark suite's records of one example job, the same for every arm (plain Horovod included)
and on either engine (Horovod or torch.distributed, through `bench.jobs.common.world`).

`SuiteRecorder` times each step on every rank (compute = forward + backward, slowdown included; the
rest of the step is idle: waiting for the gradient allreduce, data, the controller; under DDP the
gradient allreduce ends inside backward, and a model's buffers are broadcast at the start of
forward, so there those waits count as compute and the idle fraction reads lower than under
Horovod), evaluates every ``--eval-samples`` training samples, and keeps evaluation time out of the
training clock. At the end rank 0 writes, into the job's OUT directory:

* ``suite_evals.csv``: one row per evaluation (train_s: training wall seconds before it, evaluation
  excluded; eval_s; samples; steps; value; progress: base-batch-equivalent epochs of training
  progress, where the job set `SuiteRecorder.progress`, else NaN);
* ``suite_steps.csv``: one row per rank and step (t_s on the training clock, step_s, compute_s,
  local_batch, global_batch);
* ``suite_result.json``: totals (train_s, eval_total_s, samples, optimizer steps, time to target,
  per-rank idle fraction, the slowed rank's stalls).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.jobs.common import world
from dynamix_hvd.comm import Collective, library_channel

SUITE_FINISH = Collective("bench.suite_finish", 600.0, "bench.jobs.records: every rank's step rows to rank 0")


def sharded_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                score: Callable[[torch.Tensor, torch.Tensor], float]) -> float:
    """Every rank scores its share of (x, y); one allreduce adds the scores and the counts up
    (a collective). Returns the sum of `score` over all samples divided by their number."""
    rank, size = world.rank, world.size
    xs, ys = x[rank::size], y[rank::size]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        value = score(model(xs), ys)
    model.train(was_training)
    total, n = world.allreduce_sum(torch.tensor([value, len(ys)], dtype=torch.float64), "suite_eval").tolist()
    return total / n


class SuiteRecorder:
    """Step timing, evaluations every `eval_samples` samples and the result files (see module doc).

    With ``eval_samples=0`` nothing is evaluated mid-epoch and nothing is written; `evaluate` still
    times the evaluations the script makes (so its clock stays honest)."""

    def __init__(self, out: str | Path, eval_samples: int, target: float, metric: str, meta: dict[str, Any]) -> None:
        if eval_samples < 0:
            raise ValueError(f"--eval-samples {eval_samples}: need >= 0")
        if metric not in ("accuracy", "loss"):
            raise ValueError(f"metric {metric!r}: choose accuracy or loss")
        self.out, self.eval_samples, self.target, self.metric = Path(out), eval_samples, target, metric
        self.meta = meta
        self.rank, self.size = world.rank, world.size
        self.samples = self.steps = 0
        self.eval_total = 0.0
        self.evals: list[dict[str, float]] = []
        self.progress: Callable[[], float] | None = None
        """Training progress in base-batch-equivalent epochs (the job sets it), recorded per evaluation."""
        self.rows: list[tuple[float, ...]] = []
        self._t0 = self._last = self._c0 = self._compute = 0.0

    def start(self) -> None:
        """Line the ranks up (one allreduce) and start the training clock."""
        world.barrier("suite_start")
        self._t0 = time.perf_counter()
        self._last = 0.0

    def train_s(self) -> float:
        """Seconds of training so far, evaluations excluded."""
        return time.perf_counter() - self._t0 - self.eval_total

    def compute_start(self) -> None:
        self._c0 = time.perf_counter()

    def compute_end(self) -> None:
        self._compute = time.perf_counter() - self._c0

    def step_end(self, epoch: int, counts: list[int]) -> bool:
        """Record the step just taken (every rank's sample count in it); True when an evaluation is due."""
        now = self.train_s()
        before = self.samples
        self.samples += sum(counts)
        self.steps += 1
        self.rows.append((self.rank, epoch, self.steps, round(now, 6), now - self._last, self._compute,
                          counts[self.rank], sum(counts)))
        self._last = now
        return self.eval_samples > 0 and self.samples // self.eval_samples > before // self.eval_samples

    def evaluate(self, score: Callable[[], float], epoch: int = -1) -> float:
        """Run `score` (a collective on every rank), keep its time off the training clock, record it."""
        t = time.perf_counter()
        train_s = t - self._t0 - self.eval_total
        value = float(score())
        took = time.perf_counter() - t
        self.eval_total += took
        self.evals.append({"epoch": epoch, "samples": self.samples, "steps": self.steps, "train_s": train_s,
                           "eval_s": took, "value": value,
                           "progress": float(self.progress()) if self.progress is not None else math.nan})
        return value

    def reached(self, value: float) -> bool:
        return value >= self.target if self.metric == "accuracy" else value <= self.target

    def finish(self, score: Callable[[], float] | None = None, extra: dict[str, Any] | None = None) -> None:
        """Final evaluation (if the last one is older than the last step) and the files (collective)."""
        import pandas as pd

        if score is not None and (not self.evals or self.evals[-1]["samples"] != self.samples):
            self.evaluate(score)
        train_s = self.train_s()
        mine = {"rows": self.rows, "extra": extra or {}}
        everyone = library_channel().gather_object(mine, SUITE_FINISH)  # named, with a deadline
        if everyone is None:
            return
        if self.rank != 0 or self.eval_samples == 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        steps = pd.DataFrame([r for d in everyone for r in d["rows"]],
                             columns=["rank", "epoch", "step", "t_s", "step_s", "compute_s", "local_batch",
                                      "global_batch"])
        steps.to_csv(self.out / "suite_steps.csv", index=False)
        evals = pd.DataFrame(self.evals)
        evals.to_csv(self.out / "suite_evals.csv", index=False)
        hit = [e for e in self.evals if math.isfinite(self.target) and self.reached(e["value"])]
        idle = {}
        for r, group in steps.groupby("rank"):
            busy = float(group.step_s.sum())
            idle[int(r)] = 1.0 - float(group.compute_s.sum()) / busy if busy > 0 else math.nan
        result = {"train_s": train_s, "eval_total_s": self.eval_total, "samples": self.samples,
                  "optimizer_steps": self.steps, "metric": self.metric, "target": self.target,
                  "reached": bool(hit), "time_to_target_s": hit[0]["train_s"] if hit else math.inf,
                  "final": self.evals[-1]["value"] if self.evals else math.nan,
                  "throughput": self.samples / train_s if train_s > 0 else math.nan,
                  "idle_fraction": idle, "ranks": self.size,
                  "per_rank": {r: d["extra"] for r, d in enumerate(everyone)}, **self.meta}
        (self.out / "suite_result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
