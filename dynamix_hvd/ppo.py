"""PPO learner for the per-rank batch-size controller (pure PyTorch; no MPI, no Horovod).

Written in the style of CleanRL's ``ppo.py``: one flat :meth:`PPOLearner.update` in which every step
of the algorithm is visible. One shared policy is applied to every rank independently: the input of
rank ``i`` is ``concat(features of rank i, global context)``, the output a categorical distribution
over a discrete action set (e.g. batch-size multipliers) and a value. Each rank is its own trajectory
(own rewards, values and GAE) sharing the policy and the episode boundaries.

Online use, one call per decision (every epoch or every k steps), all ``R`` ranks at once::

    learner = PPOLearner(obs_dim_rank, obs_dim_global, n_actions, PPOConfig(seed=0))
    obs = make_observation(rank_feats, global_feats)          # [R, obs_dim]
    while training:
        actions, _, _ = learner.act(obs)                       # apply actions[i] on rank i
        ...                                                    # run until the next decision
        obs = make_observation(...)                            # next observation
        learner.record(rewards, done)                          # rewards for the previous actions
        if learner.ready():
            logs = learner.update(next_obs=obs)

All randomness (initial weights, action sampling, minibatch permutations) comes from one
``torch.Generator`` owned by the learner, so equal seeds and equal data give bit-identical weights,
and :meth:`PPOLearner.state_dict` restores a run exactly.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Categorical

ArrayLike = Union[Tensor, np.ndarray, Sequence[float], float]


@dataclass
class PPOConfig:
    """Hyper-parameters (defaults: CleanRL's PPO, see /work/shared/REFERENCES.md, except where noted)."""

    learning_rate: float = 3e-4
    """Adam step size (not annealed: an online controller has no known total number of updates)."""
    adam_eps: float = 1e-5
    """Adam epsilon (CleanRL uses 1e-5 instead of PyTorch's 1e-8)."""
    gamma: float = 0.99
    """Discount factor of the per-decision rewards."""
    gae_lambda: float = 0.95
    """GAE lambda: 0 = one-step TD advantages, 1 = Monte-Carlo returns minus the value baseline."""
    rollout_length: int = 32
    """Decisions (each with R transitions) collected before an update. Smaller than CleanRL's 128-2048
    because every decision costs an epoch (or k steps) of real training."""
    update_epochs: int = 10
    """Passes over the rollout per update."""
    num_minibatches: int = 4
    """Minibatches per pass over the ``rollout_length * R`` transitions (capped at that number).
    Fewer than CleanRL's 32 because online rollouts are small."""
    clip_coef: float = 0.2
    """Ratio clip of the surrogate objective; also the value-clip range when ``clip_vloss``."""
    clip_vloss: bool = True
    """Clip the value update around the old values (CleanRL's default)."""
    norm_adv: bool = True
    """Normalise advantages to zero mean, unit std within each minibatch."""
    ent_coef: float = 0.01
    """Weight of the entropy bonus (keeps exploring batch sizes)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    max_grad_norm: float = 0.5
    """Clip the global L2 norm of all gradients to this value."""
    target_kl: Optional[float] = None
    """Stop the update epochs early once the approximate KL exceeds this (None = never)."""
    hidden_sizes: Tuple[int, ...] = (64, 64)
    """Widths of the tanh hidden layers of the actor and of the critic (separate MLPs, like CleanRL)."""
    seed: int = 0
    """Seed of the learner's torch.Generator (weights, action sampling, minibatch order)."""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        positive = ("learning_rate", "adam_eps", "clip_coef", "max_grad_norm")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"PPOConfig.{name} must be a finite number > 0 (got {value!r})")
        for name in ("gamma", "gae_lambda"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"PPOConfig.{name} must be in [0, 1] (got {value!r})")
        for name in ("ent_coef", "vf_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < math.inf:
                raise ValueError(f"PPOConfig.{name} must be a finite number >= 0 (got {value!r})")
        for name in ("rollout_length", "update_epochs", "num_minibatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PPOConfig.{name} must be an int >= 1 (got {value!r})")
        for name in ("clip_vloss", "norm_adv"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PPOConfig.{name} must be a bool (got {getattr(self, name)!r})")
        if self.target_kl is not None and (isinstance(self.target_kl, bool) or not isinstance(self.target_kl, (int, float))
                                           or not self.target_kl > 0):
            raise ValueError(f"PPOConfig.target_kl must be None or a number > 0 (got {self.target_kl!r})")
        if not self.hidden_sizes or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.hidden_sizes):
            raise ValueError(f"PPOConfig.hidden_sizes must be a non-empty sequence of ints >= 1 (got {self.hidden_sizes!r})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"PPOConfig.seed must be an int in [0, 2**63) (got {self.seed!r})")


def make_observation(rank_obs: ArrayLike, global_obs: ArrayLike) -> Tensor:
    """Concatenate per-rank features ``[R, d_rank]`` with the global context ``[d_global]`` -> ``[R, d_rank + d_global]``."""
    rank_obs = torch.as_tensor(rank_obs, dtype=torch.float32)
    global_obs = torch.as_tensor(global_obs, dtype=torch.float32).reshape(1, -1)
    return torch.cat([rank_obs, global_obs.expand(rank_obs.shape[0], -1)], dim=1)


def layer_init(layer: nn.Linear, gain: float, generator: torch.Generator) -> nn.Linear:
    """Orthogonal weights with ``gain``, zero bias (CleanRL's ``layer_init``), drawn from ``generator``."""
    nn.init.orthogonal_(layer.weight, gain, generator=generator)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def mlp(sizes: Sequence[int], out_gain: float, generator: torch.Generator) -> nn.Sequential:
    """Tanh MLP: hidden layers with gain sqrt(2), last layer with ``out_gain``."""
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        layers.append(layer_init(nn.Linear(n_in, n_out), out_gain if last else math.sqrt(2), generator))
        if not last:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Shared per-rank policy: ``[*, obs_dim_rank + obs_dim_global]`` -> categorical(n_actions) and value."""

    def __init__(self, obs_dim_rank: int, obs_dim_global: int, n_actions: int,
                 hidden_sizes: Sequence[int] = (64, 64), generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.obs_dim = obs_dim_rank + obs_dim_global
        sizes = [self.obs_dim, *hidden_sizes]
        self.critic = mlp([*sizes, 1], 1.0, generator)
        self.actor = mlp([*sizes, n_actions], 0.01, generator)

    def get_value(self, obs: Tensor) -> Tensor:
        """State values ``[*]``."""
        return self.critic(obs).squeeze(-1)

    def get_action_and_value(self, obs: Tensor, action: Optional[Tensor] = None,
                             generator: Optional[torch.Generator] = None
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(action, log_prob(action), entropy, value)``; samples ``action`` (from ``generator``) when None."""
        logits = self.actor(obs)
        dist = Categorical(logits=logits)
        if action is None:
            flat = dist.probs.reshape(-1, logits.shape[-1])
            action = torch.multinomial(flat, 1, generator=generator).reshape(logits.shape[:-1])
        return action, dist.log_prob(action), dist.entropy(), self.get_value(obs)


def compute_gae(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor,
                gamma: float, gae_lambda: float) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation per rank; returns ``(advantages, returns)``, each ``[T, R]``.

    ``rewards`` and ``values`` are ``[T, R]``; ``dones[t]`` (``[T]``) is 1 when the episode ended with
    transition ``t`` (no bootstrapping across it); ``last_value`` ``[R]`` is ``V(obs_T)``, the value
    of the observation after the last transition.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(last_value)
    for t in reversed(range(num_steps)):
        nextnonterminal = 1.0 - dones[t]
        nextvalues = last_value if t == num_steps - 1 else values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


class RolloutBuffer:
    """Fixed-size storage of ``num_steps`` decisions for ``num_ranks`` ranks (``reset`` for a new world size)."""

    def __init__(self, num_steps: int, num_ranks: int, obs_dim: int) -> None:
        self.num_steps, self.obs_dim = num_steps, obs_dim
        self.reset(num_ranks)

    def reset(self, num_ranks: Optional[int] = None) -> None:
        """Drop the stored decisions; optionally change the number of ranks."""
        if num_ranks is not None:
            self.num_ranks = num_ranks
        shape = (self.num_steps, self.num_ranks)
        self.obs = torch.zeros(*shape, self.obs_dim)
        self.actions = torch.zeros(shape, dtype=torch.long)
        self.logprobs = torch.zeros(shape)
        self.rewards = torch.zeros(shape)
        self.values = torch.zeros(shape)
        self.dones = torch.zeros(self.num_steps)
        self.pos = 0

    @property
    def full(self) -> bool:
        """True once ``num_steps`` decisions are stored."""
        return self.pos == self.num_steps

    def add(self, obs: Tensor, action: Tensor, logprob: Tensor, reward: Tensor, done: bool, value: Tensor) -> None:
        """Store one decision: ``obs [R, obs_dim]``, ``action/logprob/reward/value [R]``, ``done`` shared."""
        if self.full:
            raise RuntimeError("RolloutBuffer is full: call PPOLearner.update() (or reset()) first")
        t = self.pos
        self.obs[t], self.actions[t], self.logprobs[t] = obs, action, logprob
        self.rewards[t], self.values[t], self.dones[t] = reward, value, float(done)
        self.pos += 1

    def compute_returns_and_advantages(self, last_value: Tensor, gamma: float, gae_lambda: float) -> Tuple[Tensor, Tensor]:
        """GAE over the stored decisions (see :func:`compute_gae`)."""
        t = self.pos
        return compute_gae(self.rewards[:t], self.values[:t], self.dones[:t], last_value, gamma, gae_lambda)

    def state_dict(self) -> Dict[str, Any]:
        """Copies of all tensors plus position and sizes."""
        keys = ("obs", "actions", "logprobs", "rewards", "values", "dones")
        return {"num_steps": self.num_steps, "num_ranks": self.num_ranks, "obs_dim": self.obs_dim,
                "pos": self.pos, **{k: getattr(self, k).clone() for k in keys}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.num_steps, self.obs_dim = state["num_steps"], state["obs_dim"]
        self.reset(state["num_ranks"])
        for k in ("obs", "actions", "logprobs", "rewards", "values", "dones"):
            getattr(self, k).copy_(state[k])
        self.pos = state["pos"]


class PPOLearner:
    """Online PPO: :meth:`act` for all ranks, :meth:`record` the rewards, :meth:`update` when :meth:`ready`."""

    def __init__(self, obs_dim_rank: int, obs_dim_global: int, n_actions: int,
                 config: Optional[PPOConfig] = None) -> None:
        for name, value in (("obs_dim_rank", obs_dim_rank), ("obs_dim_global", obs_dim_global), ("n_actions", n_actions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "n_actions" else 0):
                raise ValueError(f"PPOLearner {name} must be a non-negative int (n_actions >= 1) (got {value!r})")
        self.obs_dim_rank, self.obs_dim_global, self.n_actions = obs_dim_rank, obs_dim_global, n_actions
        self.obs_dim = obs_dim_rank + obs_dim_global
        self.config = config if config is not None else PPOConfig()
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self._build(self.generator)
        self.buffer: Optional[RolloutBuffer] = None
        self._pending: Optional[Dict[str, Tensor]] = None
        self.global_step = 0  # decisions recorded
        self.num_updates = 0

    def _build(self, generator: torch.Generator) -> None:
        cfg = self.config
        self.net = ActorCritic(self.obs_dim_rank, self.obs_dim_global, self.n_actions, cfg.hidden_sizes, generator)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps)

    def _as_obs(self, obs: ArrayLike) -> Tensor:
        obs = torch.as_tensor(obs, dtype=torch.float32)
        if obs.dim() != 2 or obs.shape[1] != self.obs_dim or obs.shape[0] < 1:
            raise ValueError(f"obs must have shape [R, {self.obs_dim}] (got {tuple(obs.shape)})")
        return obs

    @torch.no_grad()
    def act(self, obs: ArrayLike, deterministic: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        """Actions, log-probs and values ``[R]`` for observations ``[R, obs_dim]``.

        Stochastic calls remember the decision for the next :meth:`record` (an unrecorded decision is
        replaced by the next call). ``deterministic=True`` takes each rank's most probable action and is
        never recorded (its behaviour policy is not the one PPO's ratios assume).
        """
        obs = self._as_obs(obs)
        if deterministic:
            self._pending = None
            logits = self.net.actor(obs)
            action = logits.argmax(dim=-1)
            _, logprob, _, value = self.net.get_action_and_value(obs, action)
            return action, logprob, value
        action, logprob, _, value = self.net.get_action_and_value(obs, generator=self.generator)
        self._pending = {"obs": obs.clone(), "action": action, "logprob": logprob, "value": value}
        return action, logprob, value

    def record(self, rewards: ArrayLike, done: bool = False, truncated_obs: Optional[ArrayLike] = None) -> None:
        """Store the rewards (scalar shared by all ranks, or ``[R]``) earned by the last :meth:`act`.

        ``done`` marks the end of an episode with this decision (no bootstrapping across it). When the
        episode was cut by a time limit rather than ended, also pass the observation reached as
        ``truncated_obs``: ``gamma * V(truncated_obs)`` is added to the rewards (as in SB3).
        """
        if self._pending is None:
            raise RuntimeError("record() needs a preceding act(obs, deterministic=False)")
        p = self._pending
        num_ranks = p["obs"].shape[0]
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
        if rewards.numel() not in (1, num_ranks):
            raise ValueError(f"rewards must be a scalar or have {num_ranks} entries (got shape {tuple(rewards.shape)})")
        rewards = rewards.reshape(-1).expand(num_ranks)
        if truncated_obs is not None:
            if not done:
                raise ValueError("truncated_obs is only meaningful with done=True")
            with torch.no_grad():
                rewards = rewards + self.config.gamma * self.net.get_value(self._as_obs(truncated_obs))
        if self.buffer is None:
            self.buffer = RolloutBuffer(self.config.rollout_length, num_ranks, self.obs_dim)
        elif self.buffer.num_ranks != num_ranks:
            if self.buffer.pos > 0:
                raise ValueError(f"world size changed from {self.buffer.num_ranks} to {num_ranks} within a rollout: "
                                 "call reset_rollout() (drops it) or update() first")
            self.buffer.reset(num_ranks)
        self.buffer.add(p["obs"], p["action"], p["logprob"], rewards, done, p["value"])
        self._pending = None
        self.global_step += 1

    def ready(self) -> bool:
        """True when the buffer holds ``rollout_length`` decisions."""
        return self.buffer is not None and self.buffer.full

    def reset_rollout(self, num_ranks: Optional[int] = None) -> None:
        """Drop the stored decisions and any pending one (e.g. after the world size changed)."""
        self._pending = None
        if self.buffer is not None:
            self.buffer.reset(num_ranks)

    def update(self, next_obs: Optional[ArrayLike] = None) -> Dict[str, float]:
        """One PPO update on the stored decisions (all of them, even if fewer than ``rollout_length``).

        ``next_obs`` ``[R, obs_dim]`` is the observation after the last decision, used to bootstrap its
        value; it may be omitted only when the last decision ended an episode. Empties the buffer.
        """
        cfg, b = self.config, self.buffer
        if b is None or b.pos == 0:
            raise RuntimeError("update() needs at least one recorded decision")
        num_steps, num_ranks = b.pos, b.num_ranks

        # 1. bootstrap value and GAE per rank
        with torch.no_grad():
            if next_obs is None:
                if not b.dones[num_steps - 1]:
                    raise ValueError("update() needs next_obs unless the last recorded decision had done=True")
                last_value = torch.zeros(num_ranks)
            else:
                last_value = self.net.get_value(self._as_obs(next_obs))
            advantages, returns = b.compute_returns_and_advantages(last_value, cfg.gamma, cfg.gae_lambda)

        # 2. flatten decisions x ranks into one batch of transitions
        b_obs = b.obs[:num_steps].reshape(-1, self.obs_dim)
        b_actions = b.actions[:num_steps].reshape(-1)
        b_logprobs = b.logprobs[:num_steps].reshape(-1)
        b_values = b.values[:num_steps].reshape(-1)
        b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
        batch_size = b_obs.shape[0]
        num_minibatches = min(cfg.num_minibatches, batch_size)

        # 3. optimise the clipped surrogate for several epochs of shuffled minibatches
        stats: Dict[str, list] = {k: [] for k in ("policy_loss", "value_loss", "entropy", "old_approx_kl",
                                                  "approx_kl", "clipfrac", "grad_norm")}
        epochs_run = 0
        for _ in range(cfg.update_epochs):
            epochs_run += 1
            perm = torch.randperm(batch_size, generator=self.generator)
            for mb_inds in perm.tensor_split(num_minibatches):
                _, newlogprob, entropy, newvalue = self.net.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    old_approx_kl = (-logratio).mean()
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfrac = ((ratio - 1.0).abs() > cfg.clip_coef).float().mean()

                mb_advantages = b_advantages[mb_inds]
                if cfg.norm_adv and mb_advantages.numel() > 1:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                # policy loss
                pg_loss1 = -mb_advantages * ratio
                pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)
                pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                # value loss
                if cfg.clip_vloss:
                    v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                    v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds], -cfg.clip_coef, cfg.clip_coef)
                    v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                    v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

                entropy_loss = entropy.mean()
                loss = pg_loss - cfg.ent_coef * entropy_loss + v_loss * cfg.vf_coef

                self.optimizer.zero_grad()
                loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(self.net.parameters(), cfg.max_grad_norm)
                self.optimizer.step()

                for k, v in (("policy_loss", pg_loss), ("value_loss", v_loss), ("entropy", entropy_loss),
                             ("old_approx_kl", old_approx_kl), ("approx_kl", approx_kl), ("clipfrac", clipfrac),
                             ("grad_norm", grad_norm)):
                    stats[k].append(float(v.detach()))

            if cfg.target_kl is not None and float(approx_kl) > cfg.target_kl:
                break

        # 4. diagnostics; empty the buffer for the next rollout
        var_y = b_returns.var(unbiased=False)
        explained_var = float("nan") if var_y == 0 else float(1 - (b_returns - b_values).var(unbiased=False) / var_y)
        b.reset()
        self.num_updates += 1
        logs = {k: float(np.mean(v)) for k, v in stats.items()}
        logs.update(explained_variance=explained_var, epochs=float(epochs_run), num_transitions=float(batch_size),
                    learning_rate=float(self.optimizer.param_groups[0]["lr"]), mean_return=float(b_returns.mean()))
        return logs

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue bit-for-bit: config, dims, network, Adam, buffer, RNG, counters.

        Contains only tensors and plain Python values (loadable with ``torch.load(weights_only=True)``).
        """
        pending = None if self._pending is None else {k: v.clone() for k, v in self._pending.items()}
        return {"config": asdict(self.config),
                "dims": (self.obs_dim_rank, self.obs_dim_global, self.n_actions),
                "net": copy.deepcopy(self.net.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "generator": self.generator.get_state(),
                "buffer": None if self.buffer is None else self.buffer.state_dict(),
                "pending": pending,
                "global_step": self.global_step,
                "num_updates": self.num_updates}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the checkpoint's config replaces this learner's."""
        dims = tuple(state["dims"])
        if dims != (self.obs_dim_rank, self.obs_dim_global, self.n_actions):
            raise ValueError(f"checkpoint dims (obs_dim_rank, obs_dim_global, n_actions) = {dims} do not match "
                             f"{(self.obs_dim_rank, self.obs_dim_global, self.n_actions)}")
        self.config = PPOConfig(**state["config"])
        self._build(torch.Generator().manual_seed(0))  # weights are overwritten just below
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.buffer = None
        if state["buffer"] is not None:
            sb = state["buffer"]
            self.buffer = RolloutBuffer(sb["num_steps"], sb["num_ranks"], sb["obs_dim"])
            self.buffer.load_state_dict(sb)
        self._pending = None if state["pending"] is None else {k: v.clone() for k, v in state["pending"].items()}
        self.global_step, self.num_updates = int(state["global_step"]), int(state["num_updates"])

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "PPOLearner":
        """A learner rebuilt from :meth:`state_dict` output alone."""
        obs_dim_rank, obs_dim_global, n_actions = state["dims"]
        learner = cls(obs_dim_rank, obs_dim_global, n_actions, PPOConfig(**state["config"]))
        learner.load_state_dict(state)
        return learner
