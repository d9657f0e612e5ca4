"""Run records: one row per epoch and rank, and the full traces of every rank in one HDF5 file.

Attach a `RunLog` to the loader (and controller) of a Horovod job; at the end, `finish` gathers every
rank's per-step records to rank 0 (named collectives of `dynamix_hvd.comm`, each with a deadline), which
writes ``OUT/``:

* ``epochs.csv`` (and ``epochs.parquet`` when pyarrow is installed): one row per epoch and rank;
* ``trace.h5``: ``/steps`` (every StepRecord field of every rank, plus ``wall_s`` and ``loss``),
  ``/epochs``, ``/decisions`` (``sizes``/``previous_sizes``/``reward`` as decisions x ranks arrays,
  ``noise_scale``, ``efficiency``, ``throughput``, ``lr_gain``, ``wall_s``, the network fit (``net_s``,
  ``latency_s``, ``bus_bandwidth_Bps``), ... and the whole
  controller history as JSON in ``/decisions/history_json``), run metadata in the root's ``meta``
  attribute;
* ``meta.json``: run metadata (hosts, world size, launcher, versions, arguments, wall time, each
  rank's memory budget and where it was read, and with a controller every setting it ran with,
  ``controller_config``: `DynamixController.config_dict`, which ``ControllerConfig.from_dict`` reads);
* ``steps_rank{r}.csv`` and ``decisions.csv``: the per-rank step records and the controller's
  decisions as plain CSV (what `bench.lab.calibrate` reads);
* ``tensorboard/``: TensorBoard event files, with ``RunLog(..., tensorboard=True)`` (optional; see
  `dynamix_hvd.runs.tensorboard` for the tags).

`dynamix_hvd.runs.rundir.read_run` loads a run directory back (used by ``dynamix-hvd summarize`` and `dynamix_hvd.runs.report`).
``wall_s`` is seconds since the earliest rank started its RunLog (`RunLog.t0`, agreed on by every rank
when the RunLog is made; ranks on one clock).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import math
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from ..comm import RUNLOG_CLOCK, RUNLOG_EPOCH, RUNLOG_FINISH, Collective, library_channel
from ..data.metrics import COLUMN, STEP_FIELDS as _FIELDS, StepColumns
from ..logs import get_logger
from .progress import Progress

STEP_FIELDS = list(_FIELDS)
_STEP, _EPOCH, _GLOBAL_BATCH, _LOSS = COLUMN["step"], COLUMN["epoch"], COLUMN["global_batch"], len(_FIELDS) + 1
DECISION_SCALARS = ("decision", "epoch", "wall_s", "lr_gain", "loss", "noise_scale", "efficiency",
                    "throughput", "overhead_s", "learn_s")
NETWORK_SCALARS = ("net_s", "latency_s", "bus_bandwidth_Bps")
"""The network fit of each decision (``fit["net"]``): allreduce time, latency, effective bandwidth."""


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


class RunLog:
    """Per-step and per-epoch records of one rank; rank 0 writes the run directory in `finish`.

    Make it, and call `end_epoch` and `finish`, on every rank (all three are collectives: making it
    agrees on the clock origin `t0`); call `step` after each optimizer step. The trace keeps the first `max_trace_steps` steps of each rank (``meta.json`` counts
    the dropped ones); the epoch rows always cover every step.
    """

    def __init__(self, out_dir: str | os.PathLike, loader: Any, *, controller: Any = None,
                 meta: dict[str, Any] | None = None, progress: Progress | None = None,
                 gather: Callable[[Any], list[Any]] | None = None, max_trace_steps: int = 500_000,
                 tensorboard: bool = False) -> None:
        if tensorboard:  # on every rank, before training: a missing package fails now, not at the end
            from .tensorboard import require_tensorboard

            require_tensorboard()
        self.tensorboard = tensorboard
        self.out = Path(out_dir)
        self.loader, self.controller, self.progress = loader, controller, progress
        self.rank, self.world_size = loader.rank, loader.world_size
        self.meta = dict(meta or {})
        self._gather = gather
        self.t_start = time.time()
        self.t0: float = min(self.gather(self.t_start, RUNLOG_CLOCK))
        """Unix time when the earliest rank made its RunLog: the origin of every ``wall_s``."""
        # Step records as columns, each row the record, the unix time at the step's end and the loss
        # (NaN until the losses are read, at the epoch's end)
        self._steps = StepColumns(("time_unix", "loss"))  # the trace: the first `max_trace_steps` steps
        self._epoch = StepColumns(("time_unix", "loss"))  # the current epoch's steps
        self._epoch_losses: list[Any] = []   # the current epoch's losses as given (read lazily)
        self._losses_read = 0                # of which the first ones are in the loss columns
        self._epoch_in_trace = 0             # the current epoch's first steps that are in the trace
        self.max_trace_steps = max_trace_steps
        self.trace_steps_dropped = 0
        self._steps_seen = loader.tracker.finished
        self._pending_loss: Any = None
        self._seen_decisions = len(controller.history) if controller is not None else 0
        self._decision_times: dict[int, float] = {}
        self._sizes_seen: tuple[int, ...] = tuple(loader.batch_sizes)
        self.epoch_rows: list[dict[str, Any]] = []  # rank 0: every rank's rows; other ranks: their own
        loader.step_end_callbacks.append(self._on_step_end)

    def gather(self, obj: Any, op: Collective, *, root_only: bool = False) -> list[Any] | None:
        """Every rank's `obj` in rank order, on every rank (on rank 0 only with `root_only`)."""
        if self._gather is not None:
            return self._gather(obj)
        if root_only:
            return library_channel().gather_object(obj, op)
        return library_channel().allgather_object(obj, op)

    # --- per step ------------------------------------------------------------------------------------
    def step(self, loss: Any) -> None:
        """This step's loss (tensor or float); read lazily, so no device sync per step."""
        self._pending_loss = loss.detach() if hasattr(loss, "detach") else loss

    def _on_step_end(self, loader: Any, epoch_end: bool) -> None:
        tracker = loader.tracker
        if tracker.finished == self._steps_seen:
            return  # the optimizer did not step: nothing measured
        self._steps_seen = tracker.finished
        loss, self._pending_loss = self._pending_loss, None
        row, now = tracker.records.row(-1), time.time()
        self._epoch.append(row, now, math.nan)
        self._epoch_losses.append(loss)
        if len(self._steps) < self.max_trace_steps:
            self._steps.append(row, now, math.nan)
            self._epoch_in_trace += 1
        else:
            self.trace_steps_dropped += 1
        if self.controller is not None and len(self.controller.history) > self._seen_decisions:
            for d in self.controller.history[self._seen_decisions:]:
                self._decision_times[int(d.get("decision", len(self._decision_times)))] = now
            self._seen_decisions = len(self.controller.history)
        if self.progress is None or not self.progress.enabled:
            return
        sizes = tuple(loader.batch_sizes)
        step, epoch = int(row[_STEP]), int(row[_EPOCH])
        if step == 0:
            self.progress.start_epoch(epoch, step + 1 + loader.steps_left)
        total = None
        if sizes != self._sizes_seen and not epoch_end:
            total = step + 1 + loader.steps_left
        self._sizes_seen = sizes
        self.progress.update(step, total, sizes, int(row[_GLOBAL_BATCH]), loss)

    def _read_losses(self) -> None:
        """The current epoch's losses not read yet, into the loss columns (NaN where none was given)."""
        first_in_trace = len(self._steps) - self._epoch_in_trace
        for i in range(self._losses_read, len(self._epoch_losses)):
            loss = self._epoch_losses[i]
            if loss is None:
                continue
            value = loss if isinstance(loss, float) else _float(loss.item() if hasattr(loss, "item") else loss)
            self._epoch.row(i)[_LOSS] = value
            if i < self._epoch_in_trace:
                self._steps.row(first_in_trace + i)[_LOSS] = value
        self._losses_read = len(self._epoch_losses)

    # --- per epoch (collective) -----------------------------------------------------------------------
    def end_epoch(self, **metrics: float) -> list[dict[str, Any]]:
        """Close the epoch on every rank (a collective): one row per rank; rank 0 prints the summary."""
        self._read_losses()
        recs = self._epoch
        n = len(recs)
        losses = [l for l in recs.column("loss").tolist() if math.isfinite(l)]
        batches = recs.values("local_batch")
        time_s = sum(recs.column("step_s").tolist())
        mean = (lambda key: statistics.fmean(recs.column(key).tolist()) if n else math.nan)  # noqa: E731
        row = {"epoch": int(recs.row(-1)[_EPOCH]) if n else -1, "rank": self.rank,
               "wall_unix": float(recs.row(-1)[len(_FIELDS)]) if n else time.time(), "steps": n,
               "samples": sum(batches),
               "batch_size": int(statistics.median(batches)) if n else 0,
               "loss_mean": statistics.fmean(losses) if losses else math.nan,
               "loss_last": losses[-1] if losses else math.nan,
               "samples_per_s": sum(batches) / time_s if time_s > 0 else math.nan,
               "step_s": mean("step_s"), "compute_s": mean("compute_s"), "sync_wait_s": mean("sync_wait_s"),
               "data_wait_s": mean("data_wait_s"), "lr": float(recs.row(-1)[COLUMN["lr"]]) if n else math.nan,
               "peak_memory_bytes": max(recs.values("peak_memory_bytes"), default=0),
               **{k: _float(v) for k, v in metrics.items()}}
        self._epoch.clear()
        self._epoch_losses.clear()
        self._losses_read = self._epoch_in_trace = 0
        rows = self.gather(row, RUNLOG_EPOCH)
        if self.rank == 0:
            self.epoch_rows.extend(rows)
            if self.progress is not None:
                weighted = [(r["loss_mean"], r["samples"]) for r in rows if math.isfinite(r["loss_mean"])]
                loss = sum(l * n for l, n in weighted) / max(1, sum(n for _, n in weighted))
                tput = sum(r["samples_per_s"] for r in rows if math.isfinite(r["samples_per_s"]))
                self.progress.end_epoch(row["epoch"], sizes=[r["batch_size"] for r in rows], loss=loss,
                                        samples_per_s=tput, sync_wait_ms=[r["sync_wait_s"] * 1e3 for r in rows],
                                        **{k: _float(v) for k, v in metrics.items()})
        else:
            self.epoch_rows.append(row)
        return rows

    # --- end of run (collective) -----------------------------------------------------------------------
    def finish(self, history: Sequence[dict[str, Any]] | None = None, report: bool = False) -> Path | None:
        """Gather every rank's steps to rank 0 and write the run directory (returned on rank 0)."""
        self._read_losses()
        cols: dict[str, list[Any]] = {k: self._steps.values(k) for k in STEP_FIELDS}
        cols["time_unix"] = self._steps.column("time_unix").tolist()
        cols["loss"] = self._steps.column("loss").tolist()
        budget = getattr(self.controller, "memory_budget", None)
        everything = self.gather({"steps": cols, "host": socket.gethostname(),
                                  "memory_budget": None if budget is None else budget.to_dict()},
                                 RUNLOG_FINISH, root_only=True)
        if self.progress is not None:
            self.progress.close()
        if self.rank != 0:
            return None
        t0 = self.t0
        steps = pd.concat([pd.DataFrame(e["steps"]) for e in everything], ignore_index=True)
        steps["wall_s"] = steps.pop("time_unix") - t0
        epochs = pd.DataFrame(self.epoch_rows)
        if len(epochs):
            epochs.insert(2, "wall_s", epochs.pop("wall_unix") - t0)
        if history is None and self.controller is not None:
            history = self.controller.history
        decisions = decision_arrays(history or [], self.world_size, {k: v - t0 for k, v in self._decision_times.items()})
        meta = {"created": _dt.datetime.fromtimestamp(t0, _dt.timezone.utc).isoformat(timespec="seconds"),
                "world_size": self.world_size, "hosts": sorted({e["host"] for e in everything}),
                "wall_time_s": time.time() - t0, "epochs": int(epochs.epoch.max()) + 1 if len(epochs) else 0,
                "decisions": len(history or []), "trace_steps_dropped": self.trace_steps_dropped,
                "memory_budgets": [e.get("memory_budget") for e in everything],
                **_controller_config(self.controller), **_environment(), **self.meta}
        if len(epochs) and "accuracy" in epochs:
            meta["final_accuracy"] = float(epochs[epochs.epoch == epochs.epoch.max()].accuracy.mean())
        write_run(self.out, meta, steps, epochs, decisions, history or [])
        if self.tensorboard:
            from .tensorboard import write_tensorboard

            write_tensorboard(self.out / "tensorboard", steps, decisions, t0)
        if report:
            if importlib.util.find_spec("matplotlib") is None:
                get_logger(__name__).warning("matplotlib is not installed: no %s/report.png (pip install "
                                             "matplotlib, then dynamix-hvd plot RUN_DIR)", self.out)
            else:
                from .report import write_report

                write_report(self.out)
        return self.out


