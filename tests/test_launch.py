"""Launch wrappers and ``dynamix-hvd run``: real jobs, and clear errors for misconfigured launches.

Every bad-settings case runs the real wrapper (``launch/mpirun.sh``, ``launch/horovodrun.sh``) or CLI
and checks the exit code and that the message names the offending value. Where it is cheap, the test
also shows that the real launcher fails the same way without our check (so the check is not spurious).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamix_hvd.tools.launchcheck import local_cores, parse_hostfile

REPO = Path(__file__).resolve().parents[1]
ROOT = os.geteuid() == 0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "DYNAMIX_PROGRESS"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, **extra)
    return env


def wrapper(name: str, *args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / name), *args], env=_env(**env), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def cli(*args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamix_hvd", *args], env=_env(**env), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)


def assert_refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"expected a refusal, got exit 0:\n{out}"
    for needle in needles:
        assert needle in out, f"{needle!r} not in the message:\n{out}"


# --- real jobs through the wrappers (the mpi tier; the checks below refuse before any job starts) ---------
@pytest.mark.mpi
@pytest.mark.parametrize("name,env", [("mpirun.sh", {}), ("horovodrun.sh", {"GLOO": "1"})])
def test_wrapper_runs_a_real_job(tmp_path, name, env):
    # --decide-every 0: decisions at epoch ends only, so the epoch line shows the sizes it was launched with
    proc = wrapper(name, "--epochs", "1", "--samples", "512", "--no-report", "--decide-every", "0",
                   "--out", str(tmp_path), NP="2", BATCH_SIZES="8,24", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "epoch 1/1 | sizes 8/24" in proc.stdout, proc.stdout
    assert (tmp_path / "trace.h5").is_file() and (tmp_path / "epochs.csv").is_file()


@pytest.mark.mpi
def test_run_job_keeps_its_interface(tmp_path):
    # --decide-every 0: decisions at epoch ends only, so epoch 1's line shows the sizes it was launched with
    proc = wrapper("run_job.sh", "--samples", "512", "--no-report", "--decide-every", "0", JOB="mlp", NP="2",
                   LAUNCHER="horovodrun",
                   BATCH_SIZES="4,12", EPOCHS="1", OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sizes 4/12" in proc.stdout and "horovodrun --mpi -np 2" in proc.stderr
    assert (tmp_path / "meta.json").is_file()


def test_run_job_oversubscribes_and_refuses_unknown_choices():
    # more ranks than cores still work as before: run_job.sh oversubscribes by default
    more = wrapper("run_job.sh", JOB="mlp", NP=str(local_cores() + 1), LAUNCHER="mpirun", DRY_RUN="1")
    assert more.returncode == 0 and "--oversubscribe" in more.stderr, more.stderr
    assert wrapper("run_job.sh", JOB="mlp", LAUNCHER="srun").returncode == 2
    assert wrapper("run_job.sh", JOB="nope").returncode == 2


def test_run_job_runs_the_demo_by_default():
    proc = wrapper("run_job.sh", DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [l for l in proc.stderr.splitlines() if "bench.jobs.cnn_train" in l]
    assert len(lines) == 2 and "--plain-horovod" in lines[0] and "--policy model" in lines[1], proc.stderr
    assert all("--slow-factor 3.0" in l for l in lines)


def test_dry_run_shows_the_command():
    proc = wrapper("mpirun.sh", "--epochs", "4", NP="2", DRY_RUN="1", MPIRUN_ARGS="--mca btl self,tcp")
    assert proc.returncode == 0, proc.stderr
    assert "mpirun -np 2 --bind-to none" in proc.stderr and "--mca btl self,tcp" in proc.stderr
    assert "-m dynamix_hvd.examples.mlp --epochs 4" in proc.stderr


# --- no MPI ------------------------------------------------------------------------------------------
def test_no_mpi_found(tmp_path):
    missing = str(tmp_path / "nowhere" / "mpirun")
    assert_refused(wrapper("mpirun.sh", NP="2", MPIRUN=missing), "no MPI found", f"MPIRUN={missing}")
    assert_refused(wrapper("horovodrun.sh", NP="2", MPIRUN=missing), "no MPI found", missing)
    # An MPI-less PATH: the CLI looks mpirun up on the PATH it will launch with.
    empty = tmp_path / "bin"
    empty.mkdir()
    assert_refused(cli("run", "--np", "2", PATH=str(empty)), "no MPI found", "MPIRUN=mpirun")
    # horovodrun --gloo needs no MPI: the same PATH passes the MPI check.
    ok = cli("check", "--np", "2", "--launcher", "horovodrun-gloo", PATH=f"{empty}{os.pathsep}{Path(sys.executable).parent}")
    assert "no MPI found" not in ok.stderr, ok.stderr


# --- hostfile slots ----------------------------------------------------------------------------------
def test_hostfile_with_too_few_slots(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# one slot only\nlocalhost slots=1\n")
    for name, env in (("mpirun.sh", {}), ("horovodrun.sh", {"GLOO": "1"})):
        assert_refused(wrapper(name, NP="2", HOSTFILE=str(hostfile), **env),
                       f"HOSTFILE={hostfile} has 1 slots", "localhost slots=1", "NP=2")
    assert_refused(cli("run", "--np", "3", "--hostfile", str(hostfile)), "has 1 slots", "NP=3")
    # Open MPI itself refuses this hostfile too (our check only says it sooner and clearer).
    real = subprocess.run(["mpirun", "-np", "2", "--hostfile", str(hostfile), "true"], env=_env(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"), capture_output=True, text=True, timeout=60)
    assert real.returncode != 0
    hostfile.write_text("localhost slots=2\n")
    assert wrapper("mpirun.sh", NP="2", HOSTFILE=str(hostfile), DRY_RUN="1").returncode == 0
    real = subprocess.run(["mpirun", "-np", "2", "--hostfile", str(hostfile), "true"], env=_env(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"), capture_output=True, text=True, timeout=60)
    assert real.returncode == 0, real.stderr


def test_hostfile_example_is_valid():
    example = REPO / "hostfile.example"
    assert sum(slots for _, slots in parse_hostfile(example)) == 10
    proc = wrapper("horovodrun.sh", NP="10", HOSTFILE=str(example), DRY_RUN="1")
    assert proc.returncode == 0 and f"-hostfile {example}" in proc.stderr, proc.stderr
    assert_refused(wrapper("mpirun.sh", NP="11", HOSTFILE=str(example)), "has 10 slots", "gpu-node-01 slots=4")


def test_unparsable_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost cpus=4\n")
    assert_refused(wrapper("mpirun.sh", NP="2", HOSTFILE=str(hostfile)), "line 1", "'cpus=4'")


# --- oversubscription --------------------------------------------------------------------------------
def test_more_ranks_than_cores_needs_oversubscribe():
    np = str(local_cores() + 1)
    msg = f"NP={np} ranks but this host has {local_cores()} cores"
    assert_refused(wrapper("mpirun.sh", NP=np), msg, "OVERSUBSCRIBE=1")
    assert_refused(wrapper("horovodrun.sh", NP=np, GLOO="1"), msg)
    assert_refused(cli("run", "--np", np), msg, "--oversubscribe")
    # Open MPI refuses the same launch without --oversubscribe ...
    real = subprocess.run(["mpirun", "-np", np, "true"], env=_env(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"), capture_output=True, text=True, timeout=60)
    assert real.returncode != 0 and "slots" in real.stdout + real.stderr
    # ... and with it the wrapper passes the flag on.
    ok = wrapper("mpirun.sh", NP=np, OVERSUBSCRIBE="1", DRY_RUN="1")
    assert ok.returncode == 0 and "--oversubscribe" in ok.stderr, ok.stderr


# --- root --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not ROOT, reason="only root meets Open MPI's root refusal")
def test_root_without_open_mpi_flags():
    for name in ("mpirun.sh", "horovodrun.sh"):
        assert_refused(wrapper(name, NP="2", ALLOW_RUN_AS_ROOT="0"), "running as root (uid 0)",
                       "OMPI_ALLOW_RUN_AS_ROOT=1", "ALLOW_RUN_AS_ROOT=1")
    assert_refused(cli("run", "--np", "2", "--no-allow-run-as-root"), "running as root", "--no-allow-run-as-root")
    real = subprocess.run(["mpirun", "-np", "1", "true"], env=_env(), capture_output=True, text=True, timeout=60)
    assert real.returncode != 0 and "root" in real.stdout + real.stderr
    # Gloo does not go through mpirun: no root problem.
    assert wrapper("horovodrun.sh", NP="2", GLOO="1", ALLOW_RUN_AS_ROOT="0", DRY_RUN="1").returncode == 0


# --- Horovod build -----------------------------------------------------------------------------------
def _horovod_without(tmp_path: Path, missing: str) -> str:
    """A Horovod that reports a build without `missing` ("mpi" or "gloo"), shadowing the real one.

    Building a second real Horovod takes 12 minutes, so this package stands in for one: it answers
    the questions `dynamix_hvd.tools.buildcheck` asks (`mpi_built`, `gloo_built`, and a CPU-only
    build's `cuda_built`, `nccl_built`).
    """
    pkg = tmp_path / "fake_horovod" / "horovod"
    (pkg / "torch").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.28.1"\n')
    (pkg / "torch" / "__init__.py").write_text(
        f"def mpi_built():\n    return {missing != 'mpi'}\n\ndef gloo_built():\n    return {missing != 'gloo'}\n"
        "\ndef cuda_built():\n    return False\n\ndef nccl_built():\n    return 0\n")
    return f"{pkg.parent}{os.pathsep}{REPO}"


def test_horovod_without_the_needed_controller(tmp_path):
    no_mpi = _horovod_without(tmp_path / "a", "mpi")
    assert_refused(wrapper("mpirun.sh", NP="2", PYTHONPATH=no_mpi), "LAUNCHER=mpirun", "missing: MPI controller",
                   "LAUNCHER=horovodrun-gloo")
    assert_refused(cli("run", "--np", "2", "--launcher", "horovodrun", PYTHONPATH=no_mpi), "missing: MPI controller")
    # Gloo does not need the MPI controller ...
    assert wrapper("horovodrun.sh", NP="2", GLOO="1", PYTHONPATH=no_mpi, DRY_RUN="1").returncode == 0
    # ... but does need Gloo.
    no_gloo = _horovod_without(tmp_path / "b", "gloo")
    assert_refused(wrapper("horovodrun.sh", NP="2", GLOO="1", PYTHONPATH=no_gloo), "LAUNCHER=horovodrun-gloo",
                   "missing: Gloo controller")


def test_several_problems_are_all_listed(tmp_path):
    proc = cli("check", "--np", str(local_cores() + 1), "--mpirun", str(tmp_path / "mpirun"))
    assert_refused(proc, "no MPI found", "oversubscription needed")


def test_cli_rejects_batch_sizes_that_do_not_fit():
    assert_refused(cli("run", "--np", "2", "--batch-sizes", "16,32,64"), "--batch-sizes 16,32,64", "--np 2")
