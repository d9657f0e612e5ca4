"""A simulated synchronous data-parallel cluster with the live controller's exact interface.

Pure NumPy/PyTorch: no MPI, no Horovod. The simulator produces, per decision interval, what the live
controller (:mod:`dynamix_hvd.control.controller`) sees: one typed :class:`~dynamix_hvd.control.core.RankInput`
per rank (its :class:`~dynamix_hvd.control.state.RankReport` and per-step series), handed to the same
:class:`~dynamix_hvd.control.core.DecisionCore` the live controller uses. The core turns them into the
observation, the reward (reference = the first interval's goodput), the noise scale and efficiency (fed
step by step with the same per-step squared gradient norms) and the memory bounds (learned from peak
memory on "GPU" clusters, from out-of-memory failures on "CPU" ones); PPO actions correct the
model-based proposal through :func:`dynamix_hvd.control.refine.refine`, as the live policy does. So a
policy trained here sees the same numbers at run time.

Models (all vectorised over ranks and steps; 1024 ranks are fine):

* compute of rank i per step: ``(alpha_i + beta_i * max(b_i, knee_i)) * slow_i * lognormal(jitter)``
  (``knee_i``: a GPU that a small batch does not fill takes as long as for ``knee_i`` samples), plus
  transient stalls (``stall_prob`` per rank and step, Pareto-distributed above ``stall_s``: a garbage
  collection, a noisy neighbour); ``slow_i`` can drift mid-run (``drift``: at a progress fraction a
  rank slows by a factor, e.g. 2x);
* where a fitted model is misspecified: a co-located job that slows one rank by ``interfere_factor``
  for ``interfere_s`` every ``interfere_every_s`` seconds of training; ranks' slowness that moves on
  by one rank every ``move_every`` decisions; bandwidth bursts (1/``burst_factor`` of the bandwidth for
  ``burst_s`` every ``burst_every_s`` seconds); a noise estimate biased by ``noise_bias`` early in
  training (fading until ``noise_bias_until``). :data:`bench.lab.scenarios.MISSPECIFIED` names them;
* data loading: ``data_s + data_s_per_sample * b_i``;
* ring allreduce: ``T_net = 2 (R-1) latency + 2 (R-1)/R * model_bytes / (bandwidth / (1 + load))``, where
  the background load (contention) fluctuates per interval and causes TCP retransmits;
* synchronous step (Pollux, overlap exponent ``gamma``):
  ``T_sync = (max_i arrival_i ** gamma + T_net ** gamma) ** (1 / gamma)``, arrival = data + compute;
  rank i waits ``T_sync - arrival_i`` in allreduce; the step ends after the optimizer update;
* memory: peak bytes = ``mem_base + mem_per_sample * b``; a batch above capacity fails (OOM): the step is
  redone smaller, as the live optimizer does;
* statistics: progress is measured in reference-batch-equivalent samples, one step adds
  ``B * (phi + B_ref) / (phi + B)`` (Pollux efficiency). The noise scale ``phi`` grows geometrically from
  ``phi_start`` to ``phi_end`` as progress goes from 0 to the target, the true gradient's squared norm
  falls from ``grad_sq_start`` to ``grad_sq_end``, and per-rank gradients are simulated in
  ``grad_dims`` dimensions (mean + noise of covariance trace ``phi * |G|^2 / b_i``), which gives the
  per-step local/global squared norms the controller's estimator uses;
* loss: ``loss_end + (loss_start - loss_end) * exp(-loss_rate * p)`` plus sampling noise; when the
  global batch (hence, through the LR rule, the learning rate) jumps up, the loss spikes by
  ``spike_coef * log2(lr ratio)`` (decaying over ``spike_steps``) and progress slows meanwhile.

Decisions: every ``steps_per_decision`` steps (``cadence="fixed"``), or where the live controller's
default cadence puts them (``cadence="live"``: :class:`~dynamix_hvd.control.cadence.DecisionCadence` over
epochs of ``dataset_size`` samples, whose last step takes the remainder: epoch ends, a ramp of short
first intervals, then ``target_decisions`` spread over ``total_epochs``).

An episode is a training run from ``start_progress`` until the statistical target or ``max_decisions``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from dynamix_hvd.control.actions import ActionSpace, BatchBounds
from dynamix_hvd.control.cadence import CadenceConfig, DecisionCadence, interval_ceiling
from dynamix_hvd.control.changewatch import OwnSpeed, vote_every
from dynamix_hvd.control.core import DecisionCore, Observation, RankInput, StepSeries
from dynamix_hvd.control.costmodel import CostConfig
from dynamix_hvd.control.policy import BatchSizePolicy, DecisionInput
from dynamix_hvd.control.proposal import ModelPolicy
from dynamix_hvd.control.refine import refine
from dynamix_hvd.control.reward import RewardConfig
from dynamix_hvd.control.state import RankReport
from dynamix_hvd.optim.lr_scaling import lr_factor
from dynamix_hvd.stats.noise_scale import GradientStatistics, StatsConfig


CHANGE_RATIO = CadenceConfig().change_ratio
"""The live default's change ratio (``ControllerConfig.advanced.cadence.change_ratio``)."""


