"""What the controller needs of the optimizer, as a typed Protocol checked when it is built. Pure."""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class ControlledOptimizer(Protocol):
    """The optimizer side of the controller: `dynamix_hvd.WeightedDistributedOptimizer` provides it.

    Without these the controller would have no gradient statistics (noise scale, efficiency, AdaScale
    gain) and could not shrink a batch after an out-of-memory error, so a plain optimizer is refused
    rather than silently run without them."""

    lr_gain: float
    """Extra LR factor (the AdaScale gain) the controller sets at every decision."""
    base_batch_size: int
    """Samples per optimizer step the learning rate was tuned for (the gain's base)."""
    backward_passes_per_step: int
    """Micro-batches per optimizer step (the gain is for all their samples)."""
    oom_handler: Callable[[list[int], list[int]], list[int]]
    """Called with (sizes, failed sizes per rank) after an out-of-memory step; returns the new sizes."""
    param_names: list[str]
    """Names of the parameters, in the order of the per-layer means."""
    accumulating: bool
    """True between the micro-batches of one optimizer step (decisions wait for the step's end)."""
    allreduce_bytes: int
    """Gradient bytes one optimizer step allreduces, after compression (the network model's payload)."""

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Micro-batches per optimizer step from the next step on (called between steps)."""
        ...

    def pop_layer_means(self) -> tuple[list[float], list[float]] | None:
        """Mean per-parameter squared norms (local, global) since the last call (None: no step)."""
        ...

    def noise_every_for(self, step_s: float) -> int:
        """Optimizer steps between two that take the gradient-noise statistics, for steps of `step_s`
        seconds (1: every step; more where taking them costs a noticeable share of the step)."""
        ...

    def set_noise_every(self, every: int) -> None:
        """Take the noise statistics on the next step, then on every `every`-th (every rank alike)."""
        ...

    def time_small_allreduce(self) -> float:
        """Seconds a single-value allreduce takes (a collective: every rank calls it at the same point)."""
        ...


def check_optimizer(optimizer: Any) -> ControlledOptimizer:
    """`optimizer` if it provides :class:`ControlledOptimizer`; otherwise a TypeError that says what to use."""
    if isinstance(optimizer, ControlledOptimizer):
        return optimizer
    members = ("lr_gain", "base_batch_size", "backward_passes_per_step", "oom_handler", "param_names",
               "accumulating", "allreduce_bytes", "set_backward_passes_per_step", "pop_layer_means",
               "noise_every_for", "set_noise_every", "time_small_allreduce")
    missing = [m for m in members if not hasattr(optimizer, m)]
    raise TypeError(
        f"DynamixController needs an optimizer that provides {', '.join(members)} (missing on "
        f"{type(optimizer).__module__}.{type(optimizer).__qualname__}: {', '.join(missing)}); wrap yours with "
        "dynamix_hvd.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader)")
