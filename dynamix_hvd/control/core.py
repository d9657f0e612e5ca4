"""The decision core: what rank 0 does with the ranks' reports. Pure: no MPI, no Horovod, no comm.

One object owns everything a decision depends on besides the reports themselves: the gradient
statistics (fed step by step with every rank's squared norms), the per-rank batch bounds (memory),
the reward references (the first interval's goodput and throughput), the previous sizes and loss,
and the policy. The live controller (:mod:`dynamix_hvd.control.controller`), the cluster simulator
(:mod:`bench.lab.simulator`) and the transition rebuild for fine-tuning
(:func:`bench.lab.pretrain.transitions_from_history`) all go through it, so a policy sees the
same numbers in the simulator as in a real job.

One decision, in this order: :meth:`DecisionCore.observe` (statistics, memory bounds, efficiency,
loss trend, context, reward earned by the previous decision, observation), then the policy call and
the AdaScale gain of the chosen sizes (:meth:`DecisionCore.decide` does both). The simulator calls
`observe` only, since its PPO rollouts act on many simulated jobs in one batch.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from .actions import BatchBounds
from .costmodel import CostConfig, CostModel, record_reports
from .policy import BatchSizePolicy, DecisionInput
from .costmodel import CostFit, NetworkFit
from .reward import RewardConfig, compute_reward, global_throughput, predicted_goodput
from .state import GlobalContext, RankReport, build_observation
from ..stats.noise_scale import GradientStatistics, StatsConfig, pooled_estimate, statistical_efficiency
from .. import validate

WARMUP_STEPS = 2
"""A process's first steps, which pay one-off costs: left out of the cost fit and the reports' means.
Not a setting: every rank and the live controller must drop the same steps (the controller's report
means and the core's fit agree on them), and one-off costs (lazy initialisation, cold caches, the
first allreduce's set-up) end within two steps on every backend."""

MEMORY_KINDS = ("rss", "cuda", "host")
"""How a report's peak memory was measured: "rss" the process's lifetime peak (no fit uses it), "cuda"
the allocator's per-step peak, "host" the resident set's peak over the interval (`IntervalPeak`)."""
FITTED_MEMORY_KINDS = ("cuda", "host")
"""The kinds whose peak belongs to the interval's sizes, so that the memory bounds are fitted to them."""


TIMED = ("compute_s", "data_wait_s", "sync_wait_s")
"""The per-step times of a StepSeries (what the cost model fits)."""


@dataclass
class StepSeries:
    """One rank's per-step values over one decision interval (all lists have one entry per step)."""

    local_batch: list[int]
    local_sq: list[float]
    """Squared norm of this rank's local mean gradient at each step."""
    global_sq: list[float]
    """Squared norm of the global mean gradient at each step (the same on every rank)."""
    losses: list[float]
    """This rank's loss at each step; NaN where it recorded none."""
    memory_kind: str = "rss"
    compute_s: list[float] = field(default_factory=list)
    """Forward + backward of each step (s); empty: not timed (filled with NaN)."""
    data_wait_s: list[float] = field(default_factory=list)
    """Wait for each step's batch (s)."""
    sync_wait_s: list[float] = field(default_factory=list)
    """Allreduce wait of each step (s)."""
    micro_batches: list[int] = field(default_factory=list)
    """Micro-batches accumulated into each step (local_batch and the times cover all of them); empty: 1 each."""
    sq_tokens: list[int] = field(default_factory=list)
    """Sum of the squared lengths of each step's samples (token budgets; the attention term of the
    cost model); empty or 0: not kept."""

    def __post_init__(self) -> None:
        n = len(self.local_batch)
        for name in TIMED:
            if n and not getattr(self, name):
                setattr(self, name, [math.nan] * n)
        if n and not self.micro_batches:
            self.micro_batches = [1] * n
        if any(isinstance(m, bool) or int(m) != m or m < 1 for m in self.micro_batches):
            raise ValueError(f"StepSeries.micro_batches={self.micro_batches!r}; each must be an integer >= 1")
        self.micro_batches = [int(m) for m in self.micro_batches]
        if n and not self.sq_tokens:
            self.sq_tokens = [0] * n
        for name in ("local_sq", "global_sq", "losses", *TIMED, "micro_batches", "sq_tokens"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StepSeries.{name} has {len(getattr(self, name))} steps, local_batch has {n}")
        if self.memory_kind not in MEMORY_KINDS:
            raise ValueError(f"StepSeries.memory_kind={self.memory_kind!r}; choose one of {MEMORY_KINDS}")


@dataclass
class LayerMeans:
    """Mean per-parameter squared norms (local, global) of one rank over the interval."""

    local_sq: list[float]
    global_sq: list[float]

    def __post_init__(self) -> None:
        if len(self.local_sq) != len(self.global_sq):
            raise ValueError(f"LayerMeans: {len(self.local_sq)} local and {len(self.global_sq)} global entries")


@dataclass
class RankInput:
    """Everything one rank reports for one decision."""

    report: RankReport
    steps: StepSeries
    layers: LayerMeans | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RankInput":
        layers = d.get("layers")
        return cls(RankReport(**d["report"]), StepSeries(**d["steps"]),
                   None if layers is None else LayerMeans(**layers))


@dataclass
class Observation:
    """What the core derived from one interval's reports (the input of the policy)."""

    obs: torch.Tensor                 # [R, OBS_DIM]
    reports: list[RankReport]
    ctx: GlobalContext
    sizes: list[int]                  # the sizes the interval ran with
    reward: torch.Tensor | None       # [R] earned by the previous decision (None at the first)
    loss: float                       # batch-weighted mean loss of the interval (NaN if unknown)
    efficiency: float
    throughput: float
    layer_variance: dict[str, float] | None
    fit: dict[str, Any] | None = None  # the cost and network fits the observation used (plain values)
    step_losses: np.ndarray | None = None  # the interval's per-step loss, sample-weighted over ranks (NaN: none)
    budget_left: float = math.nan     # fraction of the training budget still to run (NaN: no budget known)


@dataclass
class Decision:
    """One decision: the new sizes and gain, plus what they were based on (rank 0's history record)."""

    index: int
    epoch: int
    sizes: list[int]
    previous_sizes: list[int]
    lr_gain: float
    reward: list[float] | None
    loss: float
    noise_scale: float
    efficiency: float
    throughput: float
    reports: list[RankReport]
    policy: str
    info: dict[str, Any] = field(default_factory=dict)
    layer_variance: dict[str, float] | None = None
    fit: dict[str, Any] | None = None
    noise_interval: tuple[float, float] = (math.nan, math.nan)
    """(lower bound, continuous point estimate) of the noise scale the observation used."""
    passes: int = 1
    """Micro-batches per optimizer step from this decision on (gradient accumulation; 1: none)."""
    previous_passes: int = 1
    recheck: bool = False
    """Decide again soon (`DecisionCadence`'s recheck): the policy saw evidence it must confirm."""
    done: float | None = None
    """Epochs done, fractional, when the decision was taken (None: `epoch`): the budget still to run."""

    def record(self) -> dict[str, Any]:
        """The controller's history entry (plain values only)."""
        return {"decision": self.index, "epoch": self.epoch, "sizes": self.sizes,
                "previous_sizes": self.previous_sizes, "lr_gain": self.lr_gain, "reward": self.reward,
                "loss": self.loss, "noise_scale": self.noise_scale, "efficiency": self.efficiency,
                "throughput": self.throughput, "reports": [r.to_dict() for r in self.reports],
                "policy": self.policy, "info": self.info, "layer_variance": self.layer_variance, "fit": self.fit,
                "noise_lower": self.noise_interval[0], "noise_point": self.noise_interval[1],
                "passes": self.passes, "previous_passes": self.previous_passes, "recheck": self.recheck,
                "done": self.done}


# --- the pieces shared with the transition rebuild ----------------------------------------------------
def weighted_loss(reports: Sequence[RankReport]) -> float:
    """Batch-weighted mean of the ranks' finite mean losses (NaN when none is finite)."""
    weighted = [(r.loss_mean, r.local_batch) for r in reports if math.isfinite(r.loss_mean)]
    return sum(l * b for l, b in weighted) / sum(b for _, b in weighted) if weighted else math.nan


def loss_trend(loss: float, previous: float) -> float:
    """Relative loss change since the previous decision (NaN when unknown)."""
    return (loss - previous) / abs(previous) if previous else math.nan


def progress_fraction(epoch: int, total_epochs: int | None) -> float:
    return min(1.0, epoch / total_epochs) if total_epochs else 0.0


def budget_left(done: float, total_epochs: int | None) -> float:
    """Fraction of the training budget still to run after `done` epochs (fractional); NaN without a
    budget (`total_epochs` None)."""
    return min(1.0, max(0.0, 1.0 - done / total_epochs)) if total_epochs else math.nan


def observe_reports(reports: Sequence[RankReport], sizes: Sequence[int], initial_batch: int, noise_scale: float,
                    efficiency: float, trend: float, progress: float, noise_point: float = math.nan,
                    noise_lower: float = math.nan, fit: dict[str, Any] | None = None, passes: int = 1
                    ) -> tuple[GlobalContext, torch.Tensor]:
    """The global context and the observation [R + 1, OBS_DIM] the policy sees (`fit`: `fit_record`;
    the global batch is `passes` micro-batches of `sizes`)."""
    ctx = GlobalContext(global_batch=passes * sum(sizes), initial_batch=initial_batch, noise_scale=noise_scale,
                        efficiency=efficiency, loss_trend=trend, progress=progress, world_size=len(sizes),
                        noise_point=noise_point, noise_lower=noise_lower)
    cost, net = fits_from_record(fit)
    return ctx, build_observation(reports, ctx, cost, net)


def fit_record(fit: CostFit | None, net: NetworkFit) -> dict[str, Any] | None:
    """The fits as plain values (a decision's history record keeps them for the transition rebuild)."""
    if fit is None:
        return None
    return {**{k: np.asarray(v).tolist() for k, v in asdict(fit).items()}, "net": asdict(net)}


def fits_from_record(record: dict[str, Any] | None) -> tuple[CostFit | None, NetworkFit | None]:
    if record is None:
        return None, None
    arrays = {k: np.asarray(v, dtype=bool if k == "identified" else np.float64)
              for k, v in record.items() if k != "net"}
    return CostFit(**arrays), NetworkFit(**record["net"])


class DecisionCore:
    """Rank 0's decision state and step; see the module docstring."""

    def __init__(self, world_size: int, initial_batch: int, policy: BatchSizePolicy | None = None, *,
                 reward: RewardConfig | None = None, stats: StatsConfig | None = None, min_batch: int = 1,
                 max_batch: int = 1024, total_epochs: int | None = None,
                 layer_names: Sequence[str] | None = None, base_batch: int | None = None,
                 max_passes: int = 1, fit_warmup: bool = False, costs: CostConfig | None = None) -> None:
        validate.integer("DecisionCore world_size", world_size, 1)
        validate.integer("DecisionCore initial_batch", initial_batch, 1)
        self.policy = policy
        self.reward_cfg = reward or RewardConfig()
        self.stats_cfg = stats or StatsConfig()
        self.min_batch, self.max_batch = min_batch, max_batch
        self.total_epochs = total_epochs
        self.layer_names = None if layer_names is None else list(layer_names)
        self.bounds = BatchBounds(world_size, min_batch, max_batch, max_passes=max_passes)
        self.stats = GradientStatistics(self.stats_cfg)
        self.costs = CostModel(world_size, costs)
        if base_batch is not None:
            validate.number("DecisionCore base_batch", base_batch, 1, what="a finite number >= 1 or None")
        self.initial_batch = initial_batch
        """The initial batch: the global batch the job started with (E(B)'s reference, the growth floor)."""
        self.fit_warmup = fit_warmup
        """Fit costs on the job's first steps too (a simulator's, which has no one-off costs)."""
        self.changed_by: tuple[int, ...] = ()
        """The ranks whose change vote brought the latest interval's decision forward."""
        self._fresh_start = True  # the next interval is the job's first (not a restored core's)
        self.base_batch = float(base_batch or initial_batch)
        """The base batch: samples per optimizer step the learning rate was tuned for (AdaScale's base)."""
        self.ref_goodput = self.ref_tput = 0.0
        self.prev_loss = math.nan
        self.prev_sizes: list[int] | None = None
        self.initial_sizes: list[int] | None = None  # the static reference of the reward
        self.passes = self.prev_passes = self.initial_passes = 1  # micro-batches per optimizer step
        self.decisions = 0

    @property
    def world_size(self) -> int:
        return len(self.bounds.learned_max)

    # --- one decision --------------------------------------------------------------------------------
    def observe(self, inputs: Sequence[RankInput], sizes: Sequence[int], epoch: int, passes: int = 1,
                done: float | None = None, changed_by: Sequence[int] = ()) -> Observation:
        """Take one interval's reports (in rank order), the sizes it ran with (per micro-batch) and its
        micro-batches per optimizer step; update the state. `done`: epochs done so far, fractional
        (None: `epoch`), for the budget still to run. `changed_by`: the ranks whose change vote
        brought this decision forward (they measured their own speed change in the interval)."""
        self.changed_by = tuple(changed_by)
        if [i.report.rank for i in inputs] != list(range(len(inputs))) or len(inputs) != len(sizes):
            raise ValueError(f"need one input per rank in rank order for {len(sizes)} sizes, got ranks "
                             f"{[i.report.rank for i in inputs]}")
        sizes = list(sizes)
        self.passes = passes
        B = passes * sum(sizes)  # samples per optimizer step
        reports = [i.report for i in inputs]
        step_losses = self._record_steps(inputs)
        for i in inputs:
            if i.steps.memory_kind in FITTED_MEMORY_KINDS:  # a peak of this interval's sizes
                r = i.report
                self.bounds.record_memory(r.rank, r.local_batch, r.peak_memory_bytes, r.mem_total_bytes,
                                          r.memory_floor_bytes, precise=i.steps.memory_kind == "cuda")
        efficiency = float(self.stats.efficiency_at(B))
        loss = weighted_loss(reports)
        trend = loss_trend(loss, self.prev_loss)
        lower, point, _ = self.stats.noise_scale_interval(self.stats_cfg.noise_z)
        cost, net = self.costs.fit(), self.costs.fit_network()
        fit = fit_record(cost, net)
        ctx, obs = observe_reports(reports, sizes, self.initial_batch, self.stats.noise_scale, efficiency, trend,
                                   progress_fraction(epoch, self.total_epochs), point, lower, fit, passes)
        tput = global_throughput(reports, passes)
        # E(B) of the reward, from the continuous estimate: 1 while phi is unknown
        eff = float(statistical_efficiency(lower if self.reward_cfg.noise == "lower" else point, B, self.initial_batch,
                                           unknown="one"))
        if self.ref_goodput == 0.0:
            self.ref_goodput, self.ref_tput = tput * eff, tput
        if self.initial_sizes is None or len(self.initial_sizes) != len(sizes):
            self.initial_sizes, self.initial_passes = list(sizes), passes
        reward = None
        if self.prev_sizes is not None:
            static = predicted_goodput(cost, net, self.initial_sizes, self.initial_passes) or self.ref_goodput
            reward = compute_reward(self.reward_cfg, reports, eff, static, trend,
                                    [self.prev_passes * b for b in self.prev_sizes], [passes * b for b in sizes],
                                    passes)
        self.prev_sizes, self.prev_loss, self.prev_passes = sizes, loss, passes
        self.decisions += 1
        return Observation(obs, reports, ctx, sizes, reward, loss, efficiency, tput,
                           self._layer_variance(inputs, [passes * b for b in sizes]), fit, step_losses,
                           budget_left(float(epoch if done is None else done), self.total_epochs))

    def policy_input(self, seen: Observation) -> DecisionInput:
        lower, point, _ = self.stats.noise_scale_interval(self.stats_cfg.noise_z)
        return DecisionInput(seen.obs, seen.reports, seen.ctx, list(seen.sizes), self.bounds, seen.reward,
                             costs=self.costs, noise_lower=lower, noise_point=point, passes=self.passes,
                             step_losses=seen.step_losses, budget_left=seen.budget_left,
                             changed_by=self.changed_by)

    def decide(self, inputs: Sequence[RankInput], sizes: Sequence[int], epoch: int, passes: int = 1,
               done: float | None = None, changed_by: Sequence[int] = ()) -> Decision:
        """`observe`, then the policy's new sizes and the AdaScale gain for them: at the samples of one
        optimizer step (`passes` micro-batches of the new sizes) over `base_batch`."""
        if self.policy is None:
            raise RuntimeError("this DecisionCore has no policy; give one to decide (observe() needs none)")
        validate.integer("DecisionCore.decide passes", passes, 1)
        index = self.decisions
        seen = self.observe(inputs, sizes, epoch, passes, done, changed_by)
        out = self.policy.decide(self.policy_input(seen))
        new_passes = self.next_passes(out.passes, passes)
        gain = float(self.stats.gain_at(new_passes * sum(out.sizes), self.base_batch))
        return Decision(index=index, epoch=epoch, sizes=out.sizes, previous_sizes=seen.sizes, passes=new_passes,
                        previous_passes=passes,
                        lr_gain=gain if math.isfinite(gain) and gain > 0 else 1.0,
                        reward=None if seen.reward is None else seen.reward.tolist(), loss=seen.loss,
                        noise_scale=self.stats.noise_scale, efficiency=seen.efficiency, throughput=seen.throughput,
                        reports=seen.reports, policy=self.policy.name, info=out.info,
                        layer_variance=seen.layer_variance, fit=seen.fit,
                        noise_interval=(seen.ctx.noise_lower, seen.ctx.noise_point), recheck=out.recheck,
                        done=done)

    def next_passes(self, chosen: int | None, current: int) -> int:
        """The policy's micro-batches per step (None: keep `current`), within [1, bounds.max_passes]
        when accumulation is the controller's to choose (max_passes > 1)."""
        if chosen is None or self.bounds.max_passes == 1:
            return current
        return max(1, min(self.bounds.max_passes, int(chosen)))

    def _record_steps(self, inputs: Sequence[RankInput]) -> np.ndarray | None:
        """Feed the interval's per-step norms of all ranks, and each step's sample-weighted loss, into the
        noise-scale estimator (in step order, as arrays); those losses (None without steps)."""
        n = min(len(i.steps.local_batch) for i in inputs)
        loss = None
        if n:
            b = np.array([i.steps.local_batch[:n] for i in inputs], dtype=np.float64).T  # [n, R]
            losses = np.array([i.steps.losses[:n] for i in inputs], dtype=np.float64).T
            seen = np.isfinite(losses)
            weight = np.where(seen, b, 0.0)
            with np.errstate(invalid="ignore", divide="ignore"):  # a step without a loss: NaN
                loss = (np.where(seen, losses, 0.0) * weight).sum(1) / weight.sum(1)
            loss[~seen.any(1)] = np.nan
            self.stats.record_many(b.astype(np.int64), np.array([i.steps.local_sq[:n] for i in inputs]).T,
                                   inputs[0].steps.global_sq[:n], loss)
        self._record_costs(inputs, n)
        return loss

    def _record_costs(self, inputs: Sequence[RankInput], n: int) -> None:
        """Feed the per-step (batch, arrival, end of allreduce) points into the cost model; intervals
        reported without per-step times (older peers) give one point of their means. The job's first
        `WARMUP_STEPS` steps are left out: they pay one-off costs (lazy initialisation, cold caches,
        the allocator) unevenly across ranks, and a split fitted on them would be noise (an interval
        of means only that holds them is left out whole)."""
        if self.costs.world_size != len(inputs):
            self.costs = CostModel(len(inputs), self.costs.cfg)  # the world changed: start over
        skip = 0
        if self._fresh_start and not self.fit_warmup:
            self._fresh_start = False
            skip = WARMUP_STEPS
            if n <= skip:
                return
        reports = [i.report for i in inputs]
        # the fastest probe: the ranks that arrived last at it waited the least for the others
        self.costs.record_link(reports[0].allreduce_bytes, min((r.latency_probe_s for r in reports
                                                                 if math.isfinite(r.latency_probe_s)), default=math.nan))
        overhead = float(np.median([r.step_s - r.compute_s - r.data_wait_s - r.sync_wait_s for r in reports]))
        if n and all(math.isfinite(i.steps.compute_s[skip]) for i in inputs):
            k = slice(skip, n)
            b = np.array([i.steps.local_batch[k] for i in inputs], dtype=np.float64).T
            arrival = np.array([np.add(i.steps.compute_s[k], np.nan_to_num(i.steps.data_wait_s[k]))
                                for i in inputs]).T
            wait = np.array([i.steps.sync_wait_s[k] for i in inputs], dtype=np.float64).T
            passes = np.array(inputs[0].steps.micro_batches[k], dtype=np.float64)  # the same on every rank
            sq = np.array([i.steps.sq_tokens[k] for i in inputs], dtype=np.float64).T
            self.costs.record(b, arrival, np.median(arrival + wait, axis=1), overhead, passes=passes,
                              sq_tokens=sq if (sq > 0).all() else None, changed=self.changed_by)
        elif not skip and all(r.compute_s > 0 for r in reports):
            arrival = [r.compute_s + r.data_wait_s for r in reports]
            sync = float(np.median([t + r.sync_wait_s for t, r in zip(arrival, reports)]))
            record_reports(self.costs, [r.local_batch for r in reports], arrival, sync, overhead,
                           max(min(r.steps for r in reports), 1), self.passes)

    def _layer_variance(self, inputs: Sequence[RankInput], sizes: list[int]) -> dict[str, float] | None:
        """Per-parameter gradient variance tr(Sigma_l) over the interval (unbiased, pooled over ranks)."""
        if any(i.layers is None for i in inputs):
            return None
        local = np.array([i.layers.local_sq for i in inputs])  # type: ignore[union-attr]
        est = pooled_estimate(sizes, local, np.array(inputs[0].layers.global_sq))  # type: ignore[union-attr]
        if est is None:
            return None
        names = self.layer_names or [str(i) for i in range(local.shape[1])]
        return dict(zip(names, np.asarray(est.trace_sigma, dtype=float).tolist()))

    # --- plain state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"policy": None if self.policy is None else self.policy.state_dict(),
                "stats": self.stats.state_dict(), "ref_goodput": self.ref_goodput, "ref_tput": self.ref_tput,
                "prev_loss": self.prev_loss, "prev_sizes": None if self.prev_sizes is None else list(self.prev_sizes),
                "initial_batch": self.initial_batch, "base_batch": self.base_batch, "decisions": self.decisions,
                "learned_max": list(self.bounds.learned_max), "bounds": self.bounds.state_dict(),
                "costs": self.costs.state_dict(),
                "initial_sizes": None if self.initial_sizes is None else list(self.initial_sizes),
                "passes": [self.passes, self.prev_passes, self.initial_passes]}

    def load_state_dict(self, state: dict[str, Any], world_size: int | None = None) -> None:
        """Restore `state_dict()` output into a job of `world_size` ranks (default: this core's); a
        different world size keeps what was learned (policy, statistics, references) but not what was
        per rank (bounds, the last sizes)."""
        world = self.world_size if world_size is None else world_size
        self._fresh_start = False  # a restored core continues its fit exactly
        if self.policy is not None and state["policy"] is not None:
            self.policy.load_state_dict(state["policy"])
        self.stats = GradientStatistics(self.stats_cfg)
        self.stats.load_state_dict(state["stats"])
        self.ref_goodput, self.ref_tput = float(state["ref_goodput"]), float(state["ref_tput"])
        self.prev_loss = float(state["prev_loss"])
        if "initial_batch" in state:
            self.initial_batch = int(state["initial_batch"])
            self.base_batch = float(state["base_batch"])
        else:  # keys "base_batch" (the initial batch) and optionally "lr_base_batch" (the base batch)
            self.initial_batch = int(state["base_batch"])
            self.base_batch = float(state.get("lr_base_batch", self.base_batch))
        self.decisions = int(state["decisions"])
        self.passes, self.prev_passes, self.initial_passes = (int(p) for p in state.get("passes", (1, 1, 1)))
        costs = state.get("costs")  # absent in checkpoints from before the cost model
        self.costs = CostModel(world, self.costs.cfg)
        if costs is not None and int(costs["world_size"]) == world:
            self.costs.load_state_dict(costs)
        if len(state["learned_max"]) == world:
            if self.world_size == world:
                self.bounds.load_state_dict(state.get("bounds") or state)
            self.prev_sizes = None if state["prev_sizes"] is None else [int(b) for b in state["prev_sizes"]]
            initial = state.get("initial_sizes")  # absent in checkpoints from before the static reference
            self.initial_sizes = None if initial is None else [int(b) for b in initial]
        else:
            self.initial_sizes = None
            self.prev_sizes = None
            if self.policy is not None:
                self.policy.reset_world(world)
