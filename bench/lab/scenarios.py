"""The distribution of simulated jobs that pretraining and the policy card draw from. Pure NumPy.

A job is a workload (per-sample and fixed compute cost, gradient bytes, noise-scale trajectory, loss
curve, length) on a cluster (world size, per-rank speeds, stragglers and slow-downs, transient stalls,
network, memory, a GPU's small-batch knee, the decision cadence). Workloads come from a synthetic
family (:data:`FAMILIES`: ranges drawn log-uniformly) or, for families named ``real-NAME``, from a
profile fitted to a real run of this project's example jobs (``profiles/NAME.json``, written by
:func:`bench.lab.calibrate.calibrate`; read as JSON, nothing in it is executed), jittered around
the fit. The cluster is drawn the same way for both, so a real workload also meets world sizes,
stragglers and networks its log never saw.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .simulator import ClusterSpec

PROFILE_DIR = Path(__file__).with_name("profiles")
"""Calibrated workload profiles shipped with the package (``real-NAME`` families)."""

#: Per-family ranges: (low, high) are drawn log-uniformly unless noted.
FAMILIES: dict[str, dict[str, Any]] = {
    # small dense nets on CPUs or small GPUs: cheap samples, fixed costs and the allreduce dominate
    "mlp": dict(beta=(2e-6, 6e-5), alpha=(3e-4, 4e-3), model_bytes=(1e5, 8e6), phi_growth=(2.0, 20.0),
                spike=(0.1, 0.3), gpu_prob=0.3, loss=(2.3, 0.2), epochs=(3, 30)),
    # convolutional nets on GPUs: expensive samples, big activations, moderate models
    "cnn": dict(beta=(1e-4, 4e-3), alpha=(2e-3, 2e-2), model_bytes=(1e7, 2e8), phi_growth=(3.0, 30.0),
                spike=(0.1, 0.4), gpu_prob=0.9, loss=(2.3, 0.1), epochs=(5, 40)),
    # transformers / language models: per-sequence cost, large models, Adam-style LR sensitivity
    "transformer": dict(beta=(5e-4, 2e-2), alpha=(5e-3, 3e-2), model_bytes=(2e7, 5e8), phi_growth=(5.0, 50.0),
                        spike=(0.3, 0.8), gpu_prob=0.9, loss=(4.5, 1.2), epochs=(1, 10)),
}


def profile_names() -> list[str]:
    """The shipped calibrated profiles (family ``real-NAME`` for each NAME)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


@lru_cache(maxsize=None)
def load_profile(name: str) -> ClusterSpec:
    """The calibrated spec of profile `name` (``profiles/NAME.json``, a calibration JSON)."""
    path = PROFILE_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no calibrated profile {name!r} in {PROFILE_DIR} (have: {profile_names()})")
    return ClusterSpec.from_dict(json.loads(path.read_text())["spec"])


def family_names() -> list[str]:
    """Every family :func:`sample_cluster` accepts."""
    return [*FAMILIES, *(f"real-{n}" for n in profile_names())]


@dataclass
class ScenarioConfig:
    """Distribution of simulated jobs that :func:`sample_cluster` draws from (the pretraining curriculum)."""

    families: tuple[str, ...] = ("mlp", "cnn")
    """Workload families drawn uniformly: keys of FAMILIES, or ``real-NAME`` for a calibrated profile."""
    world_sizes: tuple[int, ...] = (1, 2, 2, 3, 4, 4, 8, 16, 32)
    """World sizes drawn uniformly (repeat a value to weight it)."""
    base_batches: tuple[int, ...] = (8, 16, 32, 64, 128)
    """Initial local batch of a rank (the user's static choice; a real profile keeps its own)."""
    unequal_prob: float = 0.3
    """Chance that the initial local batches differ per rank (x0.5..x2)."""
    speed_sigma: tuple[float, float] = (0.0, 0.6)
    """Log-normal sigma of per-rank speed differences (uniform range)."""
    straggler_prob: float = 0.3
    """Chance of one rank slower by x1.5..4 from the start."""
    drift_prob: float = 0.3
    """Chance that one rank slows x1.5..3 part-way through training."""
    phi_vs_batch: tuple[float, float] = (0.125, 8.0)
    """Initial noise scale relative to the initial global batch (log-uniform)."""
    bandwidth_Bps: tuple[float, float] = (1e8, 1.25e10)
    """Link bandwidth range (log-uniform)."""
    latency_s: tuple[float, float] = (1e-6, 5e-5)
    """Allreduce hop latency range (log-uniform)."""
    contention_prob: float = 0.4
    """Chance of background network load (0.1..2 x the job's own traffic)."""
    overlap_prob: float = 0.5
    """Chance of compute/allreduce overlap (gamma in 1..4 instead of 1)."""
    capacity_vs_batch: tuple[float, float] = (2.0, 64.0)
    """Memory capacity relative to the initial local batch (log-uniform)."""
    jitter: tuple[float, float] = (0.02, 0.25)
    """Per-step compute noise sigma (uniform)."""
    steps_per_decision: tuple[int, ...] = (10, 20, 50)
    """Decision interval choices (fixed cadence)."""
    static_decisions: tuple[float, float] = (30.0, 300.0)
    """Length of a run under the static sizes, in decisions (log-uniform): sets the statistical target."""
    max_batch: int = 1024
    """ControllerConfig.max_batch of the simulated jobs."""
    knee_prob: float = 0.5
    """Chance that a GPU job has a small-batch knee (compute flat below x0.5..4 of the initial local batch)."""
    stall_prob: float = 0.25
    """Chance that a job has transient stalls (per rank and step 0.2-3%, Pareto above 1-10x a step)."""
    live_cadence_prob: float = 0.5
    """Chance that a job decides on the live controller's default cadence (epoch ends, ramp, in-epoch)."""


