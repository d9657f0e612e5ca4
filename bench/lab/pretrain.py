"""Pretrain the PPO batch-size policy in the cluster simulator, fine-tune it, save it.

``python -m bench.lab.pretrain --help`` lists every option (the fields of :class:`PretrainConfig`).
The shipped default policy is reproduced by ``python -m bench.lab.pretrain`` (all defaults).

Training: each PPO update is one rollout of ``horizon`` decisions on ``clusters_per_update`` simulated
jobs drawn from :class:`~bench.lab.simulator.ScenarioConfig` (world sizes, speeds, stragglers, drifts,
noise-scale trajectories, networks, memory), each starting at a random point of its training run. The
jobs' ranks are stacked into one batch of rows (the shared policy acts on each rank independently, as
in the live controller). The rollout ends by time limit, so its last reward is bootstrapped.

Fine-tuning on transitions logged by real runs (HDF5, see :func:`write_transitions_h5`): an
*advantage-weighted policy-gradient step with a KL trust region*. Returns are discounted sums of the
logged rewards (bootstrapped with the critic at the end of the log), the critic is regressed onto
them, and the actor minimises ``-mean(A_norm * log pi(a|s)) + kl_coef * KL(pi_before || pi)``.
Unlike behaviour cloning or AWR (whose weights are all positive), negative advantages push
probability *away* from logged actions, so a log of a static run (every action "keep") still
teaches where keeping was worse than the critic expected; the KL term keeps the policy near the
pretrained one, since a short log cannot support a large policy change.
"""
from __future__ import annotations

import argparse
import ast
import copy
import inspect
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.refine import PPOPolicy
from dynamix_hvd.control.refine import make_learner as fresh_learner
from dynamix_hvd.control.policy_store import DEFAULT_POLICY, load_policy, resolve, save_policy
from dynamix_hvd.control.ppo import PPOConfig, PPOLearner
from dynamix_hvd.control.reward import RewardConfig
from .evaluate import evaluate_job, gmean_ratio, heldout_table
from .scenarios import ScenarioConfig, perturb_spec, sample_cluster
from .simulator import ClusterSimulator, ClusterSpec
from dynamix_hvd.control.core import loss_trend, observe_reports, progress_fraction
from dynamix_hvd.control.state import GLOBAL_FEATURES, OBS_DIM, RANK_FEATURES, RankReport

"""Name of the shipped policy in ``policies/`` (``policies/default.pt`` + ``default.json`` + ``default.md``)."""

H5_FORMAT_VERSION = 1


