"""Preemption-safe checkpoints for jobs under mpirun/srun (Horovod elastic is not available there).

SIGTERM or SIGINT on any rank only sets a flag. At the next step boundary (the loader's step-end
callback, reached by every rank after the same number of steps) the ranks agree through the control
plane whether any of them was signalled; if so, rank 0 writes one checkpoint and every rank exits
with `exit_code`. Agreement first, because a signal usually reaches ranks at different moments and
a checkpoint taken by some ranks mid-step would mix two states.

A checkpoint is a directory ``step-<N>`` holding ``state.pt`` (model, optimizer, loader position,
controller) and ``state.sha256``; it is written under a temporary name and renamed, then the file
``latest`` is replaced atomically. ``restore()`` takes the newest directory whose checksum verifies
and falls back to the previous good one when the newest is corrupt. The last `keep` are kept.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from ..comm import ControlChannel
from ..data.loader import AdaptiveLoader
from ..data.plan import split_proportional


class CheckpointError(RuntimeError):
    """No usable checkpoint could be read."""


def redistribute(global_batch: int, world_size: int, weights: Sequence[int] | None = None) -> list[int]:
    """Per-rank sizes that keep the global batch when the number of ranks changes."""
    return list(split_proportional(max(global_batch, world_size), list(weights or [1] * world_size)))


class Checkpointer:
    """Write a checkpoint when any rank is signalled; restore the newest good one on start-up."""

    def __init__(self, directory: str | os.PathLike, model: torch.nn.Module, optimizer: Any,
                 loader: AdaptiveLoader, controller: Any = None, *, channel: ControlChannel | None = None,
                 check_every: int = 1, exit_code: int = 143, keep: int = 2,
                 signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        if check_every < 1 or keep < 1:
            raise ValueError(f"check_every={check_every} and keep={keep} must both be >= 1")
        self.directory = Path(directory)
        self.model, self.optimizer, self.loader, self.controller = model, optimizer, loader, controller
        self.channel = channel or (controller.channel if controller is not None else ControlChannel())
        self.check_every, self.exit_code, self.keep = check_every, exit_code, keep
        self.requested = False
        self._steps = 0
        for sig in signals:
            signal.signal(sig, self._on_signal)
        loader.step_end_callbacks.append(self._on_step_end)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True  # acted upon at the next step boundary, never inside a step

    def _on_step_end(self, loader: AdaptiveLoader, epoch_end: bool) -> None:
        self._steps += 1
        if self._steps % self.check_every:
            return
        if self.channel.any_true(self.requested, what="preemption flag"):
            path = self.save()
            if self.channel.rank == 0:
                print(f"[dynamix_hvd] stop requested: checkpoint written to {path}; exiting "
                      f"with code {self.exit_code}", file=sys.stderr, flush=True)
            sys.exit(self.exit_code)

    # --- writing ---------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict(),
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "world_size": self.loader.world_size}

    def save(self) -> Path:
        """Rank 0 writes the checkpoint; every rank returns its path once it exists."""
        step = f"step-{self.loader.epoch:05d}-{self.loader.step:07d}"
        final = self.directory / step
        if self.channel.rank == 0:
            buf = io.BytesIO()
            torch.save(self.state(), buf)
            data = buf.getvalue()
            tmp = self.directory / f".{step}.tmp{os.getpid()}"
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "state.pt").write_bytes(data)
            (tmp / "state.sha256").write_text(hashlib.sha256(data).hexdigest())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp = self.directory / f".latest.tmp{os.getpid()}"
            latest_tmp.write_text(step)
            os.replace(latest_tmp, self.directory / "latest")
            for old in self._checkpoints()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.channel.broadcast(str(final), what="checkpoint path")  # others leave only once it exists
        return final

    # --- reading ---------------------------------------------------------------------------------------
    def _checkpoints(self) -> list[Path]:
        return sorted(p for p in self.directory.glob("step-*") if p.is_dir())

    def _read(self, path: Path) -> dict[str, Any]:
        data = (path / "state.pt").read_bytes()
        if hashlib.sha256(data).hexdigest() != (path / "state.sha256").read_text().strip():
            raise CheckpointError(f"checkpoint {path} fails its checksum (corrupt or partly written)")
        return torch.load(io.BytesIO(data), weights_only=False)

    def restore(self) -> Path | None:
        """Load the newest good checkpoint (None when there is none). Works on a different world size:
        the global batch is kept and split evenly over the new ranks."""
        candidates = self._checkpoints()
        errors = []
        for path in reversed(candidates):
            try:
                state = self._read(path)
            except (OSError, CheckpointError, RuntimeError, EOFError) as exc:
                errors.append(f"{path.name}: {exc}")
                print(f"[dynamix_hvd] rank {self.channel.rank}: skipping checkpoint {path}: {exc}",
                      file=sys.stderr, flush=True)
                continue
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            sizes = None
            if state["world_size"] != self.loader.world_size:
                sizes = redistribute(sum(state["loader"]["batch_sizes"]), self.loader.world_size)
            self.loader.load_state_dict(state["loader"], batch_sizes=sizes)
            if self.controller is not None and state["controller"] is not None:
                self.controller.load_state_dict(state["controller"])
            return path
        if candidates:
            raise CheckpointError("no checkpoint in " + str(self.directory) + " is usable: " + "; ".join(errors))
        return None
