"""Per-step measurements on every rank: where each step's wall time went.

The loader opens a step (data wait ends when the batch is handed out), the optimizer closes it
(allreduce wait in ``synchronize()``, then the optimizer update). Forward+backward is the time between
the two; on a GPU, where the host only launches kernels, it is the larger of that and the device time
between two CUDA events recorded at the same two points (otherwise the device's compute would show up
as allreduce wait, and every rank would look equally fast). A straggler shows up as ``sync_wait_s`` on the *other* ranks: they finish backward first and
wait in ``synchronize()`` for the slow rank's gradients.

The records are kept as columns (`StepColumns`: one float64 row per step in a preallocated array that
grows geometrically), so a step appends one row and creates no object; `StepRecord` objects are made
only when read one by one.
"""
from __future__ import annotations

import math
import resource
import time
from dataclasses import MISSING, dataclass, fields
from typing import Any, Iterator, Sequence, overload

import numpy as np
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


STEP_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepRecord))
"""The fields of a step record, in column order."""
_TYPES = {f.name: str(f.type) for f in fields(StepRecord)}
INT_FIELDS = frozenset(name for name, kind in _TYPES.items() if kind == "int")
TEXT_FIELDS = frozenset(name for name, kind in _TYPES.items() if kind == "str")
COLUMN = {name: i for i, name in enumerate(STEP_FIELDS)}
"""Column of each field in a row."""

# Text fields hold a code: the position of the text in this table, shared by every buffer of the process.
_TEXTS: list[str] = ["ok", "nonfinite", "oom", "rss", "cuda"]
_CODES: dict[str, int] = {text: i for i, text in enumerate(_TEXTS)}


def text_code(text: str) -> int:
    """The code a text field's value is stored as (new texts get the next code)."""
    code = _CODES.get(text)
    if code is None:
        code = _CODES[text] = len(_TEXTS)
        _TEXTS.append(text)
    return code


def _blank_row() -> list[float]:
    row = []
    for f in fields(StepRecord):
        default = f.default
        row.append(math.nan if default is MISSING else float(text_code(default)) if isinstance(default, str)
                   else float(default))
    return row


_BLANK = _blank_row()  # a row with every field at its default (NaN where it has none)


