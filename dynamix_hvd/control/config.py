"""The controller's configuration, and the policy and decision core it describes. Pure: no MPI, no Horovod.

:class:`ControllerConfig` holds the operational settings at top level; the research settings sit in
typed nested configs: the chosen policy's (``policy_config``: a :class:`ProposalConfig` for "ppo" and
"model", a rule's own config for a classic rule), the PPO learner's (``ppo``: a :class:`PPOOverrides`,
fields over the policy file's) and the :class:`AdvancedConfig` group (the cadence's tuning, the
reward, the gradient statistics, the cost model, the PPO action set, sampling, debugging). Every
config is frozen (change one with :func:`dataclasses.replace`) and checked at construction; an
error names the field and the value. :meth:`ControllerConfig.to_dict` and
:meth:`ControllerConfig.from_dict` turn a config into plain JSON values and back.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

from .actions import DEFAULT_MULTIPLIERS, ActionSpace
from .cadence import CadenceConfig
from .core import DecisionCore
from .costmodel import CostConfig
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


@dataclass(frozen=True)
class PPOOverrides:
    """The PPO settings a job sets over the policy file's (policy "ppo"): each field is
    :class:`~dynamix_hvd.control.ppo.PPOConfig`'s field of the same name, and None (every default)
    leaves the policy file's value (a fresh policy's: :data:`FRESH_PPO`). A field set overrides it,
    whatever its value; a field that shapes the stored network (``hidden_sizes``) and differs from
    it is refused by name. ``ControllerConfig(ppo={"seed": 3})`` is read as ``PPOOverrides(seed=3)``."""

    learning_rate: Optional[float] = None
    """PPOConfig.learning_rate: Adam's step size."""
    adam_eps: Optional[float] = None
    """PPOConfig.adam_eps: Adam's epsilon."""
    gamma: Optional[float] = None
    """PPOConfig.gamma: the discount of per-decision rewards."""
    gae_lambda: Optional[float] = None
    """PPOConfig.gae_lambda: GAE's lambda."""
    rollout_length: Optional[int] = None
    """PPOConfig.rollout_length: decisions per PPO update."""
    update_epochs: Optional[int] = None
    """PPOConfig.update_epochs: passes over the rollout per update."""
    num_minibatches: Optional[int] = None
    """PPOConfig.num_minibatches: minibatches per pass."""
    clip_coef: Optional[float] = None
    """PPOConfig.clip_coef: the surrogate objective's ratio clip."""
    clip_vloss: Optional[bool] = None
    """PPOConfig.clip_vloss: clip the value update around the old values."""
    norm_adv: Optional[bool] = None
    """PPOConfig.norm_adv: normalise advantages within each minibatch."""
    ent_coef: Optional[float] = None
    """PPOConfig.ent_coef: the entropy bonus's weight."""
    vf_coef: Optional[float] = None
    """PPOConfig.vf_coef: the value loss's weight."""
    max_grad_norm: Optional[float] = None
    """PPOConfig.max_grad_norm: the gradients' global norm clip."""
    target_kl: Optional[float] = None
    """PPOConfig.target_kl: stop an update's epochs once approx_kl exceeds it; 0 sets PPOConfig's None
    (never stop early)."""
    hidden_sizes: Optional[Tuple[int, ...]] = None
    """PPOConfig.hidden_sizes: the hidden layers' widths (must match a policy file's)."""
    seed: Optional[int] = None
    """PPOConfig.seed: the learner's random seed."""

    def __post_init__(self) -> None:
        if isinstance(self.hidden_sizes, list):
            object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
        try:
            full = dataclasses.replace(FRESH_PPO, **self.named())  # checks every value set
        except ValueError as exc:
            raise ValueError(f"ControllerConfig.ppo: {exc}") from None
        if self.hidden_sizes is not None:
            object.__setattr__(self, "hidden_sizes", full.hidden_sizes)

    def named(self) -> dict[str, Any]:
        """The PPOConfig fields set here, {field: PPOConfig's value} (target_kl 0: None)."""
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        if named.get("target_kl") == 0:
            named["target_kl"] = None
        return named

    @classmethod
    def of(cls, ppo: Any) -> "PPOOverrides":
        """`ppo` as PPOOverrides: itself, or a mapping of PPOConfig fields (checked by name)."""
        if isinstance(ppo, cls):
            return ppo
        if not isinstance(ppo, Mapping):
            raise ValueError(f"ControllerConfig.ppo={ppo!r}; give a PPOOverrides or a dict of PPOConfig fields, "
                             "e.g. PPOOverrides(learning_rate=1e-4)")
        unknown = [k for k in ppo if k not in PPO_FIELDS]
        if unknown:
            raise ValueError(f"ControllerConfig.ppo has unknown field(s) {', '.join(map(repr, unknown))}; "
                             f"PPOConfig's fields are {', '.join(PPO_FIELDS)}")
        named = dict(ppo)
        try:  # a named field is set, None included: checked as PPOConfig's value
            dataclasses.replace(FRESH_PPO, **named)
        except ValueError as exc:
            raise ValueError(f"ControllerConfig.ppo: {exc}") from None
        if "target_kl" in named and named["target_kl"] is None:
            named["target_kl"] = 0  # PPOConfig's None (never), set on purpose
        return cls(**named)


