"""The benchmark suite: plain Horovod against dynamix_hvd on real multi-rank jobs.

    python -m bench.suite --quick                # CI: the harness end to end (1 workload, 1 condition, 1 seed)
    python -m bench.suite --config zoo-headline  # one configuration (--list shows them all)

Every configuration answers one question BENCHMARKS.md asks, and each of its tables gives the
command that produced it (`CONFIGS`). Every arm trains the same model with the same optimizer, LR
rule and data order (see `bench.jobs.common`); only the batch-size policy differs. The reference arm
is the script a Horovod user would otherwise run (``--plain-horovod``: DistributedSampler +
``hvd.DistributedOptimizer(op=Average)``, equal batches). Arms on the torch.distributed engine
(``--engine torch``: zoo jobs, whose plain script is then DistributedSampler + ``DDP(model)``) are
launched with torchrun, the others with mpirun. Arms run interleaved: for seed s the arm
order is rotated by s, so no arm always runs first (cold caches) or last (a warmer machine); within
a seed a workload's conditions run side by side, so runs read against each other are minutes apart.

A run writes ``bench/results/NAME/`` (``--out``): ``machine.json`` (CPU, cores, memory, load before
and after, date, versions, git commit, the exact command), ``runs.csv`` (one row per job),
``evals.csv`` (every evaluation of every job: the raw records), ``sizes.csv`` (each rank's batch size
whenever it changed), ``summary.md``/``summary.csv`` and ``plots/``. The jobs' own directories
(traces, per-step records, stdout) stay under ``--runs-dir`` (default ``runs/suite/NAME``).
``--summarize-only --out DIR`` writes the summary of a results folder again, also one whose
configuration, workloads, conditions or arms this module does not define (those in
bench/results/archive.tar.xz): a row that cannot be measured again (its job directory is gone, or
its workload is not defined here) keeps the numbers it was recorded with. Definitions are in `bench.suite_report`.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from bench.conditions import Condition, NetworkNamespaces, RateSchedule, cleanup_stale, physical_limit, plain_mpirun, slow_args
from bench.suite_report import measure, plot_cells, summarize, summary_markdown
from dynamix_hvd.tools.launchcheck import command, local_env, local_plan

REPO = Path(__file__).resolve().parents[1]
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
    default_batch: int = 32          # per rank: plain Horovod and the adaptive arms' start


WORKLOADS = {
    # the demo's CNN (`bench.demo`): 4,000 train / 1,000 test digits; width 64: 1.12 ms CPU per sample
    # -> ~2.4 s per epoch per rank
    "cnn": Workload("cnn", "bench.jobs.cnn_train", "accuracy", 0.968, 24, 2000, 40.0, 60.0,
                    args=("--width", "64", "--train-samples", "4000", "--eval-every", "1000000000",
                          "--no-report", "--progress", "off")),
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
                                 default_batch=j.batch)
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
after 5.5-7 epochs and ends at 0.959-0.963 (three seeds; ``zoo-headline-2026-12-05-0034/`` in
bench/results/archive.tar.xz), so no target is both late and reached by every seed."""
WORKLOADS.update({f"zoo:{n}:x{k}": longer(n, k, f"zoo:{n}:x{k}", target=target,
                                            plain_s=WORKLOADS[f"zoo:{n}"].plain_s * k)
                  for n, (k, target) in HEADLINE_ZOO.items()})

