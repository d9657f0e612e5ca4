"""Smoke test of the overhead benchmark (bench/bench_overhead.py): the mpirun job runs every variant
interleaved and reports ratios; `--profile` counts host reads per step. Timings are not checked."""
from __future__ import annotations

import json
import math
import subprocess
import sys

from launching import REPO, job_env


def test_quick_run_reports_every_variant(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, "-m", "bench.bench_overhead", "--quick", "--json", str(out)],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["np"] == 2 and result["rounds"] == 3 and result["chunk"] == 2
    assert set(result["paired_ratio"]) == {"horovod", "weighted", "controller", "default", "user"}
    assert result["paired_ratio"]["horovod"] == 1.0 and result["ratio_of_totals"]["horovod"] == 1.0
    assert all(len(t) == 3 and all(x > 0 for x in t) for t in result["chunk_s"].values())
    for v, (lo, hi) in result["paired_ratio_90ci"].items():
        assert lo <= result["paired_ratio"][v] <= hi
    assert all(math.isfinite(v) for v in result["first_epoch_extra_s"].values())
    phases = result["rank0_ms_per_step"]["controller"]
    assert set(phases) == {"data", "forward+backward", "step", "controller", "main-thread CPU"} and phases["forward+backward"] > 0
    assert "paired ratio" in proc.stdout and "where the time goes" in proc.stdout


def test_what_users_run_against_an_a_a_row_in_one_process(tmp_path):
    """The measurement of the per-step cost: plain Horovod twice (the A/A row: the noise floor) and the
    user variant (the default controller, a Checkpointer and a RunLog), paired in one process."""
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, "-m", "bench.bench_overhead", "--quick", "--np", "1",
                           "--variants", "horovod,horovod-again,user", "--json", str(out)],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["np"] == 1 and set(result["paired_ratio"]) == {"horovod", "horovod-again", "user"}
    assert all(len(t) == 3 and all(x > 0 for x in t) for t in result["chunk_s"].values())
    assert result["rank0_ms_per_step"]["user"]["controller"] > 0  # record_loss and RunLog.step, timed


def test_zoo_job_runs_its_own_model_optimizer_and_clipping(tmp_path):
    """--job trains a zoo job (here the GRU language model with Adam and clipping) in every variant;
    the default controller keeps equal ranks at their sizes (every step has the job's samples): its
    epochs of four steps are too short to test one by one, and the ten steps timed hold at most one
    tested pair of them where leaving the neutral split takes two."""
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, "-m", "bench.bench_overhead", "--quick", "--job", "gru-charlm",
                           "--variants", "horovod,weighted,default", "--json", str(out)],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["job"] == "gru-charlm" and result["batch"] == 16  # the job's own batch
    assert set(result["paired_ratio"]) == {"horovod", "weighted", "default"}
    assert result["rank0_samples_per_step"] == {"horovod": 16.0, "weighted": 16.0, "default": 16.0}
    assert proc.stdout.startswith("gru-charlm:")


def test_unknown_variant_is_refused_naming_it():
    proc = subprocess.run([sys.executable, "-m", "bench.bench_overhead", "--variants", "horovod,turbo"],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "turbo" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bench.bench_overhead", "--job", "gru-lm"],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "gru-lm" in proc.stderr and "gru-charlm" in proc.stderr


def test_profile_counts_host_reads():
    proc = subprocess.run([sys.executable, "-m", "bench.bench_overhead", "--profile", "--steps", "3", "--batch", "8"],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "weighted: host reads per step" in proc.stdout and "cProfile" in proc.stdout
    assert "weighted.py" in proc.stdout  # the optimizer's own reads are attributed to their line
