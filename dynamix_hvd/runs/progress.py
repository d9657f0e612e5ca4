"""What a user sees while a job runs: a progress bar on rank 0, or one line per epoch.

Modes (``DYNAMIX_PROGRESS`` or the `mode` argument):

* ``bar``: a tqdm bar per epoch on stderr showing the step, every rank's batch size, throughput and loss;
* ``epoch``: only one summary line per epoch on stdout (what logs and batch systems get);
* ``off``: nothing;
* ``auto`` (default): ``bar`` when stderr is a terminal and tqdm is installed, else ``epoch``. Under a
  launcher (mpirun, horovodrun, srun) a rank cannot tell whether the user watches a terminal (Open MPI
  gives ranks a pseudo-terminal even when its own output goes to a file), so ``auto`` means ``epoch``
  there; ``launch/*.sh`` and ``dynamix-hvd run`` set ``DYNAMIX_PROGRESS=bar`` when they run in one.

Only rank 0 prints; on other ranks every method is a no-op. Updating costs a time check per step:
the loss (possibly a GPU tensor) is read only when the bar refreshes, so it does not sync every step.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Any, Sequence, TextIO

MODES = ("auto", "bar", "epoch", "off")
LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "HOROVOD_RANK", "SLURM_STEP_ID")


def under_launcher() -> bool:
    """True in a rank started by mpirun, horovodrun or srun."""
    return any(k in os.environ for k in LAUNCHER_ENV)


def resolve_mode(mode: str | None, stream: TextIO, rank: int) -> str:
    """The effective mode for this rank ('bar', 'epoch' or 'off')."""
    mode = (mode or os.environ.get("DYNAMIX_PROGRESS") or "auto").lower()
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}; choose one of {', '.join(MODES)} (env DYNAMIX_PROGRESS)")
    if rank != 0 or mode == "off":
        return "off"
    if mode in ("auto", "bar") and importlib.util.find_spec("tqdm") is None:
        return "epoch"  # no bar without tqdm (pip install tqdm)
    if mode == "auto":
        return "bar" if stream.isatty() and not under_launcher() else "epoch"
    return mode


def format_sizes(sizes: Sequence[int]) -> str:
    """Per-rank batch sizes as 16/48/32; long lists are shortened to min..max (R ranks)."""
    sizes = list(sizes)
    if len(sizes) <= 8:
        return "/".join(str(s) for s in sizes)
    return f"{min(sizes)}..{max(sizes)} ({len(sizes)} ranks)"


class Progress:
    """Progress display for the training loop; see the module docstring for the modes."""

    def __init__(self, total_epochs: int | None = None, *, rank: int = 0, mode: str | None = None,
                 stream: TextIO | None = None, line_stream: TextIO | None = None,
                 refresh_s: float = 0.25) -> None:
        self.stream = stream or sys.stderr          # the bar (a terminal)
        self.line_stream = line_stream or sys.stdout  # the epoch lines (results: also in logs)
        self.mode = resolve_mode(mode, self.stream, rank)
        self.total_epochs = total_epochs
        self.refresh_s = refresh_s
        self._bar: Any = None
        self._last = 0.0
        self._samples = 0
        self._t_epoch = time.perf_counter()

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def _epoch_label(self, epoch: int) -> str:
        return f"epoch {epoch + 1}/{self.total_epochs}" if self.total_epochs else f"epoch {epoch + 1}"

    def start_epoch(self, epoch: int, steps: int | None) -> None:
        """A new epoch of about `steps` steps (the count may change when sizes change mid-epoch)."""
        if self.mode != "bar":
            return
        from tqdm import tqdm

        self.close()
        self._last, self._samples = time.perf_counter(), 0
        self._bar = tqdm(total=steps, desc=self._epoch_label(epoch), unit="step", file=self.stream,
                         leave=False, dynamic_ncols=True, mininterval=self.refresh_s)

    def update(self, step: int, total_steps: int | None, sizes: Sequence[int], samples: int,
               loss: Any = None) -> None:
        """After step `step` (0-based) of the epoch, which processed `samples` samples on all ranks.

        `loss` may be a tensor: it is read only when the bar refreshes.
        """
        if self._bar is None:
            return
        self._bar.n = step + 1
        self._samples += samples
        if total_steps is not None and total_steps != self._bar.total:
            self._bar.total = total_steps  # sizes changed mid-epoch: the plan has a new length
        now = time.perf_counter()
        if now - self._last < self.refresh_s and step + 1 != self._bar.total:
            return
        post = {"sizes": format_sizes(sizes)}
        if now > self._last:
            post["samples/s"] = f"{self._samples / (now - self._last):,.0f}"
        self._last, self._samples = now, 0
        if loss is not None:
            post["loss"] = f"{float(loss):.4f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.refresh()

    def end_epoch(self, epoch: int, *, sizes: Sequence[int], loss: float, samples_per_s: float,
                  sync_wait_ms: Sequence[float] = (), **metrics: float) -> str:
        """Print (and return) the epoch's summary line: the only output in 'epoch' mode."""
        parts = [self._epoch_label(epoch), f"sizes {format_sizes(sizes)}", f"loss {loss:.4f}"]
        parts += [f"{k} {v:.4f}" for k, v in metrics.items()]
        parts.append(f"{samples_per_s:,.0f} samples/s")
        if sync_wait_ms:
            parts.append("allreduce wait ms " + "/".join(f"{w:.2f}" for w in sync_wait_ms))
        now = time.perf_counter()
        parts.append(f"{now - self._t_epoch:.1f} s")  # since the previous summary: includes evaluation
        self._t_epoch = now
        line = " | ".join(parts)
        if self.mode == "off":
            return line
        self.close()  # the bar clears its line first; the summary goes where the bar was (no interleaving)
        print(line, file=self.stream if self.mode == "bar" else self.line_stream, flush=True)
        return line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
