"""Per-step measurements on every rank: where each step's wall time went.

The loader opens a step (data wait ends when the batch is handed out), the optimizer closes it
(allreduce wait in ``synchronize()``, then the optimizer update). Forward+backward is the time between
the two; on a GPU, where the host only launches kernels, it is the larger of that and the device time
between two CUDA events recorded at the same two points (otherwise the device's compute would show up
as allreduce wait, and every rank would look equally fast). A straggler shows up as ``sync_wait_s`` on the *other* ranks: they finish backward first and
wait in ``synchronize()`` for the slow rank's gradients.
"""
from __future__ import annotations

import resource
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch


@dataclass
class StepRecord:
    """What one rank measured in one optimizer step. Times are seconds of wall time."""

    epoch: int
    step: int
    rank: int
    local_batch: int
    """Samples this rank processed in the step (b_i; with accumulation, over all its micro-batches);
    tokens when the loader plans by token budgets."""
    global_batch: int
    """Samples (or tokens) all ranks processed in the step: the global batch B (sum of b_i over its micro-batches)."""
    data_wait_s: float
    """Time the training loop waited for the batch (loading, collation, transfer)."""
    compute_s: float = float("nan")
    """Forward + backward: from batch handed out to ``optimizer.step()`` entered (on GPU at least the
    device time between those points, from CUDA events)."""
    device_compute_s: float = float("nan")
    """On GPU: the device time between those points (CUDA events); NaN on CPU."""
    sync_wait_s: float = float("nan")
    """Allreduce wait: time blocked in ``synchronize()`` for outstanding gradient allreduces."""
    optimizer_s: float = float("nan")
    """The wrapped optimizer's own update (after synchronisation and clipping)."""
    step_s: float = float("nan")
    """Whole step: from asking for the batch to the end of the update."""
    samples_per_s: float = float("nan")
    """local_batch / step_s."""
    peak_memory_bytes: int = 0
    """Peak CUDA memory allocated in this step on GPU; peak resident set size of the process on CPU."""
    memory_kind: str = "rss"
    lr: float = float("nan")
    """Learning rate of the first parameter group used for this step's update."""
    grad_norm: float = float("nan")
    """Norm of the synchronised (global mean) gradient before clipping."""
    status: str = "ok"
    """"ok", or why the update was skipped: "nonfinite" (NaN/inf gradient) or "oom" (redone smaller)."""
    local_grad_sq: float = float("nan")
    """Squared norm of this rank's local mean gradient (before allreduce)."""
    global_grad_sq: float = float("nan")
    """Squared norm of the global mean gradient (after allreduce)."""
    local_tokens: int = 0
    """Tokens this rank's samples hold (with per-sample lengths, or as given to the optimizer); 0: unknown."""
    global_tokens: int = 0
    """Tokens of all ranks' samples in the step; 0: unknown."""
    local_sq_tokens: int = 0
    """Sum of the squared lengths of this rank's samples (with token budgets; 0: not kept)."""
    micro_batches: int = 1
    """Loader steps (micro-batches) accumulated into this optimizer step; the times above cover all of
    them (data wait and compute summed, the allreduce after the last)."""


