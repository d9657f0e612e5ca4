"""Learning-rate coupling to the global batch size. Pure maths: no MPI, no Horovod.

When the global batch B moves away from the batch B0 the learning rate was tuned for:
- ``none``:     factor 1.
- ``linear``:   B / B0 (Goyal et al. 2017): right for SGD while B is below the noise scale.
- ``sqrt``:     sqrt(B / B0): the usual choice for Adam-type optimizers.
- ``adascale``: the AdaScale gain r = (tr(Sigma)/B0 + |G|^2) / (tr(Sigma)/B + |G|^2), which lies in
  [1, B/B0]: linear scaling while gradient noise dominates, none once the gradient signal does. The
  caller supplies the gain (from the gradient statistics).
"""
from __future__ import annotations

import math
from typing import Literal

LRRule = Literal["none", "linear", "sqrt", "adascale"]
LR_RULES: tuple[str, ...] = ("none", "linear", "sqrt", "adascale")


def lr_factor(rule: str, global_batch: int, base_batch: int, gain: float | None = None) -> float:
    """Multiplier for the base learning rate at global batch `global_batch`."""
    if rule not in LR_RULES:
        raise ValueError(f"lr rule {rule!r} is not one of {', '.join(LR_RULES)}")
    if global_batch < 1 or base_batch < 1:
        raise ValueError(f"batch sizes must be >= 1 (global_batch={global_batch}, base_batch={base_batch})")
    if rule == "none":
        return 1.0
    if rule == "linear":
        return global_batch / base_batch
    if rule == "sqrt":
        return math.sqrt(global_batch / base_batch)
    if gain is None or not math.isfinite(gain) or gain <= 0:
        # No statistics yet (first steps, or a single rank): fall back to no scaling rather than guess.
        return 1.0
    return float(gain)
