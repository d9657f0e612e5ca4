"""The controller's configuration, and the policy and decision core it describes. Pure: no MPI, no Horovod."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from .actions import DEFAULT_MULTIPLIERS, ActionSpace
from .core import DecisionCore
from .policy import BatchSizePolicy, StaticPolicy
from .policy_store import DEFAULT_POLICY, load_policy
from .proposal import ModelPolicy, ProposalConfig
from .refine import PPOPolicy
from .reward import RewardConfig
from .rules import BASELINES, make_baseline
from .ppo import PPOConfig
from ..stats.noise_scale import StatsConfig
from .. import validate

POLICY_NAMES = ("ppo", "static", "model", *sorted(BASELINES))


@dataclass
class ControllerConfig:
    policy: str = "ppo"
    """Decision maker: "ppo" (DYNAMIX: a shared PPO actor refining the model-based proposal, see
    `dynamix_hvd.control.refine`; policy_kwargs go to its ProposalConfig), "static", "model" (the cost-model proposal of
    `dynamix_hvd.control.proposal`; policy_kwargs go to its ProposalConfig), or a classic rule from
    `dynamix_hvd.control.rules` (linear-ramp, adabatch, increase-batch, noise-scale, goodput, speed-split)."""
    policy_kwargs: dict = field(default_factory=dict)
    """Parameters of a classic rule, e.g. {"end": 512, "ramp": 10} for linear-ramp."""
    policy_file: str | None = DEFAULT_POLICY
    """PPO weights to start from: a name in policies/ or a path; None starts from a fresh policy. The
    shipped default (pretrained in the simulator, see policies/default.md) is used unless told otherwise."""
    learn: bool = False
    """Keep training the PPO policy online from this job's transitions (sampled actions, PPO updates).
    False deploys the loaded policy's mode (the proposal where the actor is neutral; see
    policies/default.md for how it compares in the simulator); a fresh policy should learn (True)."""
    decide_every_steps: int | None = None
    """When to decide besides every epoch end. None (default): also inside epochs every
    ceil(steps per epoch / ceil(target_decisions / total_epochs)) steps (4 per epoch when total_epochs
    is not given), at least
    `min_decision_steps` apart and not in an epoch's last half-interval, so that a short job still gets
    dozens of decisions; the job's first intervals ramp up to that (min_decision_steps, twice that, ...),
    so the first split comes after a few steps. k > 0: every k steps inside epochs (an epoch end under k/2 steps after the last
    decision waits, so no decision rests on one or two noisy steps). 0: at epoch ends only."""
    target_decisions: int = 32
    """With decide_every_steps=None: the decisions a job of `total_epochs` epochs aims for."""
    min_decision_steps: int = 8
    """With decide_every_steps=None: fewest steps between two decisions inside an epoch (the cost fits
    and the noise scale need a few steps per interval)."""
    decision_budget: float = 0.01
    """With decide_every_steps=None: the share of training time decisions may take once the first few
    (which find the split) are made. Every rank waits while rank 0 decides, so on short steps a
    decision costs several steps: rank 0 measures each decision and the step time and spaces the next
    at least decision time / (budget x step time) steps later, epoch ends included. 0: no limit."""
    min_batch: int = 1
    """Smallest local batch any rank may get (in the loader's unit: tokens when it plans by token
    budgets)."""
    max_batch: int = 1024
    """Largest local batch any rank may get (lowered per rank by what memory allows). With a loader that
    plans by token budgets it counts tokens, and left at this default it becomes 1024 x the mean
    sample length."""
    batchnorm_min_batch: int = 16
    """Smallest local batch a rank may get when the model handed to the controller (``model=``) has
    BatchNorm layers that normalise with each rank's own batch (SyncBatchNorm excepted): a small rank
    would normalise with the statistics of a few samples. Never above the smallest initial size."""
    max_passes: int = 1
    """Micro-batches the controller may accumulate into one optimizer step, so that the global batch
    grows past what memory allows in one pass (the model-based policies use it when the predicted
    goodput says so; the schedules when their target exceeds the memory bounds). Needs a training
    loop that steps only when ``optimizer.should_step()``. 1: the controller never accumulates (a
    ``backward_passes_per_step`` given to the optimizer is then kept as it is)."""
    multipliers: tuple[float, ...] = DEFAULT_MULTIPLIERS
    """The discrete actions: corrections of a rank's proposed share and of the proposed global batch."""
    total_epochs: int | None = None
    """Training budget in epochs, for the progress feature (None: progress stays 0)."""
    timeout_s: float = 120.0
    """Deadline of every control-plane collective."""
    resource_period_s: float = 1.0
    """How often a background thread samples CPU, memory and network counters (0: at each decision).
    Reading them costs milliseconds in some sandboxes, which would otherwise delay every decision."""
    keep_inputs: int = 0
    """Rank 0 keeps the typed per-rank inputs of the last this-many decisions in
    `DynamixController.inputs`, e.g. to replay them through a fresh `DecisionCore`; 0 keeps none."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=lambda: PPOConfig(gamma=0.9, rollout_length=16))
    """PPO settings. gamma 0.9: rewards are O(1) log-ratios per decision, and a shorter horizon keeps
    returns O(10) so the clipped value loss can follow them."""
    stats: StatsConfig = field(default_factory=StatsConfig)

    def __post_init__(self) -> None:
        def integer(name: str, low: int) -> int:
            return validate.integer(f"ControllerConfig.{name}", getattr(self, name), low)

        if self.policy not in POLICY_NAMES:
            raise ValueError(f"ControllerConfig.policy={self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        if not isinstance(self.policy_kwargs, dict):
            raise ValueError(f"ControllerConfig.policy_kwargs={self.policy_kwargs!r}; it must be a dict")
        if self.policy_file is not None and not isinstance(self.policy_file, (str, os.PathLike)):
            raise ValueError(f"ControllerConfig.policy_file={self.policy_file!r}; give a policy name, a path or None")
        validate.boolean("ControllerConfig.learn", self.learn)
        if self.decide_every_steps is not None:
            integer("decide_every_steps", 0)
        integer("target_decisions", 1)
        integer("min_decision_steps", 1)
        validate.number("ControllerConfig.decision_budget", self.decision_budget, 0, below=1,
                        what="a share of training time in [0, 1) (0: no limit)")
        integer("keep_inputs", 0)
        integer("max_passes", 1)
        integer("batchnorm_min_batch", 1)
        if integer("min_batch", 1) > integer("max_batch", 1):
            raise ValueError(f"impossible batch bounds: min_batch={self.min_batch} > max_batch={self.max_batch}")
        if self.total_epochs is not None:
            integer("total_epochs", 1)
        validate.number("ControllerConfig.timeout_s", self.timeout_s, above=0, what="a positive number of seconds")
        validate.number("ControllerConfig.resource_period_s", self.resource_period_s, 0,
                        what="a finite number of seconds >= 0")
        if isinstance(self.multipliers, (str, bytes)) or not isinstance(self.multipliers, (tuple, list)) \
                or not all(validate.is_number(m) for m in self.multipliers):
            raise ValueError(f"ControllerConfig.multipliers={self.multipliers!r}; give a tuple of finite numbers, "
                             "e.g. (0.5, 1.0, 2.0)")
        try:
            ActionSpace(tuple(self.multipliers))  # validates the action set
        except ValueError as exc:
            raise ValueError(f"ControllerConfig.multipliers={self.multipliers!r}: {exc}") from None
        for name, kind in (("reward", RewardConfig), ("ppo", PPOConfig), ("stats", StatsConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"ControllerConfig.{name}={getattr(self, name)!r}; it must be a {kind.__name__}")
        for name, value in vars(self.reward).items():  # RewardConfig takes bools as 0/1: not here
            if isinstance(value, bool):
                raise ValueError(f"ControllerConfig.reward.{name}={value!r}; a reward weight is a number, not a bool")


def make_policy(cfg: ControllerConfig) -> BatchSizePolicy:
    """The policy `cfg` names (PPO weights are loaded from the policy store)."""
    if cfg.policy == "static":
        return StaticPolicy()
    if cfg.policy == "model":
        return ModelPolicy(**cfg.policy_kwargs)
    if cfg.policy in BASELINES:
        return make_baseline(cfg.policy, **cfg.policy_kwargs)
    actions = ActionSpace(tuple(cfg.multipliers))
    learner = None
    if cfg.policy_file:
        # A missing or unreadable policy (the default included) is an error saying how to fix it. The
        # fields of cfg.ppo that differ from both defaults were set by the user: they override the
        # stored config, or load_policy refuses them by name.
        defaults = (PPOConfig(), ControllerConfig().ppo)
        learner = load_policy(cfg.policy_file, actions, ppo=cfg.ppo, ppo_defaults=defaults)[0]
    return PPOPolicy(learner, actions, learn=cfg.learn, config=cfg.ppo,
                     proposal=ProposalConfig(**cfg.policy_kwargs))


def make_core(cfg: ControllerConfig, world_size: int, base_batch: int,
              layer_names: Sequence[str] | None = None, lr_base_batch: int | None = None) -> DecisionCore:
    """The decision core of a job configured by `cfg` (what the live controller builds on every rank);
    `lr_base_batch`: the optimizer's ``base_batch_size`` (default `base_batch`)."""
    return DecisionCore(world_size, base_batch, make_policy(cfg), reward=cfg.reward, stats=cfg.stats,
                        min_batch=cfg.min_batch, max_batch=cfg.max_batch, total_epochs=cfg.total_epochs,
                        layer_names=layer_names, lr_base_batch=lr_base_batch, max_passes=cfg.max_passes)
