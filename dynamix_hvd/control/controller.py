"""The DYNAMIX controller: every rank reports, rank 0 decides, every rank applies.

The only module that knows rank 0 decides. Per decision (end of every epoch, or every k steps):

1. every rank condenses its step records, resource use, losses and gradient norms into a report;
2. the reports are gathered on rank 0 (``comm.ControlChannel``: deadline, names a silent rank);
3. rank 0 updates the gradient-noise statistics, builds the state, computes the reward earned by the
   previous decision, asks the policy for new per-rank sizes and the AdaScale gain;
4. the decision is broadcast and every rank applies it to its loader and optimizer.

Ordering hazard: decisions run inside the loader's step-end callback, i.e. after a step's
``optimizer.step()`` and before the next batch is planned. Every rank reaches that point after the
same number of steps, which is what keeps the collectives matched.
"""
from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .actions import ActionSpace, BatchBounds
from .rules import BASELINES, make_baseline
from ..comm import ControlChannel
from ..data.loader import AdaptiveLoader
from ..data.metrics import StepRecord
from ..stats.noise_scale import GradientStatistics, StatsConfig, pooled_estimate
from .policy import BatchSizePolicy, DecisionInput, PPOPolicy, StaticPolicy
from .policy_store import DEFAULT_POLICY, default_policy_dir, load_policy, resolve
from ..rl.ppo import PPOConfig
from ..data.resources import ResourceSampler
from .reward import RewardConfig, compute_reward, global_throughput
from .state import GlobalContext, RankReport, build_observation


POLICY_NAMES = ("ppo", "static", *sorted(BASELINES))
_BROADCAST_KEYS = ("decision", "epoch", "sizes", "previous_sizes", "lr_gain")


