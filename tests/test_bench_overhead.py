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
    assert result["np"] == 2 and result["repeats"] == 2
    assert set(result["ratio"]) == {"horovod", "weighted", "controller"} and result["ratio"]["horovod"] == 1.0
    assert all(len(t) == 2 and all(x > 0 for x in t) for t in result["epoch_s"].values())
    assert all(math.isfinite(v) for v in result["first_epoch_extra_s"].values())
    assert "ratio" in proc.stdout and "controller" in proc.stdout


def test_profile_counts_host_reads():
    proc = subprocess.run([sys.executable, "-m", "bench.bench_overhead", "--profile", "--steps", "3", "--batch", "8"],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "weighted: host reads per step" in proc.stdout and "cProfile" in proc.stdout
    assert "weighted.py" in proc.stdout  # the optimizer's own reads are attributed to their line
