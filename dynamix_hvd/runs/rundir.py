"""Reading a finished run directory back (written by `dynamix_hvd.runs.runlog.RunLog.finish`).

Separate from the writer so that the report (which reads runs) and the writer (which draws the report
at the end of a run) do not import each other.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd


@dataclasses.dataclass
class RunData:
    """A finished run read back from its directory."""

    path: Path
    meta: dict[str, Any]
    steps: pd.DataFrame
    epochs: pd.DataFrame
    decisions: dict[str, np.ndarray]
    history: list[dict[str, Any]]


def read_run(run_dir: str | os.PathLike) -> RunData:
    """Load `run_dir` (written by `RunLog.finish`); raises FileNotFoundError naming what is missing."""
    import h5py

    path = Path(run_dir)
    trace = path / "trace.h5"
    if not trace.is_file():
        raise FileNotFoundError(f"{trace} not found: is {path} the OUT directory of a finished run?")
    with h5py.File(trace, "r") as h5:
        meta = json.loads(h5.attrs["meta"])
        frames = {}
        for name in ("steps", "epochs"):
            frames[name] = pd.DataFrame({k: (v[()].astype(str) if v.dtype.kind in "OS" else v[()])
                                         for k, v in h5[name].items()})
        decisions = {k: v[()] for k, v in h5["decisions"].items() if k != "history_json"}
        raw = h5["decisions"]["history_json"][()]
        history = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    epochs = pd.read_csv(path / "epochs.csv") if (path / "epochs.csv").is_file() else frames["epochs"]
    return RunData(path, meta, frames["steps"], epochs, decisions, history)