def _logu(rng: np.random.Generator, lo: float, hi: float, size: Any = None) -> Any:
    return np.exp(rng.uniform(math.log(lo), math.log(hi), size))


def _synthetic_workload(rng: np.random.Generator, fam: dict[str, Any], cfg: ScenarioConfig, B0: int,
                        steps_per_decision: int) -> dict[str, Any]:
    phi0 = B0 * float(_logu(rng, *cfg.phi_vs_batch))
    target = float(_logu(rng, *cfg.static_decisions)) * steps_per_decision * B0
    epochs = int(rng.integers(fam["epochs"][0], fam["epochs"][1] + 1))
    loss0, loss1 = fam["loss"]
    return dict(phi_start=phi0, phi_end=phi0 * float(_logu(rng, *fam["phi_growth"])),
                grad_sq_start=1.0, grad_sq_end=float(_logu(rng, 0.01, 0.3)),
                loss_start=loss0 * float(rng.uniform(0.8, 1.2)), loss_end=loss1 * float(rng.uniform(0.5, 1.5)),
                spike_coef=float(rng.uniform(*fam["spike"])), target_progress=target,
                dataset_size=max(1, math.ceil(target / epochs)), total_epochs=epochs)


def sample_cluster(rng: np.random.Generator, cfg: Optional[ScenarioConfig] = None,
                   world_size: Optional[int] = None, family: Optional[str] = None) -> ClusterSpec:
    """Draw one simulated job from the scenario distribution."""
    cfg = cfg or ScenarioConfig()
    fam_name = family or str(rng.choice(cfg.families))
    if fam_name.startswith("real-"):
        return _calibrated_job(rng, cfg, fam_name, world_size)
    if fam_name not in FAMILIES:
        raise ValueError(f"unknown workload family {fam_name!r} (have: {family_names()})")
    fam = FAMILIES[fam_name]
    R = int(world_size or rng.choice(cfg.world_sizes))
    init = _initial_sizes(rng, cfg, R, int(rng.choice(cfg.base_batches)))
    speed = _speeds(rng, cfg, R)
    beta = float(_logu(rng, *fam["beta"])) / speed
    alpha = float(_logu(rng, *fam["alpha"])) / speed
    gpu = bool(rng.random() < fam["gpu_prob"])
    memory = _memory(rng, cfg, init, gpu)
    B0 = int(init.sum())
    steps_per_decision = int(rng.choice(cfg.steps_per_decision))
    workload = _synthetic_workload(rng, fam, cfg, B0, steps_per_decision)
    spec = dict(
        alpha_s=alpha.tolist(), beta_s=beta.tolist(), initial_batch=init.tolist(), **memory, gpu=gpu,
        net_latency_s=float(_logu(rng, *cfg.latency_s)), model_bytes=float(_logu(rng, *fam["model_bytes"])),
        bandwidth_Bps=float(_logu(rng, *cfg.bandwidth_Bps)),
        contention=float(rng.uniform(0.1, 2.0)) if rng.random() < cfg.contention_prob else 0.0,
        gamma=float(rng.uniform(1.0, 4.0)) if rng.random() < cfg.overlap_prob else 1.0,
        data_s=float(_logu(rng, 2e-5, 1e-3)), data_s_per_sample=float(beta.min() * rng.uniform(0.0, 0.3)),
        optimizer_s=float(_logu(rng, 5e-5, 2e-3)), jitter=float(rng.uniform(*cfg.jitter)),
        drift=_drift(rng, cfg, R), **workload, steps_per_decision=steps_per_decision,
        max_batch=cfg.max_batch, name=fam_name)
    spec.update(_cluster_events(rng, cfg, spec))
    return ClusterSpec(**spec)


