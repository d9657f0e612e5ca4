"""Start real multi-process jobs the way users do: mpirun, horovodrun (MPI), horovodrun --gloo and torchrun."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from dynamix_hvd.tools.launchcheck import ROOT_ENV, local_plan
from dynamix_hvd.tools.launchcheck import command as launch_command

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        **ROOT_ENV,  # CI and this machine run as root; Open MPI refuses root without these two.
        "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
    })
    return env


def command(launcher: str, np: int, argv: list[str]) -> list[str]:
    """The launcher line `dynamix-hvd run` and the benchmarks use, on this host, oversubscribed."""
    return launch_command(local_plan(launcher, np), argv, forward=())


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a launched job: the launcher's process group and every process it started, wherever
    they are (torchrun starts each rank in a session of its own, so killing torchrun's group alone
    would leave its ranks running, holding the output pipe open)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


class Job:
    """One job started by `launch_side_by_side`: its CompletedProcess and when it ended (time.time())."""

    def __init__(self, proc: subprocess.CompletedProcess, ended: float) -> None:
        self.proc, self.ended = proc, ended


def launch_side_by_side(jobs: dict[str, tuple[str, int, list[str]]], timeout: float = 300) -> dict[str, Job]:
    """Start several jobs at once, name -> (launcher, ranks, argv), and wait for all of them; returns name ->
    Job. For jobs that spend most of their time waiting (a rank that sleeps or is stopped on purpose): side
    by side they take about as long as the longest. A job still running after `timeout` is killed, its
    output kept (the caller sees the exit code and its output)."""
    started = {}
    for name, (launcher, np, argv) in jobs.items():
        log = tempfile.TemporaryFile("w+")  # a pipe could fill up while another job is waited for
        proc = subprocess.Popen(command(launcher, np, argv), env=job_env(), stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        started[name] = (proc, log)
    end = time.monotonic() + timeout
    ended: dict[str, float] = {}
    killed = set()
    while len(ended) < len(started):
        for name, (proc, _) in started.items():
            if name not in ended and proc.poll() is not None:
                ended[name] = time.time()
        if time.monotonic() > end:
            for name, (proc, _) in started.items():
                if name not in ended:
                    kill_job(proc)
                    proc.wait()
                    ended[name] = time.time()
                    killed.add(name)
        time.sleep(0.05)
    out = {}
    for name, (proc, log) in started.items():
        log.seek(0)
        text = log.read() + (f"\n[launching] killed: still running after {timeout} s\n" if name in killed else "")
        out[name] = Job(subprocess.CompletedProcess(proc.args, proc.returncode, text, ""), ended[name])
        log.close()
    return out


def launch(launcher: str, np: int, script: str, *args: str, timeout: float = 300,
           expect_success: bool = True) -> subprocess.CompletedProcess:
    """Run tests/workers/`script` on `np` ranks; kill the whole job if it outlives `timeout`.

    With expect_success (default) a non-zero exit fails the test; otherwise the caller checks."""
    argv = [sys.executable, str(WORKERS / script), *args]
    proc = subprocess.Popen(command(launcher, np, argv), env=job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{launcher} -np {np} {script} did not finish in {timeout} s:\n{out[-4000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
    if expect_success and proc.returncode != 0:
        raise AssertionError(f"{launcher} -np {np} {script} exited {proc.returncode}:\n{out[-6000:]}")
    return result
