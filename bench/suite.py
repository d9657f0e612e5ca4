"""The benchmark suite: plain Horovod vs static sizes, classic rules and PPO, on real multi-rank jobs.

    python -m bench.suite --quick            # CI: the harness end to end (1 workload, 1 condition, 1 seed)
    python -m bench.suite --config headline  # one configuration of the full matrix (--list shows them all)

Every arm trains the same model with the same optimizer, LR rule and data order (see
`bench.jobs.common`); only the batch-size policy differs. The reference arm is the
script a Horovod user would otherwise run (``--plain-horovod``: DistributedSampler +
``hvd.DistributedOptimizer(op=Average)``, equal batches). Arms run interleaved: for seed s the arm
order is rotated by s, so no arm always runs first (cold caches) or last (a warmer machine); within
a seed a workload's conditions run side by side, so runs read against each other are minutes apart.

A run writes ``bench/results/NAME/`` (``--out``): ``machine.json`` (CPU, cores, memory, load before
and after, date, versions, git commit, the exact command), ``runs.csv`` (one row per job),
``evals.csv`` (every evaluation of every job: the raw records), ``sizes.csv`` (each rank's batch size
whenever it changed), ``summary.md``/``summary.csv`` and ``plots/``. The jobs' own directories
(traces, per-step records, stdout) stay under ``--runs-dir`` (default ``runs/suite/NAME``).
Definitions are in `bench.suite_report`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from bench.conditions import (Condition, NetworkNamespaces, RateSchedule, cleanup_stale, physical_limit,
                              plain_mpirun, slow_args)
from bench.suite_report import measure, plot_cells, summarize, summary_markdown
from bench.lab.scenarios import MISSPECIFIED
from dynamix_hvd.tools.launchcheck import local_env

REPO = Path(__file__).resolve().parents[1]
RULES = ("linear-ramp", "adabatch", "increase-batch", "noise-scale", "goodput", "speed-split")
STARTUP_S = 8.0  # starting Python, torch, Horovod and MPI on 2 ranks, per job (idle machine)


@dataclass(frozen=True)
class Workload:
    """A benchmark job of bench/jobs, its size in the suite and its target.

    `plain_s`: the plain Horovod run's expected training time on an idle 2-core machine, no
    straggler, from per-step CPU times measured one process at a time (see BENCHMARKS.md)."""

    name: str
    module: str
    metric: str                      # "accuracy" (higher is better) or "loss" (lower is better)
    target: float
    epochs: int
    eval_samples: int
    wall_budget_s: float             # the fixed wall-time budget: final metric at this training time
    plain_s: float
    args: tuple[str, ...] = ()
    default_batch: int = 32          # per rank: plain Horovod, the data-plane rows, the adaptive arms' start
    static_batches: tuple[int, ...] = (16, 32, 64)
    rule_kwargs: dict[str, dict] = field(default_factory=dict)


def rule_kwargs(base: int, steps_per_epoch: int, epochs: int) -> dict[str, dict]:
    """Classic rules' parameters scaled to the workload (global base batch, its schedule length)."""
    return {"linear-ramp": {"end": 4 * base, "ramp": epochs // 2},
            "adabatch": {"every": max(1, epochs // 4), "end": 8 * base},
            "increase-batch": {"milestones": [0.5, 0.75], "factor": 2.0}}


WORKLOADS = {
    # 4,000 train / 1,000 test digits; width 64: 1.12 ms CPU per sample -> ~2.4 s per epoch per rank
    "cnn": Workload("cnn", "bench.jobs.cnn_train", "accuracy", 0.968, 24, 2000, 40.0, 60.0,
                    args=("--width", "64", "--train-samples", "4000", "--eval-every", "1000000000",
                          "--no-report", "--progress", "off"),
                    rule_kwargs=rule_kwargs(64, 63, 24)),
    # 400k characters of stdlib source, 5,940 sequences of 64; 0.92 ms per sequence
    "charlm": Workload("charlm", "bench.jobs.charlm_train", "loss", 1.5, 25, 2000, 50.0, 75.0,
                       args=("--chars", "400000", "--eval-every", "0", "--decide-every", "-1"),
                       default_batch=16, static_batches=(8, 16, 32), rule_kwargs=rule_kwargs(32, 186, 25)),
    # 16,384 generated samples, 2 x 1024 hidden units: 0.15 ms per sample + a 4 MB allreduce per step
    # its test accuracy peaks at ~0.77 after ~2 epochs (label noise) and then slowly falls back
    "mlp": Workload("mlp", "bench.jobs.mlp_train", "accuracy", 0.765, 20, 4096, 30.0, 45.0,
                    args=("--samples", "16384", "--hidden", "1024", "--depth", "2", "--no-report",
                          "--progress", "off"),
                    rule_kwargs=rule_kwargs(64, 256, 20)),
    # functional runs at 8-16 ranks on 2 cores: a narrow CNN, 8 samples per rank (35 steps an epoch at 16 ranks), a decision
    # every 4 steps (what it checks is that decisions reach every rank, not the time)
    "cnn-scale": Workload("cnn-scale", "bench.jobs.cnn_train", "accuracy", 0.5, 4, 500, 60.0, 90.0,
                          args=("--width", "16", "--train-samples", "4500", "--eval-every", "1000000000",
                                "--no-report", "--progress", "off", "--decide-every", "4"), default_batch=8),
    # --quick: the CNN cut to seconds (checks the harness, not the numbers)
    "cnn-quick": Workload("cnn-quick", "bench.jobs.cnn_train", "accuracy", 0.5, 2, 500, 5.0, 15.0,
                          args=("--train-samples", "1000", "--eval-every", "1000000000", "--no-report",
                                "--progress", "off", "--decide-every", "4")),
}

def zoo_workloads() -> dict[str, Workload]:
    """Every job of the workload zoo (`bench.zoo`) as a suite workload, named ``zoo:JOB``: its own
    batch, epochs, evaluation interval and target (time to target on the median of the last three
    evaluations, see `bench.zoo_report`)."""
    from bench.zoo import JOBS

    return {f"zoo:{n}": Workload(f"zoo:{n}", "bench.zoo_train", "accuracy" if j.higher_is_better else "loss",
                                 j.target, j.epochs, j.eval_every, 600.0, 30.0, args=("--job", n),
                                 default_batch=j.batch, static_batches=(j.batch,))
            for n, j in JOBS.items()}


WORKLOADS.update(zoo_workloads())

LONG_ZOO = {"gru-charlm": 4, "lstm-rows": 10}
"""Epoch multipliers that make plain Horovod train the two shortest-step evaluation jobs for about a
minute on the 2-core VM (``zoo:JOB:long``: same target, evaluations half as often per epoch)."""


def longer(job: str, k: int, name: str, **changes: Any) -> Workload:
    """Zoo job `job` trained k times its epochs, as workload `name` (other fields in `changes`)."""
    base = WORKLOADS[f"zoo:{job}"]
    return replace(base, name=name, epochs=base.epochs * k, **changes)


WORKLOADS.update({f"zoo:{n}:long": longer(n, k, f"zoo:{n}:long", plain_s=65.0,
                                          eval_samples=WORKLOADS[f"zoo:{n}"].eval_samples * k // 2)
                  for n, k in LONG_ZOO.items()})
HEADLINE_ZOO = {"lstm-rows": (3, 0.94)}
"""Epoch multipliers and targets of the headline's evaluation jobs that their own length leaves too
short (``zoo:JOB:xK``). At 8 epochs lstm-rows trains about 5 s; at 24 about 12 s, with 96
evaluations, so its budget time (the whole run) is a longer measurement. Its accuracy flattens
early: plain Horovod's median of three evaluations passes the target 0.94 (the job's own is 0.935)
after 5.5-7 epochs and ends at 0.959-0.963 (three seeds, bench/results/zoo-headline-2026-12-05-0034), so no target
is both late and reached by every seed."""
WORKLOADS.update({f"zoo:{n}:x{k}": longer(n, k, f"zoo:{n}:x{k}", target=target,
                                            plain_s=WORKLOADS[f"zoo:{n}"].plain_s * k)
                  for n, (k, target) in HEADLINE_ZOO.items()})

def periodic_schedule(every: float, length: float, during: float, after: float, until: float = 300.0) -> str:
    """"SECONDS:VALUE,..." that is `during` for `length` seconds every `every` seconds (from `every` on)
    and `after` in between, up to `until` seconds."""
    points, t = [], every
    while t < until:
        points += [f"{t:g}:{during:g}", f"{t + length:g}:{after:g}"]
        t += every
    return ",".join(points)


def _interference() -> dict[str, float]:
    c = MISSPECIFIED["interference"]
    return dict(every=c["interfere_every"], length=c["interfere_for"], during=c["interfere_factor"], after=1.0)


def _bursts() -> dict[str, float]:
    c = MISSPECIFIED["bursts"]
    return dict(every=c["burst_every"], length=c["burst_for"], during=1000.0 / c["burst_factor"], after=1000.0)


CONDITIONS = {
    "none": Condition("none", 2),
    "slow2x": Condition("slow2x", 2, slow_rank=1, slow_factor=2.0),
    "slow3x": Condition("slow3x", 2, slow_rank=1, slow_factor=3.0),
    "slow-varying": Condition("slow-varying", 2, slow_rank=1, slow_factor=1.0, slow_schedule="20:3,60:1.5"),
    # the zoo's changing straggler: jobs of ~15-60 s, so the phases come sooner
    "slow-changing": Condition("slow-changing", 2, slow_rank=1, slow_factor=1.0, slow_schedule="5:3,20:1.5"),
    # the same phases at the same points of every arm's training: 3x from 10% of the epoch budget's
    # samples, 1.5x from 35% (a seconds schedule gives the faster arm fewer slow seconds)
    "slow-phases": Condition("slow-phases", 2, slow_rank=1, slow_factor=1.0, slow_schedule="0.1:3,0.35:1.5",
                             slow_clock="budget"),
    "stalls": Condition("stalls", 2, slow_rank=1, stall_rate=0.5, stall_ms=200.0),
    "net10": Condition("net10", 2, rate_mbit=10.0),
    "net100": Condition("net100", 2, rate_mbit=100.0),
    "net1g": Condition("net1g", 2, rate_mbit=1000.0),
    # the zoo's changing network: jobs of ~15-60 s, so the phases come a few decisions apart
    "net-changing": Condition("net-changing", 2, rate_mbit=100.0, rate_schedule="10:10,25:50"),
    "net10-slow3x": Condition("net10-slow3x", 2, slow_rank=1, slow_factor=3.0, rate_mbit=10.0),
    "net100-slow3x": Condition("net100-slow3x", 2, slow_rank=1, slow_factor=3.0, rate_mbit=100.0),
    "net1g-1ms": Condition("net1g-1ms", 2, rate_mbit=1000.0, delay_ms=1.0),
    # where a fitted model is misspecified (bench.lab.scenarios.MISSPECIFIED, in seconds for jobs that
    # decide about once a second): a co-located job on rank 1 (training seconds), another job's traffic
    # on the link (seconds from the job's launch, as every rate schedule)
    "interference": Condition("interference", 2, slow_rank=1, slow_factor=1.0,
                              slow_schedule=periodic_schedule(**_interference())),
    "bursts": Condition("bursts", 2, rate_mbit=1000.0, rate_schedule=periodic_schedule(**_bursts())),
    # scaling rows: more ranks than cores, so the slowed rank sleeps (the output says so)
    "scale4-slow3x": Condition("scale4-slow3x", 4, slow_rank=3, slow_factor=3.0, slow_mode="sleep"),
    "scale8-slow3x": Condition("scale8-slow3x", 8, slow_rank=7, slow_factor=3.0, slow_mode="sleep"),
    "scale16-slow3x": Condition("scale16-slow3x", 16, slow_rank=15, slow_factor=3.0, slow_mode="sleep"),
}


@dataclass(frozen=True)
class Arm:
    """One batch-size policy: its label, the flags that select it and its per-rank starting batch
    (None: the workload's default)."""

    label: str
    flags: tuple[str, ...]
    batch: int | None = None


def arms(w: Workload, names: list[str]) -> list[Arm]:
    """Arms by name: "plain" (plain Horovod), "static" (every static size), "static-N",
    "dataplane" (loader + weighted optimizer, no controller, default size), "rules" (every classic
    rule), a rule name, "model" (the cost-model proposal alone), "model-explore" (the proposal letting B
    grow before the cost lines are identified, as AdaptDL), "model-nobudget" (the proposal without the
    training budget's cap on B), "ppo" (shipped policy, greedy),
    "ppo-online" (it keeps learning), "ppo-progress" (the shipped policy, ending on training progress)."""
    out: list[Arm] = []
    for name in names:
        if name == "plain":
            out.append(Arm("plain-horovod", ("--plain-horovod",)))
        elif name == "static":
            out += [Arm(f"static-{b}", ("--policy", "static"), b) for b in w.static_batches]
        elif name.startswith("static-"):
            out.append(Arm(name, ("--policy", "static"), int(name.split("-")[1])))
        elif name == "split":  # a fixed speed-proportional split through the data plane alone, no controller
            out.append(Arm("split-speed", ("--policy", "static", "--no-controller")))
        elif name == "dataplane":
            out.append(Arm(f"dataplane-{w.default_batch}", ("--policy", "static", "--no-controller")))
        elif name == "rules":
            out += arms(w, list(RULES))
        elif name in RULES:
            kw = ("--policy-config", json.dumps(w.rule_kwargs[name])) if name in w.rule_kwargs else ()
            out.append(Arm(name, ("--policy", name, *kw)))
        elif name == "ppo-bn1":  # the shipped policy without the BatchNorm floor: ranks may go down to one sample
            out.append(Arm(name, ("--policy", "ppo", "--policy-file", "default", "--learn", "0",
                                  "--batchnorm-floor", "1")))
        elif name == "model":
            out.append(Arm("model", ("--policy", "model")))
        elif name == "model-nobudget":  # the default without the budget's cap on B (goodput alone decides)
            out.append(Arm(name, ("--policy", "model", "--policy-config", json.dumps({"budget_loss": 1.0}))))
        elif name == "model-explore":  # AdaptDL's exploration: B may grow on the pinned fixed-cost guess
            out.append(Arm(name, ("--policy", "model", "--policy-config", json.dumps({"hold_unidentified": 0}))))
        elif name == "ppo-progress":  # the shipped policy ending on training progress (zoo jobs: --budget progress)
            out.append(Arm(name, ("--policy", "ppo", "--policy-file", "default", "--learn", "0",
                                  "--budget", "progress")))
        elif name in ("ppo-progress-fullgain", "ppo-progress-sqrtgain"):  # the LR rule on Adam-type optimizers
            out.append(Arm(name, ("--policy", "ppo", "--policy-file", "default", "--learn", "0",
                                  "--budget", "progress", "--adaptive", "0" if name.endswith("fullgain") else "1")))
        elif name in ("ppo", "ppo-online"):
            out.append(Arm(name, ("--policy", "ppo", "--policy-file", "default", "--learn",
                                  "1" if name == "ppo-online" else "0")))
        else:
            raise ValueError(f"unknown arm {name!r}")
    return out


ALL_ARMS = ["plain", "static", "rules", "model", "ppo", "ppo-online"]
TIMING = ["none", "slow2x", "slow3x", "slow-varying", "stalls", "net10", "net1g-1ms"]
# A group: workloads x conditions x arms, `seeds` seeds (headline rows: 5); with `first_seed` k the seeds
# k .. seeds - 1 only (to add seeds to an earlier run of seeds 0 .. k - 1).
CONFIGS: dict[str, list[dict[str, Any]]] = {
    "quick": [{"workloads": ["cnn-quick"], "conditions": ["slow2x"], "arms": ["plain", "static-32", "speed-split"],
               "seeds": 1}],
    "headline": [{"workloads": ["cnn"], "conditions": ["none", "slow3x"], "arms": ALL_ARMS, "seeds": 5}],
    # the headline's 3x row cut to what fits in about an hour: the references and the adaptive defaults
    "headline-lite": [{"workloads": ["cnn"], "conditions": ["slow3x"],
                       "arms": ["plain", "static-32", "static-64", "model", "ppo"], "seeds": 5}],
    # the CNN's other rows (2x, no straggler), same arms and cut as headline-lite
    # (~107 min: run it in parts with --budget-min and --resume)
    "goals-lite": [{"workloads": ["cnn"], "conditions": ["slow2x", "none"],
                    "arms": ["plain", "static-32", "static-64", "model", "ppo"], "seeds": 5}],
    # the proposal's early phase: B held until the cost lines are identified (model) against AdaptDL's
    # exploration (model-explore), with plain Horovod as the reference (~35 min)
    "early-lite": [{"workloads": ["cnn"], "conditions": ["slow3x"], "arms": ["plain", "model", "model-explore"],
                    "seeds": 5}],
    # a live check of a newly trained shipped policy on the 3x row, beside the proposal alone (~28 min)
    "policy-check": [{"workloads": ["cnn"], "conditions": ["slow3x"], "arms": ["plain", "model", "ppo"],
                      "seeds": 3}],
    # the three goal rows with the shipped policy (ppo, greedy) against both
    # references, 5 seeds each, in one run (~110 min)
    "headline-final": [{"workloads": ["cnn"], "conditions": ["slow3x", "slow2x", "none"],
                        "arms": ["plain", "static-32", "ppo"], "seeds": 5}],
    # per-step logs of the other two workloads for the simulator's calibrated profiles
    # (bench/lab/profiles/), with plain Horovod beside them (~20 min)
    "calibration-logs": [{"workloads": ["charlm", "mlp"], "conditions": ["slow3x", "none"],
                          "arms": ["plain", "model"], "seeds": 1}],
    "cnn": [{"workloads": ["cnn"], "conditions": ["slow2x", "slow-varying", "stalls", "net10", "net1g-1ms"],
             "arms": ALL_ARMS, "seeds": 3}],
    "charlm": [{"workloads": ["charlm"], "conditions": ["none", "slow3x"], "arms": ALL_ARMS, "seeds": 5},
               {"workloads": ["charlm"], "conditions": ["slow2x", "slow-varying", "stalls", "net10"],
                "arms": ["plain", "static", "speed-split", "goodput", "ppo", "ppo-online"], "seeds": 3}],
    "mlp": [{"workloads": ["mlp"], "conditions": ["none", "slow3x", "net10"],
             "arms": ["plain", "static", "speed-split", "goodput", "ppo", "ppo-online"], "seeds": 3}],
    "overhead": [{"workloads": ["cnn", "charlm", "mlp"], "conditions": ["none"],
                  "arms": ["plain", "dataplane", "static-32", "static-16"], "seeds": 5}],
    "scaling": [{"workloads": ["cnn"], "conditions": ["scale4-slow3x"],
                 "arms": ["plain", "static", "speed-split", "ppo"], "seeds": 3}],
}
ZOO_EVAL = ["zoo:mnist-cnn", "zoo:resnet-bn", "zoo:gru-charlm", "zoo:lstm-rows", "zoo:mf-ratings"]
ZOO_HEADLINE = [f"{w}:x{HEADLINE_ZOO[n][0]}" if (n := w.removeprefix("zoo:")) in HEADLINE_ZOO else w for w in ZOO_EVAL]
ZOO_TUNING = ["zoo:mlp-digits", "zoo:mlp-synth", "zoo:cnn-wide", "zoo:vgg-digits", "zoo:charlm-transformer",
              "zoo:bag-code"]
# the workload zoo's headline: its evaluation half, with and without stragglers, the default (the
# proposal, policy "model") against plain Horovod and the fixed speed-proportional split
# (3 seeds; `bench.zoo_report` reads it)
CONFIGS.update({
    "zoo-quick": [{"workloads": ["zoo:mnist-cnn"], "conditions": ["slow3x"], "arms": ["plain", "split", "ppo"],
                   "seeds": 1}],
    "zoo-headline": [{"workloads": ZOO_HEADLINE, "conditions": ["none"], "arms": ["plain", "model"], "seeds": 3},
                     {"workloads": ZOO_HEADLINE, "conditions": ["slow3x", "slow-phases"],
                      "arms": ["plain", "split", "model"], "seeds": 3}],
    "zoo-headline-lite": [{"workloads": ZOO_EVAL, "conditions": ["none", "slow3x"],
                           "arms": ["plain", "split", "ppo"], "seeds": 1}],
    # with a straggler, the default (the proposal) beside plain Horovod and the best fixed split on the
    # evaluation half; each row's limit comes from its own plain run (`bench.zoo_report`)
    "zoo-straggler": [{"workloads": ZOO_EVAL, "conditions": ["slow3x", "slow2x", "slow-changing"],
                       "arms": ["plain", "split", "model"], "seeds": 3}],
    # the changing slowdown alone (rank 1: 1x, 3x from 5 s, 1.5x from 20 s), as in zoo-straggler (~17 min)
    "zoo-straggler-changing": [{"workloads": ZOO_EVAL, "conditions": ["slow-changing"],
                                "arms": ["plain", "split", "model"], "seeds": 3}],
    # rank 1 2x slower alone, the default beside plain Horovod and the best fixed split, on the
    # headline's jobs (lstm-rows at its 24 epochs), the headline's missing column (~25 min)
    "zoo-straggler-2x": [{"workloads": ZOO_HEADLINE, "conditions": ["slow2x"], "arms": ["plain", "split", "model"],
                          "seeds": 3}],
    # no harm: the default (the proposal) against plain Horovod on equal-speed ranks (3 seeds, ~12 min)
    "zoo-noharm": [{"workloads": ZOO_EVAL, "conditions": ["none"], "arms": ["plain", "model"], "seeds": 3}],
    # the two shortest-step evaluation jobs trained about a minute each, where whole jobs of 13-37 s
    # were too noisy and too short for the first decisions: no harm on equal ranks, and rank 1 3x
    # slower beside the best fixed split (~45 min)
    "zoo-long": [{"workloads": ["zoo:gru-charlm:long", "zoo:lstm-rows:long"], "conditions": ["none"],
                  "arms": ["plain", "model"], "seeds": 3},
                 {"workloads": ["zoo:gru-charlm:long", "zoo:lstm-rows:long"], "conditions": ["slow3x"],
                  "arms": ["plain", "split", "model"], "seeds": 3}],
    # no harm on jobs of about a minute: zoo-long's equal-rank half alone (~20 min)
    "zoo-long-noharm": [{"workloads": ["zoo:gru-charlm:long", "zoo:lstm-rows:long"], "conditions": ["none"],
                         "arms": ["plain", "model"], "seeds": 3}],
    # no harm, per epoch: the data plane alone and the controller deciding static, at equal sizes
    "zoo-overhead": [{"workloads": ZOO_EVAL, "conditions": ["none"], "arms": ["plain", "dataplane", "static"],
                      "seeds": 1}],
    # what the BatchNorm floor costs or saves: the ResNet with a straggler, the shipped policy with and without it
    "zoo-batchnorm": [{"workloads": ["zoo:resnet-bn"], "conditions": ["slow3x"], "arms": ["plain", "ppo", "ppo-bn1"],
                       "seeds": 2}],
    # measured critical batch against the noise-scale estimate: static sizes (the controller deciding
    # "static", so the AdaScale LR and the gradient statistics run) at 1/2, 1, 2 and 4 times the batch,
    # 3 seeds (~15 min)
    "zoo-critical": [{"workloads": [w], "conditions": ["none"],
                      "arms": ["plain", *(f"static-{m * b // 2}" for m in (1, 2, 4, 8))], "seeds": 3}
                     for w, b in (("zoo:mnist-cnn", 64), ("zoo:lstm-rows", 32), ("zoo:gru-charlm", 16))],
    # slow and changing links (every rank in its own network namespace, tbf-shaped): where a larger
    # batch pays for the allreduce, and where it must not be grown
    # (the adaptive arm ends on training progress, so its final metric is at equal progress; ~45 min)
    "zoo-network": [{"workloads": ["zoo:mnist-cnn", "zoo:gru-charlm"],
                     "conditions": ["net10", "net100", "net-changing"],
                     "arms": ["plain", "ppo-progress"], "seeds": 3}],
    # the same links with rank 1 3x slower; the plain runs without the straggler give each row's limit
    # (~25 min)
    "zoo-network-slow": [{"workloads": ["zoo:mnist-cnn"], "conditions": ["net10-slow3x", "net100-slow3x"],
                          "arms": ["plain", "ppo-progress"], "seeds": 3},
                         {"workloads": ["zoo:mnist-cnn"], "conditions": ["net10", "net100"], "arms": ["plain"],
                          "seeds": 3}],
    # where a fitted model is misspecified, live: the shipped PPO against the proposal alone (~10 min;
    # the simulator's side: python -m bench.lab.misspecified)
    "zoo-misspecified": [{"workloads": ["zoo:mnist-cnn"], "conditions": ["interference", "bursts"],
                          "arms": ["plain", "model", "ppo"], "seeds": 3}],
    # the same on an evaluation job (~8 min): interference, and a slow rank that goes 1x, 3x (from 20 s),
    # 1.5x (from 60 s), which in these ~10 s-to-target jobs mostly comes after the target
    "zoo-misspecified-gru": [{"workloads": ["zoo:gru-charlm"], "conditions": ["slow-varying", "interference"],
                              "arms": ["plain", "model", "ppo"], "seeds": 3}],
    # functional runs at 8 and 16 ranks on this machine's cores (the slow rank sleeps): decisions reach
    # every rank, nobody starves; decision latency per world size (python -m bench.scale_report)
    "scale-functional": [{"workloads": ["cnn-scale"], "conditions": ["scale8-slow3x", "scale16-slow3x"],
                          "arms": ["plain", "model"], "seeds": 1}],
    # where the no-straggler cost sits: the data plane alone (equal sizes, no controller) and the shipped policy,
    # each as its own mpirun job beside plain Horovod (~6 min)
    "zoo-dataplane-cnn": [{"workloads": ["zoo:mnist-cnn"], "conditions": ["none"], "arms": ["plain", "dataplane", "ppo"],
                           "seeds": 3}],
    # the LR coupling on Adam-type optimizers where B grows: AdaScale's gain or its square root
    "zoo-adaptive-lr": [{"workloads": ["zoo:mf-ratings"], "conditions": ["none"],
                         "arms": ["plain", "ppo-progress-fullgain", "ppo-progress-sqrtgain"], "seeds": 3},
                        {"workloads": ["zoo:gru-charlm"], "conditions": ["net10"],
                         "arms": ["plain", "ppo-progress-fullgain", "ppo-progress-sqrtgain"], "seeds": 2}],
    # the changing slowdown on the two jobs whose cadence intervals are longest in steps, the default
    # beside plain Horovod (~3 min): how soon it follows a change (each run's decisions.csv)
    "zoo-changing-probe": [{"workloads": ["zoo:mnist-cnn", "zoo:lstm-rows:x3"], "conditions": ["slow-phases"],
                            "arms": ["plain", "model"], "seeds": 1}],
    # the tuning half under the changing slowdown beside plain Horovod (~7 min): how closely the
    # default's splits follow each change (`bench.zoo_report --balance`: a run's steps' time at the
    # balanced split over theirs)
    "zoo-changing-tuning": [{"workloads": ZOO_TUNING, "conditions": ["slow-phases"], "arms": ["plain", "model"],
                             "seeds": 2}],
    "zoo-network-quick": [{"workloads": ["zoo:mnist-cnn"], "conditions": ["net10", "net100", "net1g"],
                           "arms": ["plain", "ppo"], "seeds": 1}],
    "zoo-tuning": [{"workloads": ZOO_TUNING, "conditions": ["none", "slow3x"], "arms": ["plain", "split", "ppo"],
                    "seeds": 1}],
    # the budget's cap on growth against the same proposal without it, beside plain Horovod: decided on
    # the tuning half (seed 0, then seeds 1-2: ~18 and ~23 min), reported on the evaluation half (~23 min)
    "zoo-budget-tuning": [{"workloads": ZOO_TUNING, "conditions": ["none", "slow2x", "slow-phases"],
                           "arms": ["plain", "model", "model-nobudget"], "seeds": 1}],
    "zoo-budget-tuning-more": [{"workloads": ZOO_TUNING, "conditions": ["none", "slow2x"],
                                "arms": ["plain", "model", "model-nobudget"], "seeds": 3, "first_seed": 1}],
    "zoo-budget-eval": [{"workloads": ZOO_HEADLINE, "conditions": ["slow3x"],
                         "arms": ["plain", "model", "model-nobudget"], "seeds": 3}],
    # the tuning half's compute-dominated job (a few percent of a step fixed, where a split should come
    # close to the limit), added after the defaults were set: the headline's matrix on it (~28 min)
    "zoo-vgg-tuning": [{"workloads": ["zoo:vgg-digits"], "conditions": ["none"], "arms": ["plain", "model"],
                        "seeds": 3},
                       {"workloads": ["zoo:vgg-digits"], "conditions": ["slow3x", "slow-phases"],
                        "arms": ["plain", "split", "model"], "seeds": 3}],
    # the controller's gate on the tuning half before the evaluation half is run: equal ranks, a 2x
    # straggler and a changing one, the default beside plain Horovod and the fixed split (~21 min)
    "zoo-straggler-tuning": [{"workloads": ZOO_TUNING, "conditions": ["none"], "arms": ["plain", "model"], "seeds": 1},
                             {"workloads": ZOO_TUNING, "conditions": ["slow2x", "slow-phases"],
                              "arms": ["plain", "split", "model"], "seeds": 1}],
})
CONFIGS["full"] = [g for name in ("headline", "cnn", "charlm", "mlp", "overhead", "scaling") for g in CONFIGS[name]]


@dataclass(frozen=True)
class Job:
    workload: Workload
    condition: Condition
    arm: Arm
    seed: int

    @property
    def batch(self) -> int:
        if self.arm.label.startswith("dataplane-"):
            return int(self.arm.label.split("-")[1])
        return self.arm.batch or self.workload.default_batch

    @property
    def key(self) -> str:
        return f"{self.workload.name}/{self.condition.name}/{self.arm.label}_s{self.seed}"

    def sizes(self) -> list[int]:
        """Per-rank starting sizes: equal, or for the split-speed arm in proportion to the ranks' speeds
        under the condition (a changing slowdown: its time-weighted mean is not known up front, so the
        mean of its phases' factors), the global batch kept."""
        c, b = self.condition, self.batch
        if self.arm.label != "split-speed" or c.slow_rank < 0:
            return [b] * c.ranks
        phases = [c.slow_factor] + [f for _, f in _pairs(c.slow_schedule)]
        factor = sum(phases[1:]) / len(phases[1:]) if c.slow_schedule else c.slow_factor
        speed = [1.0 / factor if r == c.slow_rank else 1.0 for r in range(c.ranks)]
        total = b * c.ranks
        sizes = [max(1, int(total * s / sum(speed))) for s in speed]
        sizes[0] += total - sum(sizes)
        return sizes

    def expected_s(self) -> float:
        """Upper estimate on an idle machine: the plain run slowed by the slowest rank, plus start-up
        and evaluations (~15%); a shaped network is assumed to double it."""
        c, w = self.condition, self.workload
        slowest = max([c.slow_factor, *(f for _, f in _pairs(c.slow_schedule))]) if c.slow_rank >= 0 else 1.0
        scale = slowest * (c.ranks / 2 if c.ranks > 2 else 1.0) * (2.0 if c.networked else 1.0)
        scale += c.stall_rate * c.stall_ms / 1000 * 2  # stalls: mean Pareto(1.5) multiple 3, capped
        return STARTUP_S + 1.15 * w.plain_s * scale


def _pairs(text: str) -> list[tuple[float, float]]:
    from bench.conditions import parse_pairs

    return parse_pairs(text)


def rotate(items: list[Any], seed: int) -> list[Any]:
    """The arm order for `seed`: rotated by `seed` places."""
    k = seed % len(items) if items else 0
    return items[k:] + items[:k]


def expand(groups: list[dict[str, Any]]) -> list[Job]:
    """The jobs of a configuration, seed by seed; within a seed workload by workload (in order of first
    appearance), each workload's conditions side by side, the arms rotated. A workload's runs under
    different conditions are read against each other (a no-straggler run gives a straggler row's
    two-run limit and the no-harm rows), and this machine's speed drifts by tens of percent over
    minutes, so they run next to each other rather than a whole seed apart."""
    jobs = []
    for seed in range(max(g["seeds"] for g in groups)):
        cells = [(g, cname, wname) for g in groups if g.get("first_seed", 0) <= seed < g["seeds"]
                 for cname in g["conditions"] for wname in g["workloads"]]
        first = list(dict.fromkeys(wname for _, _, wname in cells))
        for g, cname, wname in sorted(cells, key=lambda cell: first.index(cell[2])):  # stable
            w = WORKLOADS[wname]
            jobs += [Job(w, CONDITIONS[cname], a, seed) for a in rotate(arms(w, g["arms"]), seed)]
    return jobs


def job_argv(job: Job, out: Path) -> list[str]:
    w, c = job.workload, job.condition
    return [sys.executable, "-m", w.module, *w.args, "--epochs", str(w.epochs), "--batch-sizes",
            ",".join(map(str, job.sizes())), "--seed", str(job.seed), "--out", str(out),
            "--eval-samples", str(w.eval_samples), "--target", str(w.target), *slow_args(c), *job.arm.flags]


def run_job(job: Job, runs_dir: Path, timeout: float) -> dict[str, Any]:
    """Start one mpirun job, wait for it (killing its process group at `timeout`), measure it."""
    out = runs_dir / job.key
    out.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"workload": job.workload.name, "condition": job.condition.name, "arm": job.arm.label,
                           "seed": job.seed, "run_dir": str(out), "load_before": os.getloadavg()[0],
                           "physical_limit": physical_limit(job.condition),
                           "slow_mode": job.condition.slow_mode if job.condition.slow_rank >= 0 else ""}
    argv = job_argv(job, out)
    env = local_env(REPO, DYNAMIX_PROGRESS="off")
    keys = ("OMP_NUM_THREADS", "PYTHONPATH", "DYNAMIX_PROGRESS")
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        cmd = plain_mpirun(job.condition.ranks, argv, keys)
        net = None
        if job.condition.networked:
            try:
                net = stack.enter_context(NetworkNamespaces(job.condition.ranks, job.condition.rate_mbit,
                                                            job.condition.delay_ms))
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                why = str(getattr(exc, "stderr", "") or exc).strip().splitlines()[0]
                return {**row, "status": f"not runnable here: {why}"}
            cmd, extra = net.mpirun(argv, keys)
            env.update(extra)
        (out / "command.txt").write_text(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        sched = RateSchedule(net, job.condition.rate_schedule) if net and job.condition.rate_schedule else None
        if sched:
            sched.start()
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text = proc.communicate()[0] + f"\n[suite] killed after {timeout:.0f} s\n"
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): take the job down, then clean up
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        if sched:
            sched.stop()
        if net is not None:
            (out / "tc_stats.txt").write_text("\n".join(net.stats()))
    (out / "stdout.txt").write_text(text)
    row.update(job_s=time.perf_counter() - t0, returncode=proc.returncode, load_after=os.getloadavg()[0])
    if proc.returncode != 0:
        return {**row, "status": f"failed (exit {proc.returncode}); see {out}/stdout.txt"}
    try:
        return {**row, "status": "ok", **measure(out, job.workload.wall_budget_s)}
    except (OSError, KeyError, ValueError, IndexError) as exc:
        return {**row, "status": f"unreadable: {exc!r}"}


def earlier_record(machine_json: Path) -> dict[str, Any]:
    """The machine.json of an earlier run in OUT ({} when there is none or it does not parse)."""
    try:
        return json.loads(machine_json.read_text()) if machine_json.exists() else {}
    except json.JSONDecodeError:
        print(f"ignoring {machine_json}: not valid JSON", flush=True)
        return {}


def read_runs(runs_csv: Path, commit: str = "unknown") -> list[dict[str, Any]]:
    """runs.csv's rows as written (a run that ran no job wrote no columns: no rows); rows without a
    commit get `commit`."""
    if not runs_csv.exists() or runs_csv.stat().st_size == 0:
        return []
    try:
        frame = pd.read_csv(runs_csv, dtype={"physical_limit": str, "git_commit": str, "slow_mode": str})
    except pd.errors.EmptyDataError:
        return []
    for column, missing in (("git_commit", commit), ("slow_mode", "")):
        if column in frame:
            frame[column] = frame[column].fillna(missing)
        else:
            frame[column] = missing
    return frame.to_dict("records")


def kept_rows(runs_csv: Path, wanted: dict[str, Job], commit: str = "unknown") -> dict[str, dict[str, Any]]:
    """The rows of an earlier (partial) run worth keeping: jobs of this configuration with a result
    whose job directory still reads, re-measured with today's `measure` (a row that no longer
    measures is dropped, so its job runs again); keyed like `Job.key`."""
    kept, other = {}, []
    for row in read_runs(runs_csv, commit):
        key = f"{row['workload']}/{row['condition']}/{row['arm']}_s{row['seed']}"
        if key not in wanted:
            other.append(key)
        if key not in wanted or row.get("status") != "ok":
            continue
        try:
            row.update(measure(Path(str(row["run_dir"])), wanted[key].workload.wall_budget_s))
        except (OSError, KeyError, ValueError, IndexError):
            continue
        kept[key] = row
    if other:
        print(f"not kept ({len(other)} rows of jobs this configuration does not have): {', '.join(other)}", flush=True)
    return kept


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, load average, date, versions and git commit of this run."""
    import torch

    import dynamix_hvd

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    mem = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0) if Path("/proc/meminfo").exists() else 0
    try:
        import horovod

        hvd_version = horovod.__version__
    except ImportError:
        hvd_version = "not installed"
    mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpu": cpu,
            "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)), "memory_mib": mem,
            "load_before": os.getloadavg(), "python": platform.python_version(), "torch": torch.__version__,
            "horovod": hvd_version, "mpi": mpi[0] if mpi else "", "dynamix_hvd": dynamix_hvd.__version__,
            "git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(_git("status", "--porcelain")),
            "kernel": platform.release()}


def listing(name: str, jobs: list[Job]) -> str:
    total = sum(j.expected_s() for j in jobs)
    lines = [f"{j.key}: {j.condition.describe()}; ~{j.expected_s():.0f} s" for j in jobs]
    return "\n".join(lines + [f"config {name}: {len(jobs)} jobs, expected ~{total / 60:.0f} min on an idle "
                              "2-core machine"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="", choices=sorted(CONFIGS), help="configuration to run")
    ap.add_argument("--quick", action="store_true", help="same as --config quick (CI)")
    ap.add_argument("--list", action="store_true", help="print the configuration's jobs (every one without --config)")
    ap.add_argument("--out", default="", help="results directory (default bench/results/NAME)")
    ap.add_argument("--runs-dir", default="", help="job directories (default runs/suite/NAME)")
    ap.add_argument("--timeout-factor", type=float, default=4.0,
                    help="a job is killed after this many times its expected time, at least 120 s (it then fails)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--summarize-only", action="store_true", help="run nothing: re-measure OUT/runs.csv's jobs")
    ap.add_argument("--resume", action="store_true",
                    help="keep the jobs OUT/runs.csv already has with a result (their job directories must "
                         "still exist) and run only the others: a configuration longer than one sitting "
                         "runs in parts; every row records the commit it ran at")
    ap.add_argument("--budget-min", type=float, default=0.0,
                    help="start no job that would end after this many minutes (its expected time); the "
                         "summary then lists the jobs not run yet (continue with --resume). 0: no limit")
    args = ap.parse_args(argv)
    name = "quick" if args.quick else args.config
    if args.list:
        for n in ([name] if name else list(CONFIGS)):
            print(listing(n, expand(CONFIGS[n])))
        return 0
    if not name:
        ap.error("give --quick, --config NAME or --list")
    if args.resume and args.summarize_only:
        ap.error("--resume runs the jobs still missing; --summarize-only runs none: give one of them")
    if not (math.isfinite(args.budget_min) and args.budget_min >= 0):
        ap.error(f"--budget-min={args.budget_min}: give minutes >= 0 (0: no limit)")
    jobs = expand(CONFIGS[name])
    out = Path(args.out or REPO / "bench" / "results" / name)
    runs_dir = Path(args.runs_dir or REPO / "runs" / "suite" / name)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["command"] = " ".join(["python", "-m", "bench.suite", *(sys.argv[1:] if argv is None else argv)])
    info["config"] = {"name": name, "groups": CONFIGS[name], "expected_s": sum(j.expected_s() for j in jobs),
                      "conditions": {c.name: c.describe() for c in {j.condition.name: j.condition for j in jobs}.values()}}
    if any(j.condition.networked for j in jobs) and (stale := cleanup_stale()):
        print(f"removed namespaces/links left by a killed benchmark: {', '.join(stale)}", flush=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    before = earlier_record(out / "machine.json") if args.summarize_only or args.resume else {}
    # rows written before runs.csv had a commit column ran at the commit their record names
    commit = str(before.get("git_commit", ""))[:12] or "unknown"
    if args.summarize_only:
        for row in read_runs(out / "runs.csv", commit):
            if row["status"] == "ok":
                try:
                    row.update(measure(Path(row["run_dir"]), WORKLOADS[row["workload"]].wall_budget_s))
                except (OSError, KeyError, ValueError, IndexError) as exc:
                    row["status"] = f"unreadable: {exc!r}"
            rows.append(row)
        jobs = []
        # the record of the run being re-measured stays (when there is one); this pass is noted beside it
        info = {**(before or {**info, "original_record": "missing"}), "config": info["config"],
                "resummarized": {k: info[k] for k in ("date", "command", "git_commit", "git_dirty")}}
    if args.resume:
        if before:  # earlier parts' machines, dates and commits stay on record
            info["earlier_parts"] = before.pop("earlier_parts", []) + [before]
        done = kept_rows(out / "runs.csv", {j.key: j for j in jobs}, commit)
        rows += [done[j.key] for j in jobs if j.key in done]
        info["resumed"] = {"kept": len(done), "commits": sorted({str(r["git_commit"]) for r in done.values()})}
        print(f"resuming: {len(done)} of {len(jobs)} jobs already have a result in {out / 'runs.csv'}", flush=True)
        jobs = [j for j in jobs if j.key not in done]
    pending: list[Job] = []
    for i, job in enumerate(jobs):
        if args.budget_min and time.perf_counter() - t0 + job.expected_s() > 60 * args.budget_min:
            pending = jobs[i:]
            break
        row = run_job(job, runs_dir, max(120.0, args.timeout_factor * job.expected_s()))
        row["git_commit"] = info["git_commit"][:12] + ("+dirty" if info["git_dirty"] else "")
        rows.append(row)
        print(f"[{i + 1}/{len(jobs)} {time.perf_counter() - t0:5.0f}s] {job.key}: {row['status']} "
              f"ttt {row.get('time_to_target_s', math.nan):.1f}s final {row.get('final', math.nan):.4f} "
              f"idle {row.get('idle_mean', math.nan):.2f}", flush=True)
        pd.DataFrame(rows).to_csv(out / "runs.csv", index=False)  # partial results survive an interrupt
    runs = pd.DataFrame(rows)
    runs.to_csv(out / "runs.csv", index=False)
    info.setdefault("pending", [])
    if not args.summarize_only:
        info["pending"] = [j.key for j in pending]
    if pending:
        print(f"budget reached: {len(pending)} jobs not run yet; continue with --resume", flush=True)
    if not args.summarize_only:
        info.update(load_after=os.getloadavg(), wall_s=round(time.perf_counter() - t0, 1))
    (out / "machine.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    table = summarize(runs, {k: w.metric for k, w in WORKLOADS.items()})
    table.to_csv(out / "summary.csv", index=False)
    (out / "summary.md").write_text(summary_markdown(table, runs, info))
    from bench.suite_report import write_raw

    write_raw(runs, out)
    if not args.no_plots:
        plot_cells(runs, out / "plots")
    print((out / "summary.md").read_text())
    print(f"results: {out}; job directories: {runs_dir}; {info.get('wall_s', '?')} s", flush=True)
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so a killed suite still removes its namespaces and its job
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
