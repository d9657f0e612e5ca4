"""The benchmark suite (bench/suite.py): `--quick` end to end as a real subprocess running real
mpirun jobs; its statistics on synthetic records; the interleaving; the physical limit; the slowed
rank's modes; and the namespaced, shaped network the network conditions use."""
from __future__ import annotations

import ipaddress
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench import suite, suite_report
from bench.conditions import (Condition, NetworkNamespaces, cleanup_stale, netem_available, parse_pairs,
                              physical_limit, slow_args, split_limit)
from bench.suite_report import PLAIN, measure, plain_of, summarize, summary_markdown
from bench.jobs.common import Slowdown

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.system
def test_quick_suite_end_to_end(tmp_path, job_env):
    out, runs_dir = tmp_path / "results", tmp_path / "runs"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.suite", "--quick", "--out", str(out), "--runs-dir",
                           str(runs_dir)], cwd=REPO, env=job_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    took = time.perf_counter() - t0

    info = json.loads((out / "machine.json").read_text())
    for key in ("cpu", "cores", "memory_mib", "load_before", "load_after", "date", "python", "torch", "horovod",
                "dynamix_hvd", "git_commit", "command", "wall_s"):
        assert key in info and info[key] not in ("", None), key
    assert info["command"].endswith(f"--quick --out {out} --runs-dir {runs_dir}")
    assert info["wall_s"] <= took
    runs = pd.read_csv(out / "runs.csv")
    assert (runs.status == "ok").all(), runs.status.tolist()
    assert sorted(runs.arm) == sorted([PLAIN, "static-32", "speed-split"])
    assert (runs.physical_limit.astype(float) == 1.5).all()  # one of 2 ranks 2x slower
    for name in ("evals.csv", "sizes.csv", "summary.csv", "summary.md", "plots/metric_cnn-quick_slow2x.png",
                 "plots/sizes_cnn-quick_slow2x.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name

    # The raw records hold every evaluation; the table's numbers are recomputed from them here.
    evals = pd.read_csv(out / "evals.csv")
    target = suite.WORKLOADS["cnn-quick"].target
    for _, r in runs.iterrows():
        e = evals[evals.arm == r.arm]
        assert list(e.samples) == sorted(e.samples) and len(e) >= 4  # every 500 samples, 2 epochs of 1,000
        hit = e[e.value >= target]
        result = json.loads((Path(r.run_dir) / "suite_result.json").read_text())
        expected = float(hit.train_s.iloc[0]) if len(hit) else result["train_s"]
        assert r.time_to_target_s == pytest.approx(expected)
        assert r.final == pytest.approx(float(e.value.iloc[-1]))
        assert result["eval_total_s"] == pytest.approx(e.eval_s.sum())
        assert r.optimizer_steps == 32 and r.samples == 2000  # 16 steps of 64 (the last one 40) x 2 epochs
    summary = pd.read_csv(out / "summary.csv").set_index("arm")
    plain_t = runs.set_index("arm").time_to_target_s[PLAIN]
    for arm in summary.index:
        assert summary.loc[arm, "vs_plain"] == pytest.approx(runs.set_index("arm").time_to_target_s[arm] / plain_t)
    assert summary.loc[PLAIN, "vs_plain"] == pytest.approx(1.0)
    assert summary.loc["static-32", "vs_best_static"] == pytest.approx(1.0)  # the only static arm

    # Same model, LR and data order: plain Horovod and the project's static arm at the same sizes
    # train the same network (identical test accuracy at every evaluation, up to rounding).
    plain, static = (evals[evals.arm == a].value.to_numpy() for a in (PLAIN, "static-32"))
    assert np.abs(plain - static).max() <= 0.01, (plain, static)
    # The condition reached the job: speed-split moved samples away from the 2x slower rank 1.
    sizes = pd.read_csv(out / "sizes.csv")
    steps = pd.read_csv(Path(runs.set_index("arm").run_dir["speed-split"]) / "suite_steps.csv")
    last = steps[steps.global_batch == 64].groupby("rank").local_batch.last()  # not an epoch's partial last step
    assert last[0] > last[1] and last.sum() == 64, last
    assert set(sizes[sizes.arm == PLAIN].local_batch) <= {32, 20}  # equal batches (the last one 20)
    text = (out / "summary.md").read_text()
    assert "Physical limit (best split / equal split): **1.50**x" in text and "plain-horovod" in text

    # In parts: --resume keeps the jobs with a result and reruns only one whose directory is gone.
    gone = Path(runs.set_index("arm").run_dir["static-32"])
    shutil.rmtree(gone)
    again = subprocess.run([sys.executable, "-m", "bench.suite", "--quick", "--out", str(out), "--runs-dir",
                            str(runs_dir), "--resume", "--no-plots"], cwd=REPO, env=job_env, capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming: 2 of 3 jobs already have a result" in again.stdout, again.stdout
    resumed = pd.read_csv(out / "runs.csv").set_index("arm")
    assert (resumed.status == "ok").all() and gone.is_dir()
    for arm in (PLAIN, "speed-split"):  # kept as they were
        assert resumed.time_to_target_s[arm] == runs.set_index("arm").time_to_target_s[arm]
    assert json.loads((out / "machine.json").read_text())["earlier_parts"][0]["command"] == info["command"]
    # --summarize-only re-measures and keeps the run's own record (date, command, wall time)
    record = json.loads((out / "machine.json").read_text())
    subprocess.run([sys.executable, "-m", "bench.suite", "--quick", "--out", str(out), "--runs-dir", str(runs_dir),
                    "--summarize-only", "--no-plots"], cwd=REPO, env=job_env, check=True, capture_output=True,
                   timeout=300)
    after = json.loads((out / "machine.json").read_text())
    assert {k: after[k] for k in ("date", "command", "wall_s")} == {k: record[k] for k in ("date", "command", "wall_s")}
    assert after["resummarized"]["command"].endswith("--summarize-only --no-plots")
    assert "Re-measured from the job directories" in (out / "summary.md").read_text()
    # --budget-min: nothing fits in 0.01 minutes; the summary says what is still to run
    part = tmp_path / "part"
    cut = subprocess.run([sys.executable, "-m", "bench.suite", "--quick", "--out", str(part), "--runs-dir",
                          str(tmp_path / "part_runs"), "--budget-min", "0.01", "--no-plots"], cwd=REPO, env=job_env,
                         capture_output=True, text=True, timeout=300)
    assert cut.returncode == 0 and "3 jobs not run yet; continue with --resume" in cut.stdout, cut.stdout
    assert "cnn-quick/slow2x/plain-horovod_s0" in (part / "summary.md").read_text()
    listed = subprocess.run([sys.executable, "-m", "bench.suite", "--quick", "--out", str(part), "--runs-dir",
                             str(tmp_path / "part_runs"), "--resume", "--budget-min", "0.01", "--no-plots"],
                            cwd=REPO, env=job_env, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0 and "resuming: 0 of 3 jobs" in listed.stdout, listed.stdout + listed.stderr


def _fake_run(d: Path, *, reached: bool, ttt: float, train_s: float, final: float, idle=(0.1, 0.3)) -> str:
    d.mkdir(parents=True)
    evals = pd.DataFrame({"train_s": [train_s / 2, train_s], "eval_s": [0.5, 0.5], "value": [final - 0.1, final],
                          "samples": [10, 20], "steps": [1, 2], "epoch": [0, 0]})
    evals.to_csv(d / "suite_evals.csv", index=False)
    (d / "suite_result.json").write_text(json.dumps({
        "train_s": train_s, "eval_total_s": 1.0, "samples": 20, "optimizer_steps": 2, "reached": reached,
        "time_to_target_s": ttt if reached else math.inf, "final": final, "throughput": 20 / train_s,
        "idle_fraction": {"0": idle[0], "1": idle[1]}, "per_rank": {"1": {"stalls": [[1.0, 0.2]]}},
        "metric": "accuracy", "target": final - 0.05}))
    return str(d)


def test_sustained_target_needs_the_next_two_evaluations_past_it():
    evals = pd.DataFrame({"train_s": [1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                          "samples": [10, 20, 20, 30, 40, 50, 60],  # the epoch end evaluated twice: once
                          "value": [0.5, 0.97, 0.97, 0.95, 0.97, 0.98, 0.97]})
    assert suite_report.sustained_time(evals, 0.96, "accuracy") == 4.0  # 2.0 touched it, 3.0 fell back
    assert suite_report.sustained_time(evals, 0.965, "accuracy", following=0) == 2.0  # = time to target
    assert suite_report.sustained_time(evals, 0.99, "accuracy") == math.inf
    loss = evals.assign(value=1 - evals.value)
    assert suite_report.sustained_time(loss, 0.04, "loss") == 4.0
    # at the end of training the evaluations that remain suffice
    assert suite_report.sustained_time(evals.iloc[:5], 0.96, "accuracy") == 4.0
    # an evaluation repeated at the same sample count is not a second one in a row
    twice = pd.DataFrame({"train_s": [1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
                          "samples": [10, 20, 20, 30, 40, 50, 60, 70],
                          "value": [0.5, 0.97, 0.97, 0.97, 0.95, 0.97, 0.98, 0.97]})
    assert suite_report.sustained_time(twice, 0.96, "accuracy") == 5.0


def test_measure_reports_the_sustained_time_and_its_misses(tmp_path):
    d = Path(_fake_run(tmp_path / "wobbly", reached=True, ttt=2.0, train_s=6.0, final=0.97))
    pd.DataFrame({"train_s": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "eval_s": [0.1] * 6, "samples": [10, 20, 30, 40, 50, 60],
                  "value": [0.5, 0.93, 0.90, 0.93, 0.95, 0.97], "steps": range(6), "epoch": [0] * 6}
                 ).to_csv(d / "suite_evals.csv", index=False)  # target 0.92: touched at 2 s, held from 4 s
    m = measure(d, 100.0)
    assert m["time_to_target_s"] == 2.0 and m["sustained_s"] == 4.0 and not m["sustained_missed"]
    pd.DataFrame({"train_s": [1.0, 2.0, 3.0], "eval_s": [0.1] * 3, "samples": [10, 20, 30],
                  "value": [0.93, 0.90, 0.91], "steps": range(3), "epoch": [0] * 3}).to_csv(d / "suite_evals.csv", index=False)
    m = measure(d, 100.0)
    assert m["sustained_missed"] and m["sustained_s"] == 6.0  # never held: counts with the full time


def test_summary_maths_on_synthetic_records(tmp_path):
    # seeds 0..4; plain: 100, 110, 120, 130, 140 s; static-16 always 0.8x plain; static-32 0.9x;
    # ppo: 0.5x plain, except seed 4 where it misses (full time 200 s counts)
    rows = []
    plain = [100.0, 110.0, 120.0, 130.0, 140.0]
    for seed, p in enumerate(plain):
        for arm, t in ((PLAIN, p), ("static-16", 0.8 * p), ("static-32", 0.9 * p), ("ppo", 0.5 * p)):
            missed = arm == "ppo" and seed == 4
            d = _fake_run(tmp_path / f"{arm}_{seed}", reached=not missed, ttt=t, train_s=200.0 if missed else t + 5,
                          final=0.95)
            rows.append({"workload": "cnn", "condition": "slow3x", "arm": arm, "seed": seed, "status": "ok",
                         "physical_limit": "2.00", "slow_mode": "spin", "run_dir": d, **measure(Path(d), 100.0)})
    runs = pd.DataFrame(rows)
    missed = runs[(runs.arm == "ppo") & (runs.seed == 4)].iloc[0]
    assert missed.missed and not missed.reached and missed.time_to_target_s == 200.0  # full time, flagged
    assert missed.idle_mean == pytest.approx(0.2) and missed.idle_per_rank == "0.10/0.30" and missed.stalls == 1
    # final@T: the last evaluation within the 100 s budget (plain: train_s/2 <= 100 < train_s)
    assert runs[runs.arm == PLAIN].final_at_budget.tolist() == pytest.approx([0.85] * 5)

    table = summarize(runs, {"cnn": "accuracy"}).set_index("arm")
    assert (table.best_static == "static-16").all()  # lowest median time in hindsight
    assert table.loc[PLAIN, "ttt_median"] == 120.0 and table.loc[PLAIN, "ttt_iqr"] == pytest.approx(20.0)
    assert table.loc["static-16", "vs_plain"] == pytest.approx(0.8) and table.loc["static-16", "vs_plain_iqr"] == \
        pytest.approx(0.0, abs=1e-12)
    # ppo ratios per seed: 0.5, 0.5, 0.5, 0.5, 200/140 -> median 0.5, IQR 0; vs best static 0.625
    assert table.loc["ppo", "vs_plain"] == pytest.approx(0.5)
    assert table.loc["ppo", "vs_best_static"] == pytest.approx(0.5 / 0.8)
    assert table.loc["ppo", "missed"] == 1 and table.loc[PLAIN, "missed"] == 0
    # sustained: of each run's two evaluations only the last (at train_s) is past target = final - 0.05;
    # as the last one it needs no followers, so sustained = train_s = time + 5 s (measure's plumbing)
    assert not runs.sustained_missed.any()
    assert table.loc["static-16", "sustained_vs_plain"] == pytest.approx(
        statistics.median((0.8 * p + 5) / (p + 5) for p in plain))
    # ppo times: 50, 55, 60, 65, 200 -> median 60, IQR 10 (> 10% of 60): noisy; plain 20/120 noisy too
    assert table.loc["ppo", "ttt_median"] == 60.0 and table.loc["ppo", "noisy"]
    runs_quiet = runs.copy()
    runs_quiet.loc[runs_quiet.arm == PLAIN, "time_to_target_s"] = [100.0, 101.0, 102.0, 103.0, 104.0]
    assert not summarize(runs_quiet, {"cnn": "accuracy"}).set_index("arm").loc[PLAIN, "noisy"]  # IQR 2 of 102

    info = {"config": {"name": "t", "conditions": {"slow3x": "2 ranks, rank 1 x3 slower"}}, "command": "c",
            "date": "d", "cpu": "cpu", "cores": 2, "memory_mib": 1, "load_before": [0.1], "load_after": [0.2],
            "python": "3", "torch": "t", "horovod": "h", "dynamix_hvd": "x", "git_commit": "abc"}
    text = summary_markdown(summarize(runs, {"cnn": "accuracy"}), runs, info)
    assert "**2.00**x" in text and "| ppo | 60 [10] | 0.5 [0] | 0.625 |" in text and "**1/5**" in text
    assert "static-16 (best static)" in text


def test_loss_metric_prefers_the_lower_final_on_ties(tmp_path):
    rows = []
    for arm, final in (("static-8", 2.0), ("static-16", 1.5)):
        d = _fake_run(tmp_path / arm, reached=True, ttt=10.0, train_s=20.0, final=final)
        rows.append({"workload": "charlm", "condition": "none", "arm": arm, "seed": 0, "status": "ok",
                     "physical_limit": "1.00", "slow_mode": "", "run_dir": d, **measure(Path(d), 60.0)})
    table = summarize(pd.DataFrame(rows), {"charlm": "loss"})
    assert set(table.best_static) == {"static-16"}


def test_arms_are_interleaved_across_seeds():
    assert suite.rotate(list("abcd"), 0) == list("abcd") and suite.rotate(list("abcd"), 1) == list("bcda")
    assert suite.rotate(list("abcd"), 5) == list("bcda")
    groups = [{"workloads": ["cnn"], "conditions": ["none", "slow3x"], "arms": ["plain", "static-16", "static-32", "model"],
               "seeds": 3},
              {"workloads": ["cnn-quick"], "conditions": ["none"], "arms": ["plain", "model"], "seeds": 1}]
    jobs = suite.expand(groups)
    assert [j.seed for j in jobs] == sorted(j.seed for j in jobs)  # seed by seed
    first = {}
    for j in jobs:
        first.setdefault((j.seed, j.workload.name, j.condition.name), j.arm.label)
    assert [first[(s, "cnn", "none")] for s in range(3)] == [PLAIN, "static-16", "static-32"]
    labels = {s: [j.arm.label for j in jobs if j.seed == s and j.workload.name == "cnn" and j.condition.name == "none"]
              for s in range(3)}
    assert all(sorted(v) == sorted(labels[0]) for v in labels.values()) and len(labels[0]) == 4
    assert sum(j.workload.name == "cnn-quick" for j in jobs) == 2  # its group has one seed
    # within a seed, a workload's conditions run side by side (even across groups), in group order
    two = suite.expand([{"workloads": ["cnn", "cnn-quick"], "conditions": ["none"], "arms": ["plain"], "seeds": 1},
                        {"workloads": ["cnn", "cnn-quick"], "conditions": ["slow3x"], "arms": ["plain"], "seeds": 1}])
    assert [(j.workload.name, j.condition.name) for j in two] == [("cnn", "none"), ("cnn", "slow3x"),
                                                                  ("cnn-quick", "none"), ("cnn-quick", "slow3x")]
    # first_seed adds seeds to an earlier run: seeds 1 and 2 only, the arms rotated as in a full run
    more = suite.expand([{"workloads": ["cnn"], "conditions": ["none"], "arms": ["plain", "static-16", "static-32", "model"],
                          "seeds": 3, "first_seed": 1}])
    assert sorted({j.seed for j in more}) == [1, 2]
    assert [j.arm.label for j in more] == [j.arm.label for j in jobs if j.seed > 0 and j.workload.name == "cnn"
                                           and j.condition.name == "none"]
    w = suite.WORKLOADS["cnn"]
    assert suite.arms(w, ["static-48"])[0] == suite.Arm("static-48", ("--policy", "static"), 48)
    assert suite.arms(w, ["ppo-progress"])[0].flags[-2:] == ("--budget", "progress")
    for unknown in ("nope", "static", "static-x", "ppo-online"):
        with pytest.raises(ValueError, match=f"unknown arm '{unknown}'"):
            suite.arms(w, [unknown])


def test_every_configuration_expands_and_plain_horovod_is_in_every_cell():
    """Every cell holds the plain script of each engine it runs: plain Horovod, or plain DDP for the
    torch.distributed engine's arms."""
    for name, groups in suite.CONFIGS.items():
        jobs = suite.expand(groups)
        assert jobs, name
        cells = {(j.workload.name, j.condition.name, plain_of(j.arm.label)) for j in jobs}
        assert all(any(j.arm.label == base and (j.workload.name, j.condition.name) == (w, c) for j in jobs)
                   for w, c, base in cells), name
        assert all(j.condition.ranks <= 2 or j.condition.slow_mode == "sleep" for j in jobs), name
    argv = suite.job_argv(suite.Job(suite.WORKLOADS["cnn"], SCALE4,
                                    suite.arms(suite.WORKLOADS["cnn"], ["plain"])[0], 2), Path("/x"))
    assert "--plain-horovod" in argv and argv[argv.index("--batch-sizes") + 1] == "32,32,32,32"
    assert argv[argv.index("--slow-mode") + 1] == "sleep" and argv[argv.index("--seed") + 1] == "2"


# conditions the harness supports beyond the configurations' own: more ranks than cores (the slowed
# rank sleeps) and heavy-tailed stalls
SCALE4 = Condition("scale4-slow3x", 4, slow_rank=3, slow_factor=3.0, slow_mode="sleep")
STALLS = Condition("stalls", 2, slow_rank=1, stall_rate=0.5, stall_ms=200.0)


def test_physical_limit():
    assert split_limit([1.0, 1.0 / 3]) == pytest.approx(2.0)
    assert split_limit([1.0, 0.5]) == pytest.approx(1.5)
    assert split_limit([1.0, 1.0, 1.0, 1.0 / 3]) == pytest.approx(2.5)  # (3 + 1/3) / (4 x 1/3)
    assert split_limit([2.0, 2.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="speeds"):
        split_limit([1.0, 0.0])
    assert physical_limit(suite.CONDITIONS["slow3x"]) == "2.00"
    assert physical_limit(suite.CONDITIONS["none"]) == "1.00"
    varying = Condition("slow-varying", 2, slow_rank=1, slow_factor=1.0, slow_schedule="20:3,60:1.5")
    assert physical_limit(varying) == "1.00 then 2.00 then 1.25"
    assert physical_limit(STALLS).startswith("n/a")
    assert physical_limit(SCALE4) == "2.50"


def test_condition_flags():
    assert parse_pairs("15:1, 0:2") == [(0.0, 2.0), (15.0, 1.0)]
    c = Condition("x", 2, slow_rank=1, slow_factor=2.0, slow_schedule="5:3")
    assert slow_args(c) == ["--slow-rank", "1", "--slow-factor", "2.0", "--slow-mode", "spin", "--slow-schedule", "5:3"]
    assert slow_args(STALLS)[-4:] == ["--stall-rate", "0.5", "--stall-ms", "200.0"]
    assert slow_args(Condition("n", 2)) == []
    assert "SLEEPS" in SCALE4.describe()
    assert "stalls" in STALLS.describe()


def test_slowdown_spins_or_sleeps_and_stalls_are_heavy_tailed():
    for mode in ("spin", "sleep"):
        slow = Slowdown(True, 0.0, 3.0, [], mode=mode)
        slow.per_sample = 0.001  # 1 ms per sample: a batch of 40 waits (3 - 1) x 40 ms = 80 ms
        cpu, wall = time.thread_time(), time.perf_counter()
        slow.before_compute(40)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        assert wall >= 0.079
        assert (cpu >= 0.079) if mode == "spin" else (cpu < 0.02), (mode, cpu)
    with pytest.raises(ValueError, match="slow mode 'nap'"):
        Slowdown(True, 0.0, 2.0, [], mode="nap")
    # stalls: Poisson times, Pareto lengths in [stall_ms, 10 x stall_ms], the same for the same seed
    clock = [0.0]
    draws = []
    for seed in (3, 3, 4):
        slow = Slowdown(True, 0.0, 1.0, [], mode="sleep", stall_rate=2.0, stall_ms=0.01, seed=seed)
        clock[0] = 0.0
        slow.clock = lambda: clock[0]
        for _ in range(2000):
            clock[0] += 0.05
            slow.before_compute(1)
        draws.append(slow.stalls)
    assert draws[0] == draws[1] and draws[0] != draws[2]
    lengths = np.array([p for _, p in draws[0]])
    assert 150 < len(lengths) < 250  # ~2 per second over 100 s
    assert lengths.min() >= 1e-5 - 1e-9 and lengths.max() <= 1e-4 + 1e-9
    assert np.median(lengths) < lengths.mean()  # skewed to the right



def test_budget_clock_drives_the_schedule_and_stalls_keep_to_seconds():
    """With the budget clock the slowdown's phases follow the fraction of the budget trained, not
    seconds, while stalls keep to seconds; a budget-clock slowdown given no budget is refused, as is a
    budget schedule past 1."""
    from bench.conditions import Condition, slow_args

    slow = Slowdown(True, 0.0, 1.0, [(0.1, 3.0), (0.35, 1.5)], mode="sleep", clock_kind="budget",
                    stall_rate=0.5, stall_ms=100.0)
    seconds, budget, waits = [0.0], [0.0], []
    slow._wait = lambda s, wall=False: waits.append(round(s, 9))  # what it would wait, not the wait
    slow.use_clock(lambda: seconds[0], budget=lambda: budget[0])
    slow.per_sample = 0.002  # a batch of 10: (f - 1) x 20 ms
    for frac in (0.05, 0.2, 0.5):
        budget[0], seconds[0] = frac, 1000 * frac  # seconds far past the fractions: only the budget places a phase
        waits.clear()
        slow.before_compute(10)
        assert waits[-1] == {0.05: 0.0, 0.2: 0.04, 0.5: 0.01}[frac], (frac, waits)
    assert slow.stalls and all(t >= 50 for t, _ in slow.stalls), "stalls come at training seconds"
    with pytest.raises(ValueError, match="does not report its budget"):
        Slowdown(True, 0.0, 1.0, [(0.1, 3.0)], clock_kind="budget").use_clock(lambda: 0.0)
    with pytest.raises(ValueError, match=r"fractions in \[0, 1\]"):
        Slowdown(True, 0.0, 1.0, [(5.0, 3.0)], clock_kind="budget")
    with pytest.raises(ValueError, match="slow clock 'steps'"):
        Slowdown(True, 0.0, 1.0, [], clock_kind="steps")
    with pytest.raises(ValueError, match="slow_schedule='5:3'"):
        Condition("bad", 2, slow_rank=1, slow_schedule="5:3", slow_clock="budget")
    with pytest.raises(ValueError, match="slow_clock='epochs'"):
        Condition("bad", 2, slow_rank=1, slow_schedule="0.5:3", slow_clock="epochs")
    phases = Condition("p", 2, slow_rank=1, slow_schedule="0.1:3,0.35:1.5", slow_clock="budget")
    assert slow_args(phases)[-2:] == ["--slow-clock", "budget"] and "budget fraction" in phases.describe()


def _require_netns() -> None:
    """The suite runs as root with iproute2 (launch/setup_env.sh installs it); fail loudly otherwise."""
    assert os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc"), \
        "network-namespace tests need root and iproute2 (apt-get install iproute2)"


def NEEDS_NETNS(test):  # noqa: N802 - reads like the marker it replaces
    def wrapped(*args, **kwargs):
        _require_netns()
        return test(*args, **kwargs)
    wrapped.__name__, wrapped.__doc__ = test.__name__, test.__doc__
    import inspect
    wrapped.__signature__ = inspect.signature(test)
    return wrapped
ALLREDUCE = """
import sys, time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
a = np.ones(1 << 18, dtype=np.float32); b = np.empty_like(a)
c.Allreduce(a, b); t = time.perf_counter()
for _ in range(3): c.Allreduce(a, b)
open(f"{sys.argv[1]}/rank{c.rank}.txt", "w").write(f"{float(b[0])} {(time.perf_counter() - t) / 3}")
"""


@pytest.mark.system
@NEEDS_NETNS
def test_ranks_in_namespaces_over_a_shaped_link(tmp_path, job_env):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    seconds = {}
    for rate in (None, 8.0):
        with NetworkNamespaces(2, rate) as net:
            assert net.subnet.subnet_of(ipaddress.ip_network("198.18.0.0/15"))
            cmd, extra = net.mpirun([sys.executable, str(script), str(tmp_path)], ["OMP_NUM_THREADS"])
            res = subprocess.run(cmd, env={**job_env, **extra}, capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            results = [[float(v) for v in (tmp_path / f"rank{r}.txt").read_text().split()] for r in (0, 1)]
            assert all(value == 2.0 for value, _ in results)  # the sum over both ranks arrived
            seconds[rate] = float(np.median([took for _, took in results]))
            if rate:
                assert "tbf" in net.stats()[0]
        names = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"dx{net.tag}" not in names  # torn down
        assert not any(ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                       for ns in net.namespaces)
    # 1 MiB allreduce: ring sends ~1 MiB per rank; at 8 Mbit/s that is >= ~0.5 s, unshaped veth ~ms.
    assert seconds[8.0] > 0.3 and seconds[8.0] > 5 * seconds[None], seconds


def test_netem_probe_reports_a_reason():
    _require_netns()
    ok, why = netem_available()
    assert isinstance(ok, bool) and why


@pytest.mark.system
def test_namespaces_of_a_killed_benchmark_are_removed():
    _require_netns()
    code = ("import time; from bench.conditions import NetworkNamespaces; "
            "n = NetworkNamespaces(2, 10.0).__enter__(); print(n.tag, flush=True); time.sleep(120)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    tag = proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    listed = lambda: subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout  # noqa: E731
    assert tag and f"dx{tag}n0" in listed()
    removed = cleanup_stale()
    assert {f"dx{tag}n0", f"dx{tag}n1", f"dx{tag}br"} <= set(removed)
    assert f"dx{tag}" not in listed() + subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_suite_balance_reads_job_directories(tmp_path, capsys):
    """bench.suite_balance: decision cost share and windowed balance from a job directory."""
    from bench import suite_balance

    job = tmp_path / "cfg" / "cnn" / "slow2x" / "model_s0"
    job.mkdir(parents=True)
    (job / "suite_result.json").write_text('{"train_s": 10.0}')
    (job / "decisions.csv").write_text("decision,overhead_s\n1,0.1\n2,0.2\n")
    for rank, t in ((0, 0.010), (1, 0.020)):  # rank 1 spends twice rank 0's compute: balance 0.5
        (job / f"steps_rank{rank}.csv").write_text("compute_s\n" + f"{t}\n" * 20)
    # rank 0 trains 64 samples a step (rank 1's rows must not count): 8000 samples at step 125
    (job / "suite_steps.csv").write_text("rank,epoch,step,t_s,step_s,compute_s,local_batch,global_batch\n" + "".join(
        f"{r},0,{k},{0.1 * k:.1f},0.1,0.05,32,64\n" for k in range(1, 200) for r in (0, 1)))
    assert suite_balance.main(["cfg", "--runs", str(tmp_path), "--window", "5", "--skip", "0"]) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if "model_s0" in l][0].split()
    assert line[1:4] == ["2", "0.30", "3.00%"] and line[4:7] == ["0.500", "0.500", "100%"]
    assert line[7] == "12.50"
    assert suite_balance.main(["cfg", "--runs", str(tmp_path), "--samples", "10000000"]) == 0
    assert capsys.readouterr().out.split()[-1] == "-", "never reached: no time"


# --- the configurations the documentation cites, and the results of removed ones -------------------
def cited_configurations() -> dict[str, list[str]]:
    """Every `python -m bench.suite --config NAME` in BENCHMARKS.md, README.md and docs/*.md: NAME ->
    the files citing it."""
    import re

    cited: dict[str, list[str]] = {}
    for path in [REPO / "BENCHMARKS.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for name in re.findall(r"--config\s+`?([A-Za-z0-9][\w.-]*)", path.read_text()):
            cited.setdefault(name, []).append(path.name)
    return cited


def test_the_configurations_are_those_the_documentation_cites():
    """Each configuration answers a question BENCHMARKS.md (or docs/) asks with its command; "quick"
    is the harness check the end-to-end test runs."""
    cited = cited_configurations()
    assert {"zoo-headline", "zoo-critical"} <= set(cited), "the reading of the documentation found nothing"
    missing = {name: files for name, files in cited.items() if name not in suite.CONFIGS}
    assert not missing, f"the documentation cites configurations bench/suite.py does not define: {missing}"
    uncited = set(suite.CONFIGS) - set(cited) - {"quick"}
    assert not uncited, f"configurations no document cites (cite them with their results, or remove them): {uncited}"


def test_the_check_of_citations_reads_a_command_split_over_two_lines(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "BENCHMARKS.md").write_text("```\npython -m bench.suite --config zoo-a --no-plots\n```\n")
    (tmp_path / "README.md").write_text("with `python -m bench.suite --config\nzoo-b` (and `--config zoo-c`)\n")
    (docs / "x.md").write_text("nothing here\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert cited_configurations() == {"zoo-a": ["BENCHMARKS.md"], "zoo-b": ["README.md"], "zoo-c": ["README.md"]}


def _old_results(folder: Path) -> None:
    """A results folder of a configuration bench/suite.py no longer has ("charlm"): workloads,
    conditions and arms it no longer defines, job directories gone, one row unmeasured (failed)."""
    folder.mkdir(parents=True)
    rows = []
    for seed, (plain, online) in enumerate([(100.0, 60.0), (120.0, 90.0), (110.0, 66.0)]):
        for arm, t in ((PLAIN, plain), ("ppo-online", online)):
            rows.append({"workload": "charlm", "condition": "stalls", "arm": arm, "seed": seed,
                         "run_dir": str(folder / "gone" / f"{arm}_s{seed}"), "physical_limit": "n/a (stalls)",
                         "slow_mode": "spin", "status": "ok", "reached": True, "missed": False,
                         "time_to_target_s": t, "train_s": t + 10, "eval_total_s": 1.0, "final": 1.5,
                         "final_at_budget": 1.6, "throughput": 100.0, "optimizer_steps": 40, "samples": 4000,
                         "idle_mean": 0.2, "idle_per_rank": "0.1/0.3", "stalls": 3, "git_commit": "abc"})
    rows.append({**rows[0], "workload": "zoo:mnist-cnn", "condition": "interference", "arm": "ppo", "seed": 0,
                 "status": "failed (exit 1)", "time_to_target_s": float("nan")})
    pd.DataFrame(rows).to_csv(folder / "runs.csv", index=False)
    (folder / "machine.json").write_text(json.dumps({
        "command": "python -m bench.suite --config charlm", "date": "then", "cpu": "cpu", "cores": 2,
        "memory_mib": 1, "load_before": [0.1], "load_after": [0.2], "python": "3", "torch": "t", "horovod": "h",
        "dynamix_hvd": "x", "git_commit": "abc", "wall_s": 500,
        "config": {"name": "charlm", "groups": [], "conditions": {"stalls": "2 ranks, rank 1 stalls now and then"}}}))


def test_summarize_only_reads_the_results_of_a_removed_configuration(tmp_path):
    out = tmp_path / "charlm"
    _old_results(out)
    assert "charlm" not in suite.CONFIGS and "charlm" not in suite.WORKLOADS and "stalls" not in suite.CONDITIONS
    assert suite.main(["--config", "charlm", "--summarize-only", "--out", str(out)]) == 0
    runs = pd.read_csv(out / "runs.csv")
    assert list(runs.status) == ["ok"] * 6 + ["failed (exit 1)"]  # kept as recorded, not "unreadable"
    table = pd.read_csv(out / "summary.csv").set_index("arm")
    assert table.loc["ppo-online", "vs_plain"] == pytest.approx(0.6)  # per seed 0.6, 0.75, 0.6
    assert table.loc[PLAIN, "ttt_median"] == 110.0
    text = (out / "summary.md").read_text()
    assert "# Benchmark suite: charlm" in text and "## charlm / stalls" in text
    assert "2 ranks, rank 1 stalls now and then" in text  # the recorded description of a removed condition
    assert "6 jobs keep the numbers runs.csv recorded" in text and "zoo:mnist-cnn/interference/ppo seed 0" in text
    record = json.loads((out / "machine.json").read_text())
    assert record["date"] == "then" and record["config"]["name"] == "charlm"
    assert not (out / "evals.csv").exists(), "no job directory: the raw records are not rewritten"
    assert (out / "plots" / "metric_charlm_stalls.png").is_file()  # a figure without the gone records
    # running it is refused: the configuration is not defined
    with pytest.raises(SystemExit):
        suite.main(["--config", "charlm", "--out", str(tmp_path / "new")])


def test_summarize_only_reads_an_archived_results_folder(tmp_path):
    """A results folder in bench/results/archive.tar.xz, written by a configuration this suite no
    longer has (its workloads charlm and mlp neither): summarized again from runs.csv alone, it gives
    the table it gave when it ran."""
    import tarfile

    name = "calibration-logs"
    with tarfile.open(REPO / "bench" / "results" / "archive.tar.xz") as archive:
        members = [m for m in archive.getmembers() if m.name in {f"{name}/{f}" for f in
                                                                  ("runs.csv", "machine.json", "summary.csv")}]
        assert len(members) == 3, [m.name for m in members]
        archive.extractall(tmp_path, members=members, filter="data")
    out = tmp_path / name
    recorded = pd.read_csv(out / "summary.csv")
    (out / "summary.csv").unlink()
    assert name not in suite.CONFIGS and not {"charlm", "mlp"} & set(suite.WORKLOADS)
    assert suite.main(["--summarize-only", "--out", str(out), "--no-plots"]) == 0  # the folder's name
    again = pd.read_csv(out / "summary.csv")
    key = ["workload", "condition", "arm"]
    merged = recorded.merge(again, on=key, suffixes=("_then", "_now"))
    assert len(merged) == len(recorded) > 0 and {"charlm", "mlp"} <= set(merged.workload)
    for column in ("ttt_median", "vs_plain", "final"):
        assert merged[f"{column}_now"].to_numpy() == pytest.approx(merged[f"{column}_then"].to_numpy()), column
    assert "# Benchmark suite: calibration-logs" in (out / "summary.md").read_text()
    assert "## charlm / slow3x" in (out / "summary.md").read_text()


# --- arms on the torch.distributed engine: launched with torchrun ----------------------------------
def test_ddp_arms_are_launched_with_torchrun_and_horovod_arms_with_mpirun(tmp_path, monkeypatch):
    """DDP arms start through torchrun (standalone, one process per rank, the job's argv after
    --no-python), Horovod arms through mpirun; the slowdown flags are the same on both. run_job writes
    the line it starts (checked with a Popen that starts nothing)."""
    jobs = suite.expand(suite.CONFIGS["zoo-ddp"])
    assert {j.arm.label for j in jobs} == {"plain-ddp", "model-ddp"}
    jobs += suite.expand([{**group, "arms": ["plain", "model"]} for group in suite.CONFIGS["zoo-ddp"]])
    labels = {j.arm.label for j in jobs}
    assert {"plain-ddp", "model-ddp"} <= labels and PLAIN in labels
    assert {j.condition.name for j in jobs} == {"none", "slow3x"} and {j.seed for j in jobs} == {0, 1, 2}
    assert {j.workload.name for j in jobs} == set(suite.ZOO_HEADLINE)
    flags = {a.label: a.flags for a in suite.arms(suite.WORKLOADS["zoo:mnist-cnn"], ["plain-ddp", "model-ddp"])}
    assert flags == {"plain-ddp": ("--engine", "torch", "--plain-horovod"),
                     "model-ddp": ("--engine", "torch", "--policy", "model")}
    keys = ("OMP_NUM_THREADS", "PYTHONPATH", "DYNAMIX_PROGRESS")
    for job in jobs:
        argv = suite.job_argv(job, Path("/x"))
        cmd = suite.launch_command(job, argv, keys)
        assert cmd[-len(argv):] == argv, job.key
        if job.arm.label.endswith("-ddp"):
            assert job.arm.engine == "torch"
            assert cmd[:len(cmd) - len(argv)] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node", "2", "--no-python"], job.key
            assert argv[argv.index("--engine") + 1] == "torch"
        else:
            assert job.arm.engine == "horovod" and "--engine" not in argv
            assert cmd[0] == "mpirun" and cmd[cmd.index("-np") + 1] == "2", job.key
            assert "torch.distributed.run" not in cmd
        if job.condition.name == "slow3x":
            assert argv[argv.index("--slow-factor") + 1] == "3.0" and argv[argv.index("--slow-rank") + 1] == "1"

    started: list[list[str]] = []

    class NoJob:  # what run_job would start, started nowhere
        def __init__(self, cmd, **kwargs):
            started.append(list(cmd))
            self.pid, self.returncode = -1, 3

        def communicate(self, timeout=None):
            return "", None

    monkeypatch.setattr(suite.subprocess, "Popen", NoJob)
    ddp = next(j for j in jobs if j.arm.label == "model-ddp")
    hvd = next(j for j in jobs if j.arm.label == PLAIN)
    for job in (ddp, hvd):
        row = suite.run_job(job, tmp_path, 10.0)
        assert row["status"].startswith("failed (exit 3)")
        assert (tmp_path / job.key / "command.txt").read_text().split() == started[-1]
    assert started[0][1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert started[1][0] == "mpirun"


def test_a_ddp_arm_under_a_network_condition_or_outside_the_zoo_is_refused():
    """Network conditions start their ranks through mpirun in namespaces, and only the zoo jobs have
    --engine: either combination fails when the job is made, naming the arm and the condition or workload."""
    zoo = suite.WORKLOADS["zoo:mnist-cnn"]
    ddp = suite.arms(zoo, ["plain-ddp"])[0]
    with pytest.raises(ValueError, match="'plain-ddp'.*'net10'"):
        suite.Job(zoo, suite.CONDITIONS["net10"], ddp, 0)
    with pytest.raises(ValueError, match="'model-ddp'.*'net-changing'"):
        suite.expand([{"workloads": ["zoo:mnist-cnn"], "conditions": ["net-changing"],
                       "arms": ["plain", "model-ddp"], "seeds": 1}])
    with pytest.raises(ValueError, match="'plain-ddp'.*'cnn-quick'"):
        suite.Job(suite.WORKLOADS["cnn-quick"], suite.CONDITIONS["none"], ddp, 0)
    assert suite.Job(zoo, suite.CONDITIONS["net10"], suite.arms(zoo, ["plain"])[0], 0).arm.engine == "horovod"