CONDITIONS = {
    "none": Condition("none", 2),
    "slow2x": Condition("slow2x", 2, slow_rank=1, slow_factor=2.0),
    "slow3x": Condition("slow3x", 2, slow_rank=1, slow_factor=3.0),
    # a changing slowdown at the same points of every arm's training: 3x from 10% of the epoch
    # budget's samples, 1.5x from 35% (a seconds schedule would give the faster arm fewer slow seconds)
    "slow-phases": Condition("slow-phases", 2, slow_rank=1, slow_factor=1.0, slow_schedule="0.1:3,0.35:1.5",
                             slow_clock="budget"),
    # a slowdown that changes every tenth of the budget (every 2-6 s on the headline's jobs): 3x, 1x,
    # 1.5x, 3x, 1x, 2x, 1x, 3x, 1.5x
    "slow-fast-phases": Condition("slow-fast-phases", 2, slow_rank=1, slow_factor=1.0,
                                  slow_schedule="0.1:3,0.2:1,0.3:1.5,0.4:3,0.5:1,0.6:2,0.7:1,0.8:3,0.9:1.5",
                                  slow_clock="budget"),
    # slow links: every rank in its own network namespace, tbf-shaped
    "net10": Condition("net10", 2, rate_mbit=10.0),
    "net100": Condition("net100", 2, rate_mbit=100.0),
    # a link that changes during jobs of ~15-60 s, so the phases come a few decisions apart
    "net-changing": Condition("net-changing", 2, rate_mbit=100.0, rate_schedule="10:10,25:50"),
}


@dataclass(frozen=True)
class Arm:
    """One batch-size policy: its label, the flags that select it and its per-rank starting batch
    (None: the workload's default)."""

    label: str
    flags: tuple[str, ...]
    batch: int | None = None

    @property
    def engine(self) -> str:
        """The engine its jobs run on: "torch" when its flags say ``--engine torch`` (launched with
        torchrun), else "horovod" (launched with mpirun)."""
        f = self.flags
        return f[f.index("--engine") + 1] if "--engine" in f[:-1] else "horovod"


ARMS = ("plain", "split", "model", "model-adam", "ppo-progress", "speed-split", "static-N", "plain-ddp", "model-ddp")
"""The arm names `arms` knows (static-N: any N)."""


def arms(w: Workload, names: list[str]) -> list[Arm]:
    """Arms by name: "plain" (plain Horovod), "split" (a fixed split in proportion to the ranks'
    speeds, through the loader and the weighted optimizer alone, no controller), "model" (the default
    controller), "model-adam" (the default controller with the opt-in noise statistics of Adam's step
    direction, ``noise_preconditioner="auto"``), "static-N" (the controller deciding "static" at N
    samples per rank, so the LR rule and the gradient statistics run; "static-adam-N" with those
    statistics), "speed-split" (the controller's speed-proportional rule) and
    "ppo-progress" (the shipped PPO policy, ending on training progress); on the torch.distributed
    engine, launched with torchrun (zoo jobs only): "plain-ddp" (the plain DDP script:
    DistributedSampler + ``DDP(model)`` + the plain optimizer) and "model-ddp" (the default
    controller over DDP and the weighted optimizer)."""
    out: list[Arm] = []
    for name in names:
        if name == "plain":
            out.append(Arm("plain-horovod", ("--plain-horovod",)))
        elif name.startswith("static-") and name.split("-", 1)[1].isdigit():
            out.append(Arm(name, ("--policy", "static"), int(name.split("-", 1)[1])))
        elif name == "split":
            out.append(Arm("split-speed", ("--policy", "static", "--no-controller")))
        elif name == "model":
            out.append(Arm("model", ("--policy", "model")))
        elif name == "model-adam":  # the default with the opt-in noise statistics of Adam's step direction
            out.append(Arm(name, ("--policy", "model", "--noise-preconditioner", "auto")))
        elif name.startswith("static-adam-") and name.rsplit("-", 1)[1].isdigit():
            out.append(Arm(name, ("--policy", "static", "--noise-preconditioner", "auto"), int(name.rsplit("-", 1)[1])))
        elif name == "speed-split":
            out.append(Arm(name, ("--policy", "speed-split")))
        elif name == "plain-ddp":
            out.append(Arm(name, ("--engine", "torch", "--plain-horovod")))
        elif name == "model-ddp":
            out.append(Arm(name, ("--engine", "torch", "--policy", "model")))
        elif name == "ppo-progress":  # zoo jobs: --budget progress
            out.append(Arm(name, ("--policy", "ppo", "--policy-file", "default", "--learn", "0",
                                  "--budget", "progress")))
        else:
            raise ValueError(f"unknown arm {name!r} (known: {', '.join(ARMS)})")
    return out


