"""PPO learner for the per-rank batch-size controller (pure PyTorch; no MPI, no Horovod).

Written in the style of CleanRL's ``ppo.py``: one flat :meth:`PPOLearner.update` in which every step
of the algorithm is visible. One shared policy is applied to every rank independently: the input of
rank ``i`` is ``concat(features of rank i, global context)``, the output a categorical distribution
over a discrete action set (e.g. batch-size multipliers) and a value. Each rank is its own trajectory
(own rewards, values and GAE) sharing the policy and the episode boundaries.

Online use, one decision (every epoch or every k steps) for all ``R`` ranks at once: ``act(obs)``
(``obs = make_observation(rank_feats, global_feats)``, ``[R, obs_dim]``) returns one action per rank;
at the next decision ``record(rewards, done)`` stores what they earned, then ``if ready():
update(next_obs=obs)``, then ``act(obs)`` again.

All randomness (initial weights, action sampling, minibatch order) comes from one ``torch.Generator``
owned by the learner: equal seeds and equal data give bit-identical weights (same machine and torch
thread count), and
:meth:`PPOLearner.state_dict` / :meth:`PPOLearner.load_state_dict` continue a run exactly.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Categorical

from .. import validate

ArrayLike = Union[Tensor, np.ndarray, Sequence[float], float]
BUFFER_KEYS = ("obs", "actions", "logprobs", "rewards", "values", "dones")


@dataclass(frozen=True)
class PPOConfig:
    """Hyper-parameters; defaults are CleanRL's PPO (``ppo.py``, ``ppo_continuous_action.py``) except where noted.

    In the controller the settings come, highest first, from the fields set in
    ``ControllerConfig.ppo`` (a :class:`~dynamix_hvd.control.config.PPOOverrides`), the policy file's stored config (a fresh policy: ``FRESH_PPO`` of
    :mod:`dynamix_hvd.control.config`), then these defaults."""

    learning_rate: float = 3e-4
    """Adam step size (not annealed: an online controller has no known total number of updates)."""
    adam_eps: float = 1e-5
    """Adam epsilon (CleanRL's 1e-5, not PyTorch's 1e-8)."""
    gamma: float = 0.99
    """Discount of per-decision rewards. Returns scale like reward / (1 - gamma): keep them O(1-10),
    since ``clip_vloss`` lets a value move only ``clip_coef`` per update."""
    gae_lambda: float = 0.95
    """GAE lambda: 0 = one-step TD advantages, 1 = Monte-Carlo returns minus the value baseline."""
    rollout_length: int = 32
    """Decisions (each of R transitions) per update; smaller than CleanRL's 128-2048 because a
    decision costs an epoch (or k steps) of real training."""
    update_epochs: int = 10
    """Passes over the rollout per update."""
    num_minibatches: int = 4
    """Minibatches per pass over the ``rollout_length * R`` transitions (capped at that count); fewer
    than CleanRL's 32 because online rollouts are small."""
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
    """Stop the epochs of an update early once approx_kl exceeds this (None = never)."""
    hidden_sizes: Tuple[int, ...] = (64, 64)
    """Widths of the tanh hidden layers of the actor and of the critic (separate MLPs, like CleanRL)."""
    seed: int = 0
    """Seed of the learner's torch.Generator (weights, action sampling, minibatch order)."""

    def __post_init__(self) -> None:
        if isinstance(self.hidden_sizes, list):
            object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
        positive, unit, nonneg = "a finite number > 0", "a number in [0, 1]", "a finite number >= 0"
        rules = [
            ("learning_rate", _num(self.learning_rate) and self.learning_rate > 0, positive),
            ("adam_eps", _num(self.adam_eps) and self.adam_eps > 0, positive),
            ("gamma", _num(self.gamma) and 0 <= self.gamma <= 1, unit),
            ("gae_lambda", _num(self.gae_lambda) and 0 <= self.gae_lambda <= 1, unit),
            ("rollout_length", _int(self.rollout_length, 1), "an int >= 1"),
            ("update_epochs", _int(self.update_epochs, 1), "an int >= 1"),
            ("num_minibatches", _int(self.num_minibatches, 1), "an int >= 1"),
            ("clip_coef", _num(self.clip_coef) and self.clip_coef > 0, positive),
            ("clip_vloss", isinstance(self.clip_vloss, bool), "a bool"),
            ("norm_adv", isinstance(self.norm_adv, bool), "a bool"),
            ("ent_coef", _num(self.ent_coef) and self.ent_coef >= 0, nonneg),
            ("vf_coef", _num(self.vf_coef) and self.vf_coef >= 0, nonneg),
            ("max_grad_norm", _num(self.max_grad_norm) and self.max_grad_norm > 0, positive),
            ("target_kl", self.target_kl is None or (_num(self.target_kl) and self.target_kl > 0),
             "None or " + positive),
            ("hidden_sizes", isinstance(self.hidden_sizes, tuple) and len(self.hidden_sizes) > 0
             and all(_int(h, 1) for h in self.hidden_sizes), "a non-empty tuple of ints >= 1"),
            ("seed", _int(self.seed, 0) and self.seed < 2**63, "an int in [0, 2**63)"),
        ]
        for name, ok, what in rules:
            if not ok:
                validate.fail(f"PPOConfig.{name}", getattr(self, name), what)