@dataclass
class ClusterSpec:
    """One concrete simulated job (cluster + workload). Per-rank fields are lists, one entry per rank."""

    alpha_s: list[float]
    """Fixed compute time per step of each rank (s): kernel launches, small layers."""
    beta_s: list[float]
    """Compute time per sample of each rank (s)."""
    initial_batch: list[int]
    """The user's static local batch sizes (the reference configuration)."""
    mem_base_bytes: list[float] = field(default_factory=list)
    """Memory in use at batch 0 (weights, optimizer state); empty: 1 GB on every rank."""
    mem_per_sample_bytes: list[float] = field(default_factory=list)
    """Activation memory per sample; empty: 20 MB on every rank."""
    mem_total_bytes: list[float] = field(default_factory=list)
    """Device memory of each rank; empty: 16 GB on every rank."""
    gpu: bool = True
    """True: memory bounds learned from peak memory (as on CUDA); False: from OOM failures (as on CPU)."""
    net_latency_s: float = 5e-6
    """Latency of one ring-allreduce hop (s)."""
    model_bytes: float = 4e6
    """Gradient bytes allreduced per step."""
    bandwidth_Bps: float = 1.25e9
    """Link bandwidth in bytes/s."""
    contention: float = 0.0
    """Mean background network load (fraction of bandwidth used by others, 0 = idle network)."""
    gamma: float = 1.0
    """Pollux overlap exponent: 1 = compute and allreduce add up, large = fully overlapped."""
    data_s: float = 1e-4
    """Data-loading time per step (s)."""
    data_s_per_sample: float = 0.0
    """Data-loading time per sample (s)."""
    optimizer_s: float = 2e-4
    """Optimizer update time per step (s)."""
    jitter: float = 0.05
    """Log-normal sigma of per-step compute-time noise."""
    knee: list[float] = field(default_factory=list)
    """Small-batch knee of each rank (samples): compute is ``alpha + beta * max(b, knee)``, flat below
    it (a GPU a small batch does not fill); empty: no knee."""
    stall_prob: float = 0.0
    """Chance per rank and step of a transient stall (GC pause, noisy neighbour, slow I/O)."""
    stall_s: float = 0.0
    """Shortest stall (s); stalls are Pareto-distributed above it (heavy-tailed), capped at 50x."""
    stall_shape: float = 1.5
    """Pareto shape of the stalls (smaller = heavier tail)."""
    drift: list[tuple[float, int, float]] = field(default_factory=list)
    """Speed changes: (progress fraction, rank, factor), e.g. (0.5, 3, 2.0) = rank 3 twice as slow from half-way."""
    interfere_every_s: float = 0.0
    """A co-located job slows one rank every this many seconds of training (0: never); a model fitted
    on the recent past mistakes it for a change of speed."""
    interfere_s: float = 0.0
    """How long each such slow-down lasts (s)."""
    interfere_factor: float = 1.0
    """How many times slower the rank computes meanwhile."""
    interfere_rank: int = -1
    """The rank it hits (-1: one drawn afresh for each slow-down)."""
    move_every: int = 0
    """The ranks' slowness (``slow``, from stragglers and drift) moves on by one rank every this many
    decision intervals, the first (before any decision) included (0: never): a straggler that moves
    between ranks."""
    burst_every_s: float = 0.0
    """Every this many seconds the link carries only 1/`burst_factor` of its bandwidth for `burst_s`
    seconds (0: never): bandwidth bursts of another job."""
    burst_s: float = 0.0
    burst_factor: float = 1.0
    noise_bias: float = 1.0
    """The gradient noise the controller measures is this factor times the true one at the start,
    fading linearly to the truth at progress fraction `noise_bias_until` (1: unbiased): an estimate
    biased early in training."""
    noise_bias_until: float = 0.0
    phi_start: float = 200.0
    """Gradient noise scale at the start of training (samples)."""
    phi_end: float = 2000.0
    """Gradient noise scale at the target (grows geometrically with progress)."""
    grad_sq_start: float = 1.0
    """Squared norm of the true gradient at the start."""
    grad_sq_end: float = 0.05
    """... at the target."""
    grad_dims: int = 16
    """Dimensions of the simulated gradient vectors (more = less noisy norm estimates)."""
    loss_start: float = 2.3
    """Loss at the start of training."""
    loss_end: float = 0.3
    """Loss approached at the target."""
    loss_rate: float = 3.0
    """Exponential decay rate of the loss with progress."""
    loss_noise: float = 1.0
    """Per-sample relative loss std (a rank's mean loss has std loss * loss_noise / sqrt(b))."""
    spike_coef: float = 0.3
    """Relative loss spike per doubling of the learning rate caused by a global-batch increase."""
    spike_steps: float = 5.0
    """Decay time of a loss spike (steps)."""
    spike_progress_cost: float = 0.5
    """Fraction of a step's progress lost per unit of current spike (capped at 90%)."""
    lr_rule: str = "sqrt"
    """How the learning rate follows the global batch (see :mod:`dynamix_hvd.optim.lr_scaling`);
    "adascale" (the live optimizer's default) uses the gain of the true statistics. The shipped
    policy was pretrained with "sqrt"."""
    ref_batch: int = 0
    """B_ref of the progress unit; 0 = the initial global batch."""
    target_progress: float = 2e5
    """Statistical progress (B_ref-equivalent samples) that ends training."""
    dataset_size: int = 50_000
    """Samples per epoch (for the epoch-based progress feature)."""
    total_epochs: int = 0
    """Training budget for the progress feature (as ControllerConfig.total_epochs); 0: target at B_ref."""
    steps_per_decision: int = 20
    """Optimizer steps per decision interval with ``cadence="fixed"`` (ControllerConfig.decide_every_steps)."""
    cadence: str = "fixed"
    """"fixed": a decision every `steps_per_decision` steps; "live": the live controller's default
    cadence (epoch ends, a ramp, then `target_decisions` spread over `total_epochs` epochs of
    `dataset_size` samples; an epoch's last step takes the remainder)."""
    target_decisions: int = 32
    """ControllerConfig.advanced.cadence.target_decisions (``cadence="live"``)."""
    min_decision_steps: int = 8
    """ControllerConfig.advanced.cadence.min_decision_steps (``cadence="live"``)."""
    max_decision_interval_s: float = 20.0
    """ControllerConfig.advanced.cadence.max_decision_interval_s (``cadence="live"``): the longest
    in-epoch interval, in seconds at the last interval's mean step time."""
    change_vote_s: float = 0.25
    """ControllerConfig.advanced.cadence.change_vote_s (``cadence="live"``): seconds of training (at the
    last interval's mean step time) between two change votes; a yes ends the interval there
    (:mod:`dynamix_hvd.control.changewatch`). 0: no votes."""
    max_decisions: int = 2000
    """Decisions after which an episode stops even if the target was not reached."""
    min_batch: int = 1
    """Smallest local batch (ControllerConfig.min_batch)."""
    max_batch: int = 1024
    """Largest local batch (ControllerConfig.max_batch)."""
    max_passes: int = 1
    """Micro-batches a policy may accumulate per optimizer step (ControllerConfig.max_passes)."""
    oom_penalty_s: float = 0.0
    """Extra time lost per out-of-memory failure beyond the redone step (s)."""
    name: str = "cluster"
    """Free-form label (workload family, calibration source)."""

    def __post_init__(self) -> None:
        R = len(self.alpha_s)
        if R < 1 or len(self.beta_s) != R or len(self.initial_batch) != R:
            raise ValueError(f"alpha_s, beta_s, initial_batch need one entry per rank (got {len(self.alpha_s)}, "
                             f"{len(self.beta_s)}, {len(self.initial_batch)})")
        for name, default in (("mem_base_bytes", 1e9), ("mem_per_sample_bytes", 2e7), ("mem_total_bytes", 16e9),
                              ("knee", 0.0)):
            value = getattr(self, name)
            if len(value) == 0:
                setattr(self, name, [default] * R)
            elif len(value) != R:
                raise ValueError(f"{name} needs {R} entries, got {len(value)}")
        if min(self.alpha_s) < 0 or min(self.beta_s) <= 0:
            raise ValueError("alpha_s must be >= 0 and beta_s > 0")
        if not (self.phi_start > 0 and self.phi_end > 0 and self.target_progress > 0 and self.gamma >= 1):
            raise ValueError("phi_start, phi_end, target_progress must be > 0 and gamma >= 1")
        if self.steps_per_decision < 1 or self.grad_dims < 1:
            raise ValueError("steps_per_decision and grad_dims must be >= 1")
        if self.cadence not in ("fixed", "live"):
            raise ValueError(f"cadence={self.cadence!r}: use 'fixed' or 'live'")
        if self.cadence == "live" and (self.target_decisions < 1 or self.min_decision_steps < 1):
            raise ValueError(f"target_decisions={self.target_decisions} and min_decision_steps="
                             f"{self.min_decision_steps} must be >= 1")
        if not (0.0 <= self.stall_prob < 1.0 and self.stall_s >= 0.0 and self.stall_shape > 0.0):
            raise ValueError(f"stall_prob={self.stall_prob} must be in [0, 1), stall_s={self.stall_s} >= 0, "
                             f"stall_shape={self.stall_shape} > 0")
        for name in ("interfere_every_s", "interfere_s", "burst_every_s", "burst_s", "noise_bias_until"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        for name in ("interfere_factor", "burst_factor", "noise_bias"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not (-1 <= self.interfere_rank < R and self.move_every >= 0):
            raise ValueError(f"interfere_rank={self.interfere_rank} must be -1 or a rank < {R}; "
                             f"move_every={self.move_every} must be >= 0")
        if isinstance(self.max_passes, bool) or not isinstance(self.max_passes, int) or self.max_passes < 1:
            raise ValueError(f"max_passes={self.max_passes!r} must be an integer >= 1")
        if min(self.knee) < 0:
            raise ValueError(f"knee {self.knee[:8]} must be >= 0")
        if not 1 <= self.min_batch <= min(self.initial_batch) or max(self.initial_batch) > self.max_batch:
            raise ValueError(f"initial_batch {self.initial_batch[:8]} outside [{self.min_batch}, {self.max_batch}]")
        self.drift = [tuple(d) for d in self.drift]  # type: ignore[misc]

    @property
    def world_size(self) -> int:
        return len(self.alpha_s)

    @property
    def cadence_config(self) -> CadenceConfig:
        """The live cadence's settings this spec names (``cadence="live"``; the rest at their defaults;
        the simulator spends no time deciding, so no decision budget applies)."""
        return CadenceConfig(target_decisions=self.target_decisions, min_decision_steps=self.min_decision_steps,
                             max_decision_interval_s=self.max_decision_interval_s, change_vote_s=self.change_vote_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (provenance); :meth:`from_dict` inverts it."""
        return {k: (list(map(list, v)) if k == "drift" else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ClusterSpec":
        return cls(**d)


@dataclass
class EpisodeResult:
    """Outcome of one simulated training run under one policy."""

    time_to_target_s: float
    """Simulated wall time until the statistical target (inf if it was not reached)."""
    wall_s: float
    """Simulated wall time of the whole episode."""
    decisions: int
    reached: bool
    mean_reward: float
    """Mean over decisions and ranks of the controller's reward."""
    mean_goodput_ratio: float
    """Mean over decisions of goodput / goodput of the optimum for the same moment."""
    final_sizes: list[int]
    ooms: int


class ClusterSimulator:
    """One simulated job; ``reset()`` then ``step(actions)`` (PPO) or :meth:`run_policy` (any policy)."""

    def __init__(self, spec: ClusterSpec, reward: Optional[RewardConfig] = None,
                 actions: Optional[ActionSpace] = None, stats: Optional[StatsConfig] = None, seed: int = 0,
                 log_steps: bool = False, costs: Optional[CostConfig] = None) -> None:
        self.spec = spec
        self.log_steps = log_steps
        self.step_log: list[dict[str, Any]] = []
        """Per-step records in the StepRecord format of real runs (when ``log_steps``)."""
        self.reward_cfg = reward or RewardConfig()
        self.actions = actions or ActionSpace()
        self.stats_cfg = stats or StatsConfig()
        self.costs_cfg = costs or CostConfig()
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        s = spec
        self.R = s.world_size
        self.alpha = np.asarray(s.alpha_s, dtype=np.float64)
        self.beta = np.asarray(s.beta_s, dtype=np.float64)
        self.knee = np.asarray(s.knee, dtype=np.float64)
        self.mem_base = np.asarray(s.mem_base_bytes, dtype=np.float64)
        self.mem_ps = np.asarray(s.mem_per_sample_bytes, dtype=np.float64)
        self.mem_total = np.asarray(s.mem_total_bytes, dtype=np.float64)
        self.capacity = np.maximum(np.floor((self.mem_total - self.mem_base) / self.mem_ps), 0).astype(np.int64)
        self.ref_batch = float(s.ref_batch or sum(s.initial_batch))
        self.total_epochs = s.total_epochs or max(1, math.ceil(s.target_progress / s.dataset_size))
        self.reset()

    # --- true physics ----------------------------------------------------------------------------
    def phi(self, p: Optional[float] = None) -> float:
        """True noise scale at progress fraction ``p`` (default: now)."""
        p = min(1.0, self.progress / self.spec.target_progress) if p is None else p
        return self.spec.phi_start * (self.spec.phi_end / self.spec.phi_start) ** p

    def lr_factor(self, global_batch: float, base_batch: float) -> float:
        """The LR rule's factor at `global_batch` over `base_batch`; for ``adascale`` the gain that the
        true gradient statistics give now, r = (phi/B0 + 1) / (phi/B + 1)."""
        if self.spec.lr_rule != "adascale":
            return lr_factor(self.spec.lr_rule, int(global_batch), int(base_batch))
        phi = self.phi()
        return (phi / base_batch + 1.0) / (phi / global_batch + 1.0)

    def net_time(self, load: float = 0.0) -> float:
        """Expected ring-allreduce time per step (0 on one rank)."""
        R, s = self.R, self.spec
        if R == 1:
            return 0.0
        return 2 * (R - 1) * s.net_latency_s + 2 * (R - 1) / R * s.model_bytes * (1 + load) / s.bandwidth_Bps

    def expected_step_time(self, sizes: np.ndarray, load: Optional[float] = None, passes: int = 1) -> np.ndarray:
        """Noise-free step time of per-rank (micro-batch) sizes ``[..., R]`` with the current speeds,
        `passes` micro-batches per step (the allreduce after the last)."""
        s = self.spec
        b = np.asarray(sizes, dtype=np.float64)
        arrival = s.data_s + s.data_s_per_sample * b + (self.alpha + self.beta * np.maximum(b, self.knee)) * self.slow
        net = self.net_time(s.contention if load is None else load)
        g, last = s.gamma, arrival.max(axis=-1)
        return (passes - 1) * last + (last ** g + net ** g) ** (1 / g) + s.optimizer_s

    def goodput(self, sizes: np.ndarray, phi: Optional[float] = None, passes: int = 1) -> np.ndarray:
        """Expected progress per second of sizes ``[..., R]``, `passes` micro-batches of them per step
        (B_ref-equivalent samples per second)."""
        B = passes * np.asarray(sizes, dtype=np.float64).sum(axis=-1)
        phi = self.phi() if phi is None else phi
        return B * (phi + self.ref_batch) / (phi + B) / self.expected_step_time(sizes, passes=passes)

    def optimum_sizes(self, caps: Optional[np.ndarray] = None, grid: int = 400) -> list[int]:
        """Goodput-maximising per-rank sizes for the current speeds and true noise scale, within
        ``[min_batch, caps]`` (default: the true memory capacities). For a fixed slowest-arrival time
        every rank should take the largest batch that arrives in time (goodput grows with B at fixed
        step time), so a search over that time on a log grid plus a local refinement finds it."""
        s = self.spec
        caps = np.minimum(self.capacity, s.max_batch) if caps is None else np.asarray(caps)
        caps = np.maximum(caps, s.min_batch)
        per_sample = self.beta * self.slow + s.data_s_per_sample
        fixed = self.alpha * self.slow + s.data_s
        t_lo = float((fixed + per_sample * np.maximum(s.min_batch, self.knee)).max())
        t_hi = float((fixed + per_sample * np.maximum(caps, self.knee)).max())
        knee = np.clip(np.floor(self.knee), s.min_batch, caps)

        def fill(times: np.ndarray) -> np.ndarray:
            # the line above the knee; below it a rank arrives at the knee's time whatever its batch,
            # so each fill also has a twin with every rank at least at its knee (those samples are free)
            b = np.clip(np.floor((times[:, None] - fixed) / per_sample * (1 + 1e-12)), s.min_batch, caps)
            return np.concatenate([b, np.maximum(b, knee)])

        times = np.geomspace(t_lo, max(t_hi, t_lo * (1 + 1e-9)), grid)
        cands = fill(times)
        g = self.goodput(cands)
        k = int(np.argmax(g)) % grid
        fine = np.linspace(times[max(k - 1, 0)], times[min(k + 1, grid - 1)], 64)
        cands = np.concatenate([cands, fill(fine)])
        g = self.goodput(cands)
        return cands[int(np.argmax(g))].astype(np.int64).tolist()

    # --- episode ---------------------------------------------------------------------------------
    def reset(self, start_progress: float = 0.0) -> torch.Tensor:
        """Start a run at progress fraction ``start_progress`` with the initial sizes; simulates the first
        interval (the reference) and returns its observation ``[R + 1, OBS_DIM]``."""
        s = self.spec
        self.slow = np.ones(self.R)
        self.progress = float(start_progress) * s.target_progress
        self.samples_seen = self.progress  # epoch counter for the progress feature
        for frac, rank, factor in s.drift:
            if frac <= start_progress:
                self.slow[int(rank)] *= factor
        self._drift_done = [frac <= start_progress for frac, _, _ in s.drift]
        fresh = BatchBounds(self.R, s.min_batch, s.max_batch)
        self.sizes = [fresh.clip(r, b) for r, b in enumerate(s.initial_batch)]
        self.passes = 1  # micro-batches per optimizer step
        self.base_batch = sum(self.sizes)
        self.core = DecisionCore(self.R, self.base_batch, reward=self.reward_cfg, stats=self.stats_cfg,
                                 min_batch=s.min_batch, max_batch=s.max_batch, total_epochs=self.total_epochs,
                                 max_passes=s.max_passes, fit_warmup=True, costs=self.costs_cfg)  # no one-off costs here
        self.wall_s, self.ooms = 0.0, 0
        self.proposer = ModelPolicy()  # the proposal PPO's actions correct (step)
        self._epoch, self._epoch_step = int(self.samples_seen // s.dataset_size), 0
        # the loader's position (cadence="live"): epoch, samples and steps done in it
        self._pos_epoch = int(self.samples_seen // s.dataset_size)
        self._pos_samples = float(self.samples_seen - self._pos_epoch * s.dataset_size)
        self._pos_step = int(self._pos_samples // max(1, sum(s.initial_batch)))
        self.cadence = DecisionCadence.from_config(None, s.cadence_config, self.total_epochs)
        self._recheck = False  # the last decision asked for the next one soon (the cadence's recheck)
        self._watch = [OwnSpeed() for _ in range(self.R)]  # each rank's change vote (cadence="live")
        self._steps_done = 0  # optimizer steps so far (the step count the watches' references carry)
        self.changed_by: tuple[int, ...] = ()  # ranks whose vote ended the last interval
        self.step_log = []
        self.time_to_target = math.inf if self.progress < s.target_progress else 0.0
        self._spike = 0.0
        self._intervals = 0
        self._step_guess = float(self.expected_step_time(np.asarray(self.sizes, dtype=np.float64)))
        self._loader_step_guess = self._step_guess / self.passes
        self._interfered = np.random.default_rng([self.seed, 7]).integers(0, self.R, 4096)  # rank per slow-down
        self._load = s.contention
        self.last_reward: Optional[torch.Tensor] = None
        self.done = False
        self._interval()
        return self.obs

    def _step_fractions(self) -> np.ndarray:
        """The next interval's steps, as each step's fraction of the full batch (1, except an epoch's
        last step under ``cadence="live"``, which takes the remainder); advances the loader position."""
        s = self.spec
        if s.cadence == "fixed":
            return np.ones(s.steps_per_decision)
        B, fractions, p = float(self.passes * sum(self.sizes)), [], self.passes
        ceiling = interval_ceiling(s.max_decision_interval_s, [self._loader_step_guess])
        self._positions = []  # the loader's position before each step (a change vote may end the interval there)
        while len(fractions) < 100_000:
            self._positions.append((self._pos_epoch, self._pos_samples, self._pos_step))
            left = s.dataset_size - self._pos_samples
            f = min(1.0, left / B)
            fractions.append(f)
            self._pos_samples += f * B
            self._pos_step += 1
            epoch_end = self._pos_samples >= s.dataset_size - 1e-9
            length = self._pos_step + math.ceil(max(0.0, s.dataset_size - self._pos_samples) / B - 1e-9)
            # the cadence counts loader steps (micro-batches); decisions fall at optimizer-step ends
            due = self.cadence.due(epoch_end=epoch_end, steps_since=p * len(fractions), decisions=self.decisions,
                                   epoch=self._pos_epoch, step=p * self._pos_step, sizes=self.sizes,
                                   epoch_length=lambda: p * length,
                                   recheck=p * s.min_decision_steps if self._recheck else 0,
                                   ceiling=ceiling)
            if epoch_end:
                self._pos_epoch, self._pos_samples, self._pos_step = self._pos_epoch + 1, 0.0, 0
            if due:
                break
        return np.asarray(fractions)

    def _interval(self) -> None:
        """Run one decision interval at ``self.sizes`` and build reports, context, reward, obs."""
        s, R = self.spec, self.R
        rng = self.rng
        self._oom_check()
        frac_b = self._step_fractions()
        k, p = len(frac_b), self.passes
        b_full = np.asarray(self.sizes, dtype=np.float64)
        b_micro = np.maximum(1.0, np.rint(b_full[None, :] * frac_b[:, None]))   # [k, R] samples per micro-batch
        b = p * b_micro                                                          # [k, R] samples per step
        B_t = b.sum(axis=1)
        # network load: log-normal fluctuation around the mean contention
        self._load = s.contention * float(np.exp(rng.normal(0.0, 0.5))) if s.contention > 0 else 0.0
        # p micro-batches per step: p times the micro-batch's cost (their jitter averages over the p)
        compute = p * (self.alpha + self.beta * np.maximum(b_micro, self.knee)) * self.slow \
            * np.exp(rng.normal(0.0, s.jitter / math.sqrt(p), (k, R)))
        # where each step falls on the training clock (the previous interval's pace): co-located jobs and
        # bandwidth bursts are periodic in wall time
        clock = self.wall_s + self._step_guess * np.arange(k)
        if s.interfere_every_s > 0 and s.interfere_factor != 1.0:
            n = np.floor(clock / s.interfere_every_s).astype(np.int64)
            hit = (n >= 1) & (clock - n * s.interfere_every_s < s.interfere_s)
            rank = np.full(k, s.interfere_rank) if s.interfere_rank >= 0 else self._interfered[n % len(self._interfered)]
            compute = compute * np.where(hit[:, None] & (np.arange(R)[None, :] == rank[:, None]), s.interfere_factor, 1.0)
        if s.stall_prob > 0:
            stalled = rng.random((k, R)) < s.stall_prob
            pareto = np.minimum(50.0, (1.0 - rng.random((k, R))) ** (-1.0 / s.stall_shape))
            compute = compute + np.where(stalled, s.stall_s * pareto, 0.0)
        cut = self._change_vote(compute, b_micro)
        if cut < k:  # a rank's change vote brings the decision forward to that step
            self._pos_epoch, self._pos_samples, self._pos_step = self._positions[cut]
            k, frac_b, b_micro, b, B_t = cut, frac_b[:cut], b_micro[:cut], b[:cut], B_t[:cut]
            compute, clock = compute[:cut], clock[:cut]
        self._steps_done += k
        data = p * (s.data_s + s.data_s_per_sample * b_micro) * np.exp(rng.normal(0.0, 0.1, (k, R)))
        arrival = data + compute
        net = self.net_time(self._load) * np.exp(rng.normal(0.0, 0.1, k))
        if s.burst_every_s > 0 and s.burst_factor != 1.0 and R > 1:  # the bandwidth drops, not the latency
            n = np.floor(clock / s.burst_every_s)
            burst = (n >= 1) & (clock - n * s.burst_every_s < s.burst_s)
            latency = 2 * (R - 1) * s.net_latency_s
            net = net + np.where(burst, (s.burst_factor - 1.0) * max(self.net_time(self._load) - latency, 0.0), 0.0)
        last = arrival.max(axis=1) / p  # the allreduce overlaps only the last micro-batch
        sync_end = arrival.max(axis=1) - last + (last ** s.gamma + net ** s.gamma) ** (1.0 / s.gamma)
        step_s = sync_end + s.optimizer_s
        wait = sync_end[:, None] - arrival
        # statistics, progress, loss: step by step (progress moves phi and |G|^2)
        t = np.arange(k)
        spike = self._spike * np.exp(-t / s.spike_steps)
        self._spike = float(spike[-1] * math.exp(-1.0 / s.spike_steps))
        frac0 = min(1.0, self.progress / s.target_progress)
        phi = s.phi_start * (s.phi_end / s.phi_start) ** frac0
        gain = B_t * (phi + self.ref_batch) / (phi + B_t)
        dprog = gain * (1.0 - np.minimum(0.9, s.spike_progress_cost * spike))
        prog = self.progress + np.concatenate([[0.0], np.cumsum(dprog)[:-1]])
        frac = np.minimum(1.0, prog / s.target_progress)
        phi_t = s.phi_start * (s.phi_end / s.phi_start) ** frac
        g2 = s.grad_sq_start * (s.grad_sq_end / s.grad_sq_start) ** frac
        bias = 1.0
        if s.noise_bias != 1.0 and s.noise_bias_until > 0:  # what the controller measures, not the truth
            bias = 1.0 + (s.noise_bias - 1.0) * np.maximum(0.0, 1.0 - frac / s.noise_bias_until)
        local_sq, global_sq = self._grad_norms(b, phi_t * bias, g2)
        loss_true = (s.loss_end + (s.loss_start - s.loss_end) * np.exp(-s.loss_rate * frac)) * (1.0 + spike)
        losses = loss_true[:, None] * (1.0 + s.loss_noise * rng.normal(0.0, 1.0, (k, R)) / np.sqrt(b))
        batches = [int(x) for x in self.sizes]
        self.last_steps = {"batches": batches, "step_batches": b, "local_sq": local_sq, "global_sq": global_sq,
                           "losses": losses, "compute": compute, "data": data, "wait": wait, "step_s": step_s}
        if self.log_steps:
            self._log_steps()
        # clocks and progress
        self.wall_s += float(step_s.sum()) + self._oom_time
        if math.isinf(self.time_to_target) and self.progress + dprog.sum() >= s.target_progress:
            cum = self.progress + np.cumsum(dprog)
            j = int(np.argmax(cum >= s.target_progress))
            self.time_to_target = self.wall_s - float(step_s[j + 1:].sum())
        self.progress += float(dprog.sum())
        self.samples_seen += float(B_t.sum())
        self._apply_drift()
        self._intervals += 1
        if s.move_every and self._intervals % s.move_every == 0:
            self.slow = np.roll(self.slow, 1)
        self._step_guess = float(step_s.mean())
        self._loader_step_guess = self._step_guess / p  # the cadence's unit, at the passes that ran
        # reports, exactly the fields the controller's ranks send
        mem_used = self.mem_base + self.mem_ps * b_full
        mean_step = float(step_s.mean())
        comp_m, wait_m, data_m = compute.mean(0), wait.mean(0), data.mean(0)
        b_mean = b.mean(0)  # samples per step
        net_bps = (2 * (R - 1) / R * s.model_bytes / mean_step) if R > 1 else 0.0
        retrans = float(rng.poisson(50.0 * self._load * self._load)) / (k * mean_step) if self._load > 0 else 0.0
        busy = (comp_m + data_m) / mean_step
        cpu = busy if not s.gpu else np.clip(0.15 + 0.2 * data_m / mean_step + rng.normal(0, 0.02, R), 0, 1)
        gpu = np.clip(comp_m / mean_step, 0, 1) if s.gpu else np.full(R, math.nan)
        loss_mean = losses.mean(0)
        ls_m, gs_m = local_sq.mean(0), float(global_sq.mean())
        upper = [self.bounds.upper(r) for r in range(R)]
        self.reports = [RankReport(
            rank=r, local_batch=batches[r], steps=k, compute_s=float(comp_m[r]), sync_wait_s=float(wait_m[r]),
            data_wait_s=float(data_m[r]), step_s=mean_step, samples_per_s=float(b_mean[r]) / mean_step,
            peak_memory_bytes=int(mem_used[r]), mem_used_bytes=int(mem_used[r]), mem_total_bytes=int(self.mem_total[r]),
            cpu_util=float(cpu[r]), gpu_util=float(gpu[r]), net_bytes_per_s=net_bps, tcp_retrans_per_s=retrans,
            loss_mean=float(loss_mean[r]), local_grad_sq=float(ls_m[r]), global_grad_sq=gs_m, max_batch=upper[r],
            allreduce_bytes=int(s.model_bytes), latency_probe_s=2 * (R - 1) * s.net_latency_s if R > 1 else math.nan)
            for r in range(R)]
        kind = "cuda" if s.gpu else "rss"
        glob = global_sq.tolist()
        self.inputs = [RankInput(rep, StepSeries(b[:, r].astype(int).tolist(), local_sq[:, r].tolist(), glob,
                                                 losses[:, r].tolist(), kind, compute[:, r].tolist(),
                                                 data[:, r].tolist(), wait[:, r].tolist(), [p] * k))
                       for r, rep in enumerate(self.reports)]
        """The last interval as the typed reports the controller's ranks send to rank 0."""
        self.seen: Observation = self.core.observe(self.inputs, list(self.sizes), self.epoch, p, self.budget_done,
                                                   self.changed_by)
        for r in self.changed_by:  # a rank whose speed changed takes its reference again
            self._watch[r].forget()
        self.ctx, self.obs, self.last_reward = self.seen.ctx, self.seen.obs, self.seen.reward
        self.done = self.progress >= s.target_progress or self.decisions >= s.max_decisions

    def _change_vote(self, compute: np.ndarray, b_micro: np.ndarray) -> int:
        """Under ``cadence="live"``, the live controller's change votes over the interval's steps
        (compute [k, R], micro-batch sizes [k, R]): every `vote_every` steps each rank's watch votes;
        returns the step count at the first vote a rank said yes to, once `min_decision_steps` ran (k:
        none), and sets `changed_by`."""
        s, k = self.spec, len(compute)
        self.changed_by = ()
        every = vote_every(s.change_vote_s, [self._loader_step_guess]) if s.cadence == "live" else 0
        if not every or self.passes > 1:
            return k
        for j in range(every, k, every):
            votes = [w.vote(compute[:j, r], b_micro[:j, r], self._steps_done, self.sizes[r], CHANGE_RATIO)
                     for r, w in enumerate(self._watch)]
            if any(votes) and j >= s.min_decision_steps:
                self.changed_by = tuple(r for r, v in enumerate(votes) if v)
                return j
        return k

    def _log_steps(self) -> None:
        """Append the last interval's steps as StepRecord-like rows (one per rank and step); called
        before ``samples_seen`` moves past the interval."""
        d, s = self.last_steps, self.spec
        lr0 = 1.0
        b = d["step_batches"]
        before = self.samples_seen + np.concatenate([[0.0], np.cumsum(b.sum(axis=1))[:-1]])
        for j in range(len(d["step_s"])):
            epoch = int(before[j] // s.dataset_size)
            if epoch != self._epoch:
                self._epoch, self._epoch_step = epoch, 0
            B = float(b[j].sum())
            lr = lr0 * self.lr_factor(B, self.base_batch)
            for r in range(self.R):
                self.step_log.append(dict(
                    epoch=epoch, step=self._epoch_step, rank=r, local_batch=int(b[j, r]), global_batch=int(B),
                    data_wait_s=float(d["data"][j, r]), compute_s=float(d["compute"][j, r]),
                    sync_wait_s=float(d["wait"][j, r]), optimizer_s=s.optimizer_s, step_s=float(d["step_s"][j]),
                    samples_per_s=float(b[j, r]) / float(d["step_s"][j]), status="ok", lr=lr,
                    local_grad_sq=float(d["local_sq"][j, r]), global_grad_sq=float(d["global_sq"][j]),
                    memory_kind="cuda" if s.gpu else "rss", micro_batches=self.passes))
            self._epoch_step += 1

    def step_log_frame(self) -> Any:
        """The logged steps as a pandas DataFrame (the columns :mod:`bench.lab.calibrate` reads)."""
        import pandas as pd

        return pd.DataFrame(self.step_log)

    @property
    def stats(self) -> GradientStatistics:
        return self.core.stats

    @property
    def bounds(self) -> BatchBounds:
        return self.core.bounds

    @property
    def decisions(self) -> int:
        return self.core.decisions

    @property
    def prev_sizes(self) -> Optional[list[int]]:
        return self.core.prev_sizes

    @property
    def epoch(self) -> int:
        """Epochs completed (the loader's epoch counter at this decision)."""
        return int(self.samples_seen // self.spec.dataset_size)

    @property
    def budget_done(self) -> float:
        """The budget done, in epochs of `total_epochs`: the simulated job ends at its progress target,
        not after a number of epochs, so this is the share of the progress made (what a replay of its
        decisions passes as ``done``). The late-growth rule shortens the time left by the predicted
        gain in samples per second, more than the gain in progress here: the simulated rule is the
        stricter one."""
        return self.total_epochs * min(1.0, self.progress / self.spec.target_progress)

    def _grad_norms(self, b: np.ndarray, phi_t: np.ndarray, g2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-step squared norms of each rank's local mean gradient ``[k, R]`` and of the global one ``[k]``
        for per-step local batches ``b`` ``[k, R]`` (or ``[R]``, the same every step)."""
        k, R, D = len(phi_t), self.R, self.spec.grad_dims
        b = np.broadcast_to(np.asarray(b, dtype=np.float64), (k, R))
        noise_sd = np.sqrt(phi_t[:, None] * g2[:, None] / (b * D))  # per dimension, [k, R]
        n = self.rng.standard_normal((k, R, D)) * noise_sd[:, :, None]
        mean = np.zeros(D)
        mean[0] = 1.0
        G = np.sqrt(g2)[:, None] * mean[None, :]                              # [k, D]
        local = G[:, None, :] + n
        glob = G + np.einsum("krd,kr->kd", n, b / b.sum(axis=1, keepdims=True))
        return (local ** 2).sum(-1), (glob ** 2).sum(-1)

    def _oom_check(self) -> None:
        """Sizes above a rank's memory capacity fail; the live optimizer redoes the step smaller and the
        controller lowers that rank's bound (``BatchBounds.record_oom``)."""
        self._oom_time = 0.0
        for _ in range(8):
            failed = [r for r, bb in enumerate(self.sizes) if bb > self.capacity[r]]
            if not failed:
                return
            self.ooms += len(failed)
            self._oom_time += float(self.expected_step_time(np.asarray(self.sizes), passes=self.passes)) \
                + self.spec.oom_penalty_s
            for r in failed:
                self.sizes[r] = min(self.sizes[r], self.bounds.record_oom(r, self.sizes[r]))

    def _apply_drift(self) -> None:
        frac = self.progress / self.spec.target_progress
        for i, (at, rank, factor) in enumerate(self.spec.drift):
            if not self._drift_done[i] and frac >= at:
                self.slow[int(rank)] *= factor
                self._drift_done[i] = True

    # --- acting ----------------------------------------------------------------------------------
    def decision_input(self) -> DecisionInput:
        """What a live policy is handed at this decision (reward of the previous decision included)."""
        return self.core.policy_input(self.seen)

    def step_sizes(self, sizes: Sequence[int], passes: int | None = None, recheck: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, bool, dict[str, Any]]:
        """Apply new per-rank (micro-batch) sizes, clipped to the bounds, and micro-batches per step
        (None: keep), simulate the next interval (under ``cadence="live"`` a short one where the
        decision asked for a recheck); returns ``(obs, reward [R] earned by this change, done, info)``."""
        if len(sizes) != self.R:
            raise ValueError(f"{len(sizes)} sizes for {self.R} ranks")
        old_B = self.core.prev_passes * sum(self.prev_sizes or self.sizes)
        self.passes = self.core.next_passes(passes, self.passes)
        self.sizes = [self.bounds.clip(r, int(b)) for r, b in enumerate(sizes)]
        new_B = self.passes * sum(self.sizes)
        self._recheck = bool(recheck)
        if new_B > old_B:  # a larger global batch raises the LR through the LR rule: loss spike
            ratio = self.lr_factor(new_B, old_B)
            self._spike += self.spec.spike_coef * max(0.0, math.log2(max(ratio, 1.0)))
        self._interval()
        assert self.last_reward is not None
        info = {"sizes": list(self.sizes), "passes": self.passes, "wall_s": self.wall_s,
                "progress": self.progress / self.spec.target_progress}
        return self.obs, self.last_reward, self.done, info

    def step(self, actions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, bool, dict[str, Any]]:
        """Apply R + 1 action indices (the ranks' share corrections, then the batch row's) to this
        decision's model-based proposal, as the live PPO policy does (see :meth:`step_sizes`)."""
        sizes, info = refine(self.proposer, self.actions, self.decision_input(), [int(a) for a in actions])
        return self.step_sizes(sizes, info["passes"], bool(info.get("recheck")))

    def goodput_ratio(self, sizes: Optional[Sequence[int]] = None) -> float:
        """Expected goodput of ``sizes`` (default: the current sizes and passes) / that of
        :meth:`optimum_sizes` (one pass), now; above 1 where accumulation beats the one-pass optimum."""
        caps = np.array([self.bounds.upper(r) for r in range(self.R)])
        best = float(self.goodput(np.asarray(self.optimum_sizes(np.minimum(caps, self.capacity)))))
        now = self.goodput(np.asarray(self.sizes), passes=self.passes) if sizes is None else self.goodput(np.asarray(sizes))
        return float(now) / best

    def run_policy(self, policy: BatchSizePolicy, start_progress: float = 0.0,
                   track_optimum: bool = True) -> EpisodeResult:
        """Drive any live policy exactly as the controller does until the episode ends."""
        self.reset(start_progress)
        rewards, ratios = [], []
        while not self.done:
            out = policy.decide(self.decision_input())
            policy.after_decision()
            self.step_sizes(out.sizes, out.passes, out.recheck)
            rewards.append(float(self.last_reward.mean()))
            if track_optimum:
                ratios.append(self.goodput_ratio())
        return self.result(rewards, ratios)

    def run_oracle(self, start_progress: float = 0.0) -> EpisodeResult:
        """Set the goodput-optimal sizes (true speeds, noise scale, learned bounds) at every decision."""
        self.reset(start_progress)
        rewards = []
        while not self.done:
            caps = np.minimum([self.bounds.upper(r) for r in range(self.R)], self.capacity)
            self.step_sizes(self.optimum_sizes(caps))
            rewards.append(float(self.last_reward.mean()))
        return self.result(rewards, [1.0])

    def result(self, rewards: Sequence[float], ratios: Sequence[float]) -> EpisodeResult:
        return EpisodeResult(time_to_target_s=self.time_to_target, wall_s=self.wall_s, decisions=self.decisions,
                             reached=math.isfinite(self.time_to_target),
                             mean_reward=float(np.mean(rewards)) if len(rewards) else 0.0,
                             mean_goodput_ratio=float(np.mean(ratios)) if len(ratios) else math.nan,
                             final_sizes=list(self.sizes), ooms=self.ooms)
