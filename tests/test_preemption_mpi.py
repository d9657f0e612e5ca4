"""SIGTERM under mpirun: all ranks agree, one atomic checkpoint, exit; a relaunch resumes exactly."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dynamix_hvd.data.plan import epoch_permutation
from launching import launch

SAMPLES = 500
STOP_AT = 1005  # epoch 1, step 5 (rank 1 signals itself)


def _params(out: Path, rank: int = 0) -> list[torch.Tensor]:
    data = json.loads((out / f"rank{rank}.json").read_text())
    return [torch.tensor(p, dtype=torch.float64) for p in data["params"]]


def _served(out: Path, ranks: int, epoch: int) -> list[int]:
    return [i for r in range(ranks) for s in json.loads((out / f"rank{r}.json").read_text())["served"]
            if s["epoch"] == epoch for i in s["indices"]]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_sigterm_checkpoint_and_resume_matches_uninterrupted_run(tmp_path):
    plain, first, again, wider = (tmp_path / n for n in ("plain", "first", "again", "wider"))
    for d in (plain, first, again, wider):
        d.mkdir()
    launch("mpirun", 2, "resume.py", "--out", str(plain), "--ckpt", str(tmp_path / "ck_plain"))

    ckpt = tmp_path / "ck"
    stopped = launch("mpirun", 2, "resume.py", "--out", str(first), "--ckpt", str(ckpt),
                     "--sigterm-at", str(STOP_AT), expect_success=False)
    assert stopped.returncode != 0 and "stop requested: checkpoint written" in stopped.stdout, stopped.stdout
    assert (ckpt / "latest").read_text() == "step-00001-0000005"
    assert not list(ckpt.glob(".*")), "temporary files left behind"
    shutil.copytree(ckpt, tmp_path / "ck3")

    resumed = launch("mpirun", 2, "resume.py", "--out", str(again), "--ckpt", str(ckpt)).stdout
    assert "RESUMED-FROM" in resumed and "epoch 1 step 5" in resumed
    same = _max_diff(_params(plain), _params(again))
    print(f"max |param difference| uninterrupted vs SIGTERM+resume on 2 ranks: {same:.3e}")
    assert same == 0.0

    launch("mpirun", 3, "resume.py", "--out", str(wider), "--ckpt", str(tmp_path / "ck3"))
    wide = _max_diff(_params(plain), _params(wider))
    print(f"max |param difference| uninterrupted vs resume on 3 ranks: {wide:.3e}")
    assert wide < 1e-9  # same global batches, only the summation order differs
    log_first = first / "rank0.json"
    assert not log_first.exists(), "the stopped run must exit before writing its final results"


def test_resumed_epoch_loses_and_repeats_nothing(tmp_path):
    first, wider = tmp_path / "first", tmp_path / "wider"
    first.mkdir(), wider.mkdir()
    ckpt = tmp_path / "ck"
    launch("mpirun", 2, "resume.py", "--out", str(first), "--ckpt", str(ckpt), "--sigterm-at", str(STOP_AT),
           expect_success=False)
    launch("mpirun", 3, "resume.py", "--out", str(wider), "--ckpt", str(ckpt))
    rest = _served(wider, 3, epoch=1)
    done = 5 * 32  # five steps of global batch 32 before the checkpoint
    order = epoch_permutation(SAMPLES, seed=4, epoch=1).tolist()
    assert sorted(rest) == sorted(order[done:]), "the resumed epoch must serve exactly the unserved samples"
    assert sorted(_served(wider, 3, epoch=2)) == list(range(SAMPLES))
