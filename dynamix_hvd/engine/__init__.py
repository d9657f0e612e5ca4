"""Engines: the two ways the ranks of a job talk to each other, Horovod and torch.distributed.

An engine provides the data plane the weighted optimizer needs (`DataPlane`: the gradient
reduction, small named allreduces) and the point-to-point messages the control plane's collectives
run on where there is no MPI (`dynamix_hvd.comm` owns the collectives and their deadlines).

- `engine.horovod`: ``hvd.DistributedOptimizer`` as the gradient allreduce, Horovod's object
  collectives under ``horovodrun --gloo``.
- `engine.torchdist`: a ``DistributedDataParallel`` communication hook (or, without DDP, one
  allreduce per flat gradient buffer), and Gloo point-to-point messages for the control plane.

Only these modules import horovod or torch.distributed. Which engine runs is chosen once, by the
optimizer (`choose`): DDP when it is given a ``DistributedDataParallel`` model, torch.distributed
when a process group is initialised and Horovod is not, Horovod otherwise.
"""
from __future__ import annotations

import sys
from typing import Any, Protocol

ENGINES = ("auto", "horovod", "torch")

HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"
"""The module of ``hvd.DistributedOptimizer``'s classes: Horovod's ``broadcast_optimizer_state``
recognises its wrappers by it (tests check it against the installed Horovod)."""


class GradientReducer(Protocol):
    """Sums every rank's (already weighted) gradients into ``p.grad`` on every rank."""

    hooked: bool
    """True when gradients are handed to the reducer as backward produces them (it then calls the
    optimizer's weighting); False when `synchronize` takes them all at once (weighted before)."""
    recovers_oom: bool
    """Whether a rank that ran out of memory mid-step can still take part in this step's reduction."""
    reduced_in_backward: bool
    """Whether ``p.grad`` holds the sum as soon as backward returns (a GradScaler may then look at the
    gradients before ``step()``)."""

    def synchronize(self) -> None:
        """Wait until ``p.grad`` holds the sum over the ranks."""
        ...

    def in_flight(self) -> bool:
        """True between a backward pass and the `synchronize` that ends its reduction."""
        ...

    def unsent(self) -> list[int]:
        """Indices of the parameters whose gradient has not been handed to the reduction this step."""
        ...

    def set_backward_passes_per_step(self, passes: int) -> None:
        ...

    def reset(self, passes: int) -> None:
        """Forget a step in progress (after a checkpoint is loaded)."""
        ...


class DataPlane(Protocol):
    """What the weighted optimizer needs of an engine."""

    name: str

    def size(self) -> int:
        ...

    def allreduce_sum(self, tensor: Any, name: str) -> Any:
        """The sum over the ranks (every rank calls it at the same point with the same name)."""
        ...

    def allreduce_sum_async(self, tensor: Any, name: str) -> Any:
        """Start the sum; `wait` returns it."""
        ...

    def wait(self, handle: Any) -> Any:
        ...

    def default_compression(self) -> Any:
        ...

    def uncompressed(self, compression: Any) -> bool:
        ...

    def gradient_reducer(self, optimizer: Any, named: list[tuple[str, Any]], passes: int, compression: Any,
                         owner: Any, model: Any = None) -> GradientReducer:
        """The reduction for `owner` (the weighted optimizer, whose `_weigh` / `_weigh_bucket` weigh
        the gradients as they are handed over); `model`: a DistributedDataParallel model, if any."""
        ...


def _is_ddp(model: Any) -> bool:
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    return ddp is not None and isinstance(model, ddp.DistributedDataParallel)


def choose(engine: str, model: Any) -> str:
    """'horovod' or 'torch' for the optimizer's `engine` argument and what it was given as parameters."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}; choose one of {', '.join(ENGINES)}")
    if _is_ddp(model):
        if engine == "horovod":
            raise ValueError("engine='horovod' with a DistributedDataParallel model: DDP reduces the gradients "
                             "itself; pass the unwrapped model's named_parameters() for Horovod")
        return "torch"
    if engine != "auto":
        return engine
    if _horovod_initialised():
        return "horovod"
    return "torch" if torch_distributed_ready() else "horovod"


def torch_distributed_ready() -> bool:
    """A torch.distributed default process group exists (``init_process_group`` was called)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _horovod_initialised() -> bool:
    hvd = sys.modules.get("horovod.torch")
    if hvd is None:
        return False
    try:
        return bool(hvd.is_initialized())
    except Exception:  # noqa: BLE001 - an older Horovod without is_initialized
        return False


def data_plane(kind: str) -> DataPlane:
    if kind == "horovod":
        from .horovod import HorovodPlane

        return HorovodPlane()
    from .torchdist import TorchPlane

    return TorchPlane()
