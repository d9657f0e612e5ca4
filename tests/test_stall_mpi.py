"""A rank stopped with SIGSTOP under mpirun: the job ends within timeout_s plus the documented margin,
with a message naming the stopped rank and a non-zero exit (no rank left hanging in Horovod)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dynamix_hvd.comm import ABORT_CODE
from launching import WORKERS, launch_side_by_side

TIMEOUT_S = 4.0
# docs/faults.md "A rank that stops answering": the probe (min(10, 2 + 0.1 timeout_s)) plus a few seconds for
# mpirun to end the ranks; 15 s more on this loaded two-core machine.
MARGIN_S = 2.0 + 0.1 * TIMEOUT_S + 3.0 + 15.0


def _kill_victim(out: Path) -> None:
    marker = out / "victim.json"
    if marker.exists():
        pid = json.loads(marker.read_text())["pid"]
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


STOPPED = [  # case, ranks, extra arguments, where the message says the others waited
    ("checkpointer", 2, ["--ckpt", "CKPT"], "preemption check"),       # stuck in the preemption vote
    ("allreduce", 3, [], "in the gradient allreduce"),                 # no collective of ours: the watchdog
    ("decide-every-step", 2, ["--every", "1"], "decision"),            # stuck in the controller's gather
    # the others wait in the script's own epoch-end broadcast, where only the watchdog's idle probe
    # sees the stopped rank: timeout_s without a step, then timeout_s of unanswered probes
    ("user-collective", 2, ["--epoch-vote"], "outside the gradient allreduce"),
    # the victim raises there instead: its controller closes on an error, so it does not say it is done
    ("user-collective-error", 2, ["--epoch-vote", "--fail"], "outside the gradient allreduce"),
    # the victim leaves training (its controller closes cleanly) while the other waits in the allreduce
    ("left-training", 2, ["--leave"], "in the gradient allreduce"),
]


# Jobs in which no rank may be taken for a stopped one: case -> ranks, timeout_s, extra arguments
FINISHING = {
    # The victim "evaluates" 5 s after the last step, then stops for 6 s: rank 0, idle since that
    # step, probes it from 8 s and gets no answer until 11 s. 6 s of silence is under timeout_s (8 s),
    # with 2 s to spare for a loaded machine: the job carries on (a watchdog that named a peer failing
    # one probe would end it at ~10.8 s).
    "stop-shorter-than-timeout": (2, 8.0, ["--epoch-vote", "--busy", "5", "--stop-for", "6"]),
    # Rank 1 finishes and exits (its watchdog closes and says so) while rank 0 stays in the job for
    # 5 timeouts with its controller open: rank 0 must not take rank 1's silence for a stop (without
    # the closing message it would name rank 1 after about 8 s).
    "finished-rank": (2, 3.0, ["--victim", "-1", "--linger", "15"]),
}


# A rank that ends on an unhandled exception while another is stopped: case -> (ranks, worker), see below
UNHANDLED = {"unhandled-timeout": (2, "exit_abort.py")}


@pytest.fixture(scope="module")
def stall_jobs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess, float]]:
    """Every case's job, of STOPPED and of FINISHING, side by side (each spends most of its time waiting for
    a stopped, sleeping or finished rank, so together they take about as long as the longest): case -> (its
    folder, the finished job, when it ended, time.time())."""
    cases = {case: (ranks, TIMEOUT_S, extra) for case, ranks, extra, _ in STOPPED}
    cases.update(FINISHING)
    jobs, folders = {}, {}
    for case, (ranks, timeout_s, extra) in cases.items():
        folders[case] = out = tmp_path_factory.mktemp(case)
        extra = [str(out / "ck") if a == "CKPT" else a for a in extra]
        jobs[case] = ("mpirun", ranks, [sys.executable, str(WORKERS / "stall.py"), "--out", str(out),
                                        "--timeout", str(timeout_s), *extra])
    for case, (ranks, worker) in UNHANDLED.items():
        folders[case] = out = tmp_path_factory.mktemp(case)
        jobs[case] = ("mpirun", ranks, [sys.executable, str(WORKERS / worker), "--out", str(out)])
    try:
        done = launch_side_by_side(jobs, timeout=300)
    finally:
        for out in folders.values():
            _kill_victim(out)
    return {case: (folders[case], job.proc, job.ended) for case, job in done.items()}


@pytest.mark.parametrize("case, ranks, extra, names", STOPPED)
def test_stopped_rank_ends_the_job_naming_it(stall_jobs, case, ranks, extra, names):
    tmp_path, proc, ended = stall_jobs[case]
    out = proc.stdout
    assert "killed: still running" not in out, f"{case}: the job hung (killed after 300 s):\n{out[-4000:]}"
    assert (tmp_path / "victim.json").exists(), f"the victim never stopped: the test proved nothing\n{out[-3000:]}"
    took = ended - json.loads((tmp_path / "victim.json").read_text())["t"]
    print(f"{case}: job ended {took:.1f} s after rank 1 stopped (timeout_s {TIMEOUT_S:g}, bound "
          f"{_bound(case):g} s), exit code {proc.returncode}")
    assert proc.returncode == ABORT_CODE, f"{case}: exit {proc.returncode}\n{out[-4000:]}"
    assert "FINISHED" not in out, out[-4000:]
    named = "rank(s) [1] have closed their controller" if case == "left-training" else "rank(s) [1] did not answer"
    assert named in out and names in out, out[-4000:]
    # Any rank left waiting may be the first whose watchdog fires (a race between equals): what matters
    # is that the message names the stopped rank, which the line above checks.
    waiting = [r for r in range(ranks) if r != 1]
    assert any(f"rank {r}:" in out for r in waiting) and "ending the job" in out, out[-4000:]
    if case == "allreduce":
        assert "rank(s) [0, 2] were waiting in the allreduce" in out, out[-4000:]
    assert took < _bound(case), f"{case}: took {took:.1f} s (bound {_bound(case):g} s)"


def _bound(case: str) -> float:
    """docs/faults.md "A rank that stops answering": outside the allreduce a further timeout_s and probe; a rank
    that left is named a probe after it is found closed."""
    probe = 2.0 + 0.1 * TIMEOUT_S
    extra = {"user-collective": TIMEOUT_S + probe, "user-collective-error": TIMEOUT_S + probe, "left-training": probe}
    return TIMEOUT_S + MARGIN_S + extra.get(case, 0.0)


def _finishes(stall_jobs, case: str) -> str:
    tmp_path, done, _ = stall_jobs[case]
    ranks = FINISHING[case][0]
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}"
    for r in range(ranks):
        assert f"rank {r}: FINISHED" in done.stdout, done.stdout[-4000:]
    return done.stdout


def test_stop_shorter_than_timeout_outside_the_allreduce_is_waited_for(stall_jobs):
    out = _finishes(stall_jobs, "stop-shorter-than-timeout")
    assert (stall_jobs["stop-shorter-than-timeout"][0] / "victim.json").exists(), \
        "the victim never stopped: the test proved nothing"
    assert "did not answer" not in out, out[-4000:]


def test_rank_that_finished_is_not_taken_for_a_stopped_one(stall_jobs):
    out = _finishes(stall_jobs, "finished-rank")
    assert "did not answer" not in out, out[-4000:]


def test_an_unhandled_timeout_ends_the_job_although_a_rank_is_stopped(stall_jobs):
    """Rank 0's CollectiveTimeout (naming the stopped rank 1) reaches the top of its script unhandled: at
    exit it waits for the others up to the exit barrier's deadline (60 s), then ends the job (exit code
    70) instead of waiting in MPI's shutdown for the stopped rank forever."""
    tmp_path, proc, ended = stall_jobs["unhandled-timeout"]
    out = proc.stdout
    assert "killed: still running" not in out, f"the job hung (killed after 300 s):\n{out[-4000:]}"
    took = ended - json.loads((tmp_path / "victim.json").read_text())["t"]
    print(f"unhandled timeout: job ended {took:.1f} s after rank 1 stopped, exit code {proc.returncode}")
    assert proc.returncode == ABORT_CODE, f"exit {proc.returncode}\n{out[-4000:]}"
    assert "CollectiveTimeout" in out and "rank(s) [1] did not answer" in out, out[-4000:]
    assert "after this rank failed (CollectiveTimeout" in out and "ending the job" in out, out[-4000:]
    assert took < 60.0 + 3.0 + MARGIN_S, took
