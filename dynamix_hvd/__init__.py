"""dynamix_hvd: adaptive per-rank batch sizes for Horovod + PyTorch.

Only re-exports; each concern lives in its own module. Importing the package does not import Horovod
or MPI: the modules that need them (`optimizer`) are loaded on first use.
"""
from __future__ import annotations

from typing import Any

from . import checkpoint
from .checkpoint import Checkpointer
from .controller import ControllerConfig, DynamixController
from .loader import AdaptiveLoader
from .lr_scaling import lr_factor
from .metrics import StepRecord, StepTracker
from .ppo import PPOConfig
from .plan import PlannedStep, epoch_permutation, plan_steps, split_proportional

__version__ = "0.1.0"

__all__ = ["AdaptiveLoader", "Checkpointer", "checkpoint", "ControllerConfig", "DynamixController", "PPOConfig", "PlannedStep", "StepRecord", "StepTracker", "WeightedDistributedOptimizer",
           "epoch_permutation", "lr_factor", "plan_steps", "split_proportional"]


def __getattr__(name: str) -> Any:
    if name == "WeightedDistributedOptimizer":  # needs horovod.torch: import on first use
        from .optimizer import WeightedDistributedOptimizer

        return WeightedDistributedOptimizer
    raise AttributeError(f"module 'dynamix_hvd' has no attribute {name!r}")
