"""Preemption-safe checkpoints for jobs under mpirun/srun (Horovod elastic is not available there).

SIGTERM or SIGINT on any rank only sets a flag. At a vote (in the loader's step-end callback, which
every rank reaches after the same number of steps) the ranks agree through the control plane whether
any of them was signalled; if so, rank 0 writes one checkpoint and every rank exits with `exit_code`.
Agreement first, because a signal usually reaches ranks at different moments and a checkpoint taken
by some ranks mid-step would mix two states.

How often the ranks vote (a small collective, so never at every step by default): about once every
`check_interval_s` seconds (1 s by default). Wall clocks differ between ranks, so the cadence is
counted in steps that every rank computes alike: each vote also carries every rank's mean step time
since the previous vote, and the next vote comes after ``ceil(check_interval_s / slowest step time)``
steps, at most twice as many as in the last interval (the first vote comes after the first step).
When the batch sizes or the micro-batches per step change (on every rank alike), the interval
shrinks in proportion to the largest growth of a rank's batch, so a step that becomes slower that
way does not stretch it. The bound: a stop request is acted on (checkpoint written, every rank
exiting) within about ``check_interval_s`` of training, plus the step the request arrives in and the
checkpoint's write; longer only in proportion as steps slow down between two votes for another
reason than the batch sizes. Time spent outside the loop (evaluation between epochs, say) does not
count: the vote comes once training has run that long. ``check_every=k`` instead votes every k
steps exactly (1: at every step boundary, the least delay at the cost of a collective per step).

Nothing happens on construction: `install_signal_handlers()` turns signals into a stop request
(without it, `save()` and `restore()` still work), and `close()` puts the previous handlers back.

A checkpoint is a directory ``step-<N>`` holding ``state.pt`` (model, optimizer, loader position,
controller, and every rank's own part: see below) and ``state.sha256``; it is written under a temporary name and renamed, then the file
``latest`` is replaced atomically; a failed write (a full disk, say) removes its temporary files and
raises `CheckpointError` naming the path on every rank. The directory is checked writable at
construction. ``restore()`` is all or nothing: it takes the newest checkpoint that reads, verifies
and fits this job on every rank, and skips any other (not a zip archive, truncated, a zip without a
state, a failed checksum, another format version, a state that does not fit) with a warning naming
the file and the reason. The ranks agree on each candidate, so they all restore the same one. Only
when none is usable is it an error, naming every file tried and why. The last `keep` are kept.

Rank 0's state is the state of every rank except for what each rank holds of its own: the controller's
open decision interval (this rank's step records and losses since the last decision) and the
optimizer's per-parameter gradient sums for it. Components that have such state provide
``rank_state_dict()`` and ``load_rank_state_dict()``; `save()` gathers every rank's part on rank 0
(under ``"ranks"``) and `restore()` gives each rank its own, so the first decision after a restart
reports the same steps as in the uninterrupted run. On another world size the parts are left out.

Plain data only: the state holds tensors and plain Python values (checked on `save()`, naming the
offending entry) and is read with ``torch.load(weights_only=True)``, so a crafted ``state.pt`` is
refused instead of running code. Every checkpoint carries `FORMAT_VERSION`; one of another version
is skipped like any other unusable checkpoint, its warning naming both versions.
"""
from __future__ import annotations

import copy
import hashlib
import io
import math
import os
import shutil
import signal
import sys
import time
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch

from ..comm import (CHECKPOINT_APPLIED, CHECKPOINT_CHECKED, CHECKPOINT_LIST, CHECKPOINT_RANK_STATE, CHECKPOINT_WRITTEN,
                    DEFAULT_TIMEOUT_S, PREEMPTION_VOTE, Collective, ControlChannel, StallWatchdog, abort_world)
from ..data.loader import AdaptiveLoader
from ..data.plan import split_proportional
from ..logs import get_logger
from .. import validate

FORMAT = "dynamix_hvd.checkpoint"
FORMAT_VERSION = 2
"""1: pickled live objects (0.1, read by unrestricted unpickling); 2: plain data with this header."""