def peak_memory(device: torch.device | None) -> tuple[int, str]:
    """Peak memory since the last reset: CUDA allocator peak on GPU, process peak RSS on CPU."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss"


@dataclass
class StepTracker:
    """Collects StepRecords of one rank. Bounded so a long job cannot grow it without limit."""

    rank: int
    max_records: int = 100_000
    device: torch.device | None = None
    records: deque = field(init=False)
    """The most recent `max_records` steps (history for logs and reports)."""
    _undrained: list = field(default_factory=list, init=False)
    _open: StepRecord | None = field(default=None, init=False)
    _t_request: float = field(default=0.0, init=False)
    _t_batch: float = field(default=0.0, init=False)
    _t_step: float = field(default=0.0, init=False)
    _t_sync: float = field(default=0.0, init=False)
    _events: tuple | None = field(default=None, init=False)
    _sq_group: int = field(default=0, init=False)
    _group: list = field(default_factory=list, init=False)
    """(request, ready) times of the batches handed out since the last closed step (its micro-batches)."""

    def __post_init__(self) -> None:
        self.records = deque(maxlen=self.max_records)

    # --- called by the loader -------------------------------------------------------------------
    def batch_requested(self) -> None:
        self._t_request = time.perf_counter()

    def batch_ready(self, epoch: int, step: int, local_batch: int, global_batch: int,
                    tokens: tuple[int, ...] | None = None, sq_tokens: int = 0) -> None:
        self._t_batch = time.perf_counter()
        first = not self._group  # the first micro-batch of an optimizer step (every batch without accumulation)
        self._group.append((self._t_request, self._t_batch))  # a new list per step only at step_finished
        if len(self._group) > 256:  # batches drawn without ever stepping: keep the recent ones
            del self._group[0]
        if self.device is not None and self.device.type == "cuda":
            if first:
                torch.cuda.reset_peak_memory_stats(self.device)
            if self._events is None:  # two events for the tracker's life, re-recorded every step
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if first:  # device time spans all micro-batches of the step
                self._events[0].record()
        self._open = StepRecord(epoch=epoch, step=step, rank=self.rank, local_batch=local_batch,
                                global_batch=global_batch, data_wait_s=self._t_batch - self._t_request)
        if tokens is not None:
            self._open.local_tokens, self._open.global_tokens = tokens[self.rank], sum(tokens)
        self._sq_group = (0 if first else self._sq_group) + sq_tokens  # summed over the step's micro-batches
        self._open.local_sq_tokens = self._sq_group

    # --- called by the optimizer ----------------------------------------------------------------
    def step_started(self) -> None:
        self._t_step = time.perf_counter()
        if self._events is not None:
            self._events[1].record()

    def synchronized(self) -> None:
        self._t_sync = time.perf_counter()

    def sync_wait_started(self) -> float | None:
        """When (``time.perf_counter()``) the current wait in the gradient allreduce began; None when
        this rank is not waiting there (read by the stall watchdog's thread)."""
        t_step, t_sync = self._t_step, self._t_sync
        return t_step if t_step > t_sync else None

    def progress_at(self) -> float:
        """The last time (``time.perf_counter()``) this rank asked for or got a batch, or entered or
        left the gradient allreduce; 0 before its first batch (read by the stall watchdog's thread)."""
        return max(self._t_request, self._t_batch, self._t_step, self._t_sync)

    def step_finished(self, **extra: Any) -> StepRecord | None:
        """Close the open step; `extra` fills optional fields (lr, grad norms; ``micro_batches``: the
        loader steps accumulated into this one, whose data waits and compute are then summed)."""
        rec = self._open
        group, self._group = self._group, []
        if rec is None:
            return None  # optimizer stepped without a batch from our loader: nothing to attribute
        now = time.perf_counter()
        n = max(1, min(int(extra.get("micro_batches", 1)), len(group)))
        waits = [ready - request for request, ready in group[-n:]]
        # From the first micro-batch's arrival to step(): its compute, then for each later one the loop
        # asking for the next batch (its data wait, not compute) and that batch's forward/backward.
        t_first = group[-n][1] if group else self._t_batch
        span = self._t_step - t_first - sum(waits[1:])
        rec.compute_s = span
        if n > 1:
            rec.data_wait_s = sum(waits)
        if self._events is not None:
            # the allreduce has finished, so the backward kernels before the end event have too
            start, end = self._events
            end.synchronize()
            rec.device_compute_s = start.elapsed_time(end) / 1e3
            # the events span the later micro-batches' data waits too (the device idles through them)
            rec.compute_s = max(rec.compute_s, rec.device_compute_s - sum(waits[1:]))
        rec.sync_wait_s = max(0.0, self._t_sync - self._t_step + span - rec.compute_s)
        rec.optimizer_s = now - self._t_sync
        rec.step_s = now - (group[-n][0] if group else self._t_request)
        rec.samples_per_s = rec.local_batch / rec.step_s if rec.step_s > 0 else float("nan")
        rec.peak_memory_bytes, rec.memory_kind = peak_memory(self.device)
        for key, value in extra.items():
            setattr(rec, key, value)
        self.records.append(rec)
        self._undrained.append(rec)
        self._open = None
        return rec

    # --- consumers ------------------------------------------------------------------------------
    def drain(self) -> list[StepRecord]:
        """Records since the previous drain (the controller's decision interval); history is kept."""
        out, self._undrained = self._undrained, []
        return out

    def state_dict(self) -> dict[str, Any]:
        """The records not drained yet (the controller's open decision interval), as plain values:
        this rank's own part of a checkpoint."""
        return {"undrained": [asdict(r) for r in self._undrained]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back `state_dict()` output: the next drain returns those records first."""
        known = {f.name for f in fields(StepRecord)}
        self._undrained = [StepRecord(**{k: v for k, v in r.items() if k in known}) for r in state["undrained"]]

    def to_dicts(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]

    def to_dataframe(self):  # -> pandas.DataFrame; pandas imported lazily (not needed per step)
        import pandas as pd

        return pd.DataFrame(self.to_dicts())
