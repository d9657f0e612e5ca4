"""The DYNAMIX controller: every rank reports, rank 0 decides, every rank applies.

The only module that knows rank 0 decides; it is transport only. Per decision (end of every epoch,
and every k steps inside long epochs):

1. every rank condenses its step records, resource use, losses and gradient norms into a typed
   report (:class:`~dynamix_hvd.control.core.RankInput`) and encodes it as one float64 array
   (:mod:`dynamix_hvd.control.wire`);
2. the arrays are gathered on rank 0 (``ControlChannel.gather_arrays`` of `comm.CONTROL_REPORTS`: a
   deadline, names a silent rank);
3. rank 0 decodes them and hands them to the :class:`~dynamix_hvd.control.core.DecisionCore`, which
   updates the statistics, computes the reward earned by the previous decision, and asks the policy
   for new per-rank sizes and the AdaScale gain;
4. the decision is broadcast as an array (`comm.CONTROL_DECISION`) and every rank applies it to its loader and optimizer.

Ordering hazard: decisions run inside the loader's step-end callback, i.e. after a step's
``optimizer.step()`` and before the next batch is planned. Every rank reaches that point after the
same number of steps, which is what keeps the collectives matched.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections import deque
from typing import Any

import torch

from . import wire
from .actions import BatchBounds
from .cadence import DecisionCadence, interval_ceiling
from .changewatch import OwnSpeed, vote_every
from .config import POLICY_NAMES, ControllerConfig, make_core
from .core import WARMUP_STEPS, LayerMeans, RankInput, StepSeries
from .policy import BatchSizePolicy
from .seams import check_optimizer
from .state import RankReport
from ..comm import (CONTROL_CHANGE, CONTROL_DECISION, CONTROL_MEMORY, CONTROL_REPORTS, ControlChannel, StallWatchdog, abort_world,
                    failed_exit)
from ..data.loader import AdaptiveLoader
from ..data.memory import IntervalPeak, MemoryBudget, memory_budget, memory_in_use, sharing_key
from ..data.metrics import StepColumns
from ..data.resources import ResourceSampler
from ..logs import get_logger
from ..stats.noise_scale import GradientStatistics

__all__ = ["POLICY_NAMES", "ControllerConfig", "DynamixController"]


def per_rank_batchnorm(model: torch.nn.Module | None) -> list[str]:
    """Names of the layers of `model` that normalise with each rank's own batch statistics in training
    (the BatchNorm family; torch's and Horovod's SyncBatchNorm pool all ranks and do not count)."""
    if model is None:
        return []
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and type(m).__name__ != "SyncBatchNorm"]


NO_MODEL_WARNING = ("DynamixController was given no model=, so it cannot see BatchNorm layers: with an uneven "
                    "split a rank may normalise with the statistics of a few samples. Pass model=model (a model "
                    "without per-rank BatchNorm changes nothing).")


def batchnorm_floor(cfg: ControllerConfig, model: torch.nn.Module | None, sizes: Any) -> ControllerConfig:
    """`cfg` with min_batch raised to `cfg.advanced.batchnorm_min_batch` (at most the smallest initial size)
    when `model` has per-rank batch-statistics layers."""
    if not per_rank_batchnorm(model):
        return cfg
    floor = min(cfg.advanced.batchnorm_min_batch, min(sizes))
    return cfg if floor <= cfg.min_batch else dataclasses.replace(cfg, min_batch=floor)


def token_bounds(cfg: ControllerConfig, loader: AdaptiveLoader) -> ControllerConfig:
    """`cfg` for a loader that plans by token budgets: the batch bounds count tokens there, and a
    bound left at its default (given in samples) becomes the default times the mean sample length."""
    if loader.budget != "tokens":
        return cfg
    defaults = ControllerConfig()
    per_sample = math.ceil(loader.epoch_size / loader.num_samples)
    changes = {name: getattr(defaults, name) * per_sample for name in ("max_batch",)
               if getattr(cfg, name) == getattr(defaults, name)}
    floor = defaults.advanced.batchnorm_min_batch
    if cfg.advanced.batchnorm_min_batch == floor:
        changes["advanced"] = dataclasses.replace(cfg.advanced, batchnorm_min_batch=floor * per_sample)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def warn_if_split(record: dict[str, Any]) -> None:
    """Rank 0: a warning when a decision leaves the job's own split because a rank was measured slower
    (once per such decision, not at every decision that follows the split)."""
    t = (record.get("info") or {}).get("transition") or {}
    if t.get("next") != "judging split" or t.get("phase") == "judging split":
        return
    ev = t.get("evidence", {})
    gap, rank = ev.get("gap_bound"), ev.get("slowest_rank")
    get_logger(__name__).warning(
        "rank %s was measured slower than the others (equalising their arrivals shortens the step by at least "
        "%.0f%%): local batch sizes %s -> %s (dynamix-hvd explain RUN_DIR shows each decision and why)",
        rank, 100 * gap if isinstance(gap, (int, float)) else float("nan"),
        "/".join(map(str, record.get("previous_sizes") or [])), "/".join(map(str, record.get("sizes") or [])))


class DynamixController:
    """Attach to a loader and optimizer; decisions then happen by themselves as the loader iterates.

    The optimizer must provide :class:`~dynamix_hvd.control.seams.ControlledOptimizer` (wrap it with
    ``dynamix_hvd.WeightedDistributedOptimizer``); anything else is refused with a TypeError. Give
    `model` so that BatchNorm layers, which normalise with each rank's own batch, keep every rank at
    `AdvancedConfig.batchnorm_min_batch` samples or more."""

    def __init__(self, loader: AdaptiveLoader, optimizer: Any, config: ControllerConfig | None = None,
                 device: torch.device | None = None, model: torch.nn.Module | None = None) -> None:
        self.cfg = batchnorm_floor(token_bounds(config or ControllerConfig(), loader), model, loader.batch_sizes)
        self.optimizer = check_optimizer(optimizer)
        self.loader = loader
        self.channel = ControlChannel()
        if self.channel.size != loader.world_size:
            raise ValueError(f"control plane has {self.channel.size} ranks but the loader plans "
                             f"{loader.world_size} (batch_sizes={list(loader.batch_sizes)})")
        self.rank = self.channel.rank
        if model is None and self.rank == 0 and self.cfg.policy != "static":
            warnings.warn(NO_MODEL_WARNING, stacklevel=2)
        # np.median imports numpy.ma on first use: 0.2 s here, which would land in the first decision
        # (inside the first epoch, with every other rank waiting); pay it now, before training starts
        import numpy.ma  # noqa: F401
        # The memory this rank may plan with: ranks on one device, or in one cgroup on a host, share
        # it. Which ranks share is learnt by a collective at the first decision of each world
        # (`_share_memory_budget`), not here: a worker that joins an elastic job constructs its
        # controller while the others are already training, and a collective only it calls would
        # deadlock. Until then the budget is this process's alone (nothing reads it before a report).
        self._device = device
        self.memory_budget: MemoryBudget = memory_budget(device)
        """The peak memory this rank may plan to use, and where that number comes from."""
        self._budget_shared = False
        self.memory_floor_bytes = memory_in_use(device)  # before training: model, data, libraries
        self._interval_peak = None if device is not None and device.type == "cuda" else IntervalPeak()
        self.resources = ResourceSampler(device, background_period_s=self.cfg.advanced.resource_period_s,
                                         budget_bytes=self.memory_budget.bytes)
        self.history: list[dict[str, Any]] = []   # every decision, kept on every rank
        self.inputs: deque[list[RankInput]] = deque(maxlen=self.cfg.advanced.keep_inputs)
        """Rank 0: the decoded reports of the last `keep_inputs` decisions, as the core received them."""
        self._losses: list[torch.Tensor] = []
        self._fresh_start = True  # the next report is this process's first and holds its first steps
        self._total_steps = 0
        self._steps_since = 0  # loader steps (micro-batches) since the last decision (identical on every rank)
        self.cadence = DecisionCadence.from_config(self.cfg.decide_every_steps, self.cfg.advanced.cadence,
                                                   self.cfg.total_epochs)
        for r, b in enumerate(loader.batch_sizes):
            if not self.cfg.min_batch <= b <= self.cfg.max_batch:
                raise ValueError(f"initial batch size {b} of rank {r} outside [{self.cfg.min_batch}, "
                                 f"{self.cfg.max_batch}] (ControllerConfig min_batch, max_batch; in "
                                 f"{loader.budget}, as the loader's batch sizes)")
        # Every rank holds a core and a policy, so that any rank can take over as rank 0 after an
        # elastic reset; only rank 0's is consulted.
        self.core = make_core(self.cfg, loader.world_size,
                              loader.global_micro_batch * self.optimizer.backward_passes_per_step,
                              self.optimizer.param_names, base_batch=self.optimizer.base_batch_size)
        self._due = False  # a decision fell due between the micro-batches of a step: taken at its end
        self._spacing = 0  # fewest steps before the next decision, sent by rank 0 with the last decision
        self._recheck = False  # the last decision asked for the next one soon (sent with it, like the spacing)
        self._ceiling = 0  # most steps in an in-epoch interval, sent by rank 0 with the last decision
        self._vote_every = 0  # loader steps between two change votes, sent by rank 0 with the last decision
        self._since_vote = 0  # loader steps since the last change vote or decision (identical on every rank)
        self._changed_by: list[int] = []  # ranks whose change vote brought the coming decision forward
        self._own_speed = OwnSpeed()  # this rank's reference compute time, which its change votes compare with
        self._latency_probe_s = math.nan  # the single-value allreduce timed after the last decision
        loader.step_end_callbacks.append(self._on_step_end)
        self.optimizer.oom_handler = self._shrink_after_oom
        # Under MPI and torch.distributed: a rank that waits in the gradient allreduce, or makes no
        # progress at all, for longer than timeout_s probes the others and ends the job naming any that
        # no longer answer (a stopped or dead rank would hang it).
        tracker = self.loader.tracker
        self.watchdog = (StallWatchdog(self.channel, tracker.sync_wait_started, self.cfg.timeout_s,
                                       progress_at=tracker.progress_at)
                         if self.channel.backend in ("mpi4py", "torch-gloo") else None)

    @property
    def policy(self) -> BatchSizePolicy:
        return self.core.policy  # type: ignore[return-value]

    @property
    def stats(self) -> GradientStatistics:
        return self.core.stats

    @property
    def bounds(self) -> BatchBounds:
        return self.core.bounds

    def rebind(self, rank: int, world_size: int) -> None:
        """Join a new world after an elastic reset (the loader is rebound by its own handler)."""
        self.rank = rank
        if world_size != self.core.world_size:
            self.core.bounds = BatchBounds(world_size, self.cfg.min_batch, self.cfg.max_batch,
                                           max_passes=self.cfg.max_passes)
        self.core.decisions = len(self.history)  # a new rank 0 numbers on from the shared history
        self._budget_shared = False  # the ranks that share this one's memory may have changed
        self._spacing = 0  # every rank of the new world starts without it (the cadence must agree)
        self._recheck = False
        self._ceiling = 0
        self._vote_every = self._since_vote = 0
        self._changed_by = []
        self._own_speed.forget()
        self.optimizer.set_noise_every(1)  # the new world's ranks measure the same steps from here

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
        self._steps_since += 1
        self._since_vote += 1
        if 0 < self._vote_every <= self._since_vote and not self.optimizer.accumulating:
            try:
                self._change_vote()
            except Exception as exc:  # inside the training loop: the other ranks would wait for this one
                if self.channel.backend == "horovod-objects":
                    raise
                abort_world(f"rank {self.rank}: change vote after decision {len(self.history)} failed: "
                            f"{type(exc).__name__}: {exc}")
        due = self.cadence.due(epoch_end=epoch_end, steps_since=self._steps_since, decisions=len(self.history),
                               epoch=loader.epoch, step=loader.step, sizes=loader.batch_sizes,
                               epoch_length=lambda: len(loader), spacing=self._spacing,
                               recheck=self._recheck_steps(), ceiling=self._ceiling,
                               changed=bool(self._changed_by))
        # Ordering hazard: with accumulation a decision between micro-batches would report a step
        # that has not ended and change the micro-batch count mid-step, so it waits for the step's end
        # (every rank is between the same micro-batches; an epoch's end always ends a step).
        self._due = self._due or due
        if self._due and not self.optimizer.accumulating:
            self._due = False
            try:
                self.decide()
            except Exception as exc:  # inside the training loop: the other ranks would wait for this one
                if self.channel.backend == "horovod-objects":
                    raise
                abort_world(f"rank {self.rank}: decision {len(self.history) + 1} failed: {type(exc).__name__}: {exc}")

    def _change_vote(self) -> None:
        """Every rank: one small collective, whether any rank's own compute time per step moved since
        the last decision (`changewatch.own_change`); remembers which ranks said so for the decision."""
        self._since_vote = 0
        tracker = self.loader.tracker
        compute, batch = tracker.undrained("compute_s"), tracker.undrained("local_batch")
        first = tracker.finished - len(compute)  # the step count of compute[0]
        mine = self._own_speed.vote(compute, batch, first, self.loader.batch_sizes[self.rank],
                                    self.cfg.advanced.cadence.change_ratio)
        votes = self.channel.allgather_object(mine, CONTROL_CHANGE.within(self.cfg.timeout_s))
        self._changed_by = [r for r, v in enumerate(votes) if v]

    # --- one decision --------------------------------------------------------------------------------
    def decide(self) -> dict[str, Any]:
        """One decision on every rank; returns this rank's record of it (rank 0's is the full one).

        Called directly, a failure (e.g. `ControlPlaneTimeout` naming a silent rank) raises to the
        caller; the decisions the controller takes by itself inside the loop abort the MPI world
        instead (`comm.abort_world`), since the other ranks would wait for this one forever."""
        if self.optimizer.accumulating:
            raise RuntimeError("decide() between the micro-batches of an optimizer step; call it after step()")
        t0 = time.perf_counter()
        self._steps_since = self._since_vote = 0
        changed_by, self._changed_by = self._changed_by, []
        if self.rank in changed_by:  # this rank's speed changed: its reference is taken again
            self._own_speed.forget()
        if not self._budget_shared:
            self._share_memory_budget()
        mine = wire.encode_report(self._report(self.loader.tracker.drain()))
        # A rank that rejoined after an elastic reset may have recorded fewer steps: lengths may differ.
        rows = self.channel.gather_arrays(mine, CONTROL_REPORTS.within(self.cfg.timeout_s))
        record, sent = None, None
        if rows is not None:
            t1 = time.perf_counter()
            inputs = wire.decode_reports(rows)
            if self.inputs.maxlen:
                self.inputs.append(inputs)
            decision = self.core.decide(inputs, list(self.loader.batch_sizes), self.loader.epoch,
                                        passes=self.optimizer.backward_passes_per_step,
                                        done=self.loader.epochs_done, changed_by=changed_by)
            record = decision.record()
            warn_if_split(record)
            # per loader step, the cadence's unit (a step record spans the micro-batches of the
            # interval that ran, before this decision sets their number for the next)
            passes = self.optimizer.backward_passes_per_step
            step_s = [i.report.step_s / passes for i in inputs]
            spacing = self._budget_spacing(time.perf_counter() - t1, step_s)
            cadence = self.cfg.advanced.cadence
            ceiling = interval_ceiling(cadence.max_decision_interval_s, step_s)
            # a vote compares steps at the planned size: none under accumulation (a step's record sums
            # its micro-batches) or token budgets (a step's tokens are what it drew)
            votes = (vote_every(cadence.change_vote_s, step_s) if self.cfg.decide_every_steps is None
                     and decision.passes == 1 and self.loader.budget != "tokens" else 0)
            noise_every = self.optimizer.noise_every_for(statistics.median(i.report.step_s for i in inputs))
            sent = wire.encode_decision(decision.index, decision.epoch, decision.lr_gain, decision.sizes,
                                        decision.previous_sizes, decision.passes, spacing, decision.recheck,
                                        ceiling, votes, noise_every)
        # Only what the ranks need travels; the full record (reports, rewards, statistics) stays on 0.
        world = self.loader.world_size
        compact = wire.decode_decision(
            self.channel.broadcast_array(sent, wire.decision_length(world), CONTROL_DECISION.within(self.cfg.timeout_s)),
            world)
        # Every rank has just received the decision, so they are as close together as they get: a
        # single-value allreduce now times the collective's latency (reported with the next interval).
        self._latency_probe_s = self.optimizer.time_small_allreduce()
        self.loader.set_batch_sizes(compact["sizes"])
        if compact["passes"] != self.optimizer.backward_passes_per_step:
            self.optimizer.set_backward_passes_per_step(compact["passes"])
        self.optimizer.lr_gain = compact["lr_gain"]
        self._spacing, self._recheck, self._ceiling = compact["spacing"], compact["recheck"], compact["ceiling"]
        self._vote_every = compact["vote_every"]
        self.optimizer.set_noise_every(compact["noise_every"])
        record = dict(record or compact, overhead_s=time.perf_counter() - t0, spacing=self._spacing,
                      recheck=self._recheck, ceiling=self._ceiling, vote_every=self._vote_every,
                      changed_by=changed_by, total_steps=self._total_steps, noise_every=compact["noise_every"])
        if self.rank == 0:
            t1 = time.perf_counter()
            update = self.policy.after_decision()  # learning runs after the others got the decision
            if update:
                record.update(ppo_update=update, learn_s=time.perf_counter() - t1)
        self.history.append(record)
        return record

    def _share_memory_budget(self) -> None:
        """Every rank, at the first decision of a world: learn which ranks share this one's device or
        cgroup (one collective) and divide the budget between them."""
        keys = self.channel.allgather_object(sharing_key(self._device), CONTROL_MEMORY.within(self.cfg.timeout_s))
        self.memory_budget = memory_budget(self._device, shared_by=keys.count(keys[self.rank]))
        self.resources.budget_bytes = self.memory_budget.bytes
        self._budget_shared = True
        get_logger(__name__).info("memory budget %s", self.memory_budget.describe())

    def _recheck_steps(self) -> int:
        """Loader steps to a recheck the last decision asked for (0: none): `min_decision_steps`
        optimizer steps, enough for the paired test, also when each accumulates micro-batches."""
        if not self._recheck:
            return 0
        return self.cfg.advanced.cadence.min_decision_steps * self.optimizer.backward_passes_per_step

    def _budget_spacing(self, decide_s: float, step_s: list[float]) -> int:
        """Rank 0: fewest loader steps (of `step_s` seconds, per rank) before the next decision so that
        deciding (rank 0's share, which every rank waits for) stays within `decision_budget` of the
        training time (0: no limit)."""
        step = statistics.median(step_s) if step_s else 0.0
        budget = self.cfg.advanced.cadence.decision_budget
        if not budget or not step > 0 or not math.isfinite(decide_s):
            return 0
        return min(1 << 20, math.ceil(decide_s / (budget * step)))

    def _report(self, records: StepColumns) -> RankInput:
        res = self.resources.latest()
        losses = torch.stack(self._losses).tolist() if self._losses else []
        finite_losses = [l for l in losses if math.isfinite(l)]  # a NaN step must not poison the mean
        self._losses.clear()
        # A fresh process's first steps pay one-off costs (lazy initialisation, the allocator): the
        # times reported are those of the steps after them (the per-step series keep every step; the
        # decision core leaves the same steps out of its cost fit).
        timed = records[WARMUP_STEPS:] if self._fresh_start and len(records) > WARMUP_STEPS else records
        self._fresh_start = False
        mean = (lambda key: statistics.fmean(timed.column(key).tolist()) if timed else 0.0)  # noqa: E731

        def finite_mean(key: str) -> float:  # NaN on steps that took no noise statistics
            values = [v for v in timed.values(key) if math.isfinite(v)] if timed else []
            return statistics.fmean(values) if values else math.nan
        total_time = sum(timed.column("step_s").tolist())
        kind = records[-1].memory_kind if records else "rss"
        peak = max(records.values("peak_memory_bytes"), default=0)
        if self._interval_peak is not None:  # CPU: the resident set's peak over this interval
            peak, kind = self._interval_peak.take(), self._interval_peak.kind
        report = RankReport(
            rank=self.rank, local_batch=self.loader.batch_sizes[self.rank], steps=len(records),
            compute_s=mean("compute_s"), sync_wait_s=mean("sync_wait_s"), data_wait_s=mean("data_wait_s"),
            step_s=mean("step_s"),
            samples_per_s=sum(timed.values("local_batch")) / total_time if total_time > 0 else 0.0,
            peak_memory_bytes=peak, memory_floor_bytes=self.memory_floor_bytes,
            mem_used_bytes=res.mem_used_bytes, mem_total_bytes=self.memory_budget.bytes, cpu_util=res.cpu_util,
            gpu_util=res.gpu_util, net_bytes_per_s=res.net_bytes_per_s, tcp_retrans_per_s=res.tcp_retrans_per_s,
            # recorded losses none of which is finite: diverged (inf), which the growth check acts on
            loss_mean=statistics.fmean(finite_losses) if finite_losses else (math.inf if losses else math.nan),
            local_grad_sq=finite_mean("local_grad_sq"), global_grad_sq=finite_mean("global_grad_sq"),
            max_batch=self.bounds.upper(self.rank), allreduce_bytes=self.optimizer.allreduce_bytes,
            latency_probe_s=self._latency_probe_s)
        steps = StepSeries(local_batch=records.values("local_batch"), local_sq=records.values("local_grad_sq"),
                           global_sq=records.values("global_grad_sq"),
                           losses=wire.padded_losses(losses, len(records)),
                           memory_kind=kind,
                           compute_s=records.values("compute_s"), data_wait_s=records.values("data_wait_s"),
                           sync_wait_s=records.values("sync_wait_s"),
                           micro_batches=records.values("micro_batches"),
                           sq_tokens=records.values("local_sq_tokens"))
        layers = self.optimizer.pop_layer_means()
        return RankInput(report, steps, None if layers is None else LayerMeans(*layers))

    def config_dict(self) -> dict[str, Any]:
        """Every setting this controller runs with, as plain JSON values (`ControllerConfig.to_dict`):
        the config it was given with the batch bounds it derived (a BatchNorm model's floor, token
        budgets' bounds) applied and the policy's default settings spelled out
        (`ControllerConfig.resolved`); ``ControllerConfig.from_dict`` rebuilds it."""
        return self.cfg.resolved().to_dict()

    # --- checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue, as plain values: on rank 0 also the decision core (policy,
        statistics, reward references). ``config`` records the settings the run had
        (:meth:`config_dict`); a restored job runs with the config it is given."""
        state: dict[str, Any] = {"history": self.history, "total_steps": self._total_steps,
                                 "steps_since": self._steps_since, "since_vote": self._since_vote,
                                 "learned_max": list(self.bounds.learned_max), "bounds": self.bounds.state_dict(),
                                 "world_size": self.loader.world_size, "config": self.config_dict()}
        if self.rank == 0:
            state["root"] = self.core.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (taken on rank 0); a different world size keeps the learning
        (policy, statistics) but not what was per rank (memory bounds, the last sizes)."""
        self.history = list(state["history"])
        self._total_steps = int(state["total_steps"])
        self._steps_since = int(state.get("steps_since", 0))
        self._due = False
        # the last decision's spacing, from the history every rank loads alike: the cadence agrees and
        # continues where the checkpointed run was
        self._spacing = int(self.history[-1].get("spacing") or 0) if self.history else 0
        self._recheck = bool(self.history[-1].get("recheck")) if self.history else False
        self._ceiling = int(self.history[-1].get("ceiling") or 0) if self.history else 0
        self._vote_every = (int(self.history[-1].get("vote_every") or 0)
                            if self.history and self.cfg.decide_every_steps is None else 0)
        self._since_vote, self._changed_by = int(state.get("since_vote", 0)), []
        self.optimizer.set_noise_every(int(self.history[-1].get("noise_every") or 1) if self.history else 1)
        self._own_speed.forget()
        # the micro-batches per step the last decision set (a rank joining after an elastic reset
        # starts with its constructor's; every rank must accumulate alike or their allreduces differ)
        passes = int(self.history[-1].get("passes", 0)) if self.history else 0
        if passes and passes != self.optimizer.backward_passes_per_step and not self.optimizer.accumulating:
            self.optimizer.set_backward_passes_per_step(passes)
        if state["world_size"] == self.loader.world_size:
            self.bounds.load_state_dict(state.get("bounds") or state)
        if state.get("root") is not None:
            self.core.load_state_dict(state["root"], world_size=self.loader.world_size)
            self.core.base_batch = float(self.optimizer.base_batch_size)  # the optimizer's, as configured now

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's part of the open decision interval, as plain values (a checkpoint holds one per
        rank): its step records and losses since the last decision, which the next one reports."""
        return {"records": self.loader.tracker.state_dict(), "losses": [float(loss) for loss in self._losses]}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's open interval: its first report then holds the same steps as in the
        uninterrupted run, warm-up included (a restored decision core fits every step)."""
        self.loader.tracker.load_state_dict(state["records"])
        self._fresh_start = False
        self._losses = [torch.tensor(float(loss), dtype=torch.float64) for loss in state["losses"]]

    # --- lifetime ------------------------------------------------------------------------------------
    def close(self, failed: bool = False) -> None:
        """Stop deciding: detach from the loader, stop the resource thread, free the control channel
        (an MPI communicator: every rank calls this). Idempotent; call it after training, or use
        ``with DynamixController(...) as controller:``. `failed`: this rank leaves training on an
        error, so the other ranks' stall watchdogs keep watching it (the ``with`` block sets it)."""
        if self._on_step_end in self.loader.step_end_callbacks:
            self.loader.step_end_callbacks.remove(self._on_step_end)
        self.resources.close()
        if self.watchdog is not None:
            self.watchdog.close(failed)
        self.channel.close()

    def __enter__(self) -> "DynamixController":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        self.close(failed=failed_exit(exc_type, exc))