log = get_logger(__name__)
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none that could be read is usable."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint was written in another format version."""


def redistribute(micro_batch: int, world_size: int, weights: Sequence[int] | None = None) -> list[int]:
    """Local batches that keep the global micro-batch (so the global batch) when the number of ranks
    changes."""
    return list(split_proportional(max(micro_batch, world_size), list(weights or [1] * world_size)))


def non_plain_entry(value: Any, where: str = "state") -> str | None:
    """The first entry of `value` that is not a tensor or plain Python value, e.g.
    ``"state['controller']['root']['stats']: GradientStatistics"`` (None when all of it is plain)."""
    if isinstance(value, torch.Tensor) or type(value) in _SCALARS:
        return None
    if type(value) in (list, tuple, torch.Size):
        items = enumerate(value)
    elif type(value) in (dict, OrderedDict):
        for key in value:
            bad = non_plain_entry(key, f"{where} key {key!r}")
            if bad is not None:
                return bad
        items = value.items()
    else:
        return f"{where}: {type(value).__module__}.{type(value).__qualname__}"
    for key, item in items:
        bad = non_plain_entry(item, f"{where}[{key!r}]")
        if bad is not None:
            return bad
    return None


def _reason(exc: Exception) -> str:
    """The cause of a failed load, without torch's advice to retry with unrestricted unpickling."""
    boilerplate = ("Weights only load failed", "Check the documentation of torch.load")
    lines = [line.split("WeightsUnpickler error:")[-1].strip() for line in str(exc).splitlines()]
    text = " ".join(line for line in lines if line and not line.startswith(boilerplate))
    return f"{type(exc).__name__}: {text[:300]}"


