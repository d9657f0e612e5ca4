"""Reports and decisions as fixed-size float64 arrays, the form in which they travel between ranks.

Pure NumPy: no MPI, no Horovod. Every value is a float64, so integers (sizes, bytes up to 2**53) and
floats (NaN included) survive the round trip exactly and decisions are the same as on typed objects.

One rank's report for one decision (n steps in the interval, L parameters with layer means, or L = 0
when the optimizer had none), ``report_length(n, L) = 25 + 9 n + 2 L`` values::

    [0]            n                       steps in the interval
    [1]            L                       parameters with layer means (0: none)
    [2]            memory kind             index into MEMORY_KINDS (0 "rss", 1 "cuda", 2 "host")
    [3 : 25]       RankReport fields       in declaration order (REPORT_FIELDS)
    [25 : 25+n]    local_batch per step
    [.. +n]        local_sq per step
    [.. +n]        global_sq per step
    [.. +n]        loss per step           NaN where the rank recorded none
    [.. +n]        compute_s per step      NaN where not timed (so for the three below)
    [.. +n]        data_wait_s per step
    [.. +n]        sync_wait_s per step
    [.. +n]        micro-batches per step  accumulated into each optimizer step (1: none)
    [.. +n]        squared lengths         sum over the step's samples (token budgets; 0: not kept)
    [.. +L]        layer local_sq means
    [.. +L]        layer global_sq means

Ranks normally report the same n (they run the same steps between decisions); a rank that rejoined
after an elastic reset may report fewer, and the core then uses the first min(n) steps of every rank.

A decision for R ranks, ``decision_length(R) = 9 + 2 R`` values::

    [0] decision index, [1] epoch, [2] lr_gain, [3] micro-batches per optimizer step,
    [4] fewest steps before the next decision (the decision budget's spacing; 0: none),
    [5] 1: decide again soon (`DecisionCadence`'s recheck), else 0,
    [6] most steps in an interval inside an epoch (`DecisionCadence`'s ceiling; 0: none),
    [7] loader steps between two change votes (`changewatch`; 0: none),
    [8] optimizer steps between two that take the noise statistics (1: every step),
    [9 : 9+R] new sizes (per micro-batch), [9+R : 9+2R] previous sizes
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Sequence

import numpy as np

from .core import MEMORY_KINDS, TIMED, LayerMeans, RankInput, StepSeries
from .state import RankReport

REPORT_FIELDS = tuple(f.name for f in fields(RankReport))
_INT_FIELDS = frozenset(f.name for f in fields(RankReport) if f.type in (int, "int"))
_HEADER = 3
_FIXED = _HEADER + len(REPORT_FIELDS)
_SERIES = ("local_batch", "local_sq", "global_sq", "losses", *TIMED, "micro_batches", "sq_tokens")


def report_length(steps: int, layers: int) -> int:
    """Values in one rank's encoded report (see the module docstring)."""
    return _FIXED + len(_SERIES) * steps + 2 * layers


def decision_length(world_size: int) -> int:
    return 9 + 2 * world_size


def encode_report(inp: RankInput) -> np.ndarray:
    s = inp.steps
    n, layers = len(s.local_batch), inp.layers
    L = 0 if layers is None else len(layers.local_sq)
    out = np.empty(report_length(n, L), dtype=np.float64)
    out[:_HEADER] = (n, L, MEMORY_KINDS.index(s.memory_kind))
    out[_HEADER:_FIXED] = [getattr(inp.report, k) for k in REPORT_FIELDS]
    at = _FIXED
    for name in _SERIES:
        out[at:at + n] = getattr(s, name)
        at += n
    if layers is not None:
        out[at:at + L] = layers.local_sq
        out[at + L:at + 2 * L] = layers.global_sq
    return out


def decode_report(row: np.ndarray) -> RankInput:
    """Inverse of :func:`encode_report`; refuses an array whose header does not match its length."""
    row = np.asarray(row, dtype=np.float64)
    if row.ndim != 1 or len(row) < _FIXED:
        raise ValueError(f"an encoded report needs at least {_FIXED} values, got shape {row.shape}")
    n, L, kind = (int(x) for x in row[:_HEADER])
    if report_length(n, L) != len(row) or not 0 <= kind < len(MEMORY_KINDS):
        raise ValueError(f"encoded report header (steps={n}, layers={L}, memory kind={kind}) does not match "
                         f"its {len(row)} values")
    values: dict[str, Any] = {}
    for k, v in zip(REPORT_FIELDS, row[_HEADER:_FIXED].tolist()):
        values[k] = int(v) if k in _INT_FIELDS else v
    series = [row[_FIXED + i * n:_FIXED + (i + 1) * n].tolist() for i in range(len(_SERIES))]
    steps = StepSeries([int(b) for b in series[0]], series[1], series[2], series[3], MEMORY_KINDS[kind],
                       *series[4:4 + len(TIMED)], micro_batches=[int(m) for m in series[-2]],
                       sq_tokens=[int(q) for q in series[-1]])
    layers = None
    if L:
        at = _FIXED + len(_SERIES) * n
        layers = LayerMeans(row[at:at + L].tolist(), row[at + L:at + 2 * L].tolist())
    return RankInput(RankReport(**values), steps, layers)


def decode_reports(rows: Sequence[np.ndarray] | np.ndarray) -> list[RankInput]:
    """Rank 0's gathered arrays (one per rank, or an [R, n] array) back into typed inputs, in rank order."""
    return [decode_report(row) for row in rows]


def padded_losses(losses: Sequence[float], steps: int) -> list[float]:
    """One loss per step: NaN-padded when fewer were recorded, cut when more (the extra ones are
    already in the report's mean loss and never enter the per-step statistics)."""
    out = [float(x) for x in losses[:steps]]
    return out + [math.nan] * (steps - len(out))


def encode_decision(index: int, epoch: int, lr_gain: float, sizes: Sequence[int],
                    previous_sizes: Sequence[int], passes: int = 1, spacing: int = 0,
                    recheck: bool = False, ceiling: int = 0, vote_every: int = 0, noise_every: int = 1) -> np.ndarray:
    if len(sizes) != len(previous_sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(previous_sizes)} previous sizes")
    return np.array([index, epoch, lr_gain, passes, spacing, float(recheck), ceiling, vote_every, noise_every, *sizes,
                     *previous_sizes], dtype=np.float64)


def decode_decision(values: np.ndarray, world_size: int) -> dict[str, Any]:
    """``{"decision", "epoch", "sizes", "previous_sizes", "lr_gain", "passes", "spacing", "recheck",
    "ceiling", "vote_every", "noise_every"}`` as every rank applies it."""
    v = np.asarray(values, dtype=np.float64)
    if v.shape != (decision_length(world_size),):
        raise ValueError(f"an encoded decision for {world_size} ranks has {decision_length(world_size)} values, "
                         f"got shape {v.shape}")
    R = world_size
    return {"decision": int(v[0]), "epoch": int(v[1]), "sizes": [int(b) for b in v[9:9 + R]],
            "previous_sizes": [int(b) for b in v[9 + R:]], "lr_gain": float(v[2]), "passes": int(v[3]),
            "spacing": int(v[4]), "recheck": bool(v[5]), "ceiling": int(v[6]), "vote_every": int(v[7]),
            "noise_every": int(v[8])}
