"""SIGTERM under mpirun: all ranks agree, one atomic checkpoint, exit; a relaunch resumes exactly, also
after an out-of-memory step (whose smaller batch makes the AdaScale gain depend on the statistics).

The jobs of all tests run once, in a module-scoped fixture (`jobs`), and each test checks its own runs.
A job starts its ranks (and imports torch and Horovod) once for several runs of a worker (--then between
them, each run in its own folders); a run stopped by SIGTERM ends its job, so it is the last of it. The
uninterrupted run that votes by time measures its own training time: its job runs alone; the others,
which only check results, run side by side.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynamix_hvd.data.plan import epoch_permutation
from launching import WORKERS, launch_side_by_side

SAMPLES = 500
STOP_AT = 1005  # epoch 1, step 5 (rank 1 signals itself)
# The default cadence: a vote about every check_interval_s of training (here 0.3 s of steps that sleep
# 10 ms, so at most 30 steps apart), never one per step.
BY_TIME = ("--check-every", "0", "--check-interval", "0.3", "--step-sleep", "0.01")
# Rank 1 runs out of memory at the fourth step of epoch 1 (chaos.py: 480 samples, ranks [12, 12]): the
# step is redone with [12, 9], so from then on the AdaScale gain at B = 21 depends on the gradient
# statistics of every step the controller was told about (at B = 24 it is 1 whatever they are).
OOM = [{"kind": "oom", "epoch": 1, "start": 72}]
# Restarts after the OOM: saved every N steps -> where the restart resumes (epoch, cursor)
RESTARTS = {10: (1, 408),   # mid-epoch, four steps after the last decision
            11: (1, 480)}   # the epoch's last step, before its end (and decision) ran


def _job(script: str, ranks: int, *runs: list[str]) -> tuple[str, int, list[str]]:
    """One job of tests/workers/`script` running `runs` one after the other (--then between them)."""
    argv = [str(a) for i, run in enumerate(runs) for a in ([] if i == 0 else ["--then"]) + list(run)]
    return "mpirun", ranks, [sys.executable, str(WORKERS / script), *argv]


def _side_by_side(jobs: dict[str, tuple[str, int, list[str]]]) -> dict[str, subprocess.CompletedProcess]:
    return {name: job.proc for name, job in launch_side_by_side(jobs, timeout=300).items()}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Every run of this module: folder and job name by run; each job's CompletedProcess by job name; and
    what the stopped run's checkpoint folder held before anything resumed from it."""
    root = tmp_path_factory.mktemp("preemption")
    d = {name: root / name for name in ("plain", "first", "again", "wider", "bt_plain", "bt_first", "bt_again",
                                        "ref", *(f"every{n}" for n in RESTARTS))}
    for folder in d.values():
        folder.mkdir()
    ck, bt_ck = root / "ck", root / "bt_ck"
    replay = root / "replay.json"
    replay.write_text(json.dumps(OOM))

    def chaos(name: str, *args: object) -> list[object]:
        return ["--out", d[name], "--ckpt", d[name] / "ckpt", "--replay", replay, "--step-sleep", "0", *args]

    done: dict[str, subprocess.CompletedProcess] = {}
    # alone: the uninterrupted runs (by time, then a vote every step) and one stopped by SIGTERM
    done.update(_side_by_side({"uninterrupted": _job(
        "resume.py", 2, ["--out", d["bt_plain"], "--ckpt", root / "ck_bt_plain", *BY_TIME],
        ["--out", d["plain"], "--ckpt", root / "ck_plain"],
        ["--out", d["first"], "--ckpt", ck, "--sigterm-at", STOP_AT])}))
    stopped = {"latest": (ck / "latest").read_text() if (ck / "latest").exists() else None,
               "hidden": sorted(p.name for p in ck.glob(".*"))}
    if ck.is_dir():
        shutil.copytree(ck, root / "ck3")
    # the run stopped while voting by time; the OOM job's reference and first attempts
    done.update(_side_by_side({
        "stopped-by-time": _job("resume.py", 2, ["--out", d["bt_first"], "--ckpt", bt_ck, "--sigterm-at", STOP_AT,
                                                 *BY_TIME]),
        "oom-first": _job("chaos.py", 2, chaos("ref", "--save-every", "0", "--epochs", "3"),
                          *(chaos(f"every{n}", "--save-every", n, "--epochs", "2") for n in RESTARTS))}))
    # the restarts
    done.update(_side_by_side({
        "resumed": _job("resume.py", 2, ["--out", d["again"], "--ckpt", ck],
                        ["--out", d["bt_again"], "--ckpt", bt_ck, *BY_TIME]),
        "resumed-wider": _job("resume.py", 3, ["--out", d["wider"], "--ckpt", root / "ck3"]),
        "oom-restart": _job("chaos.py", 2, *(chaos(f"every{n}", "--save-every", n, "--epochs", "3", "--attempt", "1")
                                             for n in RESTARTS))}))
    return {"dirs": d, "done": done, "stopped": stopped, "ck": ck, "bt_ck": bt_ck}


def _ok(jobs: dict, name: str) -> str:
    """The output of job `name`, which must have succeeded."""
    proc = jobs["done"][name]
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc.stdout


def _stopped(jobs: dict, name: str) -> str:
    """The output of job `name`, whose last run a SIGTERM must have stopped after writing a checkpoint."""
    proc = jobs["done"][name]
    assert proc.returncode != 0 and "stop requested: checkpoint written" in proc.stdout, proc.stdout[-6000:]
    assert "killed: still running" not in proc.stdout, proc.stdout[-6000:]
    return proc.stdout


