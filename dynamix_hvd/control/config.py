"""The controller's configuration, and the policy and decision core it describes. Pure: no MPI, no Horovod.

:class:`ControllerConfig` holds the operational settings at top level; the research settings sit in
typed nested configs: the chosen policy's (``policy_config``: a :class:`ProposalConfig` for "ppo" and
"model", a rule's own config for a classic rule), the PPO learner's (``ppo``, fields over the policy
file's), the reward's, the gradient statistics' and the :class:`AdvancedConfig` group (cadence
tuning, the action set, sampling, debugging). Every value is checked at construction; an error names
the field and the value.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from .actions import DEFAULT_MULTIPLIERS, ActionSpace
from .core import DecisionCore
from .policy import BatchSizePolicy, StaticPolicy
from .policy_store import DEFAULT_POLICY, load_policy
from .proposal import ModelPolicy, ProposalConfig
from .refine import PPOPolicy, make_learner
from .reward import RewardConfig
from .rules import (BASELINES, RULE_CONFIGS, AdaBatchConfig, GoodputConfig, IncreaseBatchConfig, LinearRampConfig,
                    NoiseScaleConfig, SpeedSplitConfig, make_baseline)
from .ppo import PPOConfig
from ..stats.noise_scale import StatsConfig
from .. import validate

POLICY_NAMES = ("ppo", "static", "model", *sorted(BASELINES))
POLICY_CONFIGS: dict[str, type | None] = {"ppo": ProposalConfig, "static": None, "model": ProposalConfig,
                                          **RULE_CONFIGS}
"""The type of ``ControllerConfig.policy_config`` each policy takes (None: it takes none)."""
PolicySettings = Union[ProposalConfig, LinearRampConfig, AdaBatchConfig, IncreaseBatchConfig, NoiseScaleConfig,
                       GoodputConfig, SpeedSplitConfig]
FRESH_PPO = PPOConfig(gamma=0.9, rollout_length=16)
"""PPO settings of a fresh policy (``policy_file=None``) before ``ControllerConfig.ppo``: PPOConfig's
defaults except gamma 0.9 (rewards are O(1) log-ratios per decision, and a shorter horizon keeps
returns O(10) so the clipped value loss can follow them) and rollouts of 16 decisions."""


@dataclass
class AdvancedConfig:
    """Settings few jobs change: the automatic cadence's tuning, the PPO action set, resource sampling
    and what rank 0 keeps for debugging."""

    target_decisions: int = 32
    """With ``decide_every_steps=None``: the decisions a job of `total_epochs` epochs aims for."""
    min_decision_steps: int = 8
    """With ``decide_every_steps=None``: fewest steps between two decisions inside an epoch (the cost
    fits and the noise scale need a few steps per interval), the length of the ramp's first two
    intervals and of a recheck's (optimizer steps there)."""
    max_decision_interval_s: float = 20.0
    """With ``decide_every_steps=None``: the longest an interval inside an epoch may last, in seconds
    of training at the ranks' median step time, so that a long job (32 decisions over days, or epochs
    of many minutes) still follows a rank whose speed changes within about two intervals; the decision
    budget's spacing and `min_decision_steps` still come first. 0: no ceiling (target_decisions alone
    spreads them)."""
    multipliers: tuple[float, ...] = DEFAULT_MULTIPLIERS
    """The discrete PPO actions: corrections of a rank's proposed share and of the proposed global
    batch (must include 1.0; a policy file is refused unless it was trained with the same set)."""
    resource_period_s: float = 1.0
    """How often a background thread samples CPU, memory and network counters (0: at each decision).
    Reading them costs milliseconds in some sandboxes, which would otherwise delay every decision."""
    keep_inputs: int = 0
    """Rank 0 keeps the typed per-rank inputs of the last this-many decisions in
    `DynamixController.inputs`, e.g. to replay them through a fresh `DecisionCore`; 0 keeps none."""

    def __post_init__(self) -> None:
        validate.integer("AdvancedConfig.target_decisions", self.target_decisions, 1)
        validate.integer("AdvancedConfig.min_decision_steps", self.min_decision_steps, 1)
        validate.integer("AdvancedConfig.keep_inputs", self.keep_inputs, 0)
        validate.number("AdvancedConfig.resource_period_s", self.resource_period_s, 0,
                        what="a finite number of seconds >= 0")
        validate.number("AdvancedConfig.max_decision_interval_s", self.max_decision_interval_s, 0,
                        what="a finite number of seconds >= 0 (0: no ceiling)")
        if isinstance(self.multipliers, (str, bytes)) or not isinstance(self.multipliers, (tuple, list)) \
                or not all(validate.is_number(m) for m in self.multipliers):
            raise ValueError(f"AdvancedConfig.multipliers={self.multipliers!r}; give a tuple of finite numbers, "
                             "e.g. (0.5, 1.0, 2.0)")
        self.multipliers = tuple(self.multipliers)
        try:
            ActionSpace(self.multipliers)  # validates the action set
        except ValueError as exc:
            raise ValueError(f"AdvancedConfig.multipliers={self.multipliers!r}: {exc}") from None


