"""``dynamix-hvd``: a real 2-rank run with a slowed rank and what it leaves behind (records, traces,
summary with the straggler diagnosis, PNG report), help texts, and the progress display."""
from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

from dynamix_hvd.tools.cli import build_parser, main
from dynamix_hvd.runs.progress import Progress, resolve_mode
from dynamix_hvd.runs.report import nominal_steps
from dynamix_hvd.runs.rundir import read_run

REPO = Path(__file__).resolve().parents[1]
SAMPLES = 1024
SLOW_MS = 10  # rank 1 waits this long before every forward pass: the straggler the diagnosis must name


def dx(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed console script (falls back to python -m dynamix_hvd when it is not installed)."""
    exe = shutil.which("dynamix-hvd", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = [exe] if exe else [sys.executable, "-m", "dynamix_hvd"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    proc = dx("run", "--np", "2", "--epochs", "2", "--samples", str(SAMPLES), "--batch-sizes", "16,48",
              "--out", str(out), "--", "--decide-every", "5", "--slow-rank", "1", "--slow-ms", str(SLOW_MS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "epoch 2/2" in proc.stdout, proc.stdout
    return out


@pytest.mark.mpi
def test_run_writes_records_and_traces(run_dir: Path):
    files = {p.name for p in run_dir.iterdir()}
    assert {"epochs.csv", "trace.h5", "meta.json", "report.png", "steps_rank0.csv", "steps_rank1.csv",
            "decisions.csv"} <= files, files
    from bench.lab.calibrate import load_run  # the per-rank CSVs serve the calibration tool

    csv_steps, csv_decisions = load_run(run_dir)
    assert len(csv_steps) == len(read_run(run_dir).steps) and len(csv_decisions) > 2
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["launcher"] == "mpirun" and meta["decisions"] > 2
    epochs = pd.read_csv(run_dir / "epochs.csv")
    # the example's budget is 2 epochs of progress: 2 passes at the base batch, more if B grew
    n = epochs.epoch.max() + 1
    assert n >= 2 and sorted(zip(epochs.epoch, epochs["rank"])) == [(e, r) for e in range(n) for r in (0, 1)]
    assert (epochs.groupby("epoch").samples.sum() == SAMPLES).all()
    assert epochs.accuracy.between(0, 1).all() and (epochs.sync_wait_s >= 0).all()

    run = read_run(run_dir)
    steps = run.steps
    assert sorted(steps["rank"].unique()) == [0, 1]
    assert (steps.groupby("epoch").local_batch.sum() == SAMPLES).all()  # every sample exactly once
    assert steps.groupby("rank").size().nunique() == 1                  # ranks ran the same steps
    assert np.isfinite(steps.loss).all() and (np.diff(steps[steps["rank"] == 0].wall_s) >= 0).all()
    d = run.decisions
    n = meta["decisions"]
    assert d["sizes"].shape == (n, 2) and d["reward"].shape == (n, 2) and len(run.history) == n
    assert list(d["previous_sizes"][0]) == [16, 48]
    assert np.isfinite(d["wall_s"]).all() and (np.diff(d["wall_s"]) >= 0).all()
    assert "noise_scale" in d and np.isfinite(d["reward"][1:]).all()
    # the sizes the steps ran with are the initial ones or ones the controller decided
    for r in (0, 1):
        s = steps[steps["rank"] == r]
        inner = s[s.step < s.groupby("epoch").step.transform("max")]
        assert set(inner.local_batch) <= {(16, 48)[r], *d["sizes"][:, r].astype(int)}, r
    assert len(nominal_steps(steps)) >= len(steps) - 2 * 2 * 2
    with h5py.File(run_dir / "trace.h5") as h5:
        assert json.loads(h5.attrs["meta"])["world_size"] == 2
        assert {"sync_wait_s", "samples_per_s", "local_grad_sq", "global_grad_sq"} <= set(h5["steps"])


@pytest.mark.mpi
def test_summarize_and_plot(run_dir: Path, tmp_path: Path, cli_here):
    proc = dx("summarize", str(run_dir))  # the console script once; then in-process
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "2 ranks on" in proc.stdout and "via mpirun" in proc.stdout
    blank = [i for i, line in enumerate(lines) if line == ""]
    table, diagnosis = lines[blank[0] + 1:blank[1]], lines[blank[1] + 1:]
    epochs = pd.read_csv(run_dir / "epochs.csv").sort_values(["epoch", "rank"])
    assert table[0].split()[:3] == ["epoch", "wall_s", "sizes"] and len(table) == 1 + epochs.epoch.nunique()
    for row, (epoch, e) in zip(table[1:], epochs.groupby("epoch")):
        assert row.split()[0] == str(epoch) and row.split()[2] == "/".join(str(b) for b in e.batch_size), row
    # the straggler diagnosis names the slowed rank, the phase its wait falls in, and what it cost
    assert diagnosis[0].startswith("straggler diagnosis over") and diagnosis[1].split()[0] == "rank"
    verdict = next(line for line in diagnosis if line.startswith("slowest rank"))
    assert verdict.startswith("slowest rank: 1, in compute"), "\n".join(diagnosis)
    from dynamix_hvd.runs.diagnosis import diagnose

    diag = diagnose(read_run(run_dir).steps)
    assert diag.phase_excess_s >= 0.8 * SLOW_MS / 1e3 and diag.cost_s >= 0.05 * diag.measured_s, diag
    assert diagnosis[-1].startswith("against the equal split: ") and " s (" in diagnosis[-1]

    png = tmp_path / "r.png"
    proc = cli_here("plot", str(run_dir), "-o", str(png))
    assert proc.returncode == 0 and proc.stdout.strip() == str(png), proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1320, 1375)

    missing = cli_here("summarize", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "trace.h5 not found" in missing.stderr


@pytest.mark.mpi
def test_explain_tells_each_decision_of_the_run(run_dir: Path, tmp_path: Path, cli_here):
    history = read_run(run_dir).history
    proc = cli_here("explain", str(run_dir), "--phases")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("phases:\n  even: ") and "judging split: " in out
    shown = []
    for line in out.splitlines():
        if line.lstrip().startswith("#"):
            first, _, last = line.split()[0].lstrip("#").partition("-#")
            shown += range(int(first), int(last or first) + 1)
    assert shown == [d["decision"] for d in history], out
    # every decision that moved the sizes says so, with the phases it went through
    for d in history:
        if d["sizes"] != d["previous_sizes"]:
            t = d["info"]["transition"]
            moved = "/".join(map(str, d["previous_sizes"])) + " -> " + "/".join(map(str, d["sizes"]))
            assert any(line.split()[:1] == [f"#{d['decision']}"] and moved in line for line in out.splitlines()), out
            if t["next"] == "judging split" and t["phase"] != "judging split":
                assert f"[{t['phase']} -> judging split]" in out and "leave the job's own split" in out, out
    assert "\ndecisions per phase: " in out
    from dynamix_hvd.runs.report import shade_phases
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    assert shade_phases(ax, history, read_run(run_dir).decisions["wall_s"], 100.0) and ax.patches
    plt.close(fig)
    missing = cli_here("explain", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "trace.h5 not found" in missing.stderr


def test_every_option_is_explained(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) >= {"run", "check", "summarize", "explain", "plot", "report", "tensorboard"}
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest != "help":
                assert action.help and len(action.help) > 10, f"{name} {action.dest} has no help"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    proc = subprocess.CompletedProcess([], exit_info.value.code, capsys.readouterr().out, "")
    assert proc.returncode == 0 and "--oversubscribe" in proc.stdout and "--batch-sizes" in proc.stdout


# --- progress display (in-process) -------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_mode_follows_terminal_rank_and_launcher(monkeypatch):
    pytest.importorskip("tqdm")
    for var in ("DYNAMIX_PROGRESS", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "HOROVOD_RANK", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_mode(None, _Tty(), rank=0) == "bar"
    assert resolve_mode(None, io.StringIO(), rank=0) == "epoch"
    assert resolve_mode("bar", _Tty(), rank=1) == "off"
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # a rank's pty says nothing under mpirun
    assert resolve_mode(None, _Tty(), rank=0) == "epoch"
    monkeypatch.setenv("DYNAMIX_PROGRESS", "bar")
    assert resolve_mode(None, io.StringIO(), rank=0) == "bar"
    with pytest.raises(ValueError, match="'fancy'"):
        resolve_mode("fancy", io.StringIO(), rank=0)


def test_progress_bar_and_epoch_lines():
    pytest.importorskip("tqdm")
    bar, lines = _Tty(), io.StringIO()
    p = Progress(3, mode="bar", stream=bar, line_stream=lines, refresh_s=0.0)
    p.start_epoch(0, 4)
    for step in range(4):
        p.update(step, None, [16, 48], 64, loss=torch.tensor(0.5))
    line = p.end_epoch(0, sizes=[16, 48], loss=0.5, samples_per_s=1234.0, sync_wait_ms=[0.1, 2.5], accuracy=0.9)
    assert "sizes=16/48" in bar.getvalue() and "loss=0.5000" in bar.getvalue() and "4/4" in bar.getvalue()
    assert line.startswith("epoch 1/3 | sizes 16/48 | loss 0.5000 | accuracy 0.9000 | 1,234 samples/s")
    assert "allreduce wait ms 0.10/2.50" in line and line in bar.getvalue() and lines.getvalue() == ""
    quiet_bar, quiet_lines = io.StringIO(), io.StringIO()
    q = Progress(2, mode="epoch", stream=quiet_bar, line_stream=quiet_lines)
    q.start_epoch(0, 4)
    q.update(0, None, [8], 8, loss=1.0)
    q.end_epoch(0, sizes=[8], loss=1.0, samples_per_s=10.0)
    assert quiet_bar.getvalue() == "" and quiet_lines.getvalue().startswith("epoch 1/2 | sizes 8 | loss 1.0000")


def test_runlog_single_process_trace_cap_and_missing_losses(tmp_path: Path):
    """One rank without Horovod (gather is the identity): real loader and tracker, optimizer hooks by hand."""
    from dynamix_hvd.data.synthetic import teacher_classification
    from dynamix_hvd.data.loader import AdaptiveLoader
    from dynamix_hvd.runs.runlog import RunLog

    train, _ = teacher_classification(100, seed=0)
    loader = AdaptiveLoader(train, [10], rank=0)
    run = RunLog(tmp_path, loader, gather=lambda o: [o], max_trace_steps=15, meta={"policy": "none"})
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, _ in enumerate(loader):
            if i == 3:
                continue  # no optimizer step: nothing is recorded for this batch
            loader.tracker.step_started()
            loader.tracker.synchronized()
            loader.tracker.step_finished(lr=0.1)
            if i % 2 == 0:
                run.step(torch.tensor(float(i)))
        rows = run.end_epoch(accuracy=0.5)
        assert rows[0]["steps"] == 9 and rows[0]["loss_mean"] == pytest.approx((0 + 2 + 4 + 6 + 8) / 5)
    run.finish()
    data = read_run(tmp_path)
    assert len(data.steps) == 15 and data.meta["trace_steps_dropped"] == 3 and data.meta["policy"] == "none"
    assert data.steps.loss.isna().sum() > 0 and len(data.epochs) == 2 and data.decisions["sizes"].shape == (0, 1)
    from dynamix_hvd.runs.report import write_report

    assert write_report(tmp_path).read_bytes()[:4] == b"\x89PNG"  # no decisions, one rank: still a report
