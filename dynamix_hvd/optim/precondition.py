"""The gradient noise scale of Adam-type optimizers: measured on the gradient as the optimizer scales it.

Adam moves each coordinate by its gradient divided by ``sqrt(v_hat) + eps``. The noise scale that
predicts how far the batch can grow is the one of that preconditioned gradient, ``tr(P S P) / |P G|^2``
with ``P = diag(1 / (sqrt(v_hat) + eps))``: coordinates whose second moment is small are scaled up, and
where they are mostly noise the critical batch is larger than the unpreconditioned estimate says (on
recurrent models with Adam, 4-10x larger). The squared norms the noise scale is built from are taken of
the gradient times ``P`` (`FlatGradients.enable_weights`); ``P`` is read from the optimizer's own second
moments after its step, every `REFRESH_STEPS` steps (``v`` moves on a time scale of ``1 / (1 - beta2)``
steps, 1000 with the usual beta2). Pure torch: no Horovod, no MPI.
"""
from __future__ import annotations

from typing import Any

import torch

from .flat import FlatGradients

MODES = ("auto", "adam", "none")
"""`WeightedDistributedOptimizer(noise_preconditioner=)`: "auto" (Adam's for Adam, AdamW, NAdam, RAdam
and their subclasses; none otherwise), "adam" (any optimizer whose parameter groups hold ``betas`` and
``eps`` and whose state holds ``exp_avg_sq``), "none" (the gradient as it is)."""

ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)

REFRESH_STEPS = 16
"""Optimizer steps between two reads of the second moments (and the first step's)."""


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
    """Keeps the weights of `flat` at Adam's ``1 / (sqrt(v_hat) + eps)`` per element.

    Until a parameter has a second moment (before the optimizer's first step, or a parameter that
    never had a gradient), its weights stay 1: the first step is measured unpreconditioned."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], flat: FlatGradients) -> None:
        flat.enable_weights()
        self.optimizer, self.params, self.flat = optimizer, params, flat
        self._steps = 0

    def after_step(self) -> None:
        """Called after every optimizer step: reads the second moments every `REFRESH_STEPS` steps."""
        if self._steps % REFRESH_STEPS == 0:
            self.refresh()
        self._steps += 1

    def refresh(self) -> None:
        """Read every parameter's second moment now (e.g. after a checkpoint was loaded)."""
        # looked up each time: loading a state dict replaces the optimizer's groups and state
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for index, p in enumerate(self.params):
            line = self.flat.weight_line(index)
            state, group = self.optimizer.state.get(p), group_of[id(p)]
            moment = state.get("max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq") if state else None
            if moment is None or "step" not in state:
                if moment is None and state and self._steps > 0 and "exp_avg_sq" not in state:
                    raise RuntimeError(f"noise_preconditioner='adam': the state of {type(self.optimizer).__name__} "
                                       f"holds no 'exp_avg_sq' (keys {sorted(state)}); pass "
                                       "noise_preconditioner='none'")
                line.fill_(1.0)
                continue
            correction = 1.0 - group["betas"][1] ** float(state["step"])
            torch.div(moment.reshape(-1), correction, out=line)
            line.sqrt_().add_(group["eps"]).reciprocal_()
