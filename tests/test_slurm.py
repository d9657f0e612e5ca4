"""The shipped sbatch scripts on a real single-node Slurm (munged + slurmctld + slurmd, no systemd).

Each script is submitted with ``sbatch`` and runs two ranks of the example training job; the test
polls ``squeue``/``scontrol show job``, then checks the job's final state (COMPLETED, exit 0:0), its
output file and the run directory the job wrote. Prints the wall time of each job and of the whole
Slurm test (cluster start and stop included).
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


@pytest.mark.parametrize("script", SCRIPTS)
def test_scancel_term_writes_a_checkpoint_and_a_resubmission_resumes_exactly(cluster: SlurmCluster, script: str,
                                                                             tmp_path: Path, uninterrupted, capsys):
    ckpt, first, again, started = tmp_path / "ck", tmp_path / "first", tmp_path / "again", tmp_path / "started"
    first.mkdir(), again.mkdir()

    def submit(out: Path, extra: str) -> int:
        env = {"DYNAMIX_ROOT": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
               "SCRIPT": str(WORKERS / "resume.py"), "SCRIPT_ARGS": f"--out {out} --ckpt {ckpt} {extra}"}
        return cluster.sbatch(f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO}", str(REPO / "launch" / script),
                              env=env)

    job = submit(first, f"--step-sleep 0.3 --started {started}")
    end = time.monotonic() + 240
    while not started.exists():
        assert time.monotonic() < end and cluster.job_info(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), \
            f"{script}: training never started: {cluster.job_info(job)}\n{cluster.logs()}"
        time.sleep(0.5)
    time.sleep(1.0)
    # srun's ranks are a job step and get the signal as they are; mpirun's batch script traps and forwards it.
    batch = ["--batch"] if script == "slurm_mpirun.sbatch" else []
    cluster.run("scancel", "--signal=TERM", *batch, str(job))
    info = cluster.wait_job(job, timeout=180)
    text = Path(info["StdOut"]).read_text()
    _say(capsys, f"{script}: scancel --signal=TERM {' '.join(batch)}-> {info.get('JobState')} {info.get('ExitCode')}")
    assert "stop requested: checkpoint written" in text, f"{info}\n{text}"
    assert info["ExitCode"] != "0:0" and not (first / "rank0.json").exists(), f"{info}\n{text}"
    latest = (ckpt / "latest").read_text()
    assert (ckpt / latest / "state.pt").is_file() and not list(ckpt.glob(".*")), sorted(p.name for p in ckpt.iterdir())

    again_job = submit(again, "")
    info = cluster.wait_job(again_job, timeout=300)
    text = Path(info["StdOut"]).read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text}"
    assert f"RESUMED-FROM {ckpt / latest}" in text, text
    resumed = json.loads((again / "rank0.json").read_text())["params"]
    assert resumed == uninterrupted, "the resumed job did not end where the uninterrupted one did"


def test_slurm_wall_time(cluster: SlurmCluster, capsys):
    """Runs last: reports the whole Slurm test's wall time so far (daemons start + both jobs)."""
    assert cluster.run("sinfo", "-h", "-o", "%t").stdout.strip() == "idle"
    _say(capsys, f"Slurm test wall time (cluster start + jobs): {time.perf_counter() - _T0[0]:.1f} s")
