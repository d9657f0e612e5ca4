"""Opt-in: gradient-noise statistics of an Adam-type optimizer's step direction.

Adam moves each coordinate by its gradient divided by ``sqrt(v_hat) + eps``, where ``v`` already holds
the step's own gradient. With ``noise_preconditioner="adam"`` the noise statistics are those of that
preconditioned gradient, ``tr(P S P) / |P G|^2`` with ``P = diag(1 / (sqrt(v_hat) + eps))`` (as AdaptDL
measures Adam): the coordinates with small second moments, which Adam scales up, weigh more. ``P`` is
the one of the step being taken: the optimizer's second moments updated with the step's global
gradient, as the optimizer is about to update them (a ``P`` read from the moments before the step is
dominated by the few coordinates whose gradient has just grown, and is unstable from step to
step). Both the local and the global gradient are measured with it
(`FlatGradients.enable_weights`: the local gradient is kept until the allreduce has ended). That costs
several passes over the gradients, so it is done on every k-th step, k chosen from its measured cost
(`every`); the other steps record no norms.

What it changes, measured on the workload zoo's two Adam jobs (BENCHMARKS.md, "Is the noise-scale
estimate right?"): a larger AdaScale gain, with which a fixed larger batch reached the target in up to
35% fewer samples; but noisier statistics, whose lower confidence bound stays near 0, so the controller
grows the batch less than with the raw gradient's (on a 10 Mbit/s link: 1.02-1.04x plain Horovod's
time against 0.89-1.01x). Hence not the default. Pure torch: no Horovod, no MPI.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .flat import FlatGradients

MODES = ("auto", "adam", "none")
"""`WeightedDistributedOptimizer(noise_preconditioner=)`: "none" (the default: the gradient as it is),
"adam" (any optimizer whose parameter groups hold ``betas`` and ``eps`` and whose state holds
``exp_avg_sq``), "auto" ("adam" for Adam, AdamW, NAdam, RAdam and their subclasses, else "none")."""

ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)


COST_SHARE = 0.005
"""The preconditioned norms (several passes over the gradients) are taken on every k-th step, k the
smallest that keeps their measured cost below this share of the step time."""
MAX_EVERY = 32
"""At least one step in this many is measured."""


def every(cost_s: float, step_s: float) -> int:
    """Steps between two measured ones: the fewest that keep `cost_s` per measurement under
    `COST_SHARE` of the step time `step_s` (1 when the step time is not known)."""
    if not (step_s > 0 and cost_s >= 0) or not math.isfinite(step_s):
        return 1
    return max(1, min(MAX_EVERY, math.ceil(cost_s / (COST_SHARE * step_s))))


def choose(mode: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the noise scale is measured on Adam's preconditioned gradient; ValueError naming the value."""
    if mode not in MODES:
        raise ValueError(f"noise_preconditioner={mode!r}; choose one of {', '.join(map(repr, MODES))}")
    if mode == "none":
        return False
    if mode == "auto":
        return isinstance(optimizer, ADAM_TYPES)
    missing = [k for k in ("betas", "eps") if any(k not in g for g in optimizer.param_groups)]
    if missing:
        raise ValueError(f"noise_preconditioner='adam' with a {type(optimizer).__name__} whose parameter groups "
                         f"have no {' or '.join(missing)}: it is not an Adam-type optimizer")
    return True


class AdamPreconditioner:
    """Writes Adam's ``1 / (sqrt(v_hat) + eps)`` of the step about to be taken into `flat`'s weights."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], flat: FlatGradients) -> None:
        flat.enable_weights()
        self.optimizer, self.params, self.flat = optimizer, params, flat
        self._index = {id(p): i for i, p in enumerate(params)}

    def weigh(self, grad_scale: float = 1.0) -> None:
        """From the optimizer's state and the global gradient now in `flat` (times `grad_scale`, e.g. a
        GradScaler's scale): ``v = beta2 v + (1 - beta2) g^2`` (the maximum with the kept one under
        amsgrad), bias-corrected for the coming step, as the optimizer will compute it."""
        self.flat.square_into_weights(1.0 / grad_scale**2)  # g^2, one operation per buffer
        # looked up each time: loading a state dict replaces the optimizer's groups and state
        for group in self.optimizer.param_groups:
            beta2, eps = group["betas"][1], group["eps"]
            lines, fresh, moments, peaks, corrections = [], [], [], [], []
            for p in group["params"]:
                index = self._index.get(id(p))
                if index is None or not p.numel():
                    continue
                line = self.flat.weight_line(index)
                state = self.optimizer.state.get(p)
                moment = state.get("exp_avg_sq") if state else None
                if moment is None:
                    if state:
                        raise RuntimeError(f"noise_preconditioner='adam': the state of {type(self.optimizer).__name__} "
                                           f"holds no 'exp_avg_sq' (keys {sorted(state)}); pass "
                                           "noise_preconditioner='none'")
                    fresh.append(line)  # the first step: v = (1 - beta2) g^2, v_hat = g^2
                    continue
                lines.append(line)
                moments.append(moment.reshape(-1))
                if group.get("amsgrad"):
                    peaks.append(state["max_exp_avg_sq"].reshape(-1))
                corrections.append(1.0 / (1.0 - beta2 ** (float(state["step"]) + 1)))
            if lines:
                torch._foreach_mul_(lines, 1.0 - beta2)
                torch._foreach_add_(lines, moments, alpha=beta2)
                if peaks:
                    torch._foreach_maximum_(lines, peaks)
                torch._foreach_mul_(lines, corrections)
            lines += fresh
            if lines:
                torch._foreach_sqrt_(lines)
                torch._foreach_add_(lines, eps)
                torch._foreach_reciprocal_(lines)
