"""Horovod elastic (``horovodrun --gloo --min-np/--max-np --host-discovery-script``) for dynamix_hvd.

`ElasticState` is Horovod's ``TorchState`` plus two state handlers, so the loader position and the
controller (policy and optimizer weights, rollout buffer, EMA statistics, current batch plan) are
committed, rolled back and synchronised together with the model and optimizer.

What happens on a world change (Horovod's order): on a failure every survivor rolls back to the last
commit (`restore`), Horovod re-initialises with the new world, reset callbacks run, then `sync`
broadcasts rank 0's state. Our handlers act in `sync`, when the new world is known: the loader
continues its epoch from the committed cursor with the global batch split over the new ranks, and
the controller rebinds to the new ranks with what it has learned. Steps after the last commit are
redone (their updates were rolled back too), so no sample is lost or counted twice.

The controller's root state lives on rank 0 only, and rank 0 may be the rank that fails; so every
commit broadcasts it, and every rank keeps a copy.

Importing this module changes nothing in Horovod: `ElasticState` attaches its two handlers itself
instead of registering them in Horovod's global handler registry, so a plain ``TorchState`` built
elsewhere in the same process keeps Horovod's behaviour.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Mapping

import horovod.torch as hvd
from horovod.torch.elastic.state import StateHandler, TorchState

from .checkpoint import redistribute
from ..comm import ELASTIC_CONTROLLER, ELASTIC_CONTROLLER_SYNC, ELASTIC_LOADER, library_channel
from ..control.controller import DynamixController
from ..data.loader import AdaptiveLoader


class LoaderStateHandler(StateHandler):
    def __init__(self, loader: AdaptiveLoader) -> None:
        super().__init__(loader)
        self._saved = copy.deepcopy(loader.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        state = library_channel().broadcast_object(self.value.state_dict(), ELASTIC_LOADER)
        world = hvd.size()
        sizes = None
        if len(state["batch_sizes"]) != world:
            sizes = redistribute(sum(state["batch_sizes"]), world)
        self.value.load_state_dict(state, batch_sizes=sizes, rank=hvd.rank())


class ControllerStateHandler(StateHandler):
    # No collective in __init__: a worker that joins later constructs its state while the others
    # are already inside sync(), and a collective only it calls would deadlock the job.
    def __init__(self, controller: DynamixController) -> None:
        super().__init__(controller)
        self._saved = copy.deepcopy(controller.state_dict())

    def save(self) -> None:  # every rank commits together, so this broadcast is matched
        state = self.value.state_dict()
        state["root"] = library_channel().broadcast_object(state.get("root"), ELASTIC_CONTROLLER)
        self._saved = copy.deepcopy(state)

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.rebind(hvd.rank(), hvd.size())
        self._saved = library_channel().broadcast_object(self._saved, ELASTIC_CONTROLLER_SYNC)
        self.value.load_state_dict(self._saved)


GLOO_TIMEOUT_DEFAULT_S = 30.0
"""Horovod's Gloo timeout when neither --gloo-timeout-seconds nor HOROVOD_GLOO_TIMEOUT_SECONDS sets it."""


def check_timeouts(timeout_s: float, environ: Mapping[str, str] | None = None) -> float:
    """Refuse a control-plane deadline that is not longer than Gloo's timeout; returns Gloo's timeout.

    Under Gloo a control-plane collective that misses its deadline ends the process (it cannot be
    abandoned). A worker that dies is reported by Gloo after its timeout, which is what lets Horovod
    elastic reset the world; a shorter deadline ends the survivors first, and Horovod then blacklists
    every host."""
    raw = (os.environ if environ is None else environ).get("HOROVOD_GLOO_TIMEOUT_SECONDS")
    try:
        gloo = float(raw) if raw is not None else GLOO_TIMEOUT_DEFAULT_S
    except ValueError:
        raise ValueError(f"HOROVOD_GLOO_TIMEOUT_SECONDS={raw!r} is not a number of seconds") from None
    if not timeout_s > gloo:
        raise ValueError(f"ControllerConfig.timeout_s={timeout_s:g} s must be longer than Gloo's timeout of {gloo:g} s "
                         "(--gloo-timeout-seconds / HOROVOD_GLOO_TIMEOUT_SECONDS): a lost worker would end the "
                         "surviving ones before Horovod elastic could reset. Raise timeout_s or lower the Gloo timeout.")
    return gloo


class ElasticState(TorchState):
    """``TorchState`` over the model, the optimizer, the loader and the controller.

    Pass the `WeightedDistributedOptimizer`; extra keyword arguments are committed like Horovod's.
    Commit every few steps (``state.commit()``): it copies model and optimizer state to host memory.
    """

    def __init__(self, model: Any, optimizer: Any, loader: AdaptiveLoader,
                 controller: DynamixController | None = None, **kwargs: Any) -> None:
        if controller is not None:
            check_timeouts(controller.cfg.timeout_s)
        inner = getattr(optimizer, "_hvd", optimizer)  # Horovod's handler wants a torch.optim.Optimizer
        own: dict[str, StateHandler] = {"dx_loader": LoaderStateHandler(loader)}
        if controller is not None:
            own["dx_controller"] = ControllerStateHandler(controller)
        super().__init__(model=model, optimizer=inner, **kwargs)
        # Ours first, as a registry entry would have placed them: every rank syncs in the same order.
        self._handlers = {**own, **self._handlers}
        for name, handler in own.items():
            setattr(self, name, handler.value)

