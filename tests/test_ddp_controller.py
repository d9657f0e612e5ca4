"""The controller and the checkpointer on the torch.distributed engine, in real torchrun jobs where
importing Horovod fails: decisions over Gloo messages, DDP's gradients, deadlines that name a rank."""
from __future__ import annotations

import json
import time
from pathlib import Path

from launching import launch


def test_a_slow_rank_gets_fewer_samples_under_torchrun(tmp_path):
    """Rank 1 sleeps 3x longer per sample: the split moves to about 3:1, alike on every rank; DDP's
    allreduce waits inside backward are counted as waits, not as the fast rank's compute."""
    launch("torchrun", 2, "ddp_controller.py", "--no-horovod", "--out", str(tmp_path),
           "--checkpoints", str(tmp_path / "ckpt"), timeout=200)
    results = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert (r["engine"], r["backend"], r["horovod_imported"]) == ("torch", "torch-gloo", False)
    decisions = [d["sizes"] for d in results[0]["decisions"]]
    assert [d["sizes"] for d in results[1]["decisions"]] == decisions
    assert len(decisions) >= 8, decisions
    b0, b1 = decisions[-1]
    assert b0 >= 2 * b1, decisions
    assert results[0]["params"] == results[1]["params"], "the ranks' models differ"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")), "no checkpoint"


def test_a_slow_rank_is_seen_where_the_others_wait_in_ddps_buffer_broadcast(tmp_path):
    """A BatchNorm model: DDP broadcasts its buffers at the start of every forward pass. Rank 1 is slow
    after backward, so the others wait for it in that broadcast, not in the allreduce: the wait must
    still count as a wait (else both ranks look equally slow and the split never moves). 32 samples
    per rank, so that the BatchNorm floor (16 per rank) leaves room to move."""
    launch("torchrun", 2, "ddp_controller.py", "--no-horovod", "--out", str(tmp_path), "--batchnorm",
           "--sleep-after-backward", "--batch", "32", "--samples", "6400", "--epochs", "2", timeout=200)
    result = json.loads(Path(tmp_path, "rank0.json").read_text())
    decisions = [d["sizes"] for d in result["decisions"]]
    b0, b1 = decisions[-1]
    assert b0 >= 2 * b1, decisions


def test_a_silent_rank_is_named_under_torchrun():
    out = launch("torchrun", 3, "ddp_controller.py", "--no-horovod", "--mode", "silent", "--silent", "2",
                 "--timeout", "3", timeout=120).stdout
    lines = {r: next((line for line in out.splitlines() if f"TIMEOUT-OK rank {r}" in line), "") for r in (0, 1)}
    assert "rank(s) [2] did not answer" in lines[0], out[-3000:]
    assert "rank(s) [2] did not answer" in lines[1] or "from rank 0" in lines[1], out[-3000:]


def test_a_stopped_rank_ends_the_job_naming_it_under_torchrun():
    """Rank 1 stops (SIGSTOP) mid-training: the others wait for it inside DDP's backward, their
    watchdogs probe it and end the job within the deadline, naming rank 1; torchrun then ends the
    stopped process (SIGKILL after its 30 s grace: a stopped process does not take SIGTERM)."""
    t0 = time.monotonic()
    out = launch("torchrun", 3, "ddp_controller.py", "--no-horovod", "--stop-rank", "1", "--timeout", "3",
                 expect_success=False, timeout=150)
    assert out.returncode != 0, out.stdout[-3000:]
    assert "rank(s) [1] did not answer a liveness probe" in out.stdout, out.stdout[-3000:]
    assert "rank 1: stopping itself" in out.stdout
    assert time.monotonic() - t0 < 90