ZOO_EVAL = ["zoo:mnist-cnn", "zoo:resnet-bn", "zoo:gru-charlm", "zoo:lstm-rows", "zoo:mf-ratings"]
ZOO_HEADLINE = [f"{w}:x{HEADLINE_ZOO[n][0]}" if (n := w.removeprefix("zoo:")) in HEADLINE_ZOO else w for w in ZOO_EVAL]
# A group: workloads x conditions x arms, `seeds` seeds (with `first_seed` k: seeds k .. seeds - 1
# only, to add seeds to an earlier run of seeds 0 .. k - 1). Each configuration answers one question of
# BENCHMARKS.md, whose table gives its command; tests/test_bench_suite.py checks that every one is
# cited there and that every one cited exists.
CONFIGS: dict[str, list[dict[str, Any]]] = {
    # CI: does the harness run end to end? (not a measurement)
    "quick": [{"workloads": ["cnn-quick"], "conditions": ["slow2x"], "arms": ["plain", "static-32", "speed-split"],
               "seeds": 1}],
    # Does it help with a slow rank (3x, changing), and does it cost time without one? The zoo's
    # evaluation half: the default against plain Horovod and the fixed speed-proportional split
    # (`bench.zoo_report`, `bench.reachable_limit`; ~50 min)
    "zoo-headline": [{"workloads": ZOO_HEADLINE, "conditions": ["none"], "arms": ["plain", "model"], "seeds": 3},
                     {"workloads": ZOO_HEADLINE, "conditions": ["slow3x", "slow-phases"],
                      "arms": ["plain", "split", "model"], "seeds": 3}],
    # Does it follow a rank whose speed changes? The headline's jobs under the changing slowdown and
    # one that changes every tenth of the budget, and without a slow rank (how often a change vote
    # says yes on equal ranks: `bench.zoo_report --votes`) (~45 min)
    "zoo-changing": [{"workloads": [ZOO_HEADLINE[i] for i in (2, 0, 3, 4, 1)],  # gru-charlm first
                      "conditions": ["slow-fast-phases", "slow-phases", "none"],
                      "arms": ["plain", "model"], "seeds": 3}],
    # Does it help with a rank 2x slower? The headline's jobs (~25 min)
    "zoo-straggler-2x": [{"workloads": ZOO_HEADLINE, "conditions": ["slow2x"], "arms": ["plain", "split", "model"],
                          "seeds": 3}],
    # Does it help on a job added after the defaults were set? vgg-digits, a compute-dominated job
    # (a few percent of a step fixed), under the headline's matrix (~28 min)
    "zoo-vgg-tuning": [{"workloads": ["zoo:vgg-digits"], "conditions": ["none"], "arms": ["plain", "model"],
                        "seeds": 3},
                       {"workloads": ["zoo:vgg-digits"], "conditions": ["slow3x", "slow-phases"],
                        "arms": ["plain", "split", "model"], "seeds": 3}],
    # Does it cost time without a slow rank on about a minute of training? The two shortest-step
    # evaluation jobs trained 40-55 s (~20 min)
    "zoo-long-noharm": [{"workloads": ["zoo:gru-charlm:long", "zoo:lstm-rows:long"], "conditions": ["none"],
                         "arms": ["plain", "model"], "seeds": 3}],
    # Is the noise-scale estimate right? The measured critical batch: static sizes (the controller
    # deciding "static", so the AdaScale LR and the gradient statistics run) at 1/2, 1, 2 and 4 times
    # the batch, 3 seeds (`bench.zoo_report --critical`; ~15 min)
    "zoo-critical": [{"workloads": [w], "conditions": ["none"],
                      "arms": ["plain", *(f"static-{m * b // 2}" for m in (1, 2, 4, 8))], "seeds": 3}
                     for w, b in (("zoo:mnist-cnn", 64), ("zoo:lstm-rows", 32), ("zoo:gru-charlm", 16))],
    # Does it help on a slow or changing link? Every rank in its own network namespace; the adaptive
    # arm ends on training progress, so its final metric is at equal progress (~45 min)
    "zoo-network": [{"workloads": ["zoo:mnist-cnn", "zoo:gru-charlm"],
                     "conditions": ["net10", "net100", "net-changing"],
                     "arms": ["plain", "ppo-progress"], "seeds": 3}],
    # Does an Adam job grow its batch on a slow link? The two Adam jobs of the critical-batch table at
    # 10 Mbit/s: the default and the default with the noise statistics of Adam's step direction
    # ("model-adam"), plain Horovod in the same run (~45 min)
    "zoo-network-adam": [{"workloads": ["zoo:gru-charlm", "zoo:lstm-rows"], "conditions": ["net10"],
                          "arms": ["plain", "model", "model-adam"], "seeds": 3}],
    # The critical-batch table's Adam jobs with the noise statistics of Adam's step direction (~8 min)
    "zoo-critical-adam": [{"workloads": [w], "conditions": ["none"],
                           "arms": ["plain", *(f"static-adam-{m * b // 2}" for m in (1, 2, 4, 8))], "seeds": 3}
                          for w, b in (("zoo:lstm-rows", 32), ("zoo:gru-charlm", 16))],
    # Does the torch.distributed engine help, against plain DDP? The headline's jobs without a slow
    # rank and with rank 1 3x slower: plain DDP and the default on DDP, both under torchrun; the
    # ratios are to plain DDP (the Horovod engine's to plain Horovod: zoo-headline) (~25 min)
    "zoo-ddp": [{"workloads": ZOO_HEADLINE, "conditions": ["none", "slow3x"], "arms": ["plain-ddp", "model-ddp"],
                 "seeds": 3}],
}


