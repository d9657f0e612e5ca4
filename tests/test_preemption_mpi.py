"""SIGTERM under mpirun: all ranks agree, one atomic checkpoint, exit; a relaunch resumes exactly, also
after an out-of-memory step (whose smaller batch makes the AdaScale gain depend on the statistics)."""
from __future__ import annotations

import json
import math
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


# Rank 1 runs out of memory at the fourth step of epoch 1 (chaos.py: 480 samples, ranks [12, 12]): the
# step is redone with [12, 9], so from then on the AdaScale gain at B = 21 depends on the gradient
# statistics of every step the controller was told about (at B = 24 it is 1 whatever they are).
OOM = [{"kind": "oom", "epoch": 1, "start": 72}]


def test_restart_after_an_oom_step_matches_the_uninterrupted_run(tmp_path):
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps(OOM))

    def run(where: Path, *args: str) -> None:
        launch("mpirun", 2, "chaos.py", "--out", str(where), "--ckpt", str(where / "ckpt"), "--replay", str(replay),
               "--step-sleep", "0", *args)

    def params(where: Path) -> list[list[float]]:
        final = json.loads((where / "final.json").read_text())
        assert final["epochs"] == 3
        return final["params"]

    run(tmp_path / "ref", "--save-every", "0", "--epochs", "3")
    want = params(tmp_path / "ref")
    for save_every, resume_at in ((10, (1, 408)),   # mid-epoch, four steps after the last decision
                                  (11, (1, 480))):  # the epoch's last step, before its end (and decision) ran
        out = tmp_path / f"every{save_every}"
        run(out, "--save-every", str(save_every), "--epochs", "2")
        run(out, "--save-every", str(save_every), "--epochs", "3", "--attempt", "1")
        assert [json.loads(line)["kind"] for line in (out / "injected-a0.jsonl").read_text().splitlines()] == ["oom"]
        restored = json.loads((out / "restore-a1.json").read_text())
        assert restored["checkpoint"] and (restored["epoch"], restored["cursor"]) == resume_at, restored
        diff = max(abs(a - b) for x, y in zip(want, params(out)) for a, b in zip(x, y))
        print(f"max |param difference| uninterrupted vs restarted after an OOM (saved every {save_every}): {diff:.3e}")
        assert diff == 0.0


def test_vote_by_time_is_rare_and_the_checkpoint_resumes_exactly(tmp_path):
    # The default cadence: a vote about every check_interval_s of training (here 0.3 s of steps that
    # sleep 10 ms, so at most 30 steps apart), never one per step; the checkpoint it writes after
    # the signal resumes to the uninterrupted run's parameters.
    plain, first, again = (tmp_path / n for n in ("plain", "first", "again"))
    for d in (plain, first, again):
        d.mkdir()
    by_time = ("--check-every", "0", "--check-interval", "0.3", "--step-sleep", "0.01")
    done = launch("mpirun", 2, "resume.py", "--out", str(plain), "--ckpt", str(tmp_path / "ck_plain"), *by_time).stdout
    steps, votes, channel_votes, train_s = (float(done.split(key + " ")[1].split()[0])
                                            for key in ("STEPS", "VOTES", "CHANNEL-VOTES", "TRAIN-S"))
    print(f"uninterrupted: {steps:g} steps in {train_s:.2f} s, {votes:g} preemption votes")
    assert steps == 48 and votes == channel_votes >= 3, done[-3000:]
    # one vote per interval of training, plus the first ones while the interval doubles up to it
    assert votes <= train_s / 0.3 + 1 + math.log2(30) and votes <= steps / 3, done[-3000:]
    ckpt = tmp_path / "ck"
    stopped = launch("mpirun", 2, "resume.py", "--out", str(first), "--ckpt", str(ckpt), "--sigterm-at", str(STOP_AT),
                     *by_time, expect_success=False)
    assert stopped.returncode != 0 and "stop requested: checkpoint written" in stopped.stdout, stopped.stdout[-3000:]
    at = int(stopped.stdout.split("STEPS")[1].split()[0])
    signalled = 16 + 5  # epoch 0 has 16 steps (500 samples, 32 a step)
    print(f"signal after step {signalled}, checkpoint after step {at}")
    assert signalled <= at <= signalled + 30, stopped.stdout[-3000:]
    resumed = launch("mpirun", 2, "resume.py", "--out", str(again), "--ckpt", str(ckpt), *by_time).stdout
    assert "RESUMED-FROM" in resumed
    assert _max_diff(_params(plain), _params(again)) == 0.0
