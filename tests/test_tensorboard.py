"""TensorBoard output of a run: the points every tag gets, and the event files (or, without the
optional tensorboard package, a clear error naming it, raised before training starts)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import dynamix_hvd as dx
from dynamix_hvd.runs.runlog import RunLog, decision_arrays, write_run
from dynamix_hvd.runs.tensorboard import MISSING, scalars

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
RANK_TAGS = {f"{name}/rank{r}" for name in ("batch_size", "throughput", "allreduce_wait_s", "lr", "loss")
             for r in (0, 1)}
CONTROLLER_TAGS = {*(f"controller/{k}/rank{r}" for k in ("batch_size", "reward") for r in (0, 1)),
                   *(f"controller/{k}" for k in ("noise_scale", "efficiency", "throughput", "lr_gain",
                                                 "global_batch"))}


def fake_run() -> tuple[pd.DataFrame, dict[str, np.ndarray], list[dict]]:
    """Two ranks, three steps each (rank 1's first loss missing), two decisions."""
    rows = []
    for r, b in ((0, 16), (1, 48)):
        for s in range(3):
            rows.append({"rank": r, "epoch": 0, "step": s, "local_batch": b + s, "global_batch": 64 + s,
                         "samples_per_s": 100.0 * (r + 1) + s, "sync_wait_s": 0.01 * (s + 1) * (1 - r),
                         "lr": 0.1 * (s + 1), "loss": math.nan if (r, s) == (1, 0) else 2.0 - 0.1 * s,
                         "wall_s": 0.5 * s + 0.01 * r, "status": "ok"})
    history = [{"decision": i, "epoch": i, "sizes": [16 + 8 * i, 48 - 8 * i], "previous_sizes": [16, 48],
                "reward": [None, None] if i == 0 else [0.5, -0.25], "noise_scale": 40.0 + i,
                "efficiency": 0.9 - 0.1 * i, "throughput": 400.0 + i, "lr_gain": 1.0 + i} for i in range(2)]
    history[0]["reward"] = None
    return pd.DataFrame(rows), decision_arrays(history, 2, {0: 1.0, 1: 2.0}), history


def test_every_metric_gets_its_tag_and_values():
    steps, decisions, _ = fake_run()
    points = list(scalars(steps, decisions, t0=1000.0))
    tags = {p.tag for p in points}
    assert tags == RANK_TAGS | CONTROLLER_TAGS
    by = {(p.tag, p.step): p for p in points}
    assert [by["batch_size/rank1", s].value for s in range(3)] == [48, 49, 50]
    assert by["allreduce_wait_s/rank0", 2].value == pytest.approx(0.03)
    assert ("loss/rank1", 0) not in by and by["loss/rank1", 1].value == pytest.approx(1.9)  # NaN left out
    assert by["throughput/rank1", 0].wall_time == pytest.approx(1000.01)
    assert by["controller/batch_size/rank0", 1].value == 24 and by["controller/global_batch", 1].value == 64
    assert ("controller/reward/rank0", 0) not in by and by["controller/reward/rank1", 1].value == -0.25
    assert by["controller/noise_scale", 1].value == 41 and by["controller/lr_gain", 1].wall_time == 1002.0


def test_event_files_hold_the_tags_or_the_missing_package_is_named(tmp_path: Path, cli_here):
    steps, decisions, history = fake_run()
    run_dir = tmp_path / "run"
    write_run(run_dir, {"created": "2026-01-01T00:00:00+00:00", "world_size": 2}, steps,
              pd.DataFrame([{"epoch": 0, "rank": 0}]), decisions, history)
    loader = dx.AdaptiveLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), [4], 0)
    proc = cli_here("tensorboard", str(run_dir), "--logdir", str(tmp_path / "tb"))
    if not HAVE_TENSORBOARD:
        # the CLI and a RunLog asking for TensorBoard both say what to install, the RunLog before training
        assert proc.returncode == 1 and MISSING in proc.stderr and "dynamix_hvd[tensorboard]" in MISSING
        with pytest.raises(ImportError, match=r"'tensorboard' package"):
            RunLog(tmp_path / "out", loader, gather=lambda obj: [obj], tensorboard=True)
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert proc.returncode == 0, proc.stderr
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == RANK_TAGS | CONTROLLER_TAGS
    assert [e.value for e in acc.Scalars("batch_size/rank0")] == [16, 17, 18]
    assert [e.value for e in acc.Scalars("controller/noise_scale")] == [40, 41]
    # and straight from a RunLog: written by rank 0 into OUT/tensorboard at finish
    log = RunLog(tmp_path / "out", loader, gather=lambda obj: [obj], tensorboard=True)
    loader.set_epoch(0)
    for _ in loader:
        loader.tracker.step_finished(lr=0.1)
    log.end_epoch()
    out = log.finish()
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("batch_size/rank0")] == [4, 4]