class StepColumns(Sequence[StepRecord]):
    """Step records as columns: one float64 row per step (text fields as codes, integers exactly up
    to 2**53) in an array that doubles when full. A sequence of `StepRecord` (each made on reading);
    `column(name)` and `values(name)` read a field of every step at once. `extra` names columns
    after the record's fields (e.g. a run log's wall time and loss)."""

    def __init__(self, extra: Sequence[str] = (), capacity: int = 256, *, _data: np.ndarray | None = None) -> None:
        self.names: tuple[str, ...] = STEP_FIELDS + tuple(extra)
        self.index = {name: i for i, name in enumerate(self.names)}
        if _data is not None:
            self._data, self._n = _data, len(_data)
        else:
            self._data, self._n = np.empty((max(1, capacity), len(self.names))), 0

    def _view(self, lo: int, hi: int, copy: bool = False) -> "StepColumns":
        rows = self._data[lo:hi]
        out = StepColumns.__new__(StepColumns)
        out.names, out.index = self.names, self.index
        out._data, out._n = (rows.copy() if copy else rows), max(0, hi - lo)
        return out

    # --- writing -------------------------------------------------------------------------------------
    def append(self, row: Sequence[float], *extra: float) -> None:
        """Add one step: a row of numbers (text fields as `text_code`), then `extra`, ``len(names)``
        numbers in all."""
        n = self._n
        if n == len(self._data):
            grown = np.empty((2 * n, len(self.names)))
            grown[:n] = self._data[:n]
            self._data = grown
        if extra:
            k = len(row)
            self._data[n, :k] = row
            self._data[n, k:] = extra
        else:
            self._data[n] = row
        self._n = n + 1

    def extend(self, other: "StepColumns") -> None:
        """Add every row of `other` (the same columns)."""
        for i in range(len(other)):
            self.append(other._data[i])

    def drop_first(self, k: int) -> None:
        """Forget the first `k` rows."""
        k = min(max(k, 0), self._n)
        if k:
            rest = self._n - k
            self._data[:rest] = self._data[k:self._n]
            self._n = rest

    def clear(self) -> None:
        self._n = 0

    # --- reading -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def row(self, i: int) -> np.ndarray:
        """Row `i` (negative: from the end) as a float64 array (a view)."""
        if not -self._n <= i < self._n:
            raise IndexError(f"step row {i} of {self._n}")
        return self._data[i % self._n]

    def column(self, name: str) -> np.ndarray:
        """Field `name` of every step as a float64 array (a view: copy it to keep it)."""
        return self._data[:self._n, self.index[name]]

    def values(self, name: str) -> list[Any]:
        """Field `name` of every step as Python values of the field's type (int, float or str)."""
        col = self.column(name)
        if name in TEXT_FIELDS:
            return [_TEXTS[int(c)] for c in col]
        if name in INT_FIELDS:
            return col.astype(np.int64).tolist()
        return col.tolist()

    def _record(self, row: np.ndarray) -> StepRecord:
        values = row[:len(STEP_FIELDS)].tolist()
        return StepRecord(**{name: (_TEXTS[int(v)] if name in TEXT_FIELDS else int(v) if name in INT_FIELDS else v)
                             for name, v in zip(STEP_FIELDS, values)})

    @overload
    def __getitem__(self, i: int) -> StepRecord: ...

    @overload
    def __getitem__(self, i: slice) -> "StepColumns": ...

    def __getitem__(self, i: int | slice) -> StepRecord | "StepColumns":
        if isinstance(i, slice):
            lo, hi, stride = i.indices(self._n)
            if stride != 1:
                raise ValueError("step rows are sliced with a step of 1")
            return self._view(lo, max(lo, hi))
        return self._record(self.row(i))

    def __iter__(self) -> Iterator[StepRecord]:
        for i in range(self._n):
            yield self._record(self._data[i])

    def copy(self) -> "StepColumns":
        return self._view(0, self._n, copy=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepColumns):
            return self.names == other.names and np.array_equal(self._data[:self._n], other._data[:other._n],
                                                                equal_nan=True)
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StepColumns({self._n} steps)"

    def to_dicts(self) -> list[dict[str, Any]]:
        """One dict per step, the record's fields with their types (``asdict(StepRecord)``)."""
        cols = {name: self.values(name) for name in STEP_FIELDS}
        return [dict(zip(cols, values)) for values in zip(*cols.values())]


