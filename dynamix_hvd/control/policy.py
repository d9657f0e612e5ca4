"""Batch-size policies: what rank 0 consults at each decision. Pure: no MPI, no Horovod.

Every policy sees the same inputs (observation [R, OBS_DIM], the raw rank reports, the global
context, current sizes, bounds) and returns the new per-rank sizes, so PPO and the classic rules can
be swapped by name and compared side by side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from .actions import ActionSpace, BatchBounds, apply_actions
from .costmodel import CostModel
from ..rl.ppo import PPOConfig, PPOLearner
from .state import GLOBAL_FEATURES, RANK_FEATURES, GlobalContext, RankReport


@dataclass
class DecisionInput:
    obs: torch.Tensor                 # [R, OBS_DIM]
    reports: Sequence[RankReport]
    ctx: GlobalContext
    sizes: Sequence[int]
    bounds: BatchBounds
    reward: torch.Tensor | None       # [R] reward earned by the previous decision (None at the first)
    costs: CostModel | None = None    # per-step cost fits (the core's); None when built by hand
    noise_lower: float = math.nan     # lower confidence bound on the noise scale (NaN: unknown)
    noise_point: float = math.nan     # its continuous point estimate (NaN: unknown)


@dataclass
class DecisionOutput:
    sizes: list[int]
    info: dict[str, Any] = field(default_factory=dict)


class BatchSizePolicy(Protocol):
    name: str

    def decide(self, inp: DecisionInput) -> DecisionOutput: ...

    def after_decision(self) -> dict[str, float]: ...

    def reset_world(self, world_size: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StaticPolicy:
    """Keeps the sizes the job started with (the baseline every other policy is measured against)."""

    name = "static"

    def decide(self, inp: DecisionInput) -> DecisionOutput:
        return DecisionOutput([inp.bounds.clip(r, b) for r, b in enumerate(inp.sizes)])

    def after_decision(self) -> dict[str, float]:
        return {}

    def reset_world(self, world_size: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PPOPolicy:
    """The DYNAMIX policy: one shared PPO actor-critic applied to each rank, learning online.

    Ordering: the reward handed in at decision t belongs to the action taken at t-1, so it is recorded
    before the action for t is sampled. The PPO update itself runs in `after_decision`, once the
    decision has been sent, so its cost stays off the ranks' critical path; the action of t was then
    sampled by the pre-update policy, which PPO's stored log-probabilities account for.
    """

    name = "ppo"

    def __init__(self, learner: PPOLearner | None = None, actions: ActionSpace | None = None,
                 learn: bool = True, config: PPOConfig | None = None) -> None:
        self.actions = actions or ActionSpace()
        self.learner = learner or PPOLearner(len(RANK_FEATURES), len(GLOBAL_FEATURES), self.actions.n, config)
        self.learn = learn
        self.last_update: dict[str, float] = {}
        self._awaiting_reward = False  # a sampled action whose reward has not been recorded yet
        self._last_obs: torch.Tensor | None = None

    def decide(self, inp: DecisionInput) -> DecisionOutput:
        if self.learn and inp.reward is not None and self._awaiting_reward:
            self.learner.record(inp.reward)
        actions, _, values = self.learner.act(inp.obs, deterministic=not self.learn)
        self._awaiting_reward = self.learn
        self._last_obs = inp.obs
        sizes = apply_actions(self.actions, inp.bounds, inp.sizes, actions.tolist())
        return DecisionOutput(sizes, {"actions": actions.tolist(), "values": [round(v, 4) for v in values.tolist()]})

    def reset_world(self, world_size: int) -> None:
        """The number of ranks changed: drop the rollout (its transitions have the old shape)."""
        self.learner.reset_rollout(world_size)
        self._awaiting_reward = False

    def after_decision(self) -> dict[str, float]:
        """Run a PPO update when a rollout is full (bootstrapping from the latest observation)."""
        if not (self.learn and self.learner.ready()):
            return {}
        self.last_update = self.learner.update(next_obs=self._last_obs)  # keeps the pending action
        return self.last_update

    def state_dict(self) -> dict[str, Any]:
        return {"learner": self.learner.state_dict(), "multipliers": list(self.actions.multipliers),
                "learn": self.learn, "awaiting_reward": self._awaiting_reward}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.actions = ActionSpace(tuple(state["multipliers"]))
        self.learner.load_state_dict(state["learner"])
        self.learn = state["learn"]
        self._awaiting_reward = state["awaiting_reward"]
