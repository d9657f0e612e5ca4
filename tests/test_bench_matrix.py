"""The benchmark matrix end to end on a tiny configuration (1 workload x 2 policies x 1 condition x
1 seed, real mpirun jobs), and the namespaced, shaped network the network conditions use."""
from __future__ import annotations

import ipaddress
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench import bench_matrix
from bench.conditions import Condition, NetworkNamespaces, netem_available, parse_pairs, slow_args
from dynamix_hvd.runs.rundir import read_run


def test_tiny_matrix_outputs_and_ratios_come_from_the_same_run(tmp_path):
    out, runs_dir = tmp_path / "results", tmp_path / "runs"
    bench_matrix.main(["--config", "tiny", "--out", str(out), "--runs-dir", str(runs_dir), "--timeout", "110"])

    runs = pd.read_csv(out / "runs.csv")
    assert sorted(runs.policy) == ["speed-split", "static-32"]
    assert (runs.status == "ok").all(), runs.status.tolist()
    for name in ("epochs.csv", "summary.csv", "summary.md", "meta.json",
                 "plots/sizes_cnn_hetero2x_s0.png", "plots/curves_cnn_hetero2x_s0.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    epochs = pd.read_csv(out / "epochs.csv")
    assert set(epochs.policy) == {"speed-split", "static-32"} and {"accuracy", "batch_size"} <= set(epochs.columns)

    # Every number in the table is recomputed here from the jobs' own records (trace.h5, evals.csv).
    measured = {}
    for _, r in runs.iterrows():
        run = read_run(r.run_dir)
        assert len(run.steps) and set(run.steps["rank"]) == {0, 1}
        rank0 = run.steps[run.steps["rank"] == 0]
        overhead = sum(d.get("overhead_s", 0.0) + d.get("learn_s", 0.0) for d in run.history)
        tput = run.steps.local_batch.sum() / (rank0.step_s.sum() + overhead)
        evals = pd.read_csv(Path(r.run_dir) / "evals.csv")
        hit = evals[evals.accuracy >= 0.5]
        ttt = float(hit.train_s.iloc[0]) if len(hit) else math.inf
        assert run.meta["train_time_to_target_s"] == pytest.approx(ttt)
        measured[r.policy] = {"throughput": tput, "final": float(evals.accuracy.iloc[-1]), "time_to_target_s": ttt}
        assert r.throughput == pytest.approx(tput, rel=1e-9)
        assert r.final == pytest.approx(measured[r.policy]["final"])
    summary = pd.read_csv(out / "summary.csv").set_index("policy")
    assert (summary.best_static == "static-32").all()  # the only static size in this matrix
    for policy, m in measured.items():
        for metric, value in m.items():
            base = measured["static-32"][metric]
            assert summary.loc[policy, metric] == pytest.approx(value, rel=1e-9)
            expected = value / base if math.isfinite(base) and base else math.nan
            for ref in ("default", "best"):
                got = summary.loc[policy, f"{metric}/{ref}"]
                assert (math.isnan(expected) and math.isnan(got)) or got == pytest.approx(expected, rel=1e-9)
    assert summary.loc["static-32", "throughput/default"] == pytest.approx(1.0)

    # The condition reached the job: speed-split moved samples away from the 2x slower rank 1.
    sizes = [int(b) for b in summary.loc["speed-split", "final_sizes"].split("/")]
    assert sizes[0] > sizes[1] and sum(sizes) == 64, sizes
    meta = json.loads((out / "meta.json").read_text())
    assert meta["conditions"] == {"hetero2x": "2 ranks, rank 1 x2 slower"}


def test_condition_flags():
    assert parse_pairs("15:1, 0:2") == [(0.0, 2.0), (15.0, 1.0)]
    c = Condition("x", 2, slow_rank=1, slow_factor=2.0, slow_schedule="5:3")
    assert slow_args(c, True, 1.0) == ["--slow-rank", "1", "--slow-factor", "2.0", "--slow-schedule", "5:3"]
    assert slow_args(c, False, 4.0) is None  # a constant --slow-ms cannot follow a schedule
    assert slow_args(Condition("y", 2, slow_rank=0, slow_factor=3.0), False, 4.0) == \
        ["--slow-rank", "0", "--slow-ms", "8.00"]


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