def _check_archive(file: Path, data: bytes) -> None:
    """Refuse `data` unless it is a complete zip archive holding a pickled state, the layout
    ``torch.save`` writes; anything else never reaches the unpickler."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        what = ("a zip archive cut short (truncated)" if data[:4] == b"PK\x03\x04"
                else "not a zip archive, the format torch.save writes")
        raise CheckpointError(f"checkpoint {file} is refused: it is {what} ({exc})") from None
    if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
        raise CheckpointError(f"checkpoint {file} is refused: it is a zip archive without a state (no data.pkl "
                              f"among {sorted(names)[:5]})")


def _check_writable(directory: Path) -> None:
    """Create `directory` if needed and write a probe file there, so that a directory that cannot take
    a checkpoint is an error at construction, not at preemption time when the checkpoint would be lost."""
    probe = directory / f".probe.{os.uname().nodename}.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {directory} cannot take checkpoints: {exc}") from None


MAX_VOTE_INTERVAL = 1 << 20
"""Most steps between two preemption votes."""


def next_vote_interval(previous: int, step_s: Sequence[float], interval_s: float) -> int:
    """Steps to the next preemption vote: `interval_s` of the slowest rank's steps (`step_s`, every
    rank's mean step time since the last vote), at most twice `previous` and at least one. Every rank
    calls it with the same values, so every rank gets the same number."""
    slowest = max(step_s, default=0.0)
    steps = math.ceil(interval_s / slowest) if slowest > 0 and math.isfinite(slowest) else 1
    return max(1, min(steps, 2 * previous, MAX_VOTE_INTERVAL))


class Checkpointer:
    """Write a checkpoint when any rank is signalled; restore the newest good one on start-up.

    Call `install_signal_handlers()` to act on SIGTERM/SIGINT; `close()` (or ``with``) undoes it.

    Args:
        check_interval_s: about how many seconds of training pass between two preemption votes
            (default 1; see the module's documentation for how the steps between votes are counted).
        check_every: vote every this many steps instead (1: at every step boundary, the shortest
            delay, at the cost of a small collective per step); None (default): vote by time.
        exit_code: what every rank exits with after the checkpoint (default 143, as after SIGTERM).
        keep: how many checkpoints to keep (default 2).
    """

    def __init__(self, directory: str | os.PathLike, model: torch.nn.Module, optimizer: Any,
                 loader: AdaptiveLoader, controller: Any = None, *, channel: ControlChannel | None = None,
                 check_every: int | None = None, check_interval_s: float = 1.0, exit_code: int = 143,
                 keep: int = 2) -> None:
        if check_every is not None:
            validate.integer("Checkpointer check_every", check_every, 1,
                             what="an integer >= 1 (votes every check_every steps) or None (votes by time)")
        validate.number("Checkpointer check_interval_s", check_interval_s, above=0,
                        what="a positive finite number of seconds")
        validate.integer("Checkpointer keep", keep, 1)
        validate.integer("Checkpointer exit_code", exit_code, 0, 255)
        self.directory = Path(directory)
        _check_writable(self.directory)
        self.model, self.optimizer, self.loader, self.controller = model, optimizer, loader, controller
        self.channel = channel or (controller.channel if controller is not None else ControlChannel())
        self.timeout_s = float(controller.cfg.timeout_s if controller is not None else DEFAULT_TIMEOUT_S)
        """The deadline of the checkpoint's collectives: the controller's ``timeout_s``."""
        self.check_every, self.exit_code, self.keep = check_every, exit_code, keep
        self.check_interval_s = float(check_interval_s)
        self.requested = False
        self.votes = 0
        """Preemption votes taken so far (each one collective of the control channel)."""
        self._steps = 0
        self._interval = 1           # steps from one vote to the next (identical on every rank)
        self._next_vote = 1          # the step count of the next vote
        self._last_vote_step = 0
        self._t_last_vote = time.perf_counter()
        self._sizes = loader.batch_sizes
        self._passes = getattr(optimizer, "backward_passes_per_step", 1)
        self._previous_handlers: dict[int, Any] = {}
        loader.step_end_callbacks.append(self._on_step_end)
        # Without a controller nobody else watches for a stopped rank (MPI and torch.distributed).
        self.watchdog = (StallWatchdog(self.channel, loader.tracker.sync_wait_started, self.timeout_s,
                                       progress_at=loader.tracker.progress_at)
                         if controller is None and self.channel.backend in ("mpi4py", "torch-gloo") else None)

    # --- signals -----------------------------------------------------------------------------------
    def install_signal_handlers(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1),
                                ) -> "Checkpointer":
        """Make `signals` request a checkpoint and exit at the next preemption vote (main thread only).
        The handlers they replace come back with `close()`. SIGUSR1 is what mpirun forwards to every
        rank at once (launch/slurm_mpirun.sbatch turns the TERM it receives into it)."""
        for sig in signals:
            previous = signal.signal(sig, self._on_signal)
            self._previous_handlers.setdefault(sig, previous)
        return self

    def close(self, failed: bool = False) -> None:
        """Put back the signal handlers this object replaced and stop watching the loader (`failed`:
        leaving training on an error, as for `DynamixController.close`)."""
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()
        if self._on_step_end in self.loader.step_end_callbacks:
            self.loader.step_end_callbacks.remove(self._on_step_end)
        if self.watchdog is not None:
            self.watchdog.close(failed)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        self.close(failed=failed_exit(exc_type, exc))

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True  # acted upon at the next vote, a step boundary, never inside a step

    def _on_step_end(self, loader: AdaptiveLoader, epoch_end: bool) -> None:
        self._steps += 1
        if self.check_every is not None:
            if self._steps % self.check_every:
                return
        else:
            passes = getattr(self.optimizer, "backward_passes_per_step", 1)
            if loader.batch_sizes is not self._sizes or passes != self._passes:
                self._resized(loader.batch_sizes, passes)
            if self._steps < self._next_vote:
                return
        try:
            stop = self._vote()
            path = self.save() if stop else None
        except Exception as exc:  # inside the loop: the other ranks would wait for this one
            if self.channel.backend == "horovod-objects":
                raise
            abort_world(f"rank {self.channel.rank}: preemption check at step {self.loader.step} of epoch "
                        f"{self.loader.epoch} failed: {type(exc).__name__}: {exc}")
        if stop:
            if self.channel.rank == 0:
                log.warning("stop requested: checkpoint written to %s; exiting with code %d", path, self.exit_code)
            sys.exit(self.exit_code)

    def _resized(self, sizes: tuple[int, ...], passes: int) -> None:
        """New sizes (the same on every rank): shorten the vote interval by the largest growth of a
        rank's batch (a step of a larger batch takes longer; a smaller batch keeps the interval)."""
        if len(sizes) == len(self._sizes):
            growth = max(b * passes / (a * self._passes) for a, b in zip(self._sizes, sizes))
            if growth > 1:
                self._interval = max(1, int(self._interval / growth))
                self._next_vote = min(self._next_vote, max(self._steps, self._last_vote_step + self._interval))
        else:
            self._interval, self._next_vote = 1, self._steps
        self._sizes, self._passes = sizes, passes

    def _vote(self) -> bool:
        """One collective: whether any rank was signalled; by time, also when to vote next."""
        self.votes += 1
        if self.check_every is not None:
            return self.channel.any_true(self.requested, self._op(PREEMPTION_VOTE))
        now = time.perf_counter()
        step_s = (now - self._t_last_vote) / max(1, self._steps - self._last_vote_step)
        everyone = self.channel.allgather_object((bool(self.requested), step_s), self._op(PREEMPTION_VOTE))
        self._t_last_vote, self._last_vote_step = now, self._steps
        self._interval = next_vote_interval(self._interval, [s for _, s in everyone], self.check_interval_s)
        self._next_vote = self._steps + self._interval
        return any(flag for flag, _ in everyone)

    # --- writing ---------------------------------------------------------------------------------------
    def state(self, ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What a checkpoint holds: rank 0's state, and `ranks`: every rank's `rank_state()`."""
        return {"format": FORMAT, "version": FORMAT_VERSION,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict(),
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "world_size": self.loader.world_size, "ranks": ranks}

    def _with_rank_state(self) -> list[tuple[str, Any]]:
        parts = (("optimizer", self.optimizer), ("loader", self.loader), ("controller", self.controller))
        return [(name, obj) for name, obj in parts if hasattr(obj, "rank_state_dict")]

    def rank_state(self) -> dict[str, Any]:
        """This rank's own state (``rank_state_dict()`` of the components that have one)."""
        return {name: obj.rank_state_dict() for name, obj in self._with_rank_state()}

    def _load_rank_state(self, part: dict[str, Any]) -> None:
        for name, obj in self._with_rank_state():
            if name in part:
                obj.load_rank_state_dict(part[name])

    def save(self) -> Path:
        """Rank 0 writes the checkpoint; every rank returns its path once it exists, or raises
        `CheckpointError` when rank 0 could not write it (e.g. a state entry that is not plain data)."""
        step = f"step-{self.loader.epoch:05d}-{self.loader.step:07d}"
        final = self.directory / step
        problem = None
        ranks = self.channel.gather_object(self.rank_state(), self._op(CHECKPOINT_RANK_STATE))
        if self.channel.rank == 0:
            try:
                self._write(step, final, ranks)
            except Exception as exc:  # disk full, permissions, not plain data...: nothing half-written stays
                problem = f"{type(exc).__name__}: {exc}"
        problem = self.channel.broadcast_object(problem, self._op(CHECKPOINT_WRITTEN))  # others leave once it exists
        if problem is not None:
            raise CheckpointError(f"checkpoint {final} was not written: {problem} (its temporary files were removed)")
        return final

    def _write(self, step: str, final: Path, ranks: list[dict[str, Any]] | None = None) -> None:
        state = self.state(ranks)
        bad = non_plain_entry(state)
        if bad is not None:  # restore() would refuse it: say so now, not after a preemption
            raise TypeError(f"{bad} is not plain data; a state_dict() must hold only tensors and plain "
                            "Python values (numbers, str, bool, None, lists, tuples, dicts)")
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        tmp = self.directory / f".{step}.tmp{os.getpid()}"
        latest_tmp = self.directory / f".latest.tmp{os.getpid()}"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "state.pt").write_bytes(data)
            (tmp / "state.sha256").write_text(hashlib.sha256(data).hexdigest())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp.write_text(step)
            os.replace(latest_tmp, self.directory / "latest")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            latest_tmp.unlink(missing_ok=True)
            raise
        for old in self._checkpoints()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # --- reading ---------------------------------------------------------------------------------------
    def _checkpoints(self) -> list[Path]:
        return sorted(p for p in self.directory.glob("step-*") if p.is_dir())

    def _read(self, path: Path) -> dict[str, Any]:
        file = path / "state.pt"
        try:
            data, digest = file.read_bytes(), (path / "state.sha256").read_text().strip()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointError(f"checkpoint {path} fails its checksum (corrupt or partly written)")
        _check_archive(file, data)
        try:
            state = torch.load(io.BytesIO(data), weights_only=True)  # never runs code from the file
        except Exception as exc:
            raise CheckpointError(f"checkpoint {file} is refused: it holds something other than tensors and "
                                  f"plain values, or is no torch.save file ({_reason(exc)}); nothing in it "
                                  "was run") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {file} holds a {type(state).__name__}, not a checkpoint")
        found = state.get("version") if state.get("format") == FORMAT else None
        if found != FORMAT_VERSION:
            raise CheckpointVersionError(
                f"checkpoint {file} has format version {found if found is not None else '1 or unknown'}, "
                f"this dynamix_hvd reads version {FORMAT_VERSION} (the dynamix_hvd that wrote it can resume it)")
        return state

    def _check(self, path: Path, state: Any) -> None:
        """Every check that can fail, before anything is applied: the header, the world size, the
        dataset size, the model's names and shapes, the optimizer's groups and the controller."""
        file = path / "state.pt"

        def bad(reason: str) -> CheckpointError:
            return CheckpointError(f"checkpoint {file} does not fit this job: {reason}")

        missing = [k for k in ("model", "optimizer", "loader", "controller", "world_size") if k not in state]
        if missing:
            raise bad(f"it lacks {missing}")
        world = state["world_size"]
        if not validate.is_integer(world, 1):
            raise bad(f"world_size={world!r}")
        loader = state["loader"]
        if not isinstance(loader, dict) or not {"num_samples", "batch_sizes", "epoch", "cursor", "step"} <= set(loader):
            raise bad("its loader state is incomplete")
        if loader["num_samples"] != self.loader.num_samples:
            raise bad(f"it was taken on a dataset of {loader['num_samples']} samples, this one has "
                      f"{self.loader.num_samples}")
        if len(loader["batch_sizes"]) != world:
            raise bad(f"{len(loader['batch_sizes'])} batch sizes for a world of {world}")
        ours, theirs = self.model.state_dict(), state["model"]
        if not isinstance(theirs, dict) or set(theirs) != set(ours):
            names = set(theirs) if isinstance(theirs, dict) else set()
            raise bad(f"the model's entries differ (missing {sorted(set(ours) - names)[:5]}, "
                      f"unexpected {sorted(names - set(ours))[:5]})")
        for name, tensor in ours.items():
            other = theirs[name]
            if isinstance(tensor, torch.Tensor) and (not isinstance(other, torch.Tensor) or other.shape != tensor.shape):
                raise bad(f"model entry {name!r} has shape {tuple(getattr(other, 'shape', ()))}, this model "
                          f"{tuple(tensor.shape)}")
        groups = self.optimizer.state_dict()["param_groups"]
        saved = state["optimizer"].get("param_groups") if isinstance(state["optimizer"], dict) else None
        if not isinstance(saved, list) or [len(g["params"]) for g in saved] != [len(g["params"]) for g in groups]:
            raise bad("the optimizer's parameter groups differ from this optimizer's")
        if state["controller"] is not None and not isinstance(state["controller"], dict):
            raise bad("its controller state is not a dict")
        ranks = state.get("ranks")  # absent in checkpoints from before per-rank state
        if ranks is not None and (not isinstance(ranks, list) or len(ranks) != world
                                  or not all(isinstance(part, dict) for part in ranks)):
            raise bad(f"its per-rank state is not one dict for each of its {world} ranks")

    def _snapshot(self) -> dict[str, Any]:
        """What restore() may overwrite, to put back when applying a checkpoint fails half-way."""
        snap = {"model": copy.deepcopy(self.model.state_dict()), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "loader": copy.deepcopy(self.loader.state_dict()), "controller": None}
        if self.controller is not None:
            snap["controller"] = copy.deepcopy(self.controller.state_dict())
            snap["controller"]["root"] = copy.deepcopy(self.controller.core.state_dict())
        snap["rank"] = copy.deepcopy(self.rank_state())
        return snap

    def _apply(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        sizes = None
        if state["world_size"] != self.loader.world_size:
            sizes = redistribute(sum(state["loader"]["batch_sizes"]), self.loader.world_size)
        self.loader.load_state_dict(state["loader"], batch_sizes=sizes)
        if self.controller is not None and state["controller"] is not None:
            self.controller.load_state_dict(state["controller"])
        if state.get("ranks") is not None and state["world_size"] == self.loader.world_size:
            self._load_rank_state(state["ranks"][self.channel.rank])

    def _put_back(self, snap: dict[str, Any]) -> None:
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(snap["optimizer"])
        self.loader.load_state_dict(snap["loader"])
        if snap["controller"] is not None:
            self.controller.load_state_dict(snap["controller"])
        self._load_rank_state(snap["rank"])

    def _op(self, op: Collective) -> Collective:
        return op.within(self.timeout_s)

    def _everyone(self, problem: str | None, op: Collective) -> list[str]:
        """Every rank's `problem` on every rank: one entry per distinct problem, prefixed with the
        ranks that had it when not all of them did (empty when no rank had one)."""
        gathered = self.channel.allgather_object(problem, self._op(op))
        distinct = list(dict.fromkeys(p for p in gathered if p is not None))
        if len(distinct) == 1 and all(p is not None for p in gathered):
            return distinct
        return [f"rank(s) {[r for r, p in enumerate(gathered) if p == text]}: {text}" for text in distinct]

    def restore(self) -> Path | None:
        """Load the newest checkpoint usable on every rank (None when there is none). Works on a
        different world size: the global batch is kept and split evenly over the new ranks.

        All or nothing: a checkpoint is read, verified (a complete zip archive holding a state,
        checksum, format version) and checked against this job (`_check`: world size, dataset size,
        model names and shapes, optimizer groups) before anything is applied; should applying it
        still fail, model, optimizer, loader and controller are put back as they were. The ranks
        try the same candidates (rank 0's listing) in the same order and take one only when it passed
        on all of them, so they always restore the same checkpoint. A checkpoint that fails on any
        rank is skipped with a warning naming the file and the reason, and the previous one is
        tried; with none usable, `CheckpointError` names every file tried and why."""
        local = [p.name for p in self._checkpoints()] if self.channel.rank == 0 else None
        names = self.channel.broadcast_object(local, self._op(CHECKPOINT_LIST))
        errors = []
        for name in reversed(names):
            path = self.directory / name
            state, problem = None, None
            try:
                state = self._read(path)
                self._check(path, state)
            except (OSError, CheckpointError) as exc:
                problem = str(exc)
            problems = self._everyone(problem, CHECKPOINT_CHECKED)
            if not problems:
                snap = self._snapshot()
                try:
                    self._apply(state)
                except Exception as exc:
                    self._put_back(snap)
                    problem = (f"checkpoint {path / 'state.pt'} could not be applied ({type(exc).__name__}: "
                               f"{exc}); nothing was changed")
                problems = self._everyone(problem, CHECKPOINT_APPLIED)
                if problems and problem is None:  # applied here but not on another rank: undo it
                    self._put_back(snap)
            del state
            if not problems:
                return path
            reason = "; ".join(problems)
            errors.append(f"{name}: {reason}")
            log.warning("skipping checkpoint %s: %s", path, reason)
        if names:
            raise CheckpointError(f"no checkpoint in {self.directory} is usable (model, optimizer, loader and "
                                  f"controller are unchanged); tried {len(names)}, newest first: "
                                  + "; ".join(errors))
        return None