class StepTracker:
    """Collects the step records of one rank, as columns (`StepColumns`). Bounded: the history keeps
    the most recent `max_records` steps, and so do the records not drained yet."""

    def __init__(self, rank: int, max_records: int = 100_000, device: torch.device | None = None) -> None:
        self.rank = rank
        self.max_records = max_records
        self.device = device
        self._rows = StepColumns()
        self._drained = 0           # rows of _rows before this one were drained already
        self._restored = StepColumns()  # undrained records put back by load_state_dict, drained first
        self.finished = 0
        """Steps closed so far (`step_finished`), over the tracker's life."""
        self._open: list[float] | None = None
        self._t_request = 0.0
        self._t_batch = 0.0
        self._t_step = 0.0
        self._t_sync = 0.0
        self._t_ready = 0.0
        self._t_reduced = 0.0
        self._t_forward_sync = 0.0  # > 0: waiting in a forward pass's collective since then
        self._forward_waits = 0.0   # seconds waited in forward passes' collectives in the open step
        self._events: tuple | None = None
        self._sq_group = 0
        # (request, ready) times of the batches handed out since the last closed step (its micro-batches)
        self._group: list[tuple[float, float]] = []

    @property
    def records(self) -> StepColumns:
        """The most recent `max_records` steps (history for logs and reports), oldest first: a view of
        the buffer as it is now (read it before the next step; ``.copy()`` keeps it)."""
        n = len(self._rows)
        return self._rows[max(0, n - self.max_records):n]

    # --- called by the loader -------------------------------------------------------------------
    def batch_requested(self) -> None:
        self._t_request = time.perf_counter()

    def batch_ready(self, epoch: int, step: int, local_batch: int, global_batch: int,
                    tokens: tuple[int, ...] | None = None, sq_tokens: int = 0) -> None:
        t = self._t_batch = time.perf_counter()
        first = not self._group  # the first micro-batch of an optimizer step (every batch without accumulation)
        self._group.append((self._t_request, t))  # a new list per step only at step_finished
        if len(self._group) > 256:  # batches drawn without ever stepping: keep the recent ones
            del self._group[0]
        if self.device is not None and self.device.type == "cuda":
            if first:
                torch.cuda.reset_peak_memory_stats(self.device)
            if self._events is None:  # two events for the tracker's life, re-recorded every step
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if first:  # device time spans all micro-batches of the step
                self._events[0].record()
        row = self._open = _BLANK.copy()
        row[_EPOCH], row[_STEP], row[_RANK] = epoch, step, self.rank
        row[_LOCAL_BATCH], row[_GLOBAL_BATCH], row[_DATA_WAIT] = local_batch, global_batch, t - self._t_request
        if tokens is not None:
            row[_LOCAL_TOKENS], row[_GLOBAL_TOKENS] = tokens[self.rank], sum(tokens)
        self._sq_group = (0 if first else self._sq_group) + sq_tokens  # summed over the step's micro-batches
        row[_SQ_TOKENS] = self._sq_group

    # --- called by the optimizer ----------------------------------------------------------------
    def step_started(self) -> None:
        self._t_step = time.perf_counter()
        if self._events is not None:
            self._events[1].record()

    def synchronized(self) -> None:
        self._t_sync = time.perf_counter()

    def gradients_ready(self) -> None:
        """The step's last gradients were just handed to an allreduce that backward itself waits for
        (DistributedDataParallel): from here to `gradients_reduced` this rank waits, not computes."""
        self._t_ready = time.perf_counter()
        self._t_reduced = 0.0

    def gradients_reduced(self) -> None:
        """An allreduce that backward waits for has completed (called from the communication thread;
        the last call of a step ends its wait)."""
        self._t_reduced = time.perf_counter()

    def forward_sync_started(self) -> None:
        """A forward pass is about to wait in a collective (DistributedDataParallel's broadcast of
        buffers): until `forward_sync_ended`, this rank waits for the others, it does not compute."""
        self._t_forward_sync = time.perf_counter()

    def forward_sync_ended(self) -> None:
        if self._t_forward_sync:
            if self._open is not None:  # in a training step (not an evaluation between steps)
                self._forward_waits += time.perf_counter() - self._t_forward_sync
            self._t_forward_sync = 0.0

    def sync_wait_started(self) -> float | None:
        """When (``time.perf_counter()``) the current wait in the gradient allreduce began; None when
        this rank is not waiting there (read by the stall watchdog's thread)."""
        t_step, t_sync, t_ready, t_forward = self._t_step, self._t_sync, self._t_ready, self._t_forward_sync
        if t_forward:
            return t_forward
        if t_step > t_sync:
            return t_step
        # DistributedDataParallel: backward itself waits, from its last gradient handed over
        return t_ready if t_ready > t_sync and self._t_reduced < t_ready else None

    def progress_at(self) -> float:
        """The last time (``time.perf_counter()``) this rank asked for or got a batch, or entered or
        left the gradient allreduce; 0 before its first batch (read by the stall watchdog's thread)."""
        return max(self._t_request, self._t_batch, self._t_step, self._t_sync, self._t_ready, self._t_forward_sync)

    def step_finished(self, **extra: Any) -> None:
        """Close the open step (it becomes ``records[-1]``); `extra` fills optional fields (lr, grad
        norms; ``micro_batches``: the loader steps accumulated into this one, whose data waits and
        compute are then summed). Nothing happens without an open step (the optimizer stepped without
        a batch from this loader)."""
        row = self._open
        group, self._group = self._group, []
        if row is None:
            return
        now = time.perf_counter()
        n = max(1, min(int(extra.get("micro_batches", 1)), len(group)))
        t_first = group[-n][1] if group else self._t_batch
        # From the first micro-batch's arrival to step(): its compute, then for each later one the loop
        # asking for the next batch (its data wait, not compute) and that batch's forward/backward.
        later_waits = 0.0
        if n > 1:
            waits = [ready - request for request, ready in group[-n:]]
            later_waits = sum(waits[1:])
            row[_DATA_WAIT] = sum(waits)
        span = self._t_step - t_first - later_waits
        compute = span
        t_ready, t_reduced, self._t_ready, self._t_reduced = self._t_ready, self._t_reduced, 0.0, 0.0
        if t_first < t_ready < self._t_step:  # backward waited for the allreduce from t_ready to t_reduced
            compute -= (t_reduced if t_ready <= t_reduced <= self._t_step else self._t_step) - t_ready
        forward_waits, self._forward_waits = self._forward_waits, 0.0
        compute = max(0.0, compute - forward_waits)  # forward passes waited for the others
        if self._events is not None:
            # the allreduce has finished, so the backward kernels before the end event have too
            start, end = self._events
            end.synchronize()
            device_s = start.elapsed_time(end) / 1e3
            row[_DEVICE_COMPUTE] = device_s
            # the events span the later micro-batches' data waits too (the device idles through them)
            compute = max(compute, device_s - later_waits)
        row[_COMPUTE] = compute
        row[_SYNC_WAIT] = max(0.0, self._t_sync - self._t_step + span - compute)
        row[_OPTIMIZER] = now - self._t_sync
        step_s = row[_STEP_S] = now - (group[-n][0] if group else self._t_request)
        row[_SAMPLES_PER_S] = row[_LOCAL_BATCH] / step_s if step_s > 0 else math.nan
        peak, kind = peak_memory(self.device)
        row[_PEAK], row[_MEMORY_KIND] = peak, text_code(kind)
        for key, value in extra.items():
            column = COLUMN.get(key)
            if column is None:
                raise TypeError(f"step_finished() got {key}=, which is no StepRecord field")
            row[column] = text_code(value) if key in TEXT_FIELDS else value
        self._rows.append(row)
        self.finished += 1
        self._open = None
        rows = len(self._rows)
        if rows >= 2 * self.max_records:  # keep the most recent max_records (amortised: one move per max_records steps)
            dropped = rows - self.max_records
            self._rows.drop_first(dropped)
            self._drained = max(0, self._drained - dropped)

    # --- consumers ------------------------------------------------------------------------------
    def undrained(self, name: str) -> np.ndarray:
        """Column `name` of the records the next `drain` returns (the controller's open decision
        interval), oldest first; read it before the next step."""
        n = len(self._rows)
        column = self._rows[max(self._drained, n - self.max_records):n].column(name)
        return np.concatenate([self._restored.column(name), column]) if len(self._restored) else column

    def drain(self) -> StepColumns:
        """Records since the previous drain (the controller's decision interval), as a copy; the
        history is kept."""
        n = len(self._rows)
        lo = max(self._drained, n - self.max_records)
        out = self._rows[lo:n].copy()
        self._drained = n
        if len(self._restored):
            restored, self._restored = self._restored, StepColumns()
            restored.extend(out)
            out = restored
        return out

    def state_dict(self) -> dict[str, Any]:
        """The records not drained yet (the controller's open decision interval), as plain values:
        this rank's own part of a checkpoint."""
        n = len(self._rows)
        undrained = self._restored.to_dicts() + self._rows[max(self._drained, n - self.max_records):n].to_dicts()
        return {"undrained": undrained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back `state_dict()` output: the next drain returns those records first."""
        self._drained = len(self._rows)
        self._restored = StepColumns()
        for r in state["undrained"]:
            row = _BLANK.copy()
            for key, value in r.items():
                column = COLUMN.get(key)
                if column is not None:
                    row[column] = text_code(value) if key in TEXT_FIELDS else value
            self._restored.append(row)

    def to_dicts(self) -> list[dict[str, Any]]:
        return self.records.to_dicts()

    def to_dataframe(self):  # -> pandas.DataFrame; pandas imported lazily (not needed per step)
        import pandas as pd

        return pd.DataFrame(self.to_dicts(), columns=list(STEP_FIELDS))


(_EPOCH, _STEP, _RANK, _LOCAL_BATCH, _GLOBAL_BATCH, _DATA_WAIT, _COMPUTE, _DEVICE_COMPUTE, _SYNC_WAIT, _OPTIMIZER,
 _STEP_S, _SAMPLES_PER_S, _PEAK, _MEMORY_KIND, _LOCAL_TOKENS, _GLOBAL_TOKENS, _SQ_TOKENS) = (
    COLUMN[name] for name in ("epoch", "step", "rank", "local_batch", "global_batch", "data_wait_s", "compute_s",
                              "device_compute_s", "sync_wait_s", "optimizer_s", "step_s", "samples_per_s",
                              "peak_memory_bytes", "memory_kind", "local_tokens", "global_tokens", "local_sq_tokens"))
