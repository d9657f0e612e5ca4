"""Dynamic Batch Adaptation (arXiv 2208.00815): per-step selection of the samples whose per-sample
gradients best improve a metric (`selection`, one process), and its exact data-parallel form over
Horovod (`distributed`). `selection` is pure PyTorch; only `distributed` talks to other ranks (through `comm`).
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
