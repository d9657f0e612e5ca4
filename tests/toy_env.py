"""A toy synchronous data-parallel cluster whose goodput-optimal batch sizes are known exactly.

Pure NumPy (no MPI, no Horovod); used by the PPO tests and reusable by benchmarks.

Model (goodput as in Pollux/AdaptDL: throughput x statistical efficiency):

* rank ``i`` processes ``b_i`` samples per step at ``s_i`` samples/s: compute time ``t_i = b_i / s_i``;
* a synchronous step waits for the slowest rank plus a fixed overhead ``c`` (launch + allreduce):
  ``T = c + max_i t_i``;
* global batch ``B = sum_i b_i``; throughput ``B / T``; statistical efficiency ``(phi + B0) / (phi + B)``
  with gradient-noise scale ``phi`` and reference batch ``B0 = R * base_batch``;
* goodput ``G(b) = B / T * (phi + B0) / (phi + B)``.

Known optimum. Without per-rank caps the best vector is balanced (every rank computes for the same
time), ``b_i* = B* s_i / S`` with ``B* = sqrt(c * S * phi)``, ``S = sum_i s_i`` (maximise
``B / ((c + B/S)(phi + B))``); e.g. speeds (100, 200, 300) samples/s, ``c = 0.05`` s, ``phi = 1920``
give ``B* = 240``, ``b* = (40, 80, 120)``.
With integer batches in ``[min_batch, max_i]`` the exact optimum is found by brute force in
:meth:`ToyBatchSizeEnv.optimum`: for a fixed bottleneck time ``T``, goodput grows with ``B``, so every
rank takes the largest batch that fits ``T``; enumerating every candidate bottleneck time
``b / s_j`` (all ranks ``j``, all integers ``b``) therefore visits the optimum.
:func:`exhaustive_optimum` checks this against a full search on small instances.

Decision process (one decision = one controller call, e.g. one epoch). Each rank picks an index into
``multipliers`` (default ``x0.5, x0.8, x1, x1.25, x2``); its batch becomes ``round(b_i * m)`` clipped to
``[min_batch, max_i]``. Reward = ``G(b) / G*`` (fraction of the optimum, shared by all ranks), so a
return near ``1 / (1 - gamma)`` means the optimum was reached at once. Observation of rank ``i`` is
``concat(rank features, global features)``:

* rank (3): ``log2(b_i / base_batch) / 4``, relative speed ``s_i / mean(s)``, step-time share
  ``t_i / max_j t_j``;
* global (3): ``log2(B / B0) / 4``, noise-scale proxy ``log(phi / B)``, compute/overhead ratio
  ``log(max_j t_j / c)`` (the balanced optimum satisfies ``max_j t_j / c = phi / B``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np

OBS_DIM_RANK = 3
OBS_DIM_GLOBAL = 3


@dataclass
class ToyClusterConfig:
    """Parameters of :class:`ToyBatchSizeEnv`; episodes draw speeds and noise scale from the ranges."""

    num_ranks: int = 3
    """Simulated data-parallel ranks ``R``."""
    speed_range: Tuple[float, float] = (50.0, 400.0)
    """Per-rank speeds ``s_i`` (samples/s) are drawn log-uniformly from this range each episode."""
    noise_scale_range: Tuple[float, float] = (100.0, 2000.0)
    """Gradient-noise scale ``phi`` (samples) is drawn log-uniformly from this range each episode."""
    overhead_s: float = 0.05
    """Fixed per-step time ``c`` in seconds (kernel launches + allreduce), independent of batch."""
    base_batch: int = 32
    """Initial per-rank batch; ``B0 = R * base_batch`` is the efficiency reference batch."""
    min_batch: int = 8
    """Smallest per-rank batch."""
    max_batch: Union[int, Sequence[int]] = 512
    """Largest per-rank batch (memory cap), one value for all ranks or one per rank."""
    multipliers: Tuple[float, ...] = (0.5, 0.8, 1.0, 1.25, 2.0)
    """Discrete action set: factor applied to a rank's batch."""
    horizon: int = 24
    """Decisions per episode; ``step`` returns ``done=True`` at the last one."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"ToyClusterConfig.num_ranks must be >= 1 (got {self.num_ranks!r})")
        if not 1 <= self.min_batch <= self.base_batch:
            raise ValueError(f"ToyClusterConfig.min_batch must be in [1, base_batch] (got {self.min_batch!r})")
        caps = np.broadcast_to(np.asarray(self.max_batch), (self.num_ranks,))
        if np.any(caps < self.base_batch):
            raise ValueError(f"ToyClusterConfig.max_batch must be >= base_batch (got {self.max_batch!r})")
        for name in ("speed_range", "noise_scale_range"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"ToyClusterConfig.{name} must satisfy 0 < low <= high (got {getattr(self, name)!r})")
        if not self.overhead_s > 0:
            raise ValueError(f"ToyClusterConfig.overhead_s must be > 0 (got {self.overhead_s!r})")
        if self.horizon < 1:
            raise ValueError(f"ToyClusterConfig.horizon must be >= 1 (got {self.horizon!r})")


def goodput(batch: np.ndarray, speeds: np.ndarray, phi: float, overhead_s: float, ref_batch: float) -> np.ndarray:
    """Goodput of per-rank batches ``batch[..., R]`` (vectorised over leading axes), in samples/s."""
    batch = np.asarray(batch, dtype=np.float64)
    total = batch.sum(axis=-1)
    step_time = overhead_s + (batch / speeds).max(axis=-1)
    return total / step_time * (phi + ref_batch) / (phi + total)


def fill_to_time(step_compute_s: float, speeds: np.ndarray, min_batch: int, caps: np.ndarray) -> np.ndarray:
    """Largest integer per-rank batches whose compute time fits ``step_compute_s`` (clipped to the caps)."""
    fit = np.floor(step_compute_s * speeds * (1.0 + 1e-12))
    return np.clip(fit, min_batch, caps).astype(np.int64)


def exhaustive_optimum(speeds: np.ndarray, phi: float, overhead_s: float, ref_batch: float,
                       min_batch: int, caps: np.ndarray) -> Tuple[np.ndarray, float]:
    """Full search over every integer vector in ``[min_batch, caps_i]`` (only for small instances)."""
    grids = [np.arange(min_batch, int(c) + 1) for c in caps]
    batch = np.array(list(itertools.product(*grids)), dtype=np.float64)
    g = goodput(batch, speeds, phi, overhead_s, ref_batch)
    k = int(np.argmax(g))
    return batch[k].astype(np.int64), float(g[k])


class ToyBatchSizeEnv:
    """Episodic toy cluster (see module docstring); NumPy RNG seeded at construction."""

    def __init__(self, config: Optional[ToyClusterConfig] = None, seed: int = 0) -> None:
        self.config = config or ToyClusterConfig()
        self.rng = np.random.default_rng(seed)
        cfg = self.config
        self.caps = np.broadcast_to(np.asarray(cfg.max_batch, dtype=np.int64), (cfg.num_ranks,)).copy()
        self.ref_batch = float(cfg.num_ranks * cfg.base_batch)
        self.n_actions = len(cfg.multipliers)
        self.obs_dim_rank, self.obs_dim_global = OBS_DIM_RANK, OBS_DIM_GLOBAL
        self.speeds = np.ones(cfg.num_ranks)
        self.phi = 1.0
        self.batch = np.full(cfg.num_ranks, cfg.base_batch, dtype=np.int64)
        self.t = 0
        self.best_batch, self.best_goodput = self.batch.copy(), 1.0

    def reset(self, speeds: Optional[Sequence[float]] = None, noise_scale: Optional[float] = None) -> np.ndarray:
        """Start an episode (random speeds/noise scale unless given); all ranks at ``base_batch``."""
        cfg = self.config
        lo, hi = np.log(cfg.speed_range)
        self.speeds = (np.asarray(speeds, dtype=np.float64) if speeds is not None
                       else np.exp(self.rng.uniform(lo, hi, cfg.num_ranks)))
        lo, hi = np.log(cfg.noise_scale_range)
        self.phi = float(noise_scale) if noise_scale is not None else float(np.exp(self.rng.uniform(lo, hi)))
        self.batch = np.full(cfg.num_ranks, cfg.base_batch, dtype=np.int64)
        self.t = 0
        self.best_batch, self.best_goodput = self.optimum()
        return self.observe()

    def goodput(self, batch: Optional[np.ndarray] = None) -> float:
        """Goodput of ``batch`` (default: the current batches) under this episode's cluster."""
        b = self.batch if batch is None else np.asarray(batch)
        return float(goodput(b, self.speeds, self.phi, self.config.overhead_s, self.ref_batch))

    def optimum(self) -> Tuple[np.ndarray, float]:
        """Exact integer optimum ``(b*, G*)`` by enumerating every candidate bottleneck time."""
        cfg = self.config
        times = np.concatenate([np.arange(cfg.min_batch, c + 1) / s for c, s in zip(self.caps, self.speeds)])
        # fill_to_time for every candidate time at once (the same arithmetic, one row per time)
        fit = np.floor(np.unique(times)[:, None] * self.speeds * (1.0 + 1e-12))
        cands = np.clip(fit, cfg.min_batch, self.caps).astype(np.int64)
        g = goodput(cands, self.speeds, self.phi, cfg.overhead_s, self.ref_batch)
        k = int(np.argmax(g))
        return cands[k], float(g[k])

    def observe(self) -> np.ndarray:
        """Observation ``[R, 6]`` (float32): per-rank features followed by the shared global features."""
        cfg = self.config
        compute = self.batch / self.speeds
        total = float(self.batch.sum())
        rank = np.stack([np.log2(self.batch / cfg.base_batch) / 4.0,
                         self.speeds / self.speeds.mean(),
                         compute / compute.max()], axis=1)
        glob = np.array([np.log2(total / self.ref_batch) / 4.0,
                         np.log(self.phi / total),
                         np.log(compute.max() / cfg.overhead_s)])
        return np.concatenate([rank, np.broadcast_to(glob, (cfg.num_ranks, OBS_DIM_GLOBAL))], axis=1).astype(np.float32)

    def apply(self, actions: np.ndarray) -> None:
        """Apply one multiplier index per rank (rounded, clipped to ``[min_batch, max_i]``)."""
        mult = np.asarray(self.config.multipliers)[np.asarray(actions, dtype=np.int64)]
        self.batch = np.clip(np.rint(self.batch * mult), self.config.min_batch, self.caps).astype(np.int64)

    def step(self, actions: np.ndarray) -> Tuple[np.ndarray, float, bool, Dict[str, object]]:
        """Apply ``actions`` ``[R]``; return ``(obs, reward = G/G*, done, info)``."""
        self.apply(actions)
        self.t += 1
        g = self.goodput()
        info: Dict[str, object] = {"goodput": g, "optimum": self.best_goodput, "batch": self.batch.copy()}
        return self.observe(), g / self.best_goodput, self.t >= self.config.horizon, info


