"""Dynamic Batch Adaptation across Horovod ranks, with an exact mean over all selected samples.

Each rank runs the subset search (`dynamix_hvd.dba.selection`) on its own local batch, so its *effective* batch
is the k_i samples it selected (per layer with ``granularity="layer"``). One allgather of the
per-rank, per-layer selected counts per step (`comm.DBA_COUNTS`, with a deadline) gives
K = sum_i k_i, and this rank's contribution

    p.grad = (k_i / K) * (mean gradient over its k_i selected samples)

makes Horovod's Sum allreduce (`WeightedDistributedOptimizer` uses ``op=hvd.Sum``) produce the mean
over the K selected samples of *all* ranks, exactly as if one process had averaged them. With the
unbiased importance estimator (``DBAConfig(estimator="importance")``) k_i is the local batch size b_i
(each rank's update estimates its batch mean), so the same weighting gives an unbiased estimate of the
global batch mean; each rank draws with seed ``config.seed + rank``.

No backward pass runs: the per-sample gradients already give the subset mean, so the optimizer's
backward hook (which weights by the loader's planned counts) never fires. Horovod's ``synchronize()``
allreduces every parameter whose hook did not fire, so ``opt.step()`` works unchanged. The gradients
are written in place into ``p.grad`` (the optimizer's flat-buffer views). If the optimizer offers
``set_local_gradients(grads, local, global_)`` (the proposed extension that also records the local
gradient norms for the noise-scale statistics) it is used instead.

Failures: if the local DBA computation raises (e.g. out of memory inside ``opt.guard()``), this rank
still joins the count exchange with zero counts before re-raising, so the other ranks never wait on
a collective that will not come; ``opt.step()`` then skips and redoes the step on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..comm import DBA_COUNTS, library_channel
from .selection import DBAConfig, DBAResult, DynamicBatchAdaptation, LossFn

COUNTS_NAME = DBA_COUNTS.name


@dataclass
class DistributedDBAStep:
    """One distributed DBA step: this rank's selection and every rank's selected counts."""

    local: DBAResult
    """This rank's selection (indices into its local batch, mean gradients over them)."""
    counts: torch.Tensor
    """Selected samples per rank and layer, int64 [world, layers] (identical on every rank)."""

    @property
    def global_counts(self) -> list[int]:
        """Samples in the update, per layer (K = sum over ranks)."""
        return [int(v) for v in self.counts.sum(0)]

    @property
    def local_counts(self) -> list[int]:
        return self.local.counts


def exchange_counts(counts: list[int]) -> torch.Tensor:
    """Allgather this rank's per-layer counts: int64 [world, layers], rows in rank order."""
    mine = torch.tensor([counts], dtype=torch.int64)
    return library_channel().allgather_tensor(mine, DBA_COUNTS)


class DistributedDBA:
    """DBA on every rank; the update is the exact mean over the union of all ranks' selections.

    Usage (replaces ``loss.backward()``)::

        dba = DistributedDBA(model, F.cross_entropy, DBAConfig(metric="snr"), optimizer=opt)
        for x, y in loader:
            opt.zero_grad()
            dba.step(x, y)      # per-sample grads, local subset search, one small allgather
            opt.step()          # Horovod Sum allreduce -> mean over all selected samples

    Args:
        model: the local replica (same parameters on every rank, e.g. after broadcast).
        loss_fn: ``loss_fn(output, target)`` returning the mean loss of a batch.
        config: the DBA options (the same on every rank).
        optimizer: the `WeightedDistributedOptimizer`; its ``set_local_gradients`` writes this rank's
            weighted contribution (the one module that touches gradients stays the only one).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, config: DBAConfig | None = None, *,
                 optimizer: object) -> None:
        if not hasattr(optimizer, "set_local_gradients"):
            raise ValueError(f"optimizer {type(optimizer).__name__} cannot take DBA gradients; pass the "
                             "dynamix_hvd.WeightedDistributedOptimizer")
        self.dba = DynamicBatchAdaptation(model, loss_fn, config)
        self.dba.generator.manual_seed(self.dba.config.seed + library_channel().rank)  # independent draws per rank
        self.optimizer = optimizer
        self.last: DistributedDBAStep | None = None

    @property
    def config(self) -> DBAConfig:
        return self.dba.config

    def step(self, x: torch.Tensor, y: torch.Tensor) -> DistributedDBAStep:
        """Select locally, exchange counts, write this rank's weighted contribution into ``p.grad``."""
        try:
            result = self.dba.compute(x, y)
        except Exception:
            exchange_counts([0] * len(self.dba.groups))  # keep the collective sequence aligned
            raise
        counts = exchange_counts(result.counts)
        # The optimizer is the one place that writes gradients (and records their local norms).
        local = {n: k for g, k in zip(result.groups, result.counts) for n in g}
        total = {n: int(t) for g, t in zip(result.groups, counts.sum(0)) for n in g}
        self.optimizer.set_local_gradients(result.grads, local, total)
        self.last = DistributedDBAStep(result, counts)
        return self.last