def _initial_sizes(rng: np.random.Generator, cfg: ScenarioConfig, R: int, b0: int) -> np.ndarray:
    init = np.full(R, b0)
    if R > 1 and rng.random() < cfg.unequal_prob:
        init = np.maximum(1, np.rint(b0 * _logu(rng, 0.5, 2.0, R))).astype(int)
    return init


def _speeds(rng: np.random.Generator, cfg: ScenarioConfig, R: int) -> np.ndarray:
    speed = np.exp(rng.normal(0.0, rng.uniform(*cfg.speed_sigma), R))
    if R > 1 and rng.random() < cfg.straggler_prob:
        speed[rng.integers(R)] /= rng.uniform(1.5, 4.0)
    return speed


def _memory(rng: np.random.Generator, cfg: ScenarioConfig, init: np.ndarray, gpu: bool) -> dict[str, list[float]]:
    R = len(init)
    cap = np.maximum(init + 1, np.rint(init * _logu(rng, *cfg.capacity_vs_batch, R)))
    mem_total = np.full(R, float(rng.choice([16e9, 24e9, 40e9, 80e9]) if gpu else 64e9))
    mem_base = mem_total * rng.uniform(0.05, 0.3)
    return dict(mem_base_bytes=mem_base.tolist(), mem_per_sample_bytes=((mem_total - mem_base) / cap).tolist(),
                mem_total_bytes=mem_total.tolist())


def _drift(rng: np.random.Generator, cfg: ScenarioConfig, R: int) -> list[tuple[float, int, float]]:
    if R > 1 and rng.random() < cfg.drift_prob:
        return [(float(rng.uniform(0.1, 0.7)), int(rng.integers(R)), float(rng.uniform(1.5, 3.0)))]
    return []


def _cluster_events(rng: np.random.Generator, cfg: ScenarioConfig, spec: dict[str, Any]) -> dict[str, Any]:
    """The knee, transient stalls and the cadence; the same draws whether or not each applies."""
    out: dict[str, Any] = {}
    init = np.asarray(spec["initial_batch"], dtype=np.float64)
    knee = rng.random() < cfg.knee_prob
    knee_factor = float(_logu(rng, 0.5, 4.0))
    if spec["gpu"] and knee:
        out["knee"] = [float(np.median(init)) * knee_factor] * len(init)
    stalls = rng.random() < cfg.stall_prob
    p, scale, shape = float(_logu(rng, 2e-3, 3e-2)), float(_logu(rng, 1.0, 10.0)), float(rng.uniform(1.1, 2.5))
    if stalls:
        step = float(np.max(np.asarray(spec["alpha_s"]) + np.asarray(spec["beta_s"]) * init))
        out.update(stall_prob=p, stall_s=step * scale, stall_shape=shape)
    live = rng.random() < cfg.live_cadence_prob
    target_decisions = int(rng.choice([16, 32, 64]))
    if live:
        out.update(cadence="live", target_decisions=target_decisions)
    return out


def _calibrated_job(rng: np.random.Generator, cfg: ScenarioConfig, fam_name: str,
                    world_size: Optional[int]) -> ClusterSpec:
    """A job with a real profile's workload (jittered by :func:`perturb_spec`) on a drawn cluster: the
    profile's per-rank lines are pooled into one device (their median), which the drawn speeds scale."""
    base = perturb_spec(load_profile(fam_name[len("real-"):]), rng, scale=0.2, drift=False)
    R = int(world_size or rng.choice(cfg.world_sizes))
    init = _initial_sizes(rng, cfg, R, int(np.median(base.initial_batch)))
    speed = _speeds(rng, cfg, R)
    alpha = float(np.median(base.alpha_s)) / speed
    beta = float(np.median(base.beta_s)) / speed
    spec = base.to_dict()
    spec.update(alpha_s=alpha.tolist(), beta_s=beta.tolist(), initial_batch=init.tolist(),
                **_memory(rng, cfg, init, base.gpu), knee=[], drift=_drift(rng, cfg, R),
                # progress stays in the profile's unit (its logged global batch), whatever B0 is now
                ref_batch=base.ref_batch or sum(base.initial_batch),
                contention=float(rng.uniform(0.1, 2.0)) if rng.random() < cfg.contention_prob else 0.0,
                max_batch=cfg.max_batch, name=fam_name)
    spec.update(_cluster_events(rng, cfg, spec))
    return ClusterSpec.from_dict(spec)