@dataclass(frozen=True)
class Job:
    workload: Workload
    condition: Condition
    arm: Arm
    seed: int

    def __post_init__(self) -> None:
        if self.arm.engine == "torch" and self.condition.networked:
            raise ValueError(f"arm {self.arm.label!r} runs on torch.distributed (torchrun); condition "
                             f"{self.condition.name!r} puts the ranks in network namespaces, which only "
                             "mpirun lines start: give that condition Horovod arms only")
        if self.arm.engine == "torch" and self.workload.module != "bench.zoo_train":
            raise ValueError(f"arm {self.arm.label!r} runs on torch.distributed, which workload "
                             f"{self.workload.name!r} ({self.workload.module}) does not support: zoo jobs only")

    @property
    def batch(self) -> int:
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


def launch_command(job: Job, argv: list[str], env_keys: tuple[str, ...] = ()) -> list[str]:
    """The line that starts `argv` on the job's ranks on this host: torchrun for an arm on the torch
    engine, else mpirun with shared memory between ranks (a network condition's mpirun line comes
    from its namespaces instead, see `run_job`). `env_keys`: variables mpirun passes on to every rank
    (torchrun's ranks inherit its environment)."""
    if job.arm.engine == "torch":
        return command(local_plan("torchrun", job.condition.ranks), argv)
    return plain_mpirun(job.condition.ranks, argv, env_keys)