def _params(out: Path, rank: int = 0) -> list[torch.Tensor]:
    data = json.loads((out / f"rank{rank}.json").read_text())
    return [torch.tensor(p, dtype=torch.float64) for p in data["params"]]


def _served(out: Path, ranks: int, epoch: int) -> list[int]:
    return [i for r in range(ranks) for s in json.loads((out / f"rank{r}.json").read_text())["served"]
            if s["epoch"] == epoch for i in s["indices"]]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _resumed_from(out: str, ckpt: Path) -> str:
    """The line in which the run checkpointing to `ckpt` says where it resumed ('' if none)."""
    return next((line for line in out.splitlines() if line.startswith(f"RESUMED-FROM {ckpt}/")), "")


def test_sigterm_checkpoint_and_resume_matches_uninterrupted_run(jobs):
    d = jobs["dirs"]
    _stopped(jobs, "uninterrupted")
    assert (d["plain"] / "rank0.json").exists(), "the uninterrupted run did not finish"
    assert jobs["stopped"]["latest"] == "step-00001-0000005"
    assert not jobs["stopped"]["hidden"], "temporary files left behind"

    line = _resumed_from(_ok(jobs, "resumed"), jobs["ck"])
    assert line and "epoch 1 step 5" in line, jobs["done"]["resumed"].stdout[-3000:]
    same = _max_diff(_params(d["plain"]), _params(d["again"]))
    print(f"max |param difference| uninterrupted vs SIGTERM+resume on 2 ranks: {same:.3e}")
    assert same == 0.0

    _ok(jobs, "resumed-wider")
    wide = _max_diff(_params(d["plain"]), _params(d["wider"]))
    print(f"max |param difference| uninterrupted vs resume on 3 ranks: {wide:.3e}")
    assert wide < 1e-9  # same global batches, only the summation order differs
    assert not (d["first"] / "rank0.json").exists(), "the stopped run must exit before writing its final results"


def test_resumed_epoch_loses_and_repeats_nothing(jobs):
    _stopped(jobs, "uninterrupted")
    _ok(jobs, "resumed-wider")
    wider = jobs["dirs"]["wider"]
    rest = _served(wider, 3, epoch=1)
    done = 5 * 32  # five steps of global batch 32 before the checkpoint
    order = epoch_permutation(SAMPLES, seed=4, epoch=1).tolist()
    assert sorted(rest) == sorted(order[done:]), "the resumed epoch must serve exactly the unserved samples"
    assert sorted(_served(wider, 3, epoch=2)) == list(range(SAMPLES))


def test_restart_after_an_oom_step_matches_the_uninterrupted_run(jobs):
    d = jobs["dirs"]
    _ok(jobs, "oom-first")
    _ok(jobs, "oom-restart")

    def params(where: Path) -> list[list[float]]:
        final = json.loads((where / "final.json").read_text())
        assert final["epochs"] == 3
        return final["params"]

    want = params(d["ref"])
    for save_every, resume_at in RESTARTS.items():
        out = d[f"every{save_every}"]
        assert [json.loads(line)["kind"] for line in (out / "injected-a0.jsonl").read_text().splitlines()] == ["oom"]
        restored = json.loads((out / "restore-a1.json").read_text())
        assert restored["checkpoint"] and (restored["epoch"], restored["cursor"]) == resume_at, restored
        diff = max(abs(a - b) for x, y in zip(want, params(out)) for a, b in zip(x, y))
        print(f"max |param difference| uninterrupted vs restarted after an OOM (saved every {save_every}): {diff:.3e}")
        assert diff == 0.0


def test_vote_by_time_is_rare_and_the_checkpoint_resumes_exactly(jobs):
    # A vote about every 0.3 s of training, never one per step; the checkpoint it writes after the signal
    # resumes to the uninterrupted run's parameters.
    d = jobs["dirs"]
    _stopped(jobs, "uninterrupted")  # its first run is the uninterrupted one by time
    stats = json.loads((d["bt_plain"] / "stats.json").read_text())
    steps, votes, channel_votes, train_s = (stats[k] for k in ("steps", "votes", "channel_votes", "train_s"))
    print(f"uninterrupted: {steps:g} steps in {train_s:.2f} s, {votes:g} preemption votes")
    assert (d["bt_plain"] / "rank0.json").exists(), "the uninterrupted run by time did not finish"
    assert steps == 48 and votes == channel_votes >= 3, stats
    # one vote per interval of training, plus the first ones while the interval doubles up to it
    assert votes <= train_s / 0.3 + 1 + math.log2(30) and votes <= steps / 3, stats
    _stopped(jobs, "stopped-by-time")
    at = json.loads((d["bt_first"] / "stats.json").read_text())["steps"]
    signalled = 16 + 5  # epoch 0 has 16 steps (500 samples, 32 a step)
    print(f"signal after step {signalled}, checkpoint after step {at}")
    assert signalled <= at <= signalled + 30, jobs["done"]["stopped-by-time"].stdout[-3000:]
    assert _resumed_from(_ok(jobs, "resumed"), jobs["bt_ck"]), jobs["done"]["resumed"].stdout[-3000:]
    assert _max_diff(_params(d["bt_plain"]), _params(d["bt_again"])) == 0.0