def perturb_spec(spec: ClusterSpec, rng: np.random.Generator, scale: float = 0.3, drift: bool = True) -> ClusterSpec:
    """A job near ``spec``: speeds, network, noise scale and loss dynamics jittered log-normally by
    ``scale``; with `drift`, a 30% chance of a mid-run slow-down."""
    d = spec.to_dict()
    j = lambda: float(np.exp(rng.normal(0.0, scale)))  # noqa: E731
    R = spec.world_size
    d["alpha_s"] = (np.asarray(d["alpha_s"]) * j() * np.exp(rng.normal(0, scale / 2, R))).tolist()
    d["beta_s"] = (np.asarray(d["beta_s"]) * j() * np.exp(rng.normal(0, scale / 2, R))).tolist()
    for key in ("model_bytes", "net_latency_s", "data_s", "optimizer_s", "phi_start", "spike_coef"):
        d[key] = d[key] * j()
    d["phi_end"] = d["phi_start"] * (spec.phi_end / spec.phi_start) ** j()
    d["jitter"] = min(0.5, d["jitter"] * j())
    if drift and R > 1 and rng.random() < 0.3:
        d["drift"] = [(float(rng.uniform(0.1, 0.7)), int(rng.integers(R)), float(rng.uniform(1.5, 3.0)))]
    d["steps_per_decision"] = int(rng.choice([max(5, spec.steps_per_decision // 2), spec.steps_per_decision,
                                              spec.steps_per_decision * 2]))
    d["target_progress"] = d["target_progress"] * d["steps_per_decision"] / spec.steps_per_decision
    return ClusterSpec.from_dict(d)


#: Conditions where a model fitted on the recent past is misspecified, as overrides of a drawn job.
#: Times are in decision intervals of the job (``steps_per_decision`` steps at its initial sizes), so
#: one definition fits jobs of any step time.
MISSPECIFIED: dict[str, dict[str, float]] = {
    "none": {},
    # heavy-tailed transient stalls: 1% of rank-steps pause 2x the slowest rank's compute or more (Pareto 1.2)
    "stalls": {"stall_prob": 0.01, "stall_steps": 2.0, "stall_shape": 1.2},
    # a co-located job: one rank (drawn afresh each time) 3x slower for 2 intervals every 6
    "interference": {"interfere_every": 6.0, "interfere_for": 2.0, "interfere_factor": 3.0},
    # a 3x straggler that moves on to the next rank every 4 decisions
    "moving": {"straggler": 3.0, "move_every": 4},
    # another job's traffic: 1/10 of the bandwidth for 2 intervals every 5
    "bursts": {"burst_every": 5.0, "burst_for": 2.0, "burst_factor": 10.0},
    # the noise scale measured 4x too large at the start, true from 30% of training on
    "biased-noise": {"noise_bias": 4.0, "noise_bias_until": 0.3},
}


def misspecify(spec: ClusterSpec, condition: str) -> ClusterSpec:
    """`spec` under one of :data:`MISSPECIFIED` (ValueError naming an unknown one)."""
    if condition not in MISSPECIFIED:
        raise ValueError(f"unknown condition {condition!r} (have: {sorted(MISSPECIFIED)})")
    c = MISSPECIFIED[condition]
    d = spec.to_dict()
    init = np.asarray(spec.initial_batch, dtype=np.float64)
    R = spec.world_size
    compute = float(np.max(np.asarray(spec.alpha_s) + np.asarray(spec.beta_s) * init))
    net = 2 * (R - 1) * (spec.net_latency_s + spec.model_bytes / R / spec.bandwidth_Bps)
    step = compute + spec.data_s + net + spec.optimizer_s
    interval = step * spec.steps_per_decision
    if "stall_prob" in c:
        d.update(stall_prob=c["stall_prob"], stall_s=c["stall_steps"] * compute, stall_shape=c["stall_shape"])
    if "interfere_every" in c:
        d.update(interfere_every_s=c["interfere_every"] * interval, interfere_s=c["interfere_for"] * interval,
                 interfere_factor=c["interfere_factor"], interfere_rank=-1)
    if "straggler" in c and spec.world_size > 1:
        d.update(drift=[(0.0, 0, c["straggler"])], move_every=int(c["move_every"]))
    if "burst_every" in c:
        d.update(burst_every_s=c["burst_every"] * interval, burst_s=c["burst_for"] * interval,
                 burst_factor=c["burst_factor"])
    if "noise_bias" in c:
        d.update(noise_bias=c["noise_bias"], noise_bias_until=c["noise_bias_until"])
    d["name"] = f"{spec.name}/{condition}"
    return ClusterSpec.from_dict(d)