def run_job(job: Job, runs_dir: Path, timeout: float) -> dict[str, Any]:
    """Start one job (torchrun or mpirun), wait for it (killing its process group at `timeout`), measure it."""
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
        cmd = launch_command(job, argv, keys)
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
    try:
        mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    except OSError:  # no MPI here (a results folder summarized elsewhere)
        mpi = ["not installed"]
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
    ap.add_argument("--config", default="", metavar="NAME",
                    help=f"configuration to run: {', '.join(CONFIGS)} (with --summarize-only: any name, "
                         "the results folder bench/results/NAME)")
    ap.add_argument("--quick", action="store_true", help="same as --config quick (CI)")
    ap.add_argument("--list", action="store_true", help="print the configuration's jobs (every one without --config)")
    ap.add_argument("--out", default="", help="results directory (default bench/results/NAME)")
    ap.add_argument("--runs-dir", default="", help="job directories (default runs/suite/NAME)")
    ap.add_argument("--timeout-factor", type=float, default=4.0,
                    help="a job is killed after this many times its expected time, at least 120 s (it then fails)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: re-measure OUT/runs.csv's jobs and write the summary again (a row whose "
                         "job directory is gone or whose workload is not defined here keeps its recorded numbers)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the jobs OUT/runs.csv already has with a result (their job directories must "
                         "still exist) and run only the others: a configuration longer than one sitting "
                         "runs in parts; every row records the commit it ran at")
    ap.add_argument("--budget-min", type=float, default=0.0,
                    help="start no job that would end after this many minutes (its expected time); the "
                         "summary then lists the jobs not run yet (continue with --resume). 0: no limit")
    args = ap.parse_args(argv)
    name = "quick" if args.quick else args.config
    if not name and args.summarize_only and args.out:
        name = Path(args.out).name  # a results folder's summary: the folder names its configuration
    if name and name not in CONFIGS and not args.summarize_only:
        ap.error(f"--config {name!r}: no such configuration (choose from {', '.join(CONFIGS)}); "
                 "--summarize-only reads the results folder of any name")
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
    jobs = expand(CONFIGS[name]) if name in CONFIGS else []
    out = Path(args.out or REPO / "bench" / "results" / name)
    runs_dir = Path(args.runs_dir or REPO / "runs" / "suite" / name)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["command"] = " ".join(["python", "-m", "bench.suite", *(sys.argv[1:] if argv is None else argv)])
    info["config"] = {"name": name, "groups": CONFIGS.get(name, []), "expected_s": sum(j.expected_s() for j in jobs),
                      "conditions": {c.name: c.describe() for c in {j.condition.name: j.condition for j in jobs}.values()}}
    if any(j.condition.networked for j in jobs) and (stale := cleanup_stale()):
        print(f"removed namespaces/links left by a killed benchmark: {', '.join(stale)}", flush=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    before = earlier_record(out / "machine.json") if args.summarize_only or args.resume else {}
    # rows written before runs.csv had a commit column ran at the commit their record names
    commit = str(before.get("git_commit", ""))[:12] or "unknown"
    as_recorded: list[str] = []  # --summarize-only: rows that keep the numbers runs.csv holds
    if args.summarize_only:
        for row in read_runs(out / "runs.csv", commit):
            if row["status"] == "ok":
                workload = WORKLOADS.get(str(row["workload"]))
                if workload is None or not Path(str(row["run_dir"])).is_dir():
                    as_recorded.append(f"{row['workload']}/{row['condition']}/{row['arm']}_s{row['seed']}")
                else:
                    try:
                        row.update(measure(Path(row["run_dir"]), workload.wall_budget_s))
                    except (OSError, KeyError, ValueError, IndexError) as exc:
                        row["status"] = f"unreadable: {exc!r}"
            rows.append(row)
        jobs = []
        # the record of the run being re-measured stays (when there is one); this pass is noted beside
        # it. A configuration not defined here keeps its recorded one; a defined one adds the
        # recorded descriptions of conditions it does not have.
        config = before.get("config") or info["config"]
        if name in CONFIGS:
            config = {**info["config"], "conditions": {**config.get("conditions", {}), **info["config"]["conditions"]}}
        info = {**(before or {**info, "original_record": "missing"}), "config": {**config, "name": name},
                "resummarized": {**{k: info[k] for k in ("date", "command", "git_commit", "git_dirty")},
                                 "as_recorded": as_recorded}}
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

    if not as_recorded:  # evals.csv and sizes.csv stay as they are where some job directories are gone
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
