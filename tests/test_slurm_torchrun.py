"""launch/slurm_torchrun.sbatch on a real single-node Slurm: srun starts torchrun, torchrun the ranks of
the torch.distributed engine (DDP, control messages over Gloo). ``scancel --signal=TERM`` makes the ranks
write one checkpoint and end; a resubmission with 3 ranks instead of 2 resumes from it and completes."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from launching import WORKERS
from slurm_cluster import SlurmCluster, SlurmUnavailable

REPO = Path(__file__).resolve().parents[1]
ARGS = "--no-horovod --sigterm-checkpoint --epochs 4 --samples 800 --per-sample 0.003 --timeout 30"


@pytest.fixture(scope="module")
def cluster():
    c = SlurmCluster(cpus=4)
    try:
        c.start()
    except SlurmUnavailable as exc:
        pytest.fail(f"a real single-node Slurm could not be started: {exc}")
    yield c
    c.stop()


def _submit(cluster: SlurmCluster, tmp_path: Path, ranks: int, extra: str) -> int:
    env = {"DYNAMIX_ROOT": str(REPO), "PYTHONPATH": str(REPO), "SCRIPT": str(WORKERS / "ddp_controller.py"),
           "SCRIPT_ARGS": f"{ARGS} {extra}", "NPROC_PER_NODE": str(ranks),
           "RDZV_PORT": str(29400 + os.getpid() % 500 + ranks)}
    return cluster.sbatch(f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO}", f"--cpus-per-task={ranks}",
                          str(REPO / "launch" / "slurm_torchrun.sbatch"), env=env)


def _output(tmp_path: Path) -> str:
    return "\n".join(p.read_text()[-4000:] for p in sorted(tmp_path.glob("slurm-*.out")))


def test_scancel_term_checkpoints_and_a_resubmission_on_3_ranks_resumes(cluster: SlurmCluster, tmp_path: Path):
    ckpt, first, again, started = tmp_path / "ck", tmp_path / "first", tmp_path / "again", tmp_path / "started"
    first.mkdir(), again.mkdir()
    job = _submit(cluster, tmp_path, 2, f"--out {first} --checkpoints {ckpt} --started {started}")
    end = time.monotonic() + 240
    while not started.exists():
        assert time.monotonic() < end and cluster.job_info(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), \
            f"training never started: {cluster.job_info(job)}\n{_output(tmp_path)}"
        time.sleep(0.5)
    time.sleep(1.0)
    cluster.run("scancel", "--signal=TERM", str(job))
    info = cluster.wait_job(job, timeout=180)
    text = Path(info["StdOut"]).read_text()
    assert "[slurm_torchrun] job" in text and "1 node(s) x 2 ranks" in text, text
    assert "stop requested: checkpoint written" in text, f"{info}\n{text}"
    assert info["ExitCode"] != "0:0" and not (first / "rank0.json").exists(), f"{info}\n{text}"
    latest = (ckpt / "latest").read_text()
    assert (ckpt / latest / "state.pt").is_file()

    job = _submit(cluster, tmp_path, 3, f"--out {again} --checkpoints {ckpt}")
    info = cluster.wait_job(job, timeout=300)
    text = Path(info["StdOut"]).read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text}"
    assert f"rank 0: RESUMED-FROM {latest}" in text, text
    results = [json.loads((again / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(r["engine"] == "torch" and r["backend"] == "torch-gloo" for r in results)
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]