@dataclass
class PretrainConfig:
    """Pretraining run; every field is a command-line option (``--field-name``)."""

    name: str = DEFAULT_POLICY
    """Policy name (policies/NAME.pt + NAME.json + NAME.md) or a path without suffix."""
    out_dir: str = ""
    """Directory for the policy files; empty: the policy store's default (policies/ or $DYNAMIX_POLICY_DIR)."""
    seed: int = 0
    """Seed of the simulator draws and of the learner (weights, sampling, minibatches)."""
    updates: int = 600
    """PPO updates; each is one rollout of `horizon` decisions on `clusters_per_update` jobs."""
    clusters_per_update: int = 8
    """Simulated jobs per rollout (their ranks are stacked into one batch)."""
    horizon: int = 32
    """Decisions per rollout (PPO rollout length)."""
    families: str = "mlp,cnn,real-cnn,real-mlp"
    """Comma-separated workload families to train on: synthetic (mlp, cnn, transformer) or calibrated
    from a real run of the example jobs (real-cnn, real-mlp, real-charlm; bench/lab/profiles/)."""
    world_sizes: str = "2,2,2,2,3,3,4,4,4,6,8,8,16,32,64"
    """Comma-separated world sizes drawn uniformly (repeat one to weight it): mostly 2-8, some 16-64."""
    heldout_families: str = "transformer,real-charlm"
    """Workload families of the final evaluation (held out of training)."""
    eval_world_sizes: str = "2,2,2,3,4,4,8,16,32"
    """World sizes of the held-out evaluation jobs (drawn uniformly)."""
    time_limit_s: float = 600.0
    """Stop the PPO updates after this many seconds (the evaluation runs after it)."""
    calibration: str = ""
    """A calibration JSON (python -m bench.lab.calibrate): also train on jobs perturbed around it."""
    calibration_mix: float = 0.5
    """Fraction of the jobs drawn around the calibrated cluster when `calibration` is set."""
    init_policy: str = ""
    """Start from this policy (name or path) instead of fresh weights (fine-tuning)."""
    transitions: str = ""
    """Comma-separated HDF5 files of real-run transitions to fine-tune on after the simulator updates."""
    finetune_epochs: int = 200
    """Gradient steps of the fine-tuning on logged transitions."""
    finetune_kl: float = 1.0
    """KL(pretrained || fine-tuned) weight of the fine-tuning (higher = stay closer)."""
    learning_rate: float = 3e-4
    """Adam step size of the PPO updates."""
    gamma: float = 0.9
    """Discount per decision (the live controller's default 0.9)."""
    ent_coef: float = 0.001
    """Entropy bonus during pretraining (0.01 drives the neutral-biased actor towards uniform corrections:
    entropy 0.72 -> 1.41 and the sampled reward +0.64 -> +0.15 in 80 updates)."""
    update_epochs: int = 4
    """Passes over each rollout."""
    num_minibatches: int = 8
    """Minibatches per pass."""
    eval_every: int = 20
    """Evaluate the greedy policy on fixed simulated windows of the training families every this many
    updates (learning curve); the weights with the best such reward are kept (the untrained policy, which
    deploys the proposal, included; the latest of equals), so a shipped policy is never worse there than
    the proposal."""
    eval_windows: int = 16
    """Fixed simulated jobs of that validation (drawn once, separate from the held-out evaluation)."""
    eval_clusters: int = 24
    """Held-out simulated jobs of the final evaluation (full runs: PPO vs best static, model, rules, oracle)."""
    curve: str = ""
    """Learning-curve CSV; empty: NAME_curve.csv next to the policy files. A PNG is written next to it if matplotlib is installed."""
    online_learning_rate: float = 1e-4
    """Adam step size stored with the policy for online learning in live jobs (smaller than pretraining's)."""
    online_rollout_length: int = 16
    """PPO rollout length stored with the policy for online learning in live jobs."""
    online_ent_coef: float = 0.003
    """Entropy bonus stored with the policy for online learning."""


# --- dataclass <-> argparse (field docstrings are the help) -----------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def dataclass_parser(cls: type, description: str = "", prog: Optional[str] = None) -> argparse.ArgumentParser:
    """An argparse parser with one ``--field-name`` option per field of ``cls`` (help = its docstring)."""
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    docs = field_docs(cls)
    for f in fields(cls):
        kind = type(f.default)
        ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=f.default,
                        type=(lambda s: s.lower() in ("1", "true", "yes")) if kind is bool else kind,
                        help=docs.get(f.name, ""))
    return ap


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# --- simulated jobs ----------------------------------------------------------------------------------
class JobSampler:
    """Draws training/evaluation jobs: the scenario distribution, optionally mixed with a calibrated cluster."""

    def __init__(self, cfg: PretrainConfig) -> None:
        self.scenario = ScenarioConfig(families=tuple(_names(cfg.families)), world_sizes=_ints(cfg.world_sizes))
        self.calibrated: Optional[ClusterSpec] = None
        self.mix = cfg.calibration_mix
        if cfg.calibration:
            self.calibrated = ClusterSpec.from_dict(json.loads(Path(cfg.calibration).read_text())["spec"])

    def __call__(self, rng: np.random.Generator) -> ClusterSpec:
        if self.calibrated is not None and rng.random() < self.mix:
            return perturb_spec(self.calibrated, rng)
        return sample_cluster(rng, self.scenario)


