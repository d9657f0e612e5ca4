"""Batch-size policies: what rank 0 consults at each decision. Pure: no MPI, no Horovod.

Every policy sees the same inputs (observation [R, OBS_DIM], the raw rank reports, the global
context, current sizes, bounds) and returns the new per-rank sizes, so PPO and the classic rules can
be swapped by name and compared side by side. The PPO policy is in :mod:`dynamix_hvd.control.refine`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from .actions import BatchBounds
from .costmodel import CostModel
from .state import GlobalContext, RankReport


@dataclass
class DecisionInput:
    obs: torch.Tensor                 # [R + 1, OBS_DIM] (rows: the ranks, then the batch row)
    reports: Sequence[RankReport]
    ctx: GlobalContext
    sizes: Sequence[int]
    bounds: BatchBounds
    reward: torch.Tensor | None       # [R] reward earned by the previous decision (None at the first)
    costs: CostModel | None = None    # per-step cost fits (the core's); None when built by hand
    noise_lower: float = math.nan     # lower confidence bound on the noise scale (NaN: unknown)
    noise_point: float = math.nan     # its continuous point estimate (NaN: unknown)
    passes: int = 1                   # micro-batches per optimizer step the interval ran with
    step_losses: Sequence[float] | None = None  # the interval's per-step loss over all ranks (None: unknown)
    budget_left: float = math.nan     # fraction of the training budget still to run (NaN: unknown)
    changed_by: Sequence[int] = ()    # ranks whose change vote brought the decision forward (`changewatch`)


@dataclass
class DecisionOutput:
    sizes: list[int]
    """Per-rank sizes of one micro-batch (of one step without accumulation)."""
    info: dict[str, Any] = field(default_factory=dict)
    passes: int | None = None
    """Micro-batches per optimizer step from now on (within ``bounds.max_passes``); None: keep."""

    @property
    def recheck(self) -> bool:
        """``info["recheck"]``: the policy asks for the next decision soon (`DecisionCadence`'s recheck).
        Kept in ``info`` so that a policy refining another's output (PPO) passes it on."""
        return bool(self.info.get("recheck", False))


class BatchSizePolicy(Protocol):
    name: str

    def decide(self, inp: DecisionInput) -> DecisionOutput: ...

    def after_decision(self) -> dict[str, float]: ...

    def reset_world(self, world_size: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StaticPolicy:
    """Keeps the sizes the job started with (the baseline every other policy is measured against)."""

    name = "static"

    def decide(self, inp: DecisionInput) -> DecisionOutput:
        return DecisionOutput([inp.bounds.clip(r, b) for r, b in enumerate(inp.sizes)])

    def after_decision(self) -> dict[str, float]:
        return {}

    def reset_world(self, world_size: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
