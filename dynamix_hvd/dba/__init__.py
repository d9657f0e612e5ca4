"""Dynamic Batch Adaptation (arXiv 2208.00815): per-step selection of the samples whose per-sample
gradients best improve a metric (`selection`, one process), and its exact data-parallel form over
Horovod (`distributed`). Per-sample Gram matrices come from layer hooks (`ghost`) or torch.func; the
unbiased importance draws are in `importance`, the compiled greedy search in `fastgreedy` (numba).
Only `distributed` talks to other ranks (through `comm`); gradients are written through `dynamix_hvd.optim.grads` (the
optimizer plane is the only writer of ``p.grad``).
"""
import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # `dynamix_hvd.dba` was one module before 0.2; its names resolve from `selection` for one release.
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(importlib.import_module(f"{__name__}.selection"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