PPO_FIELDS = tuple(f.name for f in dataclasses.fields(PPOConfig))


@dataclass(frozen=True)
class AdvancedConfig:
    """Settings few jobs change: the automatic cadence's tuning, the reward, the gradient statistics,
    the cost model, the BatchNorm floor, the PPO action set, resource sampling and what rank 0 keeps
    for debugging."""

    batchnorm_min_batch: int = 16
    """Smallest local batch a rank may get when the model handed to the controller (``model=``) has
    BatchNorm layers that normalise with each rank's own batch (SyncBatchNorm excepted): a small rank
    would normalise with the statistics of a few samples. Never above the smallest initial size."""
    cadence: CadenceConfig = field(default_factory=CadenceConfig)
    """The automatic cadence's tuning and the decision budget (``decide_every_steps=None``)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward's weights (policy "ppo"; see `dynamix_hvd.control.reward`)."""
    stats: StatsConfig = field(default_factory=StatsConfig)
    """The gradient statistics' smoothing and windows (every policy)."""
    costs: CostConfig = field(default_factory=CostConfig)
    """The per-rank cost lines' and the network fit's settings (every policy; the model-based ones
    decide with them)."""
    multipliers: Tuple[float, ...] = DEFAULT_MULTIPLIERS
    """The discrete PPO actions: corrections of a rank's proposed share and of the proposed global
    batch (must include 1.0; a policy file is refused unless it was trained with the same set)."""
    resource_period_s: float = 1.0
    """How often a background thread samples CPU, memory and network counters (0: at each decision).
    Reading them can cost milliseconds (containers, network file systems), which would otherwise
    delay every decision."""
    keep_inputs: int = 0
    """Rank 0 keeps the typed per-rank inputs of the last this-many decisions in
    `DynamixController.inputs`, e.g. to replay them through a fresh `DecisionCore`; 0 keeps none."""

    def __post_init__(self) -> None:
        validate.integer("AdvancedConfig.batchnorm_min_batch", self.batchnorm_min_batch, 1)
        validate.integer("AdvancedConfig.keep_inputs", self.keep_inputs, 0)
        validate.number("AdvancedConfig.resource_period_s", self.resource_period_s, 0,
                        what="a finite number of seconds >= 0")
        for name, kind in (("cadence", CadenceConfig), ("reward", RewardConfig), ("stats", StatsConfig),
                           ("costs", CostConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"AdvancedConfig.{name}={getattr(self, name)!r}; it must be a {kind.__name__}")
        if isinstance(self.multipliers, (str, bytes)) or not isinstance(self.multipliers, (tuple, list)) \
                or not all(validate.is_number(m) for m in self.multipliers):
            raise ValueError(f"AdvancedConfig.multipliers={self.multipliers!r}; give a tuple of finite numbers, "
                             "e.g. (0.5, 1.0, 2.0)")
        object.__setattr__(self, "multipliers", tuple(self.multipliers))
        try:
            ActionSpace(self.multipliers)  # validates the action set
        except ValueError as exc:
            raise ValueError(f"AdvancedConfig.multipliers={self.multipliers!r}: {exc}") from None


@dataclass(frozen=True)
class ControllerConfig:
    """What the controller does. The operational settings are at top level; research settings are in
    the typed nested configs (``policy_config``, ``ppo``, ``advanced``).

    PPO settings (policy "ppo"), highest first: the fields set in ``ppo`` > the policy file's stored
    settings (``policy_file``; for a fresh policy, ``policy_file=None``: :data:`FRESH_PPO`) >
    :class:`~dynamix_hvd.control.ppo.PPOConfig`'s defaults. A field not set in ``ppo`` is never
    overridden; a set field that shapes the stored network (``hidden_sizes``) and differs from it is
    refused by name."""

    policy: str = "model"
    """Decision maker: "model" (the default: the cost-model proposal of `dynamix_hvd.control.proposal`,
    holding decisions that would flip back), "ppo" (DYNAMIX: a shared PPO actor refining that proposal,
    see `dynamix_hvd.control.refine`; deployed, the shipped policy decides as "model" does on the
    simulated clusters of tests/test_refine.py; policies/default.md compares them), "static", or a
    classic rule of `dynamix_hvd.control.rules` (linear-ramp, adabatch, increase-batch, noise-scale,
    goodput, speed-split)."""
    policy_config: Optional[PolicySettings] = None
    """The chosen policy's settings, typed per policy (:data:`POLICY_CONFIGS`): a ProposalConfig for
    "ppo" and "model", LinearRampConfig for "linear-ramp", AdaBatchConfig, IncreaseBatchConfig,
    NoiseScaleConfig, GoodputConfig, SpeedSplitConfig; "static" takes none. None: the policy's
    defaults. A config of another policy's type is an error."""
    policy_file: Optional[str] = DEFAULT_POLICY
    """Policy "ppo": the weights to start from, a name in policies/ or a path; None starts from a fresh
    policy. The shipped policy (pretrained in the simulator, see policies/default.md) is used unless told
    otherwise. Other policies ignore it."""
    learn: bool = False
    """Policy "ppo" only: keep training the PPO policy online from this job's transitions (sampled
    actions, PPO updates).
    False deploys the loaded policy's mode (the proposal where the actor is neutral; see
    policies/default.md for how it compares in the simulator); a fresh policy should learn (True)."""
    total_epochs: Optional[int] = None
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
    max_passes: int = 1
    """Micro-batches the controller may accumulate into one optimizer step, so that the global batch
    grows past what memory allows in one pass (the model-based policies use it when the predicted
    goodput says so; the schedules when their target exceeds the memory bounds). Needs a training
    loop that steps only when ``optimizer.should_step()``. 1: the controller never accumulates (a
    ``backward_passes_per_step`` given to the optimizer is then kept as it is)."""
    decide_every_steps: Optional[int] = None
    """When to decide besides every epoch end. None (default): also inside epochs every
    ceil(steps per epoch / ceil(target_decisions / total_epochs)) steps (4 per epoch when total_epochs
    is not given), at least `min_decision_steps` apart and not in an epoch's last half-interval, so
    that a short job still gets dozens of decisions; the job's first intervals ramp up to that
    (min_decision_steps twice, then twice that, ...), so the first split comes after a few steps (all
    in ``advanced.cadence``, with the decision budget that spaces later decisions); a decision whose
    interval showed a first sign of a large speed gap asks for the next one min_decision_steps later
    (a recheck, ahead of the decision budget's spacing). k > 0: every k steps inside epochs (an epoch
    end under k/2 steps after the last decision waits, so no decision rests on one or two noisy
    steps). 0: at epoch ends only."""
    timeout_s: float = 120.0
    """Deadline of every control-plane collective; under MPI also how long a rank may wait in the
    gradient allreduce, or go without finishing a step, before it probes the others for a stopped one."""
    ppo: PPOOverrides = field(default_factory=PPOOverrides)
    """Policy "ppo": the PPO settings set over the policy file's (highest first: the fields set here,
    the policy file's stored settings, PPOConfig's defaults); a dict of PPOConfig fields is read as a
    PPOOverrides. Checked at construction: an unknown field or a bad value is an error naming it."""
    advanced: AdvancedConfig = field(default_factory=AdvancedConfig)
    """The cadence's tuning and decision budget, the reward, the gradient statistics, the cost model,
    the BatchNorm floor, the PPO action set, resource sampling, kept inputs."""

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
        integer("max_passes", 1)
        if self.decide_every_steps is not None:
            integer("decide_every_steps", 0)
        validate.number("ControllerConfig.timeout_s", self.timeout_s, above=0, what="a positive number of seconds")
        object.__setattr__(self, "ppo", PPOOverrides.of(self.ppo))
        if self.policy != "ppo" and (self.learn or self.ppo.named()):
            given = "learn=True" if self.learn else f"ppo={self.ppo.named()!r}"
            raise ValueError(f"ControllerConfig.{given} applies to policy 'ppo' only, and policy={self.policy!r}; "
                             "set policy='ppo' to use the learned policy")
        if not isinstance(self.advanced, AdvancedConfig):
            raise ValueError(f"ControllerConfig.advanced={self.advanced!r}; it must be an AdvancedConfig")

    def resolved(self) -> "ControllerConfig":
        """This config as it runs: ``policy_config`` None (the policy's defaults) replaced by the
        policy's default config, so that every setting is spelled out."""
        kind = POLICY_CONFIGS[self.policy]
        if self.policy_config is not None or kind is None:
            return self
        return dataclasses.replace(self, policy_config=kind())

    def to_dict(self) -> dict[str, Any]:
        """Every setting, nested configs included, as plain JSON values (tuples as lists, a path as a
        string); :meth:`from_dict` gives back an equal config."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ControllerConfig":
        """The config of :meth:`to_dict`'s plain values; a key left out takes its default, an unknown
        key (at any depth) is an error naming it."""
        if not isinstance(data, Mapping):
            raise ValueError(f"ControllerConfig.from_dict({data!r}); give a dict of ControllerConfig fields")
        policy = data.get("policy", cls.policy)
        kind = POLICY_CONFIGS.get(policy) if isinstance(policy, str) else None
        return _typed(cls, data, "ControllerConfig", {"policy_config": kind})


def changed_settings(plain: Mapping[str, Any]) -> dict[str, Any]:
    """The settings in `plain` (:meth:`ControllerConfig.to_dict`'s values, e.g. a run's recorded
    ``controller_config``) that differ from the defaults, by dotted path:
    ``{"total_epochs": 90, "advanced.cadence.decision_budget": 0}``. The policy's settings are compared
    with that policy's defaults; a key the defaults do not have (a record of another version) counts
    as changed."""
    policy = plain.get("policy", ControllerConfig.policy)
    try:
        defaults = ControllerConfig(policy=policy).resolved().to_dict()
    except ValueError:
        defaults = ControllerConfig().to_dict()
    changed: dict[str, Any] = {} if policy == ControllerConfig.policy else {"policy": policy}

    def walk(value: Any, default: Any, path: str) -> None:
        if isinstance(value, Mapping) and isinstance(default, Mapping):
            for key, v in value.items():
                walk(v, default.get(key, _MISSING), f"{path}.{key}" if path else str(key))
        elif value != default and not (path == "policy_config" and value is None):
            changed[path] = value

    walk(plain, defaults, "")
    return changed


def settings_line(plain: Mapping[str, Any]) -> str:
    """One line naming the settings of `plain` that differ from the defaults (:func:`changed_settings`)."""
    changed = changed_settings(plain)
    if not changed:
        return "settings: the defaults"
    return "settings: " + ", ".join(f"{path}={value!r}" for path, value in changed.items())


_MISSING = object()


def _plain(value: Any) -> Any:
    """A config's value as plain JSON values (dataclasses as dicts, tuples as lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _typed(cls: type, data: Mapping[str, Any], where: str, kinds: Mapping[str, type | None] | None = None) -> Any:
    """`cls` from the plain values of :func:`_plain` (`kinds`: the config type of a field whose type
    depends on another field); `where` names it in errors."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}={data!r}; give a dict of {cls.__name__} fields")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}; "
                         f"{cls.__name__}'s fields are {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        hint = hints[name]
        if kinds is not None and name in kinds:
            kind = kinds[name]
            if value is not None and kind is not None:
                value = _typed(kind, value, f"{where}.{name}")
        else:
            nested = _config_type(hint)
            if nested is not None and value is not None:
                value = _typed(nested, value, f"{where}.{name}")
            elif isinstance(value, list) and _is_tuple(hint):
                value = tuple(value)
        values[name] = value
    return cls(**values)


def _config_type(hint: Any) -> type | None:
    """The config dataclass a field's type names (alone or with None), else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is Union else [hint]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _is_tuple(hint: Any) -> bool:
    args = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    return any(a is tuple or typing.get_origin(a) is tuple for a in args)


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
    return _typed(kind, fields, f"{kind.__name__} (policy {policy!r})")


def make_policy(cfg: ControllerConfig) -> BatchSizePolicy:
    """The policy `cfg` names (PPO weights are loaded from the policy store; PPO settings by the
    precedence of :class:`ControllerConfig`)."""
    if cfg.policy == "static":
        return StaticPolicy()
    if cfg.policy == "model":
        return ModelPolicy(cfg.policy_config, cfg.advanced.costs, hold_flips=True)
    if cfg.policy in BASELINES:
        return make_baseline(cfg.policy, cfg.policy_config)
    actions = ActionSpace(cfg.advanced.multipliers)
    if cfg.policy_file:
        # A missing or unreadable policy (the default included) is an error saying how to fix it.
        learner = load_policy(cfg.policy_file, actions, ppo=cfg.ppo.named())[0]
    else:
        learner = make_learner(actions, dataclasses.replace(FRESH_PPO, **cfg.ppo.named()))
    return PPOPolicy(learner, actions, learn=cfg.learn, proposal=cfg.policy_config, costs=cfg.advanced.costs)


def make_core(cfg: ControllerConfig, world_size: int, initial_batch: int,
              layer_names: Sequence[str] | None = None, base_batch: int | None = None) -> DecisionCore:
    """The decision core of a job configured by `cfg` (what the live controller builds on every rank);
    `initial_batch`: the job's initial batch; `base_batch`: the optimizer's ``base_batch_size``
    (default `initial_batch`)."""
    advanced = cfg.advanced
    return DecisionCore(world_size, initial_batch, make_policy(cfg), reward=advanced.reward, stats=advanced.stats,
                        min_batch=cfg.min_batch, max_batch=cfg.max_batch, total_epochs=cfg.total_epochs,
                        layer_names=layer_names, base_batch=base_batch, max_passes=cfg.max_passes,
                        costs=advanced.costs)