@dataclass
class ControllerConfig:
    policy: str = "ppo"
    """Decision maker: "ppo" (DYNAMIX), "static", or a classic rule from `dynamix_hvd.control.rules`
    (linear-ramp, adabatch, increase-batch, noise-scale, goodput, speed-split)."""
    policy_kwargs: dict = field(default_factory=dict)
    """Parameters of a classic rule, e.g. {"end": 512, "ramp": 10} for linear-ramp."""
    policy_file: str | None = DEFAULT_POLICY
    """PPO weights to start from: a name in policies/ or a path; None starts from a fresh policy. The
    shipped default (pretrained in the simulator, see policies/default.md) is used unless told otherwise."""
    learn: bool = False
    """Keep training the PPO policy online from this job's transitions (sampled actions, PPO updates).
    False acts greedily with the loaded policy, which did better for the shipped policy in the
    simulator (1.50x vs 1.42x faster than static); a fresh policy should learn (True)."""
    decide_every_steps: int = 0
    """Decide every k optimizer steps; 0 decides at the end of every epoch."""
    min_batch: int = 1
    """Smallest local batch any rank may get."""
    max_batch: int = 1024
    """Largest local batch any rank may get (lowered per rank by what memory allows)."""
    multipliers: tuple[float, ...] = (0.5, 0.8, 1.0, 1.25, 2.0)
    """The discrete actions: factors applied to a rank's batch size."""
    total_epochs: int | None = None
    """Training budget in epochs, for the progress feature (None: progress stays 0)."""
    timeout_s: float = 120.0
    """Deadline of every control-plane collective."""
    resource_period_s: float = 1.0
    """How often a background thread samples CPU, memory and network counters (0: at each decision).
    Reading them costs milliseconds in some sandboxes, which would otherwise delay every decision."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=lambda: PPOConfig(gamma=0.9, rollout_length=16))
    """PPO settings. gamma 0.9: rewards are O(1) log-ratios per decision, and a shorter horizon keeps
    returns O(10) so the clipped value loss can follow them."""
    stats: StatsConfig = field(default_factory=StatsConfig)

    def __post_init__(self) -> None:
        def integer(name: str, low: int) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ControllerConfig.{name}={value!r}; it must be an integer >= {low}")
            return value

        if self.policy not in POLICY_NAMES:
            raise ValueError(f"ControllerConfig.policy={self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        if not isinstance(self.policy_kwargs, dict):
            raise ValueError(f"ControllerConfig.policy_kwargs={self.policy_kwargs!r}; it must be a dict")
        if self.policy_file is not None and not isinstance(self.policy_file, (str, os.PathLike)):
            raise ValueError(f"ControllerConfig.policy_file={self.policy_file!r}; give a policy name, a path or None")
        if not isinstance(self.learn, bool):
            raise ValueError(f"ControllerConfig.learn={self.learn!r}; it must be True or False")
        integer("decide_every_steps", 0)
        if integer("min_batch", 1) > integer("max_batch", 1):
            raise ValueError(f"impossible batch bounds: min_batch={self.min_batch} > max_batch={self.max_batch}")
        if self.total_epochs is not None:
            integer("total_epochs", 1)
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"ControllerConfig.timeout_s={self.timeout_s!r}; it must be a positive number of seconds")
        if isinstance(self.resource_period_s, bool) or not isinstance(self.resource_period_s, (int, float)) \
                or not math.isfinite(self.resource_period_s) or self.resource_period_s < 0:
            raise ValueError(f"ControllerConfig.resource_period_s={self.resource_period_s!r}; use seconds >= 0")
        ActionSpace(tuple(self.multipliers))  # validates the action set


def _make_policy(cfg: ControllerConfig) -> BatchSizePolicy:
    if cfg.policy == "static":
        return StaticPolicy()
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
    return PPOPolicy(learner, actions, learn=cfg.learn, config=cfg.ppo)


class DynamixController:
    """Attach to a loader and optimizer; decisions then happen by themselves as the loader iterates."""

    def __init__(self, loader: AdaptiveLoader, optimizer: Any, config: ControllerConfig | None = None,
                 device: torch.device | None = None) -> None:
        self.cfg = config or ControllerConfig()
        self.loader, self.optimizer = loader, optimizer
        self.channel = ControlChannel(self.cfg.timeout_s)
        if self.channel.size != loader.world_size:
            raise ValueError(f"control plane has {self.channel.size} ranks but the loader plans "
                             f"{loader.world_size} (batch_sizes={list(loader.batch_sizes)})")
        self.rank = self.channel.rank
        self.resources = ResourceSampler(device, background_period_s=self.cfg.resource_period_s)
        self.history: list[dict[str, Any]] = []   # every decision, kept on every rank
        self._losses: list[torch.Tensor] = []
        self._total_steps = 0
        self.bounds = BatchBounds(loader.world_size, self.cfg.min_batch, self.cfg.max_batch)
        for r, b in enumerate(loader.batch_sizes):
            if not self.cfg.min_batch <= b <= self.cfg.max_batch:
                raise ValueError(f"initial batch size {b} of rank {r} outside [{self.cfg.min_batch}, "
                                 f"{self.cfg.max_batch}]")
        # Every rank holds a policy, so that any rank can take over as rank 0 after an elastic reset;
        # only rank 0's is consulted.
        self.policy = _make_policy(self.cfg)
        self.stats = GradientStatistics(self.cfg.stats)
        self._ref_goodput = self._ref_tput = 0.0
        self._prev_loss = math.nan
        self._prev_sizes: list[int] | None = None
        self._base_batch = loader.global_batch_size
        loader.step_end_callbacks.append(self._on_step_end)
        if hasattr(optimizer, "oom_handler"):
            optimizer.oom_handler = self._shrink_after_oom

    def rebind(self, rank: int, world_size: int) -> None:
        """Join a new world after an elastic reset (the loader is rebound by its own handler)."""
        self.channel.rebind(rank, world_size)
        self.rank = rank
        if world_size != len(self.bounds.learned_max):
            self.bounds = BatchBounds(world_size, self.cfg.min_batch, self.cfg.max_batch)

    def _shrink_after_oom(self, sizes: list[int], failed: list[int]) -> list[int]:
        """Every rank runs this with the same inputs, so the bounds stay identical everywhere."""
        out = []
        for rank, (b, f) in enumerate(zip(sizes, failed)):
            out.append(min(b, self.bounds.record_oom(rank, f)) if f else b)
        return out

    # --- hooks into the training loop --------------------------------------------------------------
    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Optional: the step's loss (mean over the local batch), for loss statistics and reward."""
        self._losses.append(loss.detach().reshape(()) if isinstance(loss, torch.Tensor)
                            else torch.tensor(float(loss)))

    def _on_step_end(self, loader: AdaptiveLoader, epoch_end: bool) -> None:
        self._total_steps += 1
        k = self.cfg.decide_every_steps
        if (k == 0 and epoch_end) or (k > 0 and self._total_steps % k == 0):
            self.decide()

    # --- one decision --------------------------------------------------------------------------------
    def decide(self) -> dict[str, Any]:
        """One decision on every rank; returns this rank's record of it (rank 0's is the full one)."""
        t0 = time.perf_counter()
        payload = self._report(self.loader.tracker.drain())
        gathered = self.channel.gather(payload, what="metrics")
        record = self._decide_on_root(gathered) if self.rank == 0 else None
        # Only what the ranks need travels; the full record (reports, rewards, statistics) stays on 0.
        compact = None if record is None else {k: record[k] for k in _BROADCAST_KEYS}
        compact = self.channel.broadcast(compact, what="batch-size decision")
        self.loader.set_batch_sizes(compact["sizes"])
        if hasattr(self.optimizer, "lr_gain"):
            self.optimizer.lr_gain = compact["lr_gain"]
        record = dict(record or compact, overhead_s=time.perf_counter() - t0)
        if self.rank == 0:
            t1 = time.perf_counter()
            update = self.policy.after_decision()  # learning runs after the others got the decision
            if update:
                record.update(ppo_update=update, learn_s=time.perf_counter() - t1)
        self.history.append(record)
        return record

    def _report(self, records: list[StepRecord]) -> dict[str, Any]:
        res = self.resources.latest()
        losses = torch.stack(self._losses).tolist() if self._losses else []
        finite_losses = [l for l in losses if math.isfinite(l)]  # a NaN step must not poison the mean
        self._losses.clear()
        mean = (lambda key: statistics.fmean(getattr(r, key) for r in records) if records else 0.0)  # noqa: E731
        total_time = sum(r.step_s for r in records)
        report = RankReport(
            rank=self.rank, local_batch=self.loader.batch_sizes[self.rank], steps=len(records),
            compute_s=mean("compute_s"), sync_wait_s=mean("sync_wait_s"), data_wait_s=mean("data_wait_s"),
            step_s=mean("step_s"),
            samples_per_s=sum(r.local_batch for r in records) / total_time if total_time > 0 else 0.0,
            peak_memory_bytes=max((r.peak_memory_bytes for r in records), default=0),
            mem_used_bytes=res.mem_used_bytes, mem_total_bytes=res.mem_total_bytes, cpu_util=res.cpu_util,
            gpu_util=res.gpu_util, net_bytes_per_s=res.net_bytes_per_s, tcp_retrans_per_s=res.tcp_retrans_per_s,
            loss_mean=statistics.fmean(finite_losses) if finite_losses else math.nan,
            local_grad_sq=mean("local_grad_sq"), global_grad_sq=mean("global_grad_sq"),
            max_batch=self.bounds.upper(self.rank))
        steps = {"local_batch": [r.local_batch for r in records],
                 "local_sq": [r.local_grad_sq for r in records],
                 "global_sq": [r.global_grad_sq for r in records],
                 "memory_kind": records[-1].memory_kind if records else "rss"}
        layers = self.optimizer.pop_layer_means() if hasattr(self.optimizer, "pop_layer_means") else None
        return {"report": report, "steps": steps, "losses": losses, "layers": layers}

    def _decide_on_root(self, gathered: list[dict[str, Any]]) -> dict[str, Any]:
        reports: list[RankReport] = [g["report"] for g in gathered]
        sizes = list(self.loader.batch_sizes)
        self._update_statistics(gathered)
        for r in reports:
            if gathered[r.rank]["steps"]["memory_kind"] == "cuda":
                self.bounds.record_memory(r.rank, r.local_batch, r.peak_memory_bytes, r.mem_total_bytes)
        B = sum(sizes)
        efficiency = float(self.stats.efficiency_at(B))
        weighted = [(r.loss_mean, r.local_batch) for r in reports if math.isfinite(r.loss_mean)]
        loss = sum(l * b for l, b in weighted) / sum(b for _, b in weighted) if weighted else math.nan
        loss_change = (loss - self._prev_loss) / abs(self._prev_loss) if self._prev_loss else math.nan
        progress = 0.0
        if self.cfg.total_epochs:
            progress = min(1.0, self.loader.epoch / self.cfg.total_epochs)
        ctx = GlobalContext(global_batch=B, base_batch=self._base_batch, noise_scale=self.stats.noise_scale,
                            efficiency=efficiency, loss_trend=loss_change, progress=progress,
                            world_size=len(sizes))
        tput = global_throughput(reports)
        eff = efficiency if math.isfinite(efficiency) else 1.0
        if self._ref_goodput == 0.0:
            self._ref_goodput, self._ref_tput = tput * eff, tput
        reward = None
        if self._prev_sizes is not None:
            reward = compute_reward(self.cfg.reward, reports, eff, self._ref_goodput, self._ref_tput,
                                    loss_change, math.nan, self._prev_sizes, sizes)
        obs = build_observation(reports, ctx)
        layer_variance = self._layer_variance(gathered, sizes)
        out = self.policy.decide(DecisionInput(obs, reports, ctx, sizes, self.bounds, reward))
        self._prev_sizes, self._prev_loss = sizes, loss
        gain = float(self.stats.gain_at(sum(out.sizes)))
        return {"decision": len(self.history), "epoch": self.loader.epoch, "sizes": out.sizes,
                "previous_sizes": sizes, "lr_gain": gain if math.isfinite(gain) and gain > 0 else 1.0,
                "reward": None if reward is None else reward.tolist(), "loss": loss,
                "noise_scale": self.stats.noise_scale, "efficiency": efficiency, "throughput": tput,
                "reports": [r.to_dict() for r in reports], "policy": self.policy.name, "info": out.info,
                "layer_variance": layer_variance}

    def _layer_variance(self, gathered: list[dict[str, Any]], sizes: list[int]) -> dict[str, float] | None:
        """Per-parameter gradient variance tr(Sigma_l) over the interval (unbiased, pooled over ranks)."""
        if any(g["layers"] is None for g in gathered):
            return None
        local = np.array([g["layers"][0] for g in gathered])
        est = pooled_estimate(sizes, local, np.array(gathered[0]["layers"][1]))
        if est is None:
            return None
        names = getattr(self.optimizer, "param_names", [str(i) for i in range(local.shape[1])])
        return dict(zip(names, np.asarray(est.trace_sigma, dtype=float).tolist()))

    def _update_statistics(self, gathered: list[dict[str, Any]]) -> None:
        """Feed the per-step norms of all ranks, step by step, into the noise-scale estimator."""
        per_rank = [g["steps"] for g in gathered]
        n = min(len(s["local_batch"]) for s in per_rank)
        losses = [g["losses"] for g in gathered]
        for k in range(n):
            batches = [s["local_batch"][k] for s in per_rank]
            step_losses = [(l[k], b) for l, b in zip(losses, batches) if k < len(l) and math.isfinite(l[k])]
            loss = sum(l * b for l, b in step_losses) / sum(b for _, b in step_losses) if step_losses else None
            self.stats.update(batches, [s["local_sq"][k] for s in per_rank], per_rank[0]["global_sq"][k], loss)

    # --- checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: on rank 0 also the policy, statistics and reward references."""
        state: dict[str, Any] = {"history": self.history, "total_steps": self._total_steps,
                                 "learned_max": list(self.bounds.learned_max), "world_size": self.loader.world_size}
        if self.rank == 0:
            state["root"] = {"policy": self.policy.state_dict(), "stats": self.stats,
                             "ref_goodput": self._ref_goodput, "ref_tput": self._ref_tput,
                             "prev_loss": self._prev_loss, "prev_sizes": self._prev_sizes,
                             "base_batch": self._base_batch}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (taken on rank 0); a different world size keeps the learning
        (policy, statistics) but not what was per rank (memory bounds, the last sizes)."""
        self.history = list(state["history"])
        self._total_steps = int(state["total_steps"])
        same_world = state["world_size"] == self.loader.world_size
        if same_world:
            self.bounds.learned_max = list(state["learned_max"])
        if state.get("root") is not None:
            root = state["root"]
            self.policy.load_state_dict(root["policy"])
            if not same_world:
                self.policy.reset_world(self.loader.world_size)
            self.stats = root["stats"]
            self._ref_goodput, self._ref_tput = root["ref_goodput"], root["ref_tput"]
            self._prev_loss, self._base_batch = root["prev_loss"], root["base_batch"]
            self._prev_sizes = root["prev_sizes"] if same_world else None

    # --- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop deciding: detach from the loader, stop the resource thread, free the control channel
        (an MPI communicator: every rank calls this). Idempotent; call it after training, or use
        ``with DynamixController(...) as controller:``."""
        if self._on_step_end in self.loader.step_end_callbacks:
            self.loader.step_end_callbacks.remove(self._on_step_end)
        self.resources.close()
        self.channel.close()

    def __enter__(self) -> "DynamixController":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
