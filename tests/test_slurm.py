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
import time
from pathlib import Path

import pytest

from dynamix_hvd.runs.rundir import read_run
from launching import WORKERS, launch
from slurm_cluster import SlurmCluster, SlurmUnavailable

REPO = Path(__file__).resolve().parents[1]
_T0: list[float] = []


def _say(capsys: pytest.CaptureFixture[str], message: str) -> None:
    with capsys.disabled():
        print(f"\n[slurm] {message}", flush=True)


SCRIPTS = ("slurm_srun.sbatch", "slurm_mpirun.sbatch")


@pytest.fixture(scope="module")
def cluster():
    _T0.append(time.perf_counter())
    c = SlurmCluster(cpus=4)  # room for both 2-rank jobs at once (slurmd may claim more CPUs than cores)
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


@pytest.fixture(scope="module")
def jobs(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, Path, float]]:
    """Submit both scripts at once (they run side by side); script -> (job id, its folder, submit time)."""
    out = {}
    for script in SCRIPTS:
        d = tmp_path_factory.mktemp(script.split(".")[0])
        job = cluster.sbatch(f"--output={d}/slurm-%j.out", f"--chdir={REPO}", str(REPO / "launch" / script),
                             "--epochs", "2", "--samples", "2048", "--batch-sizes", "16,48", "--out", str(d / "run"),
                             "--decide-every", "0",  # epoch ends only: epoch 1's line shows the launched sizes
                             env={"DYNAMIX_ROOT": str(REPO), "OMP_NUM_THREADS": "1"})
        state = cluster.job_info(job)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "COMPLETED"), state
        out[script] = (job, d, time.perf_counter())
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_script_runs_two_ranks(cluster: SlurmCluster, jobs, script: str, capsys):
    job, tmp_path, t0 = jobs[script]
    out_dir = tmp_path / "run"
    info = cluster.wait_job(job, timeout=300)
    _say(capsys, f"{script}: job {job} {info.get('JobState')} {info.get('ExitCode')} after "
                 f"{time.perf_counter() - t0:.1f} s")
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[list[float]]:
    """Final parameters of resume.py run start to end under mpirun (what a resumed job must reproduce)."""
    d = tmp_path_factory.mktemp("plain")
    launch("mpirun", 2, "resume.py", "--out", str(d), "--ckpt", str(d / "ck"))
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


@pytest.mark.parametrize("script", SCRIPTS)
def test_scancel_term_writes_a_checkpoint_and_a_resubmission_resumes_exactly(cluster: SlurmCluster, script: str,
                                                                             tmp_path: Path, uninterrupted, capsys):
    ckpt, first, again, started = tmp_path / "ck", tmp_path / "first", tmp_path / "again", tmp_path / "started"
    first.mkdir(), again.mkdir()
    job = _submit_resume(cluster, script, tmp_path, ckpt, first, f"--step-sleep 0.3 --started {started}")
    _wait_started(cluster, job, started, script)
    time.sleep(1.0)
    # Plain: Slurm signals the job steps only (srun's ranks; the mpirun script's relay step).
    cluster.run("scancel", "--signal=TERM", str(job))
    info = cluster.wait_job(job, timeout=180)
    _say(capsys, f"{script}: scancel --signal=TERM -> {info.get('JobState')} {info.get('ExitCode')}")
    latest = _assert_checkpointed(info, ckpt, first, script)

    again_job = _submit_resume(cluster, script, tmp_path, ckpt, again, "")
    info = cluster.wait_job(again_job, timeout=300)
    text = Path(info["StdOut"]).read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text}"
    assert f"RESUMED-FROM {ckpt / latest}" in text, text
    resumed = json.loads((again / "rank0.json").read_text())["params"]
    assert resumed == uninterrupted, "the resumed job did not end where the uninterrupted one did"


def _run_both(cluster: SlurmCluster, tmp_path: Path, step_sleep: float, *sbatch_args: str):
    """Both scripts' resume.py jobs side by side; returns script -> (job, checkpoint dir, out dir, started)."""
    jobs = {}
    for script in SCRIPTS:
        d = tmp_path / script.split(".")[0]
        d.mkdir()
        ckpt, out, started = d / "ck", d / "out", d / "started"
        out.mkdir()
        job = _submit_resume(cluster, script, d, ckpt, out, f"--step-sleep {step_sleep} --started {started}",
                             *sbatch_args)
        jobs[script] = (job, ckpt, out, started)
    for script, (job, _, _, started) in jobs.items():
        _wait_started(cluster, job, started, script)
    return jobs


def test_time_limit_warning_writes_a_checkpoint(cluster: SlurmCluster, tmp_path: Path, capsys):
    """#SBATCH --signal=TERM@60 (no B:, so job steps only) on a 2-minute job: both scripts checkpoint and
    end before the time limit. Slurm checks limits every 30 s, so the warning comes 30-60 s in."""
    jobs = _run_both(cluster, tmp_path, 2.0, "--time=2", "--signal=TERM@60")
    for script, (job, ckpt, out, _) in jobs.items():
        info = cluster.wait_job(job, timeout=240)
        _say(capsys, f"{script}: --signal=TERM@60 -> {info.get('JobState')} {info.get('ExitCode')} after "
                     f"{info.get('RunTime')}")
        assert info["JobState"] != "TIMEOUT", f"{script} ran into its time limit: {info}"
        _assert_checkpointed(info, ckpt, out, script)


def test_preemption_writes_a_checkpoint(cluster: SlurmCluster, tmp_path: Path, capsys):
    """Jobs in partition "low" are preempted by one in "high" that needs every CPU: Slurm sends SIGTERM to
    their job steps (not to the batch shell) and cancels them after GraceTime; both checkpoint first."""
    jobs = _run_both(cluster, tmp_path, 1.0, "--partition=low")
    t0 = time.monotonic()
    high = cluster.sbatch("--partition=high", f"--ntasks={cluster.cpus}", f"--output={tmp_path}/high-%j.out",
                          "--wrap", "true")
    for script, (job, ckpt, out, _) in jobs.items():
        info = cluster.wait_job(job, timeout=240)
        took = time.monotonic() - t0
        _say(capsys, f"{script}: preempted -> {info.get('JobState')} {info.get('ExitCode')} {took:.0f} s after "
                     f"the preempting job was submitted (GraceTime {cluster.grace_s} s)")
        assert info["JobState"] in ("PREEMPTED", "FAILED"), info
        assert took < cluster.grace_s, f"{script} was killed at the end of GraceTime instead of ending itself"
        _assert_checkpointed(info, ckpt, out, script)
    assert cluster.wait_job(high, timeout=120)["JobState"] == "COMPLETED"


def test_slurm_wall_time(cluster: SlurmCluster, capsys):
    """Runs last: reports the whole Slurm test's wall time so far (daemons start + both jobs)."""
    assert cluster.run("sinfo", "-h", "-o", "%t").stdout.strip() == "idle"
    _say(capsys, f"Slurm test wall time (cluster start + jobs): {time.perf_counter() - _T0[0]:.1f} s")