class ToyBatchSizeVecEnv:
    """``num_envs`` independent :class:`ToyBatchSizeEnv` clusters stepped in lock-step.

    Rows of the observation are stacked env by env (``[num_envs * R, obs_dim]``), so a learner that
    treats each row as a rank trains on all clusters at once; episodes end together (same horizon).
    """

    def __init__(self, num_envs: int, config: Optional[ToyClusterConfig] = None, seed: int = 0) -> None:
        seeds = np.random.SeedSequence(seed).spawn(num_envs)
        self.envs = [ToyBatchSizeEnv(config, seed=int(s.generate_state(1)[0])) for s in seeds]
        self.num_ranks = self.envs[0].config.num_ranks

    def reset(self) -> np.ndarray:
        """Reset every cluster; observations ``[num_envs * R, obs_dim]``."""
        return np.concatenate([env.reset() for env in self.envs])

    def step(self, actions: np.ndarray) -> Tuple[np.ndarray, np.ndarray, bool, Dict[str, np.ndarray]]:
        """Per-row actions; returns ``(obs, rewards [num_envs * R], done, info)`` with per-env fractions."""
        actions = np.asarray(actions).reshape(len(self.envs), self.num_ranks)
        results = [env.step(a) for env, a in zip(self.envs, actions)]
        obs = np.concatenate([r[0] for r in results])
        fractions = np.array([r[1] for r in results])
        return obs, np.repeat(fractions, self.num_ranks), results[0][2], {"fraction": fractions}
