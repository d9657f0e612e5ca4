"""Optional TensorBoard event files from a run's records (needs the ``tensorboard`` package:
``pip install 'dynamix_hvd[tensorboard]'``). The CSV, HDF5 and PNG outputs are written as before.

Written once, by rank 0, from what `RunLog.finish` gathered (every rank's steps and the controller's
history), into ``OUT/tensorboard`` (`RunLog(..., tensorboard=True)`), or afterwards from a run
directory (``dynamix-hvd tensorboard RUN_DIR``). Tags, one chart each (the rank is in the tag):

* per rank and optimizer step (x = the rank's step count): ``batch_size/rankR`` (its samples),
  ``throughput/rankR`` (samples/s), ``allreduce_wait_s/rankR``, ``lr/rankR`` (effective LR),
  ``loss/rankR`` where the loss was recorded;
* per controller decision (x = decision index): ``controller/batch_size/rankR``,
  ``controller/reward/rankR``, ``controller/noise_scale``, ``controller/efficiency``,
  ``controller/throughput``, ``controller/lr_gain``, ``controller/global_batch``.

Points with a NaN value are left out; wall times are the run's own (``t0 + wall_s``).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

import numpy as np
import pandas as pd

STEP_TAGS = {"local_batch": "batch_size", "samples_per_s": "throughput", "sync_wait_s": "allreduce_wait_s",
             "lr": "lr", "loss": "loss"}
DECISION_TAGS = ("noise_scale", "efficiency", "throughput", "lr_gain")
MISSING = ("TensorBoard output needs the 'tensorboard' package, which is not installed: "
           "pip install tensorboard (or pip install 'dynamix_hvd[tensorboard]')")


class Scalar(NamedTuple):
    tag: str
    value: float
    step: int
    wall_time: float | None


def require_tensorboard() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or an ImportError saying what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch.utils.tensorboard imports the tensorboard package
        raise ImportError(MISSING) from exc
    return SummaryWriter


def scalars(steps: pd.DataFrame, decisions: Mapping[str, np.ndarray], t0: float | None = None) -> Iterator[Scalar]:
    """Every TensorBoard point of a run: `steps` as in trace.h5's /steps (one row per rank and
    step, in step order per rank), `decisions` as `runlog.decision_arrays` gives them."""
    def wall(values: Any, i: int) -> float | None:
        if t0 is None or values is None:
            return None
        w = float(values[i])
        return t0 + w if math.isfinite(w) else None

    for rank, frame in steps.groupby("rank", sort=True):
        walls = frame["wall_s"].to_numpy() if "wall_s" in frame else None
        for column, name in STEP_TAGS.items():
            if column not in frame:
                continue
            for i, v in enumerate(frame[column].to_numpy(dtype=float)):
                if math.isfinite(v):
                    yield Scalar(f"{name}/rank{rank}", float(v), i, wall(walls, i))
    walls = decisions.get("wall_s")
    per_rank = {"sizes": "batch_size", "reward": "reward"}
    for key, name in per_rank.items():
        table = decisions.get(key)
        if table is None or len(table) == 0:
            continue
        for i, row in enumerate(np.asarray(table, dtype=float).reshape(len(table), -1)):
            for rank, v in enumerate(row):
                if math.isfinite(v):
                    yield Scalar(f"controller/{name}/rank{rank}", float(v), i, wall(walls, i))
            if key == "sizes" and np.isfinite(row).all():
                yield Scalar("controller/global_batch", float(row.sum()), i, wall(walls, i))
    for key in DECISION_TAGS:
        for i, v in enumerate(np.asarray(decisions.get(key, ()), dtype=float)):
            if math.isfinite(v):
                yield Scalar(f"controller/{key}", float(v), i, wall(walls, i))


def write_tensorboard(logdir: str | os.PathLike, steps: pd.DataFrame, decisions: Mapping[str, np.ndarray],
                      t0: float | None = None) -> Path:
    """Write every point of `scalars` into an event file under `logdir`; returns `logdir`."""
    SummaryWriter = require_tensorboard()
    out = Path(logdir)
    out.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(str(out))
    try:
        for s in scalars(steps, decisions, t0):
            writer.add_scalar(s.tag, s.value, s.step, walltime=s.wall_time)
    finally:
        writer.close()
    return out


def write_run_tensorboard(run_dir: str | os.PathLike, logdir: str | os.PathLike | None = None) -> Path:
    """TensorBoard files of a finished run directory (default: RUN_DIR/tensorboard)."""
    require_tensorboard()  # before reading a possibly large trace
    import datetime as _dt

    from .rundir import read_run

    run = read_run(run_dir)
    t0 = None
    if "created" in run.meta:
        t0 = _dt.datetime.fromisoformat(run.meta["created"]).timestamp()
    return write_tensorboard(logdir or Path(run_dir) / "tensorboard", run.steps, run.decisions, t0)