@dataclass
class ControllerConfig:
    """What the controller does. The operational settings are at top level; research settings are in
    the typed nested configs (``policy_config``, ``ppo``, ``reward``, ``stats``, ``advanced``).

    PPO settings (policy "ppo"), highest first: the fields named in ``ppo`` > the policy file's stored
    settings (``policy_file``; for a fresh policy, ``policy_file=None``: :data:`FRESH_PPO`) >
    :class:`~dynamix_hvd.control.ppo.PPOConfig`'s defaults. A field not named in ``ppo`` is never overridden,
    whatever its value; a named field that shapes the stored network (``hidden_sizes``) and differs
    from it is refused by name."""

    policy: str = "model"
    """Decision maker: "model" (the default: the cost-model proposal of `dynamix_hvd.control.proposal`,
    holding decisions that would flip back), "ppo" (DYNAMIX: a shared PPO actor refining that proposal,
    see `dynamix_hvd.control.refine`; deployed, the shipped policy decides as "model" does on the
    simulated clusters of tests/test_refine.py; policies/default.md compares them), "static", or a
    classic rule of `dynamix_hvd.control.rules` (linear-ramp, adabatch, increase-batch, noise-scale,
    goodput, speed-split)."""
    policy_config: PolicySettings | None = None
    """The chosen policy's settings, typed per policy (:data:`POLICY_CONFIGS`): a ProposalConfig for
    "ppo" and "model", LinearRampConfig for "linear-ramp", AdaBatchConfig, IncreaseBatchConfig,
    NoiseScaleConfig, GoodputConfig, SpeedSplitConfig; "static" takes none. None: the policy's
    defaults. A config of another policy's type is an error."""
    policy_file: str | None = DEFAULT_POLICY
    """Policy "ppo": the weights to start from, a name in policies/ or a path; None starts from a fresh
    policy. The shipped policy (pretrained in the simulator, see policies/default.md) is used unless told
    otherwise. Other policies ignore it."""
    learn: bool = False
    """Policy "ppo" only: keep training the PPO policy online from this job's transitions (sampled
    actions, PPO updates).
    False deploys the loaded policy's mode (the proposal where the actor is neutral; see
    policies/default.md for how it compares in the simulator); a fresh policy should learn (True)."""
    total_epochs: int | None = None
    """Training budget in epochs, counted from the loader's epoch 0 (``set_epoch``): spreads the
    automatic cadence's decisions over the job, feeds the progress feature, lets a batch growth
    start only where its check can end before the budget does, and bounds how far B grows (the
    model policy's ``budget_loss``: a batch held from a decision to the end may cost the budget at
    most 5% of its progress) (None: 4 decisions per epoch, progress stays 0, growth unbounded by
    time and budget)."""
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
    decide_every_steps: int | None = None
    """When to decide besides every epoch end. None (default): also inside epochs every
    ceil(steps per epoch / ceil(target_decisions / total_epochs)) steps (4 per epoch when total_epochs
    is not given), at least `min_decision_steps` apart and not in an epoch's last half-interval, so
    that a short job still gets dozens of decisions; the job's first intervals ramp up to that
    (min_decision_steps twice, then twice that, ...), so the first split comes after a few steps (both in
    ``advanced``); a decision whose interval showed a first sign of a large speed gap asks for the next one
    min_decision_steps later (a recheck, ahead of the decision budget's spacing). k > 0: every k steps inside epochs (an epoch end under k/2 steps after the last
    decision waits, so no decision rests on one or two noisy steps). 0: at epoch ends only."""
    decision_budget: float = 0.01
    """With decide_every_steps=None: the share of training time decisions may take once the first few
    (which find the split) are made. Every rank waits while rank 0 decides, so on short steps a
    decision costs several steps: rank 0 measures each decision and the step time and spaces the next
    at least decision time / (budget x step time) steps later, epoch ends included; only a recheck
    (the interval after a first sign of a large speed gap) comes sooner. 0: no limit."""
    timeout_s: float = 120.0
    """Deadline of every control-plane collective; under MPI also how long a rank may wait in the
    gradient allreduce, or go without finishing a step, before it probes the others for a stopped one."""
    ppo: dict[str, Any] = field(default_factory=dict)
    """PPO settings to override, {PPOConfig field: value}, e.g. {"learning_rate": 1e-4, "seed": 3}; only
    the fields named here override the policy file's (see the class docstring for the precedence).
    Checked at construction: an unknown field or a bad value is an error naming it."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward's weights (policy "ppo"; see `dynamix_hvd.control.reward`)."""
    stats: StatsConfig = field(default_factory=StatsConfig)
    """The gradient statistics' smoothing and windows (every policy)."""
    advanced: AdvancedConfig = field(default_factory=AdvancedConfig)
    """Cadence tuning, the PPO action set, resource sampling, kept inputs."""

    def __post_init__(self) -> None:
        def integer(name: str, low: int) -> int:
            return validate.integer(f"ControllerConfig.{name}", getattr(self, name), low)

        if self.policy not in POLICY_NAMES:
            raise ValueError(f"ControllerConfig.policy={self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        kind = POLICY_CONFIGS[self.policy]
        if self.policy_config is not None and (kind is None or type(self.policy_config) is not kind):
            takes = f"a {kind.__name__} or None (its defaults)" if kind else "none (None)"
            raise ValueError(f"ControllerConfig.policy_config={self.policy_config!r} does not fit "
                             f"policy={self.policy!r}, which takes {takes}")
        if self.policy_file is not None and not isinstance(self.policy_file, (str, os.PathLike)):
            raise ValueError(f"ControllerConfig.policy_file={self.policy_file!r}; give a policy name, a path or None")
        validate.boolean("ControllerConfig.learn", self.learn)
        if self.total_epochs is not None:
            integer("total_epochs", 1)
        if integer("min_batch", 1) > integer("max_batch", 1):
            raise ValueError(f"impossible batch bounds: min_batch={self.min_batch} > max_batch={self.max_batch}")
        integer("batchnorm_min_batch", 1)
        integer("max_passes", 1)
        if self.decide_every_steps is not None:
            integer("decide_every_steps", 0)
        validate.number("ControllerConfig.decision_budget", self.decision_budget, 0, below=1,
                        what="a share of training time in [0, 1) (0: no limit)")
        validate.number("ControllerConfig.timeout_s", self.timeout_s, above=0, what="a positive number of seconds")
        self.ppo = checked_ppo(self.ppo)
        if self.policy != "ppo" and (self.learn or self.ppo):
            given = "learn=True" if self.learn else f"ppo={self.ppo!r}"
            raise ValueError(f"ControllerConfig.{given} applies to policy 'ppo' only, and policy={self.policy!r}; "
                             "set policy='ppo' to use the learned policy")
        for name, kind in (("reward", RewardConfig), ("stats", StatsConfig), ("advanced", AdvancedConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"ControllerConfig.{name}={getattr(self, name)!r}; it must be a {kind.__name__}")
        for name, value in vars(self.reward).items():  # RewardConfig takes bools as 0/1: not here
            if isinstance(value, bool):
                raise ValueError(f"ControllerConfig.reward.{name}={value!r}; a reward weight is a number, not a bool")


PPO_FIELDS = tuple(f.name for f in dataclasses.fields(PPOConfig))


def checked_ppo(ppo: Any) -> dict[str, Any]:
    """``ControllerConfig.ppo`` checked against PPOConfig's fields and values, as a new dict with the
    values PPOConfig normalises (a list of hidden sizes becomes a tuple)."""
    if not isinstance(ppo, Mapping):
        raise ValueError(f"ControllerConfig.ppo={ppo!r}; give a dict of PPOConfig fields, e.g. "
                         "{'learning_rate': 1e-4}")
    unknown = [k for k in ppo if k not in PPO_FIELDS]
    if unknown:
        raise ValueError(f"ControllerConfig.ppo has unknown field(s) {', '.join(map(repr, unknown))}; "
                         f"PPOConfig's fields are {', '.join(PPO_FIELDS)}")
    try:
        full = dataclasses.replace(FRESH_PPO, **ppo)
    except ValueError as exc:
        raise ValueError(f"ControllerConfig.ppo: {exc}") from None
    return {k: getattr(full, k) for k in ppo}


def policy_config_from(policy: str, fields: Mapping[str, Any]) -> PolicySettings | None:
    """The typed ``policy_config`` of `policy` from plain fields (e.g. a command line's JSON); no
    fields: None (the policy's defaults)."""
    if policy not in POLICY_CONFIGS:
        raise ValueError(f"policy={policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    if not isinstance(fields, Mapping):
        raise ValueError(f"the settings of policy {policy!r} must be a JSON object of fields, not {fields!r}")
    kind = POLICY_CONFIGS[policy]
    if not fields:
        return None
    if kind is None:
        raise ValueError(f"policy {policy!r} takes no settings (got {dict(fields)!r})")
    names = [f.name for f in dataclasses.fields(kind)]
    unknown = [k for k in fields if k not in names]
    if unknown:
        raise ValueError(f"{kind.__name__} (policy {policy!r}) has no field(s) {', '.join(map(repr, unknown))}; "
                         f"its fields are {', '.join(names)}")
    return kind(**fields)


def make_policy(cfg: ControllerConfig) -> BatchSizePolicy:
    """The policy `cfg` names (PPO weights are loaded from the policy store; PPO settings by the
    precedence of :class:`ControllerConfig`)."""
    if cfg.policy == "static":
        return StaticPolicy()
    if cfg.policy == "model":
        return ModelPolicy(cfg.policy_config, hold_flips=True)
    if cfg.policy in BASELINES:
        return make_baseline(cfg.policy, cfg.policy_config)
    actions = ActionSpace(cfg.advanced.multipliers)
    if cfg.policy_file:
        # A missing or unreadable policy (the default included) is an error saying how to fix it.
        learner = load_policy(cfg.policy_file, actions, ppo=cfg.ppo)[0]
    else:
        learner = make_learner(actions, dataclasses.replace(FRESH_PPO, **cfg.ppo))
    return PPOPolicy(learner, actions, learn=cfg.learn, proposal=cfg.policy_config)


def make_core(cfg: ControllerConfig, world_size: int, initial_batch: int,
              layer_names: Sequence[str] | None = None, base_batch: int | None = None) -> DecisionCore:
    """The decision core of a job configured by `cfg` (what the live controller builds on every rank);
    `initial_batch`: the job's initial batch; `base_batch`: the optimizer's ``base_batch_size``
    (default `initial_batch`)."""
    return DecisionCore(world_size, initial_batch, make_policy(cfg), reward=cfg.reward, stats=cfg.stats,
                        min_batch=cfg.min_batch, max_batch=cfg.max_batch, total_epochs=cfg.total_epochs,
                        layer_names=layer_names, base_batch=base_batch, max_passes=cfg.max_passes)
