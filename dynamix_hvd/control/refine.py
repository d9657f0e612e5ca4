"""Policy "ppo": a shared PPO actor that refines the model-based proposal. Pure: no MPI, no Horovod.

Each decision: (1) the proposal of :mod:`dynamix_hvd.control.proposal` (arrival-equalising split,
goodput-maximising global batch with a noise-scale lower bound, trust region, hysteresis, dither),
exactly as policy "model" computes it; (2) the shared actor acts on R + 1 rows of the observation
(:mod:`dynamix_hvd.control.state`): one action per rank multiplies its proposed share, the batch
row's action multiplies the proposed global batch (:func:`dynamix_hvd.control.actions.compose`).
The neutral action (1.0) of every row is exactly the proposal, and a fresh learner's actor is biased
towards it (:data:`dynamix_hvd.control.ppo.NEUTRAL_LOGIT`), so its mode is the proposal.

The critic reads only the features all rows share (a pooled view of the ranks and job-wide signals):
one value per decision, one shared reward (:mod:`dynamix_hvd.control.reward`).

Deployed (``learn=False``) the action is the actor's mode, except where that would flip back to the
sizes of two decisions ago, or near them (A, B, A', ...): then the sizes are held
(:class:`~dynamix_hvd.control.flipguard.FlipGuard`, as policy "model" does).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .actions import ActionSpace, compose
from .costmodel import CostConfig
from .flipguard import FlipGuard
from .policy import DecisionInput, DecisionOutput
from .proposal import ModelPolicy, ProposalConfig
from .ppo import PPOConfig, PPOLearner
from .state import GLOBAL_FEATURES, RANK_FEATURES


def make_learner(actions: ActionSpace, config: PPOConfig | None = None) -> PPOLearner:
    """A fresh learner for this observation and action layout (central critic, neutral-biased actor)."""
    return PPOLearner(len(RANK_FEATURES), len(GLOBAL_FEATURES), actions.n, config, central_critic=True,
                      neutral_action=actions.keep)


def refine(model: ModelPolicy, space: ActionSpace, inp: DecisionInput,
           actions: Sequence[int]) -> tuple[list[int], dict[str, Any]]:
    """The proposal for `inp` corrected by `actions` (R + 1 of them), B kept within the global batches
    the proposal allows; with no cost fit yet the current sizes stand in for the proposal and B stays.
    The sizes are per micro-batch; ``info["passes"]`` is the proposal's micro-batches per step."""
    out = model.propose(inp)
    last = model.last  # None: no proposal this decision
    p = last.passes if last is not None else inp.passes
    # the allowed global batches count samples per step; the actions act on one micro-batch
    allowed = ((-(-last.batch_min // p), last.batch_max // p) if last is not None
               else (sum(out.sizes), sum(out.sizes)))
    sizes = compose(space, inp.bounds, out.sizes, actions, allowed)
    # a recheck tests the proposal's (neutral) split again: not where the actions moved the sizes
    recheck = out.recheck and list(sizes) == list(out.sizes)
    return sizes, {**out.info, "proposed_sizes": list(out.sizes), "passes": p, "recheck": recheck}


class PPOPolicy:
    """One shared PPO actor-critic refining the proposal, optionally learning online.

    Ordering: the reward handed in at decision t belongs to the action taken at t-1, so it is recorded
    before the action for t is sampled. The PPO update runs in `after_decision`, once the decision
    has been sent, so its cost stays off the ranks' critical path.
    """

    name = "ppo"

    def __init__(self, learner: PPOLearner | None = None, actions: ActionSpace | None = None,
                 learn: bool = True, config: PPOConfig | None = None,
                 proposal: ProposalConfig | None = None, costs: CostConfig | None = None) -> None:
        self.actions = actions or ActionSpace()
        self.learner = learner or make_learner(self.actions, config)
        self.model = ModelPolicy(proposal, costs)
        self.learn = learn
        self.guard = FlipGuard()
        self.last_update: dict[str, float] = {}
        self._awaiting_reward = False
        self._last_obs: torch.Tensor | None = None

    def decide(self, inp: DecisionInput) -> DecisionOutput:
        if self.learn and inp.reward is not None and self._awaiting_reward:
            self.learner.record(float(inp.reward.mean()))
        actions, _, values = self.learner.act(inp.obs, deterministic=not self.learn)
        self._awaiting_reward = self.learn
        self._last_obs = inp.obs
        sizes, info = refine(self.model, self.actions, inp, actions.tolist())
        held, passes = False, info["passes"]
        if not self.learn:
            sizes, passes, held = self.guard.hold(sizes, passes, inp.sizes, inp.passes, bool(info.get("dithered")))
        return DecisionOutput(sizes, {**info, "actions": actions.tolist(), "held": held,
                                      "value": round(float(values.mean()), 4)}, passes)

    def reset_world(self, world_size: int) -> None:
        """The number of ranks changed: drop the rollout (its transitions have the old shape)."""
        self.learner.reset_rollout(world_size + 1)
        self.model.reset_world(world_size)
        self.guard = FlipGuard()
        self._awaiting_reward = False

    def after_decision(self) -> dict[str, float]:
        """Run a PPO update when a rollout is full (bootstrapping from the latest observation)."""
        if not (self.learn and self.learner.ready()):
            return {}
        self.last_update = self.learner.update(next_obs=self._last_obs)
        return self.last_update

    def state_dict(self) -> dict[str, Any]:
        return {"learner": self.learner.state_dict(), "multipliers": list(self.actions.multipliers),
                "learn": self.learn, "awaiting_reward": self._awaiting_reward, "model": self.model.state_dict(),
                "guard": [list(s) for s in self.guard.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.actions = ActionSpace(tuple(state["multipliers"]))
        self.learner = PPOLearner.from_state_dict(state["learner"])
        self.learn = state["learn"]
        self._awaiting_reward = state["awaiting_reward"]
        self.model.load_state_dict(state.get("model", {"decisions": 0}))
        self.guard.history = [[int(b) for b in s] for s in state.get("guard", [])]