def make_learner(cfg: PretrainConfig) -> PPOLearner:
    """A fresh learner (or ``init_policy``'s weights) with the pretraining PPO settings."""
    ppo = PPOConfig(learning_rate=cfg.learning_rate, gamma=cfg.gamma, rollout_length=cfg.horizon,
                    update_epochs=cfg.update_epochs, num_minibatches=cfg.num_minibatches, ent_coef=cfg.ent_coef,
                    seed=cfg.seed)
    learner = fresh_learner(ActionSpace(), ppo)
    if cfg.init_policy:
        learner.net.load_state_dict(load_policy(cfg.init_policy, ActionSpace())[0].net.state_dict())
    return learner


def rollout(learner: PPOLearner, sims: Sequence[ClusterSimulator], starts: Sequence[float], horizon: int,
            deterministic: bool = False) -> float:
    """Run ``horizon`` decisions on every job at once; records transitions unless ``deterministic``.
    Returns the mean reward per decision and rank."""
    obs = torch.cat([sim.reset(p) for sim, p in zip(sims, starts)])
    splits = [sim.R + 1 for sim in sims]
    total, count = 0.0, 0
    for t in range(horizon):
        actions, _, _ = learner.act(obs, deterministic=deterministic)
        outs = [sim.step(a.tolist()) for sim, a in zip(sims, actions.split(splits))]
        obs = torch.cat([o[0] for o in outs])
        rewards = torch.cat([torch.cat([o[1], o[1].mean(0, keepdim=True)]) for o in outs])  # + batch row
        total, count = total + float(rewards.sum()), count + rewards.numel()
        if not deterministic:
            last = t == horizon - 1
            learner.record(rewards, done=last, truncated_obs=obs if last else None)
    return total / count


def _frozen_copy(learner: PPOLearner) -> PPOLearner:
    copy = fresh_learner(ActionSpace(), PPOConfig(**{**asdict(learner.config), "seed": 99}))  # fresh Adam
    copy.net.load_state_dict(learner.net.state_dict())
    return copy