_num = validate.is_number   # a finite real number (bools excluded)
_int = validate.is_integer  # an int (bools excluded) >= the minimum


def make_observation(rank_obs: ArrayLike, global_obs: ArrayLike) -> Tensor:
    """``concat(rank features [R, d_rank], global context [d_global] broadcast)`` -> ``[R, d_rank + d_global]``."""
    rank_obs = torch.as_tensor(rank_obs, dtype=torch.float32)
    global_obs = torch.as_tensor(global_obs, dtype=torch.float32).reshape(1, -1)
    return torch.cat([rank_obs, global_obs.expand(rank_obs.shape[0], -1)], dim=1)


def mlp(sizes: Sequence[int], out_gain: float, generator: torch.Generator) -> nn.Sequential:
    """Tanh MLP, orthogonal init (gain sqrt(2) hidden, ``out_gain`` last), zero biases, weights from ``generator``."""
    layers: List[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        layer = nn.utils.skip_init(nn.Linear, n_in, n_out)  # no default init: leaves torch's global RNG alone
        nn.init.orthogonal_(layer.weight, out_gain if last else math.sqrt(2), generator=generator)
        nn.init.zeros_(layer.bias)
        layers += [layer] if last else [layer, nn.Tanh()]
    return nn.Sequential(*layers)


NEUTRAL_LOGIT = 3.0
"""Initial actor bias of the neutral action (5 actions: it starts with 83% of the probability). Not a
setting: it only shapes a fresh network's start, so that a fresh policy begins at the proposal; a
policy file stores its trained weights."""


class ActorCritic(nn.Module):
    """Shared per-rank policy: ``[*, obs_dim_rank + obs_dim_global]`` -> categorical(n_actions) and value.

    ``central_critic``: the critic reads only the last ``obs_dim_global`` columns (the features every
    row of a decision shares), so all rows of one decision get one value. ``neutral``: the actor's
    output bias starts at NEUTRAL_LOGIT for that action (a fresh policy's mode is the neutral one)."""

    def __init__(self, obs_dim_rank: int, obs_dim_global: int, n_actions: int,
                 hidden_sizes: Sequence[int] = (64, 64), generator: Optional[torch.Generator] = None,
                 central_critic: bool = False, neutral: Optional[int] = None) -> None:
        super().__init__()
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        sizes = [obs_dim_rank + obs_dim_global, *hidden_sizes]
        self.critic_from = obs_dim_rank if central_critic else 0
        self.critic = mlp([sizes[0] - self.critic_from, *hidden_sizes, 1], 1.0, generator)
        self.actor = mlp([*sizes, n_actions], 0.01, generator)
        if neutral is not None:
            with torch.no_grad():
                self.actor[-1].bias[neutral] = NEUTRAL_LOGIT

    def get_value(self, obs: Tensor) -> Tensor:
        """State values ``[*]``."""
        return self.critic(obs[..., self.critic_from:]).squeeze(-1)

    def get_action_and_value(self, obs: Tensor, action: Optional[Tensor] = None,
                             generator: Optional[torch.Generator] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(action, log_prob(action), entropy, value)``; samples ``action`` (from ``generator``) when None."""
        logits = self.actor(obs)
        dist = Categorical(logits=logits)
        if action is None:
            probs = dist.probs.reshape(-1, logits.shape[-1])
            action = torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1])
        return action, dist.log_prob(action), dist.entropy(), self.get_value(obs)


def compute_gae(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor,
                gamma: float, gae_lambda: float) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation, each rank its own trajectory: ``(advantages, returns)`` ``[T, R]``.

    ``rewards``, ``values``: ``[T, R]``; ``dones[t]`` (``[T]``) is 1 when the episode ended with
    transition ``t`` (nothing is bootstrapped across it); ``last_value`` ``[R]`` is the value of the
    observation after the last transition.
    """
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(last_value)
    for t in reversed(range(rewards.shape[0])):
        nextnonterminal = 1.0 - dones[t]
        nextvalues = last_value if t == rewards.shape[0] - 1 else values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


class RolloutBuffer:
    """``num_steps`` decisions of ``num_ranks`` ranks: obs ``[T, R, obs_dim]``; actions, logprobs,
    rewards, values ``[T, R]``; dones ``[T]``. ``reset(num_ranks)`` empties it (optionally for a new world size)."""

    def __init__(self, num_steps: int, num_ranks: int, obs_dim: int) -> None:
        self.num_steps, self.obs_dim = num_steps, obs_dim
        self.reset(num_ranks)

    def reset(self, num_ranks: Optional[int] = None) -> None:
        """Drop the stored decisions; optionally change the number of ranks."""
        self.num_ranks = self.num_ranks if num_ranks is None else num_ranks
        shape = (self.num_steps, self.num_ranks)
        self.obs = torch.zeros(*shape, self.obs_dim)
        self.actions = torch.zeros(shape, dtype=torch.long)
        self.logprobs, self.rewards, self.values = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        self.dones = torch.zeros(self.num_steps)
        self.pos = 0

    @property
    def full(self) -> bool:
        """True once ``num_steps`` decisions are stored."""
        return self.pos == self.num_steps

    def add(self, obs: Tensor, action: Tensor, logprob: Tensor, reward: Tensor, done: bool, value: Tensor) -> None:
        """Store one decision: ``obs [R, obs_dim]``; ``action, logprob, reward, value [R]``; ``done`` shared."""
        if self.full:
            raise RuntimeError("RolloutBuffer is full: call PPOLearner.update() (or reset()) first")
        t = self.pos
        self.obs[t], self.actions[t], self.logprobs[t] = obs, action, logprob
        self.rewards[t], self.values[t], self.dones[t] = reward, value, float(done)
        self.pos += 1

    def compute_returns_and_advantages(self, last_value: Tensor, gamma: float,
                                       gae_lambda: float) -> Tuple[Tensor, Tensor]:
        """GAE over the stored decisions (see :func:`compute_gae`)."""
        t = self.pos
        return compute_gae(self.rewards[:t], self.values[:t], self.dones[:t], last_value, gamma, gae_lambda)

    def state_dict(self) -> Dict[str, Any]:
        """Sizes, position and copies of all tensors."""
        return {"num_steps": self.num_steps, "num_ranks": self.num_ranks, "obs_dim": self.obs_dim,
                "pos": self.pos, **{k: getattr(self, k).clone() for k in BUFFER_KEYS}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.num_steps, self.obs_dim = state["num_steps"], state["obs_dim"]
        self.reset(state["num_ranks"])
        for k in BUFFER_KEYS:
            getattr(self, k).copy_(state[k])
        self.pos = state["pos"]


class PPOLearner:
    """Online PPO: :meth:`act` for all ranks, :meth:`record` the rewards, :meth:`update` when :meth:`ready`."""

    def __init__(self, obs_dim_rank: int, obs_dim_global: int, n_actions: int,
                 config: Optional[PPOConfig] = None, central_critic: bool = False,
                 neutral_action: Optional[int] = None) -> None:
        for name, value, low in (("obs_dim_rank", obs_dim_rank, 0), ("obs_dim_global", obs_dim_global, 0),
                                 ("n_actions", n_actions, 1)):
            if not _int(value, low):
                raise ValueError(f"PPOLearner {name} must be an int >= {low} (got {value!r})")
        self.obs_dim_rank, self.obs_dim_global, self.n_actions = obs_dim_rank, obs_dim_global, n_actions
        if neutral_action is not None and not (_int(neutral_action, 0) and neutral_action < n_actions):
            raise ValueError(f"PPOLearner neutral_action must be None or an action index < {n_actions} "
                             f"(got {neutral_action!r})")
        self.obs_dim = obs_dim_rank + obs_dim_global
        self.central_critic, self.neutral_action = bool(central_critic), neutral_action
        self.config = config if config is not None else PPOConfig()
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self._build(self.generator)
        self.buffer: Optional[RolloutBuffer] = None  # created at the first record(), when R is known
        self._pending: Optional[Dict[str, Tensor]] = None  # last stochastic decision, awaiting its reward
        self.global_step = 0  # decisions recorded
        self.num_updates = 0

    def _build(self, generator: torch.Generator) -> None:
        cfg = self.config
        self.net = ActorCritic(self.obs_dim_rank, self.obs_dim_global, self.n_actions, cfg.hidden_sizes, generator,
                               self.central_critic, self.neutral_action)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps)

    def _as_obs(self, obs: ArrayLike, num_ranks: Optional[int] = None) -> Tensor:
        obs = torch.as_tensor(obs, dtype=torch.float32)
        rows_ok = obs.dim() == 2 and (obs.shape[0] == num_ranks if num_ranks is not None else obs.shape[0] >= 1)
        if not rows_ok or obs.shape[-1] != self.obs_dim:
            rows = "R" if num_ranks is None else num_ranks
            raise ValueError(f"obs must have shape [{rows}, {self.obs_dim}] (got {tuple(obs.shape)})")
        if not torch.isfinite(obs).all():
            raise ValueError(f"obs must be finite (got {obs.tolist()})")
        return obs

    @torch.no_grad()
    def act(self, obs: ArrayLike, deterministic: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        """Actions, log-probs and values ``[R]`` for observations ``[R, obs_dim]``.

        A stochastic call is remembered for the next :meth:`record` (a decision never recorded is
        replaced by the next call). ``deterministic=True`` takes each rank's most probable action and
        is never recorded (PPO's ratios assume the sampling policy).
        """
        obs = self._as_obs(obs)
        if deterministic:
            self._pending = None
            action = self.net.actor(obs).argmax(dim=-1)
            _, logprob, _, value = self.net.get_action_and_value(obs, action)
            return action, logprob, value
        action, logprob, _, value = self.net.get_action_and_value(obs, generator=self.generator)
        self._pending = {"obs": obs.clone(), "action": action, "logprob": logprob, "value": value}
        return action, logprob, value

    def record(self, rewards: ArrayLike, done: bool = False, truncated_obs: Optional[ArrayLike] = None) -> None:
        """Store the rewards (one shared scalar, or ``[R]``) earned by the last stochastic :meth:`act`.

        ``done`` marks the end of an episode with this decision. If the episode was cut by a time
        limit rather than ended, pass the observation reached as ``truncated_obs`` (with ``done=True``):
        ``gamma * V(truncated_obs)`` is added to the rewards, as in Stable-Baselines3.
        """
        if self._pending is None:
            raise RuntimeError("record() needs a preceding act(obs, deterministic=False)")
        p, num_ranks = self._pending, self._pending["obs"].shape[0]
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
        if rewards.numel() not in (1, num_ranks):
            raise ValueError(f"rewards must be a scalar or have {num_ranks} entries (got shape {tuple(rewards.shape)})")
        if not torch.isfinite(rewards).all():
            raise ValueError(f"rewards must be finite (got {rewards.tolist()})")  # one NaN would poison the policy
        rewards = rewards.reshape(-1).expand(num_ranks)
        if truncated_obs is not None:
            if not done:
                raise ValueError("truncated_obs needs done=True")
            with torch.no_grad():
                rewards = rewards + self.config.gamma * self.net.get_value(self._as_obs(truncated_obs, num_ranks))
        if self.buffer is None:
            self.buffer = RolloutBuffer(self.config.rollout_length, num_ranks, self.obs_dim)
        elif self.buffer.num_ranks != num_ranks:
            if self.buffer.pos > 0:
                raise ValueError(f"world size changed from {self.buffer.num_ranks} to {num_ranks} within a "
                                 "rollout: call update() or reset_rollout() first")
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
        """One PPO update on all stored decisions (even fewer than ``rollout_length``); empties the buffer.

        ``next_obs`` ``[R, obs_dim]``, the observation after the last decision, bootstraps its value;
        it may be omitted only when the last decision ended an episode. Returns means over minibatches.
        """
        cfg, b = self.config, self.buffer
        if b is None or b.pos == 0:
            raise RuntimeError("update() needs at least one recorded decision")
        num_steps = b.pos

        # 1. bootstrap the value after the last decision; GAE per rank
        with torch.no_grad():
            if next_obs is not None:
                last_value = self.net.get_value(self._as_obs(next_obs, b.num_ranks))
            elif b.dones[num_steps - 1]:
                last_value = torch.zeros(b.num_ranks)
            else:
                raise ValueError("update() needs next_obs unless the last recorded decision had done=True")
            advantages, returns = b.compute_returns_and_advantages(last_value, cfg.gamma, cfg.gae_lambda)

        # 2. flatten (decision, rank) pairs into one batch of transitions
        b_obs = b.obs[:num_steps].reshape(-1, self.obs_dim)
        b_actions, b_logprobs = b.actions[:num_steps].reshape(-1), b.logprobs[:num_steps].reshape(-1)
        b_values = b.values[:num_steps].reshape(-1)
        b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
        batch_size = b_obs.shape[0]

        # 3. several epochs of shuffled minibatches on the clipped surrogate
        logs: Dict[str, List[float]] = {k: [] for k in ("policy_loss", "value_loss", "entropy", "old_approx_kl",
                                                        "approx_kl", "clipfrac", "grad_norm")}
        epochs = 0
        for epochs in range(1, cfg.update_epochs + 1):
            perm = torch.randperm(batch_size, generator=self.generator)
            for mb_inds in perm.tensor_split(min(cfg.num_minibatches, batch_size)):
                _, newlogprob, entropy, newvalue = self.net.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():  # http://joschu.net/blog/kl-approx.html
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
                v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                if cfg.clip_vloss:
                    v_clipped = b_values[mb_inds] + torch.clamp(
                        newvalue - b_values[mb_inds], -cfg.clip_coef, cfg.clip_coef)
                    v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                    v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
                else:
                    v_loss = 0.5 * v_loss_unclipped.mean()

                entropy_loss = entropy.mean()
                loss = pg_loss - cfg.ent_coef * entropy_loss + v_loss * cfg.vf_coef

                self.optimizer.zero_grad()
                loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(self.net.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                for k, v in zip(logs, (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, grad_norm)):
                    logs[k].append(v.item())

            if cfg.target_kl is not None and approx_kl.item() > cfg.target_kl:
                break

        # 4. diagnostics; empty the buffer for the next rollout
        var_y = b_returns.var(unbiased=False).item()
        explained_var = math.nan if var_y == 0 else 1.0 - (b_returns - b_values).var(unbiased=False).item() / var_y
        b.reset()
        self.num_updates += 1
        out = {k: float(np.mean(v)) for k, v in logs.items()}
        out.update(explained_variance=explained_var, epochs=float(epochs), num_transitions=float(batch_size),
                   mean_return=b_returns.mean().item(), learning_rate=float(self.optimizer.param_groups[0]["lr"]))
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Config, dims, network, Adam, buffer, pending decision, generator state and counters.

        Only tensors and plain Python values: loadable with ``torch.load(..., weights_only=True)``.
        """
        return {"config": asdict(self.config), "dims": (self.obs_dim_rank, self.obs_dim_global, self.n_actions),
                "central_critic": self.central_critic, "neutral_action": self.neutral_action,
                "net": copy.deepcopy(self.net.state_dict()), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "generator": self.generator.get_state(),
                "buffer": None if self.buffer is None else self.buffer.state_dict(),
                "pending": None if self._pending is None else {k: v.clone() for k, v in self._pending.items()},
                "global_step": self.global_step, "num_updates": self.num_updates}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output exactly; the checkpoint's config replaces this learner's."""
        dims = tuple(state["dims"])
        if dims != (self.obs_dim_rank, self.obs_dim_global, self.n_actions):
            raise ValueError(f"checkpoint (obs_dim_rank, obs_dim_global, n_actions) = {dims}, this learner has "
                             f"{(self.obs_dim_rank, self.obs_dim_global, self.n_actions)}")
        central = bool(state.get("central_critic", False))  # absent in states from before the option
        if central != self.central_critic:
            raise ValueError(f"checkpoint central_critic={central}, this learner has {self.central_critic}")
        self.config = PPOConfig(**state["config"])
        self._build(torch.Generator())  # fresh modules for the checkpoint's sizes; weights loaded next
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # Adam would alias the tensors
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
        learner = cls(obs_dim_rank, obs_dim_global, n_actions, PPOConfig(**state["config"]),
                      bool(state.get("central_critic", False)), state.get("neutral_action"))
        learner.load_state_dict(state)
        return learner