def _environment() -> dict[str, Any]:
    import torch

    from .. import __version__

    env = {"launcher": os.environ.get("DYNAMIX_LAUNCHER", "unknown"), "dynamix_hvd": __version__,
           "torch": torch.__version__}
    if "SLURM_JOB_ID" in os.environ:
        env["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    try:
        env["horovod"] = importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        pass
    return env


def decision_arrays(history: Sequence[dict[str, Any]], world_size: int,
                    wall: dict[int, float] | None = None) -> dict[str, np.ndarray]:
    """Controller history as arrays: scalars per decision, sizes/rewards as decisions x ranks."""
    wall = wall or {}
    n = len(history)
    out: dict[str, np.ndarray] = {k: np.full(n, np.nan) for k in DECISION_SCALARS + NETWORK_SCALARS}
    for k in ("sizes", "previous_sizes", "reward"):
        out[k] = np.full((n, world_size), np.nan)
    for i, d in enumerate(history):
        for k in DECISION_SCALARS:
            out[k][i] = _float(wall.get(int(d.get("decision", i)), math.nan) if k == "wall_s" else d.get(k))
        net = (d.get("fit") or {}).get("net") or {}
        for k in NETWORK_SCALARS:
            out[k][i] = _float(net.get(k))
        for k in ("sizes", "previous_sizes", "reward"):
            if d.get(k) is not None:
                out[k][i, :] = np.asarray(d[k], dtype=float).reshape(-1)[:world_size]
    return out


def _controller_config(controller: Any) -> dict[str, Any]:
    """``{"controller_config": every setting}`` of `controller` (none without one)."""
    config_dict = getattr(controller, "config_dict", None)
    return {} if config_dict is None else {"controller_config": config_dict()}


def write_run(out: Path, meta: dict[str, Any], steps: pd.DataFrame, epochs: pd.DataFrame,
              decisions: dict[str, np.ndarray], history: Sequence[dict[str, Any]]) -> None:
    """Write epochs.csv (+ .parquet), steps_rank*.csv, decisions.csv, trace.h5 and meta.json into `out`."""
    import h5py

    out.mkdir(parents=True, exist_ok=True)
    epochs.to_csv(out / "epochs.csv", index=False)
    # the earlier per-rank CSVs, still read by bench.lab.calibrate and other tools
    for r, frame in steps.groupby("rank"):
        frame.to_csv(out / f"steps_rank{r}.csv", index=False)
    pd.DataFrame([{k: v for k, v in d.items() if k not in ("reports", "info")} for d in history]
                 ).to_csv(out / "decisions.csv", index=False)
    if importlib.util.find_spec("pyarrow") is not None:
        epochs.to_parquet(out / "epochs.parquet", index=False)
    tmp = out / f".trace.h5.tmp{os.getpid()}"
    with h5py.File(tmp, "w") as h5:
        h5.attrs["meta"] = json.dumps(meta, default=str)
        for name, frame in (("steps", steps), ("epochs", epochs)):
            g = h5.create_group(name)
            for col in frame.columns:
                values = frame[col].to_numpy()
                if values.dtype == object:
                    values = values.astype(str).astype(h5py.string_dtype())
                g.create_dataset(col, data=values)
        g = h5.create_group("decisions")
        for k, v in decisions.items():
            g.create_dataset(k, data=v)
        # a dataset, not an attribute: attributes are limited to 64 KiB and long runs have many decisions
        g.create_dataset("history_json", data=json.dumps(list(history), default=_jsonable),
                         dtype=h5py.string_dtype())
    os.replace(tmp, out / "trace.h5")
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return str(obj)