# --- HDF5 transitions of real runs --------------------------------------------------------------------
def write_transitions_h5(path: str | Path, obs: Any, actions: Any, rewards: Any, append: bool = False,
                         attrs: Optional[dict[str, Any]] = None) -> Path:
    """Write one run's decisions to HDF5 (the live controller can call this at the end of a job).

    Layout (root of the file): ``obs`` float32 ``[T, R, OBS_DIM]`` (the observation of decision t),
    ``actions`` int64 ``[T, R]`` (action index taken at t, into the policy's multipliers), ``rewards``
    float32 ``[T, R]`` (the reward *earned by* action t, i.e. the one handed to the policy at decision
    t+1; a decision whose reward is not known yet is left out). Attributes: ``format_version``,
    ``rank_features``, ``global_features`` (JSON lists) plus ``attrs``. Datasets are resizable along T:
    ``append=True`` extends an existing file of the same R.
    """
    import h5py

    obs = np.asarray(obs, dtype=np.float32)
    actions = np.asarray(actions, dtype=np.int64)
    rewards = np.asarray(rewards, dtype=np.float32)
    T, R = actions.shape if actions.ndim == 2 else (0, 0)
    if obs.shape != (T, R, OBS_DIM) or rewards.shape != (T, R):
        raise ValueError(f"need obs [T, R, {OBS_DIM}], actions [T, R], rewards [T, R]; got {obs.shape}, "
                         f"{actions.shape}, {rewards.shape}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "a" if append and path.exists() else "w") as f:
        if "obs" in f:
            if f["obs"].shape[1:] != (R, OBS_DIM):
                raise ValueError(f"{path} holds R={f['obs'].shape[1]} ranks, cannot append R={R}")
            for name, data in (("obs", obs), ("actions", actions), ("rewards", rewards)):
                ds = f[name]
                if T:
                    ds.resize(ds.shape[0] + T, axis=0)
                    ds[-T:] = data
        else:
            f.create_dataset("obs", data=obs, maxshape=(None, R, OBS_DIM), chunks=True)
            f.create_dataset("actions", data=actions, maxshape=(None, R), chunks=True)
            f.create_dataset("rewards", data=rewards, maxshape=(None, R), chunks=True)
            f.attrs["format_version"] = H5_FORMAT_VERSION
            f.attrs["rank_features"] = json.dumps(list(RANK_FEATURES))
            f.attrs["global_features"] = json.dumps(list(GLOBAL_FEATURES))
        for k, v in (attrs or {}).items():
            f.attrs[k] = v if isinstance(v, (int, float, str)) else json.dumps(v)
    return path


def read_transitions_h5(path: str | Path) -> dict[str, np.ndarray]:
    """``{"obs", "actions", "rewards"}`` of a file written by :func:`write_transitions_h5` (checks the spec)."""
    import h5py

    with h5py.File(path, "r") as f:
        if json.loads(f.attrs["rank_features"]) != list(RANK_FEATURES) or \
                json.loads(f.attrs["global_features"]) != list(GLOBAL_FEATURES):
            raise ValueError(f"{path}: transitions were logged with other state features than this dynamix_hvd")
        return {k: f[k][()] for k in ("obs", "actions", "rewards")}


def actions_from_sizes(proposed: Sequence[int], new: Sequence[int], actions: Optional[ActionSpace] = None) -> list[int]:
    """The R + 1 action indices whose corrections are closest (in log) to the rank's new / proposed
    share and (batch row) to the new / proposed global batch."""
    m = np.log(np.asarray((actions or ActionSpace()).multipliers))
    P, N = sum(proposed), sum(new)
    rows = [(n / N) / (p / P) for p, n in zip(proposed, new)] + [N / P]
    return [int(np.argmin(np.abs(m - math.log(x)))) for x in rows]


def transitions_from_history(history: Sequence[dict[str, Any]], total_epochs: Optional[int] = None,
                             actions: Optional[ActionSpace] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rebuild ``(obs [T, R+1, OBS_DIM], actions [T, R+1], rewards [T, R+1])`` from
    ``DynamixController.history`` (rank 0's decisions).

    The observation of decision t is recomputed from its reports, the stored statistics and the cost
    fits it used by the decision core's own function (:func:`~dynamix_hvd.control.core.observe_reports`);
    the action is the policy's (``info["actions"]``) or, for a policy without one, the nearest
    corrections of the new sizes relative to the proposal (``info["proposed_sizes"]``, else the previous
    sizes); the reward of action t is the (shared) reward logged at decision t+1, on every row.
    """
    space = actions or ActionSpace()
    base = history[0].get("previous_passes", 1) * sum(history[0]["previous_sizes"])
    obs, acts, rews = [], [], []
    prev_loss = math.nan
    for t, d in enumerate(history):
        reports = [RankReport(**r) for r in d["reports"]]
        trend, prev_loss = loss_trend(d["loss"], prev_loss), d["loss"]
        _, observation = observe_reports(reports, d["previous_sizes"], base, d["noise_scale"], d["efficiency"], trend,
                                         progress_fraction(d["epoch"], total_epochs), d.get("noise_point", math.nan),
                                         d.get("noise_lower", math.nan), d.get("fit"), d.get("previous_passes", 1))
        if t + 1 < len(history) and history[t + 1].get("reward") is not None:
            obs.append(observation.numpy())
            info = d.get("info") or {}
            info_actions = info.get("actions")
            acts.append(info_actions if info_actions is not None else
                        actions_from_sizes(info.get("proposed_sizes") or d["previous_sizes"], d["sizes"], space))
            reward = history[t + 1]["reward"]
            rews.append([*reward, float(np.mean(reward))])
    N = len(history[0]["previous_sizes"]) + 1
    return (np.asarray(obs, dtype=np.float32).reshape(-1, N, OBS_DIM), np.asarray(acts, dtype=np.int64).reshape(-1, N),
            np.asarray(rews, dtype=np.float32).reshape(-1, N))


def finetune_on_transitions(learner: PPOLearner, runs: Sequence[dict[str, np.ndarray]], steps: int = 200,
                            kl_coef: float = 1.0, lr: float = 1e-4, seed: int = 0) -> dict[str, float]:
    """Advantage-weighted policy-gradient fine-tuning with a KL trust region (see the module docstring)."""
    gamma = learner.config.gamma
    net = learner.net
    obs_l, act_l, ret_l = [], [], []
    with torch.no_grad():
        for run in runs:
            o = torch.as_tensor(run["obs"], dtype=torch.float32)
            r = torch.as_tensor(run["rewards"], dtype=torch.float32)
            if len(r) == 0:
                continue
            ret = torch.zeros_like(r)
            nxt = gamma * net.get_value(o[-1])  # bootstrap: the log ends mid-run
            for t in reversed(range(len(r))):
                nxt = ret[t] = r[t] + nxt
                nxt = gamma * nxt
            obs_l.append(o.reshape(-1, OBS_DIM))
            act_l.append(torch.as_tensor(run["actions"]).reshape(-1))
            ret_l.append(ret.reshape(-1))
    if not obs_l:
        raise ValueError("no transitions to fine-tune on")
    obs, act, ret = torch.cat(obs_l), torch.cat(act_l), torch.cat(ret_l)
    with torch.no_grad():
        prior = torch.log_softmax(net.actor(obs), -1)
    opt = torch.optim.Adam(net.parameters(), lr=lr, eps=1e-5)
    gen = torch.Generator().manual_seed(seed)
    stats: dict[str, float] = {}
    for _ in range(steps):
        idx = torch.randint(len(obs), (min(256, len(obs)),), generator=gen)
        logp_all = torch.log_softmax(net.actor(obs[idx]), -1)
        value = net.get_value(obs[idx])
        with torch.no_grad():
            adv = ret[idx] - value
            adv = (adv - adv.mean()) / (adv.std() + 1e-8) if adv.numel() > 1 else adv
        pg = -(adv * logp_all.gather(1, act[idx, None]).squeeze(1)).mean()
        kl = (prior[idx].exp() * (prior[idx] - logp_all)).sum(-1).mean()
        v_loss = 0.5 * ((value - ret[idx]) ** 2).mean()
        loss = pg + kl_coef * kl + v_loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        stats = {"policy_loss": pg.item(), "kl": kl.item(), "value_loss": v_loss.item()}
    return stats | {"transitions": float(len(obs))}


# --- the pretraining run ------------------------------------------------------------------------------
def pretrain(cfg: PretrainConfig, log: Any = print) -> tuple[PPOLearner, list[dict[str, float]], dict[str, Any]]:
    """Train (at most `updates` updates, stopping after `time_limit_s`); returns the learner, the
    learning curve (one row per update) and the held-out evaluation (``rows`` per job, ``table``)."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(cfg.seed)
    sampler = JobSampler(cfg)
    learner = make_learner(cfg)
    eval_rng = np.random.default_rng(cfg.seed + 10_000)
    window_specs = [sampler(eval_rng) for _ in range(cfg.eval_windows)]
    t0 = time.perf_counter()

    def eval_windows() -> float:
        sims = [ClusterSimulator(s, seed=77 + i) for i, s in enumerate(window_specs)]
        return rollout(learner, sims, [0.0] * len(sims), cfg.horizon, deterministic=True)

    curve: list[dict[str, float]] = [dict(update=0, elapsed_s=0.0, train_reward=math.nan, entropy=math.nan,
                                          approx_kl=math.nan, value_loss=math.nan, explained_variance=math.nan,
                                          eval_reward=eval_windows())]
    log(f"before training: eval reward (greedy) {curve[0]['eval_reward']:+.3f}")
    best = (curve[0]["eval_reward"], 0, copy.deepcopy(learner.net.state_dict()))
    for u in range(1, cfg.updates + 1):
        sims = [ClusterSimulator(sampler(rng), seed=int(rng.integers(2**31))) for _ in range(cfg.clusters_per_update)]
        train_reward = rollout(learner, sims, rng.uniform(0.0, 0.8, len(sims)).tolist(), cfg.horizon)
        stats = learner.update()
        row = dict(update=u, elapsed_s=time.perf_counter() - t0, train_reward=train_reward,
                   entropy=stats["entropy"], approx_kl=stats["approx_kl"], value_loss=stats["value_loss"],
                   explained_variance=stats["explained_variance"], eval_reward=math.nan)
        out_of_time = row["elapsed_s"] > cfg.time_limit_s
        if u % cfg.eval_every == 0 or u == cfg.updates or out_of_time:
            row["eval_reward"] = eval_windows()
            # ties go to the later weights: the same deployed behaviour, a trained critic and the
            # sampled actions online learning starts from
            if row["eval_reward"] >= best[0]:
                best = (row["eval_reward"], u, copy.deepcopy(learner.net.state_dict()))
            log(f"update {u}/{cfg.updates} {row['elapsed_s']:.0f}s train reward {train_reward:+.3f} "
                f"eval reward (greedy) {row['eval_reward']:+.3f} entropy {row['entropy']:.3f}")
        curve.append(row)
        if out_of_time:
            log(f"time limit {cfg.time_limit_s:.0f}s reached after {u} updates")
            break
    learner.net.load_state_dict(best[2])
    selection = {"selected_update": best[1], "selected_eval_reward": best[0]}
    log(f"kept the weights of update {best[1]} (validation reward {best[0]:+.3f})")
    if cfg.transitions:
        ft = finetune_on_transitions(learner, [read_transitions_h5(p) for p in _names(cfg.transitions)],
                                     cfg.finetune_epochs, cfg.finetune_kl, seed=cfg.seed)
        log(f"fine-tuned on logged transitions: {ft}")
    if cfg.eval_clusters <= 0:
        return learner, curve, selection
    heldout = ScenarioConfig(families=tuple(_names(cfg.heldout_families)), world_sizes=_ints(cfg.eval_world_sizes),
                             static_decisions=(30.0, 100.0))
    frozen = _frozen_copy(learner)
    rows = []
    for i in range(cfg.eval_clusters):
        spec = sample_cluster(eval_rng, heldout)
        rows.append(evaluate_job(spec, lambda: PPOPolicy(frozen, learn=False), seed=cfg.seed + 500 + i))
        log(f"held-out job {i}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in rows[-1].items()))
    evaluation = {**selection, "rows": rows, "table": heldout_table(rows),
                  "ppo_vs_best_static": gmean_ratio(rows, "ppo_s", "best_static_s"),
                  "ppo_vs_model": gmean_ratio(rows, "ppo_s", "model_s"),
                  "model_vs_best_static": gmean_ratio(rows, "model_s", "best_static_s")}
    log("\n".join(evaluation["table"]))
    return learner, curve, evaluation


def online_learner(learner: PPOLearner, cfg: PretrainConfig) -> PPOLearner:
    """The trained weights with the PPO settings a live job should keep learning with (fresh Adam)."""
    ppo = PPOConfig(**{**asdict(learner.config), "learning_rate": cfg.online_learning_rate,
                       "rollout_length": cfg.online_rollout_length, "ent_coef": cfg.online_ent_coef})
    out = fresh_learner(ActionSpace(), ppo)
    out.net.load_state_dict(learner.net.state_dict())
    return out


def write_curve(rows: Sequence[dict[str, float]], path: Path) -> list[Path]:
    """CSV, plus a PNG when matplotlib is importable."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)
    written = [path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    df = pd.DataFrame(rows)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(df["update"], df["train_reward"].rolling(10, min_periods=1).mean(), label="train reward (sampled, 10-update mean)")
    ev = df.dropna(subset=["eval_reward"])
    ax.plot(ev["update"], ev["eval_reward"], "o-", label="eval reward (greedy, fixed jobs)")
    ax.axhline(0.0, color="grey", lw=0.8, ls="--", label="static sizes = 0")
    ax.set_xlabel("PPO update")
    ax.set_ylabel("reward per decision and rank")
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return written + [png]


def write_card(path: Path, cfg: PretrainConfig, command: str, curve: Sequence[dict[str, float]],
               evaluation: dict[str, Any], elapsed_s: float, curve_files: Sequence[Path] = ()) -> None:
    """A markdown policy card: scheme, training data, command, held-out evaluation in the simulator."""
    first = next(r["eval_reward"] for r in curve if math.isfinite(r["eval_reward"]))
    last = [r["eval_reward"] for r in curve if math.isfinite(r["eval_reward"])][-1]
    updates = int(curve[-1]["update"])
    lines = [f"# Policy `{cfg.name}`", "",
             "PPO batch-size policy of dynamix_hvd, format 2: one shared actor refines the model-based proposal "
             "(`dynamix_hvd.control.refine`). Each decision the proposal (arrival-equalising split, goodput-"
             "maximising global batch with a noise-scale lower bound, trust region, hysteresis, dither) is "
             "computed first; then each rank's row picks a correction x0.8, x0.9, x1, x1.1, x1.25 of its proposed "
             "share and one batch row picks the same corrections of the proposed global batch. All-neutral = "
             "the proposal. Features: `dynamix_hvd.control.state` (fitted relative speed, fixed-cost share, "
             "arrival balance, fit confidence, communication share, B / noise scale, E(B), loss trend, progress); "
             "a central critic on the pooled view. Reward: `dynamix_hvd.control.reward` (measured progress per "
             "second over the cost model's prediction for the static sizes).", "",
             "## Training", "",
             f"- Simulator jobs: `ScenarioConfig(families={_names(cfg.families)}, world_sizes={list(_ints(cfg.world_sizes))})`"
             " (2-8 ranks weighted, some 16-64; `real-*` families are workloads calibrated from real runs of "
             "this project's example jobs, `bench/lab/profiles/`): heterogeneous speeds, stragglers, mid-run "
             "slow-downs, heavy-tailed transient stalls, GPU small-batch knees, ring allreduce with latency/"
             "bandwidth/contention and overlap, memory limits, noise-scale trajectories, loss spikes on LR jumps, "
             "the live controller's decision cadence over finite epochs (half the jobs) or fixed spacing.",
             f"- PPO: {updates} updates (time-boxed at {cfg.time_limit_s:.0f} s) x {cfg.clusters_per_update} jobs x "
             f"{cfg.horizon} decisions, gamma {cfg.gamma}, lr {cfg.learning_rate}, entropy {cfg.ent_coef}, seed "
             f"{cfg.seed}; {elapsed_s / 60:.1f} min wall on this machine (shared 2 CPU cores, 1 torch thread), "
             "evaluation included.",
             f"- Stored online settings (used if a live job keeps learning): lr {cfg.online_learning_rate}, rollout "
             f"{cfg.online_rollout_length}, entropy {cfg.online_ent_coef}.",
             f"- Reproduce: `{command}`", "",
             "## Evaluation", "",
             f"Deployed-mode reward on {cfg.eval_windows} fixed simulated jobs of the training families (the "
             f"validation): {first:+.3f} before training (the proposal alone), {last:+.3f} at the last update; "
             f"the weights kept are update {evaluation.get('selected_update', updates)}'s "
             f"({evaluation.get('selected_eval_reward', last):+.3f}). Learning curve: "
             + ", ".join(f"`{Path(p).name}`" for p in curve_files) + ".", "",
             *[line for p in curve_files if str(p).endswith(".png") for line in (f"![learning curve]({Path(p).name})", "")]]
    if evaluation.get("table"):
        lines += [f"Held-out workload families {_names(cfg.heldout_families)} (not trained on), world sizes "
                  f"{list(_ints(cfg.eval_world_sizes))}, full runs to the statistical target "
                  "(`bench.lab.evaluate`): time-to-target / the best static batch's (the initial sizes "
                  "scaled x0.5, x1, x2, x4, best kept), geometric means; lower is better.", "",
                  *evaluation["table"], ""]
    lines += ["Per condition where a fitted model is misspecified (stalls, a co-located job, a moving straggler, "
              "bandwidth bursts, a biased noise estimate), against the proposal, the rules, static and the oracle: "
              "`python -m bench.lab.misspecified` (BENCHMARKS.md, \"Does the learned policy beat the model?\").", ""]
    lines += ["## Limits", "",
              "- Trained only in simulation, and briefly (time-boxed); the simulator's models are approximations. "
              "Calibrate against a real log (`python -m bench.lab.calibrate`) and fine-tune for a target.",
              "- The oracle knows the true noise scale and speeds; the policy sees the controller's noisy estimates.", ""]
    evals = [r["eval_reward"] for r in curve if math.isfinite(r["eval_reward"])]
    if evaluation.get("selected_eval_reward") == first:
        lines.insert(-1, f"- The kept weights' deployed mode scores exactly the proposal's reward on the validation jobs "
                     f"(it picks the neutral correction there); the updates whose mode moved scored "
                     f"{min(evals):+.3f}..{max(e for e in evals if e != first) if len(set(evals)) > 1 else first:+.3f}: "
                     "in the simulator the refinement does not yet improve on the proposal. So a shipped policy "
                     "like this one is not the default: `ControllerConfig()` runs the proposal (policy \"model\"), "
                     "which makes the same decisions without the network; select it with `policy=\"ppo\"`.")
    path.write_text("\n".join(lines))


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = dataclass_parser(PretrainConfig, (__doc__ or "").split("\n\n")[0], prog="python -m bench.lab.pretrain")
    cfg = PretrainConfig(**vars(ap.parse_args(argv)))
    argv = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m bench.lab.pretrain", *argv])
    t0 = time.perf_counter()
    learner, curve, evaluation = pretrain(cfg)
    elapsed = time.perf_counter() - t0
    directory = Path(cfg.out_dir) if cfg.out_dir else None
    pt, _ = resolve(cfg.name, directory)
    curve_path = Path(cfg.curve) if cfg.curve else pt.with_name(f"{pt.stem}_curve.csv")
    written = write_curve(curve, curve_path)
    provenance = {"command": command, "seed": cfg.seed, "pretrain_config": asdict(cfg),
                  "simulator": {"scenario": asdict(JobSampler(cfg).scenario), "reward": asdict(RewardConfig())},
                  "num_updates": int(curve[-1]["update"]), "elapsed_s": round(elapsed, 1), "torch": torch.__version__,
                  "evaluation": {k: v for k, v in evaluation.items() if k != "rows"},
                  "learning_curve": {"first_eval_reward": curve[0]["eval_reward"],
                                     "last_eval_reward": curve[-1]["eval_reward"]}}
    pt, js = save_policy(online_learner(learner, cfg), ActionSpace(), cfg.name, provenance, directory)
    write_card(pt.with_suffix(".md"), cfg, command, curve, evaluation, elapsed, written)
    print(f"saved {pt}, {js}, {pt.with_suffix('.md')}; learning curve {', '.join(map(str, written))}")


if __name__ == "__main__":
    main()
