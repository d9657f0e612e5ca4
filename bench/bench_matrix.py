"""Side-by-side benchmark: DYNAMIX (PPO) vs static batches, schedules, noise-scale and goodput rules.

Runs the matrix policy x workload x condition x seed as real ``mpirun`` jobs (see `conditions` for
the slowed ranks and the namespaced, shaped network) and writes into ``--out``:

* ``runs.csv``: one row per job (time to target, final metric, throughput, sizes, load average);
* ``epochs.csv``: every job's per-epoch records (pandas), tagged with workload/condition/policy/seed;
* ``summary.csv`` / ``summary.md``: medians over seeds, each metric also as a ratio to the default
  static batch and to the best static batch (lowest time to target) *of the same seed and matrix run*;
* ``plots/``: batch size per rank over time, and loss / accuracy vs wall time, per workload x condition x seed.
The full traces (``trace.h5``, ``evals.csv``, stdout) stay in each job's directory under ``--runs-dir``.

Definitions. time to target: wall seconds from the start of training to the first evaluation at or
past the target, evaluation time excluded where the workload records it (cnn). Throughput: samples
of all ranks / (rank 0's summed step times + the controller's decision and learning time).
Usage: ``python -m bench.bench_matrix --config small`` (``--list`` shows the configurations).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from bench.conditions import Condition, NetworkNamespaces, RateSchedule, plain_mpirun, slow_args
from bench.matrix_report import markdown, plot_all, summarize, targets_markdown, write_epochs
from dynamix_hvd.tools.launchcheck import local_env

REPO = Path(__file__).resolve().parents[1]

RULES = ("linear-ramp", "adabatch", "increase-batch", "noise-scale", "goodput", "speed-split")


@dataclass(frozen=True)
class Workload:
    """A training script of dynamix_hvd/examples and how the matrix drives and scores it."""

    name: str
    module: str
    default_batch: int                      # per rank: the "default static" reference
    static_batches: tuple[int, ...]         # per rank: the static sizes in the matrix
    epochs: int
    target: float
    metric: str = "accuracy"                # "accuracy" (higher is better) or "loss" (lower is better)
    args: tuple[str, ...] = ()
    policies: tuple[str, ...] | None = None  # None: every policy (the script accepts them all)
    factor_flags: bool = False              # has --slow-factor/--slow-schedule (else constant --slow-ms)
    compute_ms: float = 1.0                 # its compute per step at the default batch (for --slow-ms)
    kwargs: dict[str, dict] = field(default_factory=dict)  # --policy-kwargs per rule (if supported)


def cnn_kwargs(base: int) -> dict[str, dict]:
    """Rule parameters scaled to a 4,000-sample epoch and a global base batch `base`."""
    return {"linear-ramp": {"end": 4 * base, "ramp": 12}, "adabatch": {"every": 6, "end": 8 * base},
            "increase-batch": {"milestones": [0.5, 0.75], "factor": 2.0}}


WORKLOADS = {
    "cnn": Workload("cnn", "dynamix_hvd.examples.cnn_train", 32, (16, 32, 64), 4, 0.96,
                    args=("--decide-every", "10", "--eval-every", "500"), factor_flags=True,
                    kwargs=cnn_kwargs(64)),
    "mlp": Workload("mlp", "dynamix_hvd.examples.mlp_train", 32, (16, 32, 64), 8, 0.72,
                    args=("--samples", "2048", "--decide-every", "8"), compute_ms=0.7),
    "charlm": Workload("charlm", "dynamix_hvd.examples.charlm_train", 16, (8, 16, 32), 8, 2.2, metric="loss",
                       args=("--chars", "120000", "--decide-every", "20", "--eval-every", "10"),
                       policies=("static", "ppo"), compute_ms=25.0),
}

CONDITIONS = {
    "hetero2x": Condition("hetero2x", 2, slow_rank=1, slow_factor=2.0),
    "hetero-varying": Condition("hetero-varying", 2, slow_rank=1, slow_factor=1.0, slow_schedule="0.5:3,3:1.5"),
    "net10": Condition("net10", 2, rate_mbit=10.0),
    "net-varying": Condition("net-varying", 2, rate_mbit=100.0, rate_schedule="8:5,16:50"),
    "hetero3": Condition("hetero3", 3, slow_rank=2, slow_factor=2.0),
    "hetero4": Condition("hetero4", 4, slow_rank=3, slow_factor=2.0),
}

ALL = ("static", "ppo", *RULES)
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {"workloads": ["cnn"], "conditions": ["hetero2x"], "policies": ["static-default", "speed-split"],
             "seeds": [0], "override": {"cnn": {"epochs": 1, "target": 0.5, "args": (
                 "--decide-every", "4", "--eval-every", "250", "--train-samples", "1000")}}},
    "small": {"workloads": ["cnn", "mlp", "charlm"], "conditions": ["hetero2x", "hetero-varying", "hetero4", "net10"],
              "policies": list(ALL), "seeds": [0],
              "only": {**{f"{w}/{c}": [] for w in ("mlp", "charlm") for c in ("hetero-varying", "hetero4", "net10")},
                       "cnn/hetero-varying": ["static", "ppo", "goodput", "speed-split"],
                       "cnn/hetero4": ["static", "ppo", "speed-split"],
                       "cnn/net10": ["static", "ppo", "goodput", "adabatch", "speed-split"]}},
    "full": {"workloads": ["cnn", "mlp", "charlm"], "policies": list(ALL), "seeds": [0, 1, 2],
             "conditions": ["hetero2x", "hetero-varying", "net10", "net-varying", "hetero3", "hetero4"]},
}


@dataclass(frozen=True)
class Job:
    workload: Workload
    condition: Condition
    policy: str          # "static", "ppo" or a rule
    label: str           # "static-32", "ppo", "goodput", ...
    batch: int           # per-rank starting batch
    seed: int

    @property
    def key(self) -> str:
        return f"{self.workload.name}/{self.condition.name}/{self.label}_s{self.seed}"


def expand(config: dict[str, Any]) -> list[Job]:
    """The jobs of a configuration, seed by seed (every cell of a seed runs before the next seed);
    ``only["W/C"]`` restricts the policies of one workload x condition cell ([] skips it)."""
    jobs = []
    for seed in config["seeds"]:
        for cname in config["conditions"]:
            for wname in config["workloads"]:
                w = WORKLOADS[wname]
                w = replace(w, **config.get("override", {}).get(wname, {}))
                cond = CONDITIONS[cname]
                only = config.get("only", {}).get(f"{wname}/{cname}")
                for policy in config["policies"]:
                    if only is not None and policy not in only and not (policy == "static-default" and "static" in only):
                        continue
                    if policy == "static-default":
                        jobs.append(Job(w, cond, "static", f"static-{w.default_batch}", w.default_batch, seed))
                        continue
                    if w.policies is not None and policy not in w.policies:
                        continue
                    if policy == "static":
                        jobs += [Job(w, cond, "static", f"static-{b}", b, seed) for b in w.static_batches]
                    else:
                        jobs.append(Job(w, cond, policy, policy, w.default_batch, seed))
    return jobs


def job_argv(job: Job, out: Path) -> list[str] | None:
    w, cond = job.workload, job.condition
    slow = slow_args(cond, w.factor_flags, w.compute_ms)
    if slow is None:
        return None  # the workload cannot express this condition
    argv = [sys.executable, "-m", w.module, "--epochs", str(w.epochs), "--batch-sizes",
            ",".join([str(job.batch)] * cond.ranks), "--policy", job.policy, "--seed", str(job.seed),
            "--out", str(out), *w.args, *slow]
    argv += ["--target-loss", str(w.target)] if w.metric == "loss" else []
    if w.factor_flags:
        argv += ["--target-acc", str(w.target), "--no-report", "--progress", "epoch"]
        if job.policy in w.kwargs:
            argv += ["--policy-kwargs", json.dumps(w.kwargs[job.policy])]
    elif w.name == "mlp":
        argv += ["--no-report", "--progress", "epoch"]
    if job.policy == "ppo" and (REPO / "policies" / "default.json").is_file():
        argv += ["--policy-file", "default"]
    return argv


def run_job(job: Job, runs_dir: Path, timeout: float) -> dict[str, Any]:
    """Start one mpirun job, wait for it (killing its process group at `timeout`), measure it."""
    out = runs_dir / job.key
    out.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"workload": job.workload.name, "condition": job.condition.name, "policy": job.label,
                           "seed": job.seed, "run_dir": str(out), "load_before": os.getloadavg()[0]}
    argv = job_argv(job, out)
    if argv is None:
        return {**row, "status": "not expressible"}
    env = local_env(REPO, DYNAMIX_PROGRESS="epoch")
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
                return {**row, "status": f"network setup failed: {getattr(exc, 'stderr', '') or exc}"}
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
            text = proc.communicate()[0] + f"\n[bench] killed after {timeout} s\n"
        if sched:
            sched.stop()
            row["rate_changes"] = json.dumps(sched.applied)
        if net is not None:
            (out / "tc_stats.txt").write_text("\n".join(net.stats()))
    (out / "stdout.txt").write_text(text)
    row.update(job_s=time.perf_counter() - t0, returncode=proc.returncode, load_after=os.getloadavg()[0])
    if proc.returncode != 0:
        return {**row, "status": f"failed (exit {proc.returncode}); see {out}/stdout.txt"}
    try:
        return {**row, "status": "ok", **measure(job.workload, out)}
    except (OSError, KeyError, ValueError, IndexError) as exc:
        return {**row, "status": f"unreadable: {exc!r}"}


def measure(w: Workload, out: Path) -> dict[str, Any]:
    """Time to target, final metric, throughput and sizes of one finished job (from its records)."""
    if w.name == "charlm":
        summary = json.loads((out / "summary.json").read_text())
        steps = pd.concat([pd.read_csv(p) for p in sorted(out.glob("steps_rank*.csv"))], ignore_index=True)
        try:
            decisions = pd.read_csv(out / "decisions.csv")
        except pd.errors.EmptyDataError:
            decisions = pd.DataFrame()
        ttt, final, sizes = summary["time_to_target_s"], summary["val_loss"], summary["final_sizes"]
    else:
        from dynamix_hvd.runs.rundir import read_run

        run = read_run(out)
        steps, decisions = run.steps, pd.DataFrame(run.history)
        if w.name == "cnn":
            ttt, final = run.meta["train_time_to_target_s"], float(pd.read_csv(out / "evals.csv").accuracy.iloc[-1])
        else:
            acc = run.epochs.groupby("epoch").agg(accuracy=("accuracy", "first"), wall_s=("wall_s", "max"))
            hit = acc[acc.accuracy >= w.target]
            ttt, final = (float(hit.wall_s.iloc[0]) if len(hit) else math.inf), float(acc.accuracy.iloc[-1])
        sizes = run.history[-1]["sizes"] if run.history else run.meta["batch_sizes"].split(",")
    rank0 = steps[steps["rank"] == 0]
    overhead = sum(float(decisions[c].fillna(0).sum()) for c in ("overhead_s", "learn_s") if c in decisions)
    busy = float(rank0.step_s.sum()) + overhead
    per_sample = (steps.compute_s / steps.local_batch).groupby(steps["rank"]).median()
    return {"time_to_target_s": float(ttt), "reached": bool(math.isfinite(float(ttt))), "final": float(final),
            "slow_ratio": float(per_sample.max() / per_sample.min()),
            "throughput": float(steps.local_batch.sum()) / busy if busy > 0 else math.nan,
            "samples": int(steps.local_batch.sum()), "decision_s": overhead, "final_sizes": "/".join(map(str, sizes)),
            "mean_global_batch": float(rank0.global_batch.mean())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--out", default="", help="results directory (default bench/results/matrix_CONFIG)")
    ap.add_argument("--runs-dir", default="", help="job directories (default runs/bench_matrix/CONFIG)")
    ap.add_argument("--seeds", default="", help="override the configuration's seeds, e.g. 0,1,2")
    for key in ("workloads", "conditions", "policies"):
        ap.add_argument(f"--{key}", default="", help=f"override the configuration's {key} (comma-separated)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before a job is killed")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the configurations' jobs and exit")
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: re-measure the jobs listed in OUT/runs.csv from their directories and "
                         "rewrite the tables and plots")
    args = ap.parse_args(argv)
    config = dict(CONFIGS[args.config])
    if args.seeds:
        config["seeds"] = [int(s) for s in args.seeds.split(",")]
    for key in ("workloads", "conditions", "policies"):
        if getattr(args, key):
            config[key] = getattr(args, key).split(",")
    jobs = expand(config)
    if args.list:
        print("\n".join(f"{j.key}: {j.condition.describe()}" for j in jobs))
        return
    out = Path(args.out or REPO / "bench" / "results" / f"matrix_{args.config}")
    runs_dir = Path(args.runs_dir or REPO / "runs" / "bench_matrix" / args.config)
    out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    if args.summarize_only:
        for row in pd.read_csv(out / "runs.csv").to_dict("records"):
            if row["status"] == "ok":
                w = replace(WORKLOADS[row["workload"]], **config.get("override", {}).get(row["workload"], {}))
                row.update(measure(w, Path(row["run_dir"])))
            rows.append(row)
        jobs = []
    for i, job in enumerate(jobs):
        row = run_job(job, runs_dir, args.timeout)
        rows.append(row)
        print(f"[{i + 1}/{len(jobs)} {time.perf_counter() - t0:5.0f}s] {job.key}: {row['status']} "
              f"ttt {row.get('time_to_target_s', math.nan):.2f}s final {row.get('final', math.nan):.4f} "
              f"{row.get('throughput', math.nan):.0f} samples/s sizes {row.get('final_sizes', '')}", flush=True)
        pd.DataFrame(rows).to_csv(out / "runs.csv", index=False)  # partial results survive an interrupt
    runs = pd.DataFrame(rows)
    runs.to_csv(out / "runs.csv", index=False)
    write_epochs(runs, out / "epochs.csv")
    table = summarize(runs, WORKLOADS)
    table.to_csv(out / "summary.csv", index=False)
    command = ["python", "-m", "bench.bench_matrix", *(sys.argv[1:] if argv is None else argv)]
    meta = {"config": args.config, "command": " ".join(command),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wall_s": round(time.perf_counter() - t0, 1),
            "cpus": os.cpu_count(), "conditions": {c: CONDITIONS[c].describe() for c in config["conditions"]}}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "summary.md").write_text((markdown(table) + "\n" + targets_markdown(table, WORKLOADS)) if len(table)
                                    else "no comparable runs\n")
    if not args.no_plots:
        plot_all(runs, out / "plots")
    print(markdown(table) if len(table) else "no comparable runs")
    print(f"results: {out} (runs.csv, epochs.csv, summary.csv/.md, plots/); traces: {runs_dir}; "
          f"{meta['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
