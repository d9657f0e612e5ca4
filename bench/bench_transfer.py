"""Transfer benchmark: do simulator-trained policies speed up a real multi-rank job they never saw?

Target: the character-level transformer LM (``bench/jobs/charlm_train.py``) under
``mpirun -np 2`` with a straggler (rank 1 burns ``--slow-ms`` extra per step), trained until the
validation loss is below ``--target-loss``. Compared, by wall-clock time-to-target:

(c) static   the configured sizes, never changed;
(a) default  the shipped policy (``policies/default``, trained only on simulated MLP/CNN-like jobs), greedy;
(b) tuned    the default policy fine-tuned for this target: the simulator is calibrated on run (a)'s
             per-step log (``bench.lab.calibrate``), the policy is trained further in simulated jobs
             around that calibrated cluster (transformer-like workloads), then on run (a)'s logged
             transitions (HDF5), and run greedily.

``python -m bench.bench_transfer --help`` lists the options; the defaults take about 6-10 minutes on
2 cores. Results: a table on stdout and ``OUT/results.json``. Timings on a shared machine are noisy:
use ``--seeds 0,1,2`` for repeated runs (each configuration runs once per seed, in rotating order);
the table shows the load average during each run.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from bench.lab.calibrate import calibrate, load_run
from bench.lab.pretrain import DEFAULT_POLICY, dataclass_parser
from bench.lab.pretrain import main as pretrain_main
from dynamix_hvd.tools.launchcheck import command, local_env, local_plan

REPO = Path(__file__).resolve().parents[1]


@dataclass
class BenchConfig:
    """Transfer benchmark settings; every field is a command-line option."""

    np: int = 2
    """Ranks (mpirun -np)."""
    batch_sizes: str = "16,16"
    """Initial (and static) local batch sizes, one per rank."""
    slow_rank: int = 1
    """Rank that is slowed down (straggler); -1 for none."""
    slow_ms: float = 20.0
    """Extra busy milliseconds per step on the slow rank."""
    target_loss: float = 2.0
    """Validation loss that ends a run (time-to-target)."""
    max_epochs: int = 8
    """Epoch budget of a run (a run that does not reach the target counts as inf)."""
    decide_every: int = 20
    """Controller decision interval in steps."""
    seeds: str = "0"
    """Comma-separated seeds; each configuration runs once per seed."""
    default_policy: str = DEFAULT_POLICY
    """Policy (a): name in policies/ or path."""
    finetune_updates: int = 60
    """PPO updates of the fine-tuning for (b) in the calibrated simulator."""
    finetune_learning_rate: float = 1e-4
    """Adam step size of the fine-tuning."""
    out: str = "runs/bench_transfer"
    """Output directory (logs, calibration, fine-tuned policy, results.json)."""
    run_timeout_s: int = 900
    """Wall-clock limit of one training run."""


def run_job(cfg: BenchConfig, out: Path, seed: int, extra: Sequence[str]) -> dict[str, Any]:
    """One charlm training run under mpirun; returns its summary.json plus the launcher's wall time."""
    out.mkdir(parents=True, exist_ok=True)
    job = [sys.executable, "-m", "bench.jobs.charlm_train", "--batch-sizes", cfg.batch_sizes,
           "--epochs", str(cfg.max_epochs), "--target-loss", str(cfg.target_loss), "--decide-every",
           str(cfg.decide_every), "--slow-rank", str(cfg.slow_rank), "--slow-ms", str(cfg.slow_ms),
           "--seed", str(seed), "--out", str(out), *extra]
    cmd = command(local_plan("mpirun", cfg.np), job, forward=())
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=REPO, env=local_env(REPO), capture_output=True, text=True, timeout=cfg.run_timeout_s)
    (out / "stdout.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return summary | {"launcher_s": time.perf_counter() - t0, "command": " ".join(job[1:]),
                      "loadavg": round((load0 + os.getloadavg()[0]) / 2, 1)}


