"""The shipped sbatch scripts on a real single-node Slurm (munged + slurmctld + slurmd, no systemd).

Each script is submitted with ``sbatch`` and runs two ranks of the example training job; the test
polls ``squeue``/``scontrol show job``, then checks the job's final state (COMPLETED, exit 0:0), its
output file and the run directory the job wrote. Then the signals that end jobs early: a plain
``scancel --signal=TERM``, the time-limit warning of ``--signal=TERM@T`` and a preemption must each make
both scripts write a checkpoint and end (a resubmission resumes exactly). Prints the wall time of each
job and of the whole Slurm test (cluster start and stop included).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamix_hvd.runs.rundir import read_run
from launching import WORKERS, command, job_env
from slurm_cluster import SlurmCluster, SlurmUnavailable

REPO = Path(__file__).resolve().parents[1]
_T0: list[float] = []


def _say(capsys: pytest.CaptureFixture[str], message: str) -> None:
    with capsys.disabled():
        print(f"\n[slurm] {message}", flush=True)


SCRIPTS = ("slurm_srun.sbatch", "slurm_mpirun.sbatch")
# Every job of the module holds 2 CPUs; at most three of each script's run at once (the time-limit job with the
# ones to preempt, then with the example job and the one to scancel or its resubmission)
CPUS = 6 * len(SCRIPTS)
LIMIT_CPUS = 2 * len(SCRIPTS)  # the time-limit jobs'


@pytest.fixture(scope="module")
def cluster():
    _T0.append(time.perf_counter())
    c = SlurmCluster(cpus=CPUS)  # room for every job at once (slurmd may claim more CPUs than cores)
    try:
        c.start()
    except SlurmUnavailable as exc:
        pytest.fail(f"a real single-node Slurm could not be started: {exc}")
    pids = {name: p.pid for name, p in c.procs.items()}
    yield c
    c.stop()
    for name, pid in pids.items():  # nothing may be left running
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split()[2] == "Z", f"{name} (pid {pid}) still running after stop()"


class Outcome:
    """What one step of `jobs` gave (its value), or the error that stopped it, raised again where a test
    reads it."""

    def __init__(self, fn, *args) -> None:
        self.error: BaseException | None = None
        try:
            self.value = fn(*args)
        except Exception as exc:  # the tests that read this step fail with it; the others go on
            self.error, self.value = exc, None

    def get(self):
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture(scope="module")
def jobs(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Outcome]]:
    """Every Slurm job of the module, side by side (most of them spend their time sleeping between steps or
    waiting for Slurm's signal); test -> script -> Outcome of what the test checks.

    First the 2-minute jobs that wait for their time-limit warning (partition "debug", never preempted) and
    the jobs of partition "low", which a job of partition "high" then preempts: it needs every CPU the
    time-limit jobs leave. Once it has run, beside the time-limit jobs: the example jobs, the jobs to
    scancel (and their resubmissions), and the uninterrupted run under mpirun the resubmissions must
    reproduce."""
    root = tmp_path_factory.mktemp("slurm")
    out: dict[str, dict[str, Outcome]] = {}
    limit = Outcome(_submit_both, cluster, root / "limit", 2.0, "--time=2", "--signal=TERM@60")
    low = Outcome(_submit_both, cluster, root / "low", 1.0, "--partition=low")
    for pair in (limit, low):
        if pair.error is None:
            for script, (job, _, _, started) in pair.value.items():
                pair.value[script] = (*pair.value[script], Outcome(_wait_started, cluster, job, started, script))
    out["preemption"] = _preempt(cluster, root, limit, low)
    examples = {script: Outcome(_submit_example, cluster, root, script) for script in SCRIPTS}
    cancel = Outcome(_submit_both, cluster, root / "scancel", 0.3)
    plain = root / "plain"
    plain.mkdir()
    uninterrupted = subprocess.Popen(
        command("mpirun", 2, [sys.executable, str(WORKERS / "resume.py"), "--out", str(plain), "--ckpt",
                              str(plain / "ck")]),
        env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        cancelled = Outcome(_scancel_both, cluster, cancel)
        again = {script: Outcome(_resubmit, cluster, script, cancelled) for script in SCRIPTS}
        try:
            ran, _ = uninterrupted.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(uninterrupted.pid, signal.SIGKILL)
            ran = uninterrupted.communicate()[0] + "\n[test] killed: still running after 300 s"
        params = Outcome(_params, plain, uninterrupted.returncode, ran)
        out["scancel"] = {script: Outcome(_wait_resumed, cluster, again[script], params) for script in SCRIPTS}
        out["examples"] = {script: Outcome(_wait_example, cluster, examples[script]) for script in SCRIPTS}
        out["limit"] = {script: Outcome(_wait_limit, cluster, limit, script) for script in SCRIPTS}
    finally:
        if uninterrupted.poll() is None:
            os.killpg(uninterrupted.pid, signal.SIGKILL)
            uninterrupted.wait()
    return out


def _submit_example(cluster: SlurmCluster, root: Path, script: str) -> tuple[int, Path]:
    d = root / script.split(".")[0]
    d.mkdir()
    job = cluster.sbatch(f"--output={d}/slurm-%j.out", f"--chdir={REPO}", str(REPO / "launch" / script),
                         "--epochs", "2", "--samples", "2048", "--batch-sizes", "16,48", "--out", str(d / "run"),
                         "--decide-every", "0",  # epoch ends only: epoch 1's line shows the launched sizes
                         env={"DYNAMIX_ROOT": str(REPO), "OMP_NUM_THREADS": "1"})
    state = cluster.job_info(job)["JobState"]
    assert state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "COMPLETED"), state
    return job, d


def _wait_example(cluster: SlurmCluster, submitted: Outcome) -> tuple[int, Path, dict[str, str]]:
    job, d = submitted.get()
    return job, d, cluster.wait_job(job, timeout=300)


@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_script_runs_two_ranks(cluster: SlurmCluster, jobs, script: str, capsys):
    job, tmp_path, info = jobs["examples"][script].get()
    out_dir = tmp_path / "run"
    _say(capsys, f"{script}: job {job} {info.get('JobState')} {info.get('ExitCode')} after {info.get('RunTime')}")
    output = Path(info["StdOut"])
    assert output == tmp_path / f"slurm-{job}.out"
    text = output.read_text() if output.exists() else "<no output file>"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text}\n{cluster.logs()}"
    assert info["NumTasks"] == "2", info
    assert "epoch 1/2 | sizes 16/48" in text and "epoch 2/2" in text, text
    tag = "[slurm_srun] job" if script == "slurm_srun.sbatch" else "[slurm_mpirun] job"
    assert f"{tag} {job}:" in text, text
    if script == "slurm_mpirun.sbatch":
        assert f"hostfile {cluster.node} slots=2" in text, text

    for name in ("epochs.csv", "trace.h5", "meta.json", "report.png"):
        assert (out_dir / name).is_file(), f"{name} missing in {sorted(p.name for p in out_dir.iterdir())}"
    assert (out_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = read_run(out_dir)
    assert run.meta["world_size"] == 2 and run.meta["slurm_job_id"] == str(job)
    assert run.meta["launcher"] == ("srun" if script == "slurm_srun.sbatch" else "mpirun")
    assert sorted(run.steps["rank"].unique()) == [0, 1]
    assert len(run.epochs) == 4  # 2 epochs x 2 ranks
    # every sample of every epoch was trained on exactly once, split over the two ranks
    assert (run.steps.groupby("epoch").local_batch.sum() == 2048).all()


def _params(d: Path, returncode: int, output: str) -> list[list[float]]:
    """Final parameters of resume.py run start to end under mpirun (what a resumed job must reproduce)."""
    assert returncode == 0, f"the uninterrupted run under mpirun exited {returncode}:\n{output[-4000:]}"
    return json.loads((d / "rank0.json").read_text())["params"]


def _submit_resume(cluster: SlurmCluster, script: str, tmp_path: Path, ckpt: Path, out: Path, extra: str,
                   *sbatch_args: str) -> int:
    env = {"DYNAMIX_ROOT": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "SCRIPT": str(WORKERS / "resume.py"), "SCRIPT_ARGS": f"--out {out} --ckpt {ckpt} {extra}"}
    return cluster.sbatch(f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO}", *sbatch_args,
                          str(REPO / "launch" / script), env=env)


def _wait_started(cluster: SlurmCluster, job: int, started: Path, script: str, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not started.exists():
        assert time.monotonic() < end and cluster.job_info(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), \
            f"{script}: training never started: {cluster.job_info(job)}\n{cluster.logs()}"
        time.sleep(0.5)


def _assert_checkpointed(info: dict[str, str], ckpt: Path, out: Path, script: str) -> str:
    """The job wrote one checkpoint on its own and ended early (no final results), nothing half-written."""
    text = Path(info["StdOut"]).read_text()
    assert "stop requested: checkpoint written" in text, f"{script}: {info}\n{text}"
    assert info["ExitCode"] != "0:0" and not (out / "rank0.json").exists(), f"{script}: {info}\n{text}"
    latest = (ckpt / "latest").read_text()
    assert (ckpt / latest / "state.pt").is_file() and not list(ckpt.glob(".*")), sorted(p.name for p in ckpt.iterdir())
    if script == "slurm_mpirun.sbatch":  # through the relay step or the batch shell, passed on as USR1
        assert "received, passing it to every rank as SIGUSR1" in text, text
    return latest


def _scancel_both(cluster: SlurmCluster, pair: Outcome) -> dict[str, tuple[int, Path, Path, dict[str, str]]]:
    """scancel --signal=TERM of both jobs once they train; script -> (job, checkpoint, out folder, final info)."""
    jobs = pair.get()
    for script, (job, _, _, started) in jobs.items():
        _wait_started(cluster, job, started, script)
    time.sleep(1.0)
    for job, _, _, _ in jobs.values():
        # Plain: Slurm signals the job steps only (srun's ranks; the mpirun script's relay step).
        cluster.run("scancel", "--signal=TERM", str(job))
    return {script: (job, ckpt, first, cluster.wait_job(job, timeout=180))
            for script, (job, ckpt, first, _) in jobs.items()}


def _resubmit(cluster: SlurmCluster, script: str, cancelled: Outcome):
    """The cancelled job's checks, then a resubmission that resumes from its checkpoint: (the cancelled job's
    info, its checkpoint folder, its latest checkpoint, the resubmission's job id and out folder)."""
    job, ckpt, first, info = cancelled.get()[script]
    latest = _assert_checkpointed(info, ckpt, first, script)
    again = first.parent / "again"
    again.mkdir()
    return info, ckpt, latest, _submit_resume(cluster, script, first.parent, ckpt, again, ""), again


def _wait_resumed(cluster: SlurmCluster, resubmitted: Outcome, params: Outcome):
    """What _resubmit gave, the resubmission's final info and the uninterrupted run's parameters."""
    info, ckpt, latest, again_job, again = resubmitted.get()
    return info, ckpt, latest, cluster.wait_job(again_job, timeout=300), again, params


@pytest.mark.parametrize("script", SCRIPTS)
def test_scancel_term_writes_a_checkpoint_and_a_resubmission_resumes_exactly(jobs, script: str, capsys):
    info, ckpt, latest, again_info, again, params = jobs["scancel"][script].get()
    _say(capsys, f"{script}: scancel --signal=TERM -> {info.get('JobState')} {info.get('ExitCode')}")
    text = Path(again_info["StdOut"]).read_text()
    assert again_info["JobState"] == "COMPLETED" and again_info["ExitCode"] == "0:0", f"{again_info}\n{text}"
    assert f"RESUMED-FROM {ckpt / latest}" in text, text
    resumed = json.loads((again / "rank0.json").read_text())["params"]
    assert resumed == params.get(), "the resumed job did not end where the uninterrupted one did"


def _submit_both(cluster: SlurmCluster, root: Path, step_sleep: float, *sbatch_args: str):
    """Both scripts' resume.py jobs; returns script -> (job, checkpoint dir, out dir, started)."""
    jobs = {}
    for script in SCRIPTS:
        d = root / script.split(".")[0]
        d.mkdir(parents=True)
        ckpt, out, started = d / "ck", d / "out", d / "started"
        out.mkdir()
        job = _submit_resume(cluster, script, d, ckpt, out, f"--step-sleep {step_sleep} --started {started}",
                             *sbatch_args)
        jobs[script] = (job, ckpt, out, started)
    return jobs


def _wait_limit(cluster: SlurmCluster, pair: Outcome, script: str) -> tuple[dict[str, str], Path, Path]:
    job, ckpt, out, _, started = pair.get()[script]
    started.get()
    return cluster.wait_job(job, timeout=240), ckpt, out


def test_time_limit_warning_writes_a_checkpoint(jobs, capsys):
    """#SBATCH --signal=TERM@60 (no B:, so job steps only) on a 2-minute job: both scripts checkpoint and
    end before the time limit. Slurm checks limits every 30 s, so the warning comes 30-60 s in."""
    for script in SCRIPTS:
        info, ckpt, out = jobs["limit"][script].get()
        _say(capsys, f"{script}: --signal=TERM@60 -> {info.get('JobState')} {info.get('ExitCode')} after "
                     f"{info.get('RunTime')}")
        assert info["JobState"] != "TIMEOUT", f"{script} ran into its time limit: {info}"
        _assert_checkpointed(info, ckpt, out, script)


def _preempt(cluster: SlurmCluster, root: Path, limit: Outcome, low: Outcome) -> dict[str, Outcome]:
    """Once the time-limit jobs and those of partition "low" train: a job of partition "high" that needs every
    CPU but the time-limit jobs'; the preempted jobs' final info and how long after its submission they
    ended, and the preempting job's final info."""
    def submit() -> tuple[int, float]:
        for pair in (limit, low):
            for script in SCRIPTS:
                pair.get()[script][4].get()  # training started
        t0 = time.monotonic()
        high = cluster.sbatch("--partition=high", f"--ntasks={cluster.cpus - LIMIT_CPUS}",
                              f"--output={root}/high-%j.out", "--wrap", "true")
        return high, t0

    submitted = Outcome(submit)

    def ended(script: str):
        high, t0 = submitted.get()
        job, ckpt, out, _, _ = low.get()[script]
        info = cluster.wait_job(job, timeout=240)
        return info, time.monotonic() - t0, ckpt, out

    result = {script: Outcome(ended, script) for script in SCRIPTS}
    result["high"] = Outcome(lambda: cluster.wait_job(submitted.get()[0], timeout=120))
    return result


def test_preemption_writes_a_checkpoint(cluster: SlurmCluster, jobs, capsys):
    """Jobs in partition "low" are preempted by one in "high" that needs every CPU they and the free ones
    hold: Slurm sends SIGTERM to their job steps (not to the batch shell) and cancels them after GraceTime;
    both checkpoint first."""
    for script in SCRIPTS:
        info, took, ckpt, out = jobs["preemption"][script].get()
        _say(capsys, f"{script}: preempted -> {info.get('JobState')} {info.get('ExitCode')} {took:.0f} s after "
                     f"the preempting job was submitted (GraceTime {cluster.grace_s} s)")
        assert info["JobState"] in ("PREEMPTED", "FAILED"), info
        assert took < cluster.grace_s, f"{script} was killed at the end of GraceTime instead of ending itself"
        _assert_checkpointed(info, ckpt, out, script)
    assert jobs["preemption"]["high"].get()["JobState"] == "COMPLETED"


def test_slurm_wall_time(cluster: SlurmCluster, jobs, capsys):
    """Reports the whole Slurm test's wall time (daemons start + every job); the node is idle afterwards."""
    assert cluster.run("sinfo", "-h", "-o", "%t").stdout.strip() == "idle"
    _say(capsys, f"Slurm test wall time (cluster start + jobs): {time.perf_counter() - _T0[0]:.1f} s")
