"""dynamix_hvd: adaptive per-rank batch sizes for PyTorch on Horovod or torch.distributed.

Only re-exports. The package is organised by plane, each a subpackage whose docstring says what it
owns and what it may import:

- `data`: epoch plan, loader, per-step metrics, resource sampling, generated data;
- `optim`: the weighted distributed optimizer and LR rules (the only code that touches gradients);
- `stats`: fused squared norms, gradient noise scale, efficiency;
- `control`: state, reward, actions, policies and rules, the PPO learner, policy files, the live controller;
- `comm`: every control-plane collective (the only module that imports mpi4py);
- `engine`: Horovod and torch.distributed, behind the small interface the optimizer and comm use;
- `logs`: the one logging path (rank-prefixed `logging` under "dynamix_hvd"; imports nothing of ours);
- `dba`: Dynamic Batch Adaptation; `resilience`: checkpoints and elastic; `runs`: run logs, reports
  and the progress display; `tools`: the CLI, launch and build checks; `examples`: a plain Horovod script.

The simulator, pretraining, calibration and benchmarks (the source tree's `bench/`) build on the
package; the package never imports them.

Importing the package imports neither Horovod nor MPI nor torch.distributed's engine: each is loaded
where a job uses it (`engine` holds both engines, Horovod and torch.distributed).
"""
from __future__ import annotations

from typing import Any

from .control.cadence import CadenceConfig
from .control.config import AdvancedConfig, PPOOverrides
from .control.costmodel import CostConfig
from .control.growth import GrowthConfig
from .control.splitcheck import SplitConfig
from .control.controller import ControllerConfig, DynamixController
from .control.proposal import ProposalConfig
from .control.reward import RewardConfig
from .control.rules import (AdaBatchConfig, GoodputConfig, IncreaseBatchConfig, LinearRampConfig, NoiseScaleConfig,
                            SpeedSplitConfig)
from .data.loader import AdaptiveLoader
from .data.metrics import StepRecord, StepTracker
from .data.plan import PlannedStep, epoch_permutation, plan_steps, split_proportional
from .comm import torch_env_from_mpi
from .logs import configure_logging
from .optim.lr_scaling import lr_factor
from .optim.progress import ProgressScheduler
from .resilience import checkpoint
from .resilience.checkpoint import Checkpointer
from .control.ppo import PPOConfig
from .stats.noise_scale import StatsConfig

__version__ = "0.2.0"

__all__ = ["AdaBatchConfig", "AdaptiveLoader", "AdvancedConfig", "CadenceConfig", "Checkpointer", "checkpoint",
           "ControllerConfig", "CostConfig", "DynamixController", "GoodputConfig", "GrowthConfig", "IncreaseBatchConfig",
           "LinearRampConfig", "NoiseScaleConfig", "PPOConfig", "PPOOverrides", "ProposalConfig", "RewardConfig",
           "SpeedSplitConfig", "SplitConfig", "StatsConfig",
           "PlannedStep", "ProgressScheduler", "StepRecord", "StepTracker", "WeightedDistributedOptimizer", "configure_logging",
           "epoch_permutation", "lr_factor", "plan_steps", "split_proportional", "torch_env_from_mpi"]


def __getattr__(name: str) -> Any:
    if name == "WeightedDistributedOptimizer":  # needs horovod.torch: import on first use
        from .optim.weighted import WeightedDistributedOptimizer

        return WeightedDistributedOptimizer
    raise AttributeError(f"module 'dynamix_hvd' has no attribute {name!r}")