def finetune(cfg: BenchConfig, run_dir: Path, out: Path) -> tuple[Path, dict[str, Any]]:
    """Calibrate on ``run_dir`` and fine-tune the default policy there; returns (policy path, calibration fit)."""
    steps, decisions = load_run(run_dir)
    cal = calibrate(steps, decisions, holdout=0.25, name="charlm")
    cal_path = cal.save(out / "calibration.json")
    policy = out / "tuned"
    args = ["--name", str(policy), "--init-policy", cfg.default_policy, "--calibration", str(cal_path),
            "--calibration-mix", "0.8", "--families", "transformer", "--world-sizes", str(cfg.np),
            "--updates", str(cfg.finetune_updates), "--learning-rate", str(cfg.finetune_learning_rate),
            "--ent-coef", "0.003", "--eval-every", "20", "--eval-clusters", "8", "--seed", "1"]
    h5 = run_dir / "transitions.h5"
    if h5.exists():
        args += ["--transitions", str(h5), "--finetune-epochs", "100"]
    pretrain_main(args)
    return policy, cal.fit


def fmt(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.1f}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = dataclass_parser(BenchConfig, (__doc__ or "").split("\n\n")[0], prog="python -m bench.bench_transfer")
    cfg = BenchConfig(**vars(ap.parse_args(argv)))
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in cfg.seeds.split(",")]
    results: list[dict[str, Any]] = []
    tuned: Optional[Path] = None
    fit: dict[str, Any] = {}
    for i, seed in enumerate(seeds):
        a_dir = out / f"default_s{seed}"
        if tuned is None:  # calibrate on the first run (a) and fine-tune once
            run_a = run_job(cfg, a_dir, seed, ["--policy", "ppo", "--policy-file", cfg.default_policy, "--learn", "0",
                                               "--transitions", str(a_dir / "transitions.h5")])
            tuned, fit = finetune(cfg, a_dir, out)
        jobs = {"(c) static": (out / f"static_s{seed}", ["--policy", "static"]),
                "(a) default policy": (a_dir, ["--policy", "ppo", "--policy-file", cfg.default_policy, "--learn", "0"]),
                "(b) fine-tuned policy": (out / f"tuned_s{seed}", ["--policy", "ppo", "--policy-file", str(tuned),
                                                                   "--learn", "0"])}
        names = list(jobs)
        order = names[i % 3:] + names[:i % 3]  # rotate, so a load change does not always hit the same one
        runs = {}
        for name in order:
            if name == "(a) default policy" and i == 0:
                runs[name] = run_a
                continue
            runs[name] = run_job(cfg, jobs[name][0], seed, jobs[name][1])
        for name in names:
            r = runs[name]
            results.append({"config": name, "seed": seed, **{k: r.get(k) for k in (
                "time_to_target_s", "reached", "steps", "samples", "median_step_s", "val_loss", "final_sizes",
                "loadavg")}})
        print(f"seed {seed}: " + ", ".join(f"{n} {fmt(runs[n]['time_to_target_s'])}s" for n in names), flush=True)
    print(f"\nTime to validation loss < {cfg.target_loss} (charlm, mpirun -np {cfg.np}, sizes {cfg.batch_sizes}, "
          f"rank {cfg.slow_rank} +{cfg.slow_ms} ms/step); calibration hold-out MAPE "
          f"{fit.get('holdout_mape_pct', math.nan):.1f}% per step, {fit.get('holdout_window_mape_pct', math.nan):.1f}% "
          f"per {cfg.decide_every}-step window")
    print(f"{'configuration':<24}{'seed':>5}{'time-to-target s':>18}{'steps':>7}{'samples':>9}{'step ms':>9}"
          f"{'load':>6}{'vs static':>11}  final sizes")
    static_t = {r["seed"]: r["time_to_target_s"] for r in results if r["config"] == "(c) static"}
    for r in results:
        ratio = static_t[r["seed"]] / r["time_to_target_s"] if r["time_to_target_s"] > 0 else math.nan
        print(f"{r['config']:<24}{r['seed']:>5}{fmt(r['time_to_target_s']):>18}{r['steps']:>7}{r['samples']:>9}"
              f"{1e3 * r['median_step_s']:>9.0f}{r['loadavg']:>6}{ratio:>10.2f}x  {r['final_sizes']}")
    if len(seeds) > 1:
        print("\nmedian over seeds:")
        for name in dict.fromkeys(r["config"] for r in results):
            times = sorted(r["time_to_target_s"] for r in results if r["config"] == name)
            med = times[len(times) // 2]
            print(f"{name:<24} {fmt(med)} s  ({', '.join(fmt(t) for t in times)})")
    (out / "results.json").write_text(json.dumps({"config": asdict(cfg), "calibration_fit": fit, "runs": results},
                                                 indent=2, default=str) + "\n")
    print(f"\nwrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
