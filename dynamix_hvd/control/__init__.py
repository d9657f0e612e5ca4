"""The control plane: who gets which batch size next.

Owns the controller's configuration (`config`), the typed per-rank reports and the observation built
from them (`state`), the reward (`reward`), the discrete actions and batch bounds (`actions`), the
policy interface with PPO and static (`policy`), the PPO learner (`ppo`) and its use as a refinement of
the proposal (`refine`), the classic rules (`rules`), policy files (`policy_store`), the decision
core that turns reports into a decision (`core`), the array form in which reports and decisions
travel (`wire`), what the controller needs of the optimizer (`seams`), when to decide (`cadence`),
and the live controller (`controller`), which only moves reports and decisions between ranks.
Everything here except `controller` is pure: it never imports Horovod, mpi4py or `comm`, so the
simulator and offline tools run the same decisions. `controller` reaches other ranks only through `comm`.
"""
