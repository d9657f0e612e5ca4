"""Dynamic Batch Adaptation (DBA, arXiv 2208.00815): per-sample gradients, subset selection.

Pure torch (no MPI, no Horovod). Each step:

1. per-sample gradients of the local batch with ``torch.func`` (``vmap(grad(functional_call))``);
2. one Gram matrix per layer, ``K[l, i, j] = <g_i, g_j>`` restricted to the parameters of layer l
   (a layer = the parameters of one module, e.g. a Linear's weight and bias);
3. a search over subsets S of the batch, on the Gram matrices only, for the subset whose mean
   gradient scores best on the metric (see `DBAConfig`): the subset's *size and members* change
   every step;
4. the mean gradient over S, which replaces the batch-mean gradient in the update.

Metrics, for layer l and subset S of k samples, m_S = mean gradient, sigma_S^2 = unbiased trace of
the per-sample gradient covariance within S (both from K: ``|sum_S g|^2 = w'Kw``):

- ``"variance"`` (the paper's): variance of the update, ``sigma_S^2 / k``;
- ``"snr"``: inverse signal-to-noise ratio of the update, ``sigma_S^2 / (k |m_S|^2)``.

Each layer's value is divided by the full batch's, so 1.0 means "as good as the whole batch", and the
layers are averaged (``granularity="model"``) or each layer picks its own subset (``"layer"``).
Both metrics are lower-is-better and include 1/k, so shrinking the batch must pay for itself by
removing disagreeing samples. Cost beyond plain training: the per-sample gradients (n x parameters
memory) and the Gram matrices (n^2 x parameters flops); the search itself is O(layers x n^2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

Metric = Literal["variance", "snr"]
Search = Literal["greedy", "rank"]
Granularity = Literal["model", "layer"]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
METRICS = ("variance", "snr")
SEARCHES = ("greedy", "rank")
GRANULARITIES = ("model", "layer")


@dataclass(frozen=True)
class DBAConfig:
    """Options of Dynamic Batch Adaptation; invalid values raise ValueError naming them."""

    metric: Metric = "snr"
    """What a subset is scored on (lower is better): ``"variance"`` = per-layer variance of the
    subset's mean gradient (the paper's metric); ``"snr"`` = that variance over the squared norm of
    the mean gradient (inverse signal-to-noise ratio of the update). Default ``"snr"``: the variance
    favours samples the model already fits (tiny gradients), which cost it 14-19 accuracy points in
    bench/bench_dba_digits.py; the scale-free ratio keeps the hard samples that agree in direction."""

    search: Search = "greedy"
    """How the subset is found. ``"greedy"``: backward elimination from the full batch, each time
    removing the sample whose removal scores best, down to the minimum size; the best point on that
    path (the full batch included) wins. ``"rank"``: score each sample once by the effect of removing
    it from the full batch, then keep the best prefix of that ranking (cheaper, less adaptive)."""

    granularity: Granularity = "model"
    """``"model"``: one subset for the whole network, scored by the mean over layers of each layer's
    metric relative to the full batch. ``"layer"``: every layer (module) picks its own subset."""

    min_subset: int = 2
    """Smallest subset, in samples (>= 2: the variance needs two samples). Batches of at most this
    many samples are used whole."""

    min_fraction: float = 0.5
    """Smallest subset as a fraction of the batch (0..1); the larger of the two minimums applies.
    Both metrics keep improving as the subset shrinks to a few near-identical gradients (often one
    class), so the search usually ends at this bound: it sets the typical effective batch."""

    tolerance: float = 1e-9
    """A smaller subset must beat a larger one by more than this (relative) to be preferred, so that
    rounding noise never shrinks the batch."""

    def __post_init__(self) -> None:
        for name, allowed in (("metric", METRICS), ("search", SEARCHES), ("granularity", GRANULARITIES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"DBAConfig.{name}={value!r}; choose one of {', '.join(allowed)}")
        if isinstance(self.min_subset, bool) or not isinstance(self.min_subset, int) or self.min_subset < 2:
            raise ValueError(f"DBAConfig.min_subset={self.min_subset!r}; it must be an integer >= 2")
        if not (isinstance(self.min_fraction, (int, float)) and 0.0 <= self.min_fraction <= 1.0):
            raise ValueError(f"DBAConfig.min_fraction={self.min_fraction!r}; it must be in [0, 1]")
        if not (isinstance(self.tolerance, (int, float)) and 0.0 <= self.tolerance < 1.0):
            raise ValueError(f"DBAConfig.tolerance={self.tolerance!r}; it must be in [0, 1)")

    def min_size(self, n: int) -> int:
        """Smallest subset allowed in a batch of n samples (n itself if the batch is that small)."""
        need = max(self.min_subset, int(-(-self.min_fraction * n // 1)))
        return min(n, need)


# --- per-sample gradients -------------------------------------------------------------------------
def per_sample_grads(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Gradient of every sample's loss w.r.t. every trainable parameter, without a Python loop.

    Returns ({name: tensor [n, *param.shape]}, per-sample losses [n]). ``loss_fn(output, target)``
    is called on a batch of one and must return a scalar. Layers that mix samples (BatchNorm in
    training mode) have no per-sample gradient: use eval-mode or per-sample normalisation.
    """
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    buffers = {k: b.detach() for k, b in model.named_buffers()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, frozen, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    grads, losses = vmap(grad_and_value(one), in_dims=(None, 0, 0), randomness="different")(params, x, y)
    return grads, losses


def layer_groups(names: list[str]) -> list[list[str]]:
    """Parameter names grouped by module (``"0.weight"`` and ``"0.bias"`` form one layer), in order."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.rsplit(".", 1)[0] if "." in n else n, []).append(n)
    return list(groups.values())


def gram_matrices(grads: dict[str, torch.Tensor], groups: list[list[str]]) -> torch.Tensor:
    """Per-layer Gram matrices of the per-sample gradients, float64 [layers, n, n]."""
    out = []
    for group in groups:
        flat = torch.cat([grads[n].flatten(1) for n in group], dim=1)
        out.append((flat @ flat.T).double())
    return torch.stack(out)


# --- metric -----------------------------------------------------------------------------------------
def _raw_metric(s2: torch.Tensor, q: torch.Tensor, k: torch.Tensor, metric: str) -> torch.Tensor:
    """Metric from |sum_S g|^2 (s2), sum_S |g|^2 (q) and |S| (k); elementwise, lower is better."""
    k = k.to(s2.dtype)
    spread = (q - s2 / k).clamp_min(0.0)                    # sum of squared deviations from m_S
    var_mean = spread / (k * (k - 1.0)).clamp_min(1.0)     # unbiased sigma_S^2 / k (0 when k = 1)
    if metric == "variance":
        return var_mean
    return var_mean / (s2 / (k * k)).clamp_min(torch.finfo(s2.dtype).tiny)


def subset_metric(gram: torch.Tensor, mask: torch.Tensor, metric: str) -> torch.Tensor:
    """Per-layer metric of the subset `mask` (bool [n] or [layers, n]) relative to the full batch."""
    mask = mask.to(gram.dtype).expand(gram.shape[0], -1)
    full = torch.ones_like(mask)
    value = [_raw_metric(torch.einsum("ln,lnm,lm->l", w, gram, w), (w * gram.diagonal(0, 1, 2)).sum(1),
                         w.sum(1), metric) for w in (mask, full)]
    return value[0] / value[1].clamp_min(torch.finfo(gram.dtype).tiny)


# --- search -----------------------------------------------------------------------------------------
def select_subsets(gram: torch.Tensor, config: DBAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the subset(s) on the per-layer Gram matrices ``gram`` [layers, n, n].

    Returns (mask bool [layers, n], score [layers]): the chosen samples per layer (identical rows
    when ``granularity="model"``) and each layer's metric relative to the full batch (<= 1 up to the
    tolerance, since the full batch is always a candidate).
    """
    L, n, _ = gram.shape
    min_k = config.min_size(n)
    diag = gram.diagonal(0, 1, 2)                                    # [L, n] |g_j|^2
    w = torch.ones(L, n, dtype=gram.dtype, device=gram.device)
    c = gram.sum(2)                                                  # [L, n] <sum_S g, g_j>
    s2, q = c.sum(1), diag.sum(1)                                    # [L]
    base = _raw_metric(s2, q, torch.full_like(s2, n), config.metric).clamp_min(torch.finfo(gram.dtype).tiny)
    model = config.granularity == "model"

    def removal_scores(k: int) -> torch.Tensor:
        """Relative metric of S minus {j}, for every j still in S (inf otherwise), [L, n]."""
        kk = torch.full_like(s2, k - 1).unsqueeze(1)
        new = _raw_metric(s2.unsqueeze(1) - 2 * c + diag, q.unsqueeze(1) - diag, kk, config.metric)
        return torch.where(w > 0, new / base.unsqueeze(1), torch.inf)

    def pick(scores: torch.Tensor) -> torch.Tensor:
        """Index to remove per layer [L]: one shared index (mean over layers) in model mode."""
        if model:
            return scores.mean(0).argmin().expand(L)
        return scores.argmin(1)

    rows = torch.arange(L, device=gram.device)
    if config.search == "greedy":
        order = []
        path = [_raw_metric(s2, q, torch.full_like(s2, n), config.metric) / base]
        for k in range(n, min_k, -1):
            scores = removal_scores(k)
            j = pick(scores)
            path.append(scores[rows, j])
            order.append(j)
            w[rows, j] = 0.0
            c = c - gram[rows, :, j]
            s2 = s2 - 2 * c[rows, j] - diag[rows, j]  # c already excludes j: |s - g_j|^2
            q = q - diag[rows, j]
    else:
        scores = removal_scores(n)
        key = scores.mean(0, keepdim=True).expand(L, n) if model else scores
        ranking = key.argsort(1)[:, : n - min_k]                    # most helpful removals first
        order = list(ranking.T)
        masks = torch.ones(n - min_k + 1, L, n, dtype=gram.dtype, device=gram.device)
        for r in range(1, n - min_k + 1):
            masks[r:, rows, ranking[:, r - 1]] = 0.0
        path = [subset_metric(gram, m, config.metric) for m in masks]
    values = torch.stack(path)                                       # [steps + 1, L]
    choice = values.mean(1) if model else values
    best = _first_best(choice, config.tolerance).expand(L)          # [L] removals to keep
    mask = torch.ones(L, n, dtype=torch.bool, device=gram.device)
    for r, j in enumerate(order):
        drop = best > r
        mask[rows[drop], j[drop]] = False
    return mask, values[best, rows]


def _first_best(values: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Along dim 0 (subset path, largest first): the first point where later points never improve by
    more than `tolerance` relative. ``values`` is [P] or [P, L]; returns [L] (broadcast for [P])."""
    best = torch.zeros(values.shape[1:], dtype=torch.long, device=values.device)
    best_val = values[0].clone()
    for r in range(1, values.shape[0]):
        better = values[r] < best_val * (1.0 - tolerance)
        best = torch.where(better, r, best)
        best_val = torch.where(better, values[r], best_val)
    return best


# --- one step -------------------------------------------------------------------------------------
@dataclass
class DBAResult:
    """What one DBA step chose on a local batch."""

    groups: list[list[str]]
    """Parameter names of each layer, in model order."""
    indices: list[torch.Tensor]
    """Selected positions in the batch (sorted int64), one tensor per layer (equal in model mode)."""
    grads: dict[str, torch.Tensor]
    """Mean gradient over its layer's selected samples, per parameter name."""
    score: torch.Tensor
    """Per-layer metric of the selection relative to the full batch (1.0 = no better)."""
    loss: torch.Tensor
    """Mean loss over the whole batch (detached)."""

    @property
    def counts(self) -> list[int]:
        """Selected samples per layer."""
        return [int(i.numel()) for i in self.indices]


class DynamicBatchAdaptation:
    """Runs DBA on a model: ``result = dba.compute(x, y)``; ``dba.apply(result)`` writes ``p.grad``.

    Single process: ``opt.zero_grad(); dba.step(x, y); opt.step()`` replaces ``loss.backward()``.
    For several ranks use `dynamix_hvd.dba.distributed.DistributedDBA`.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, config: DBAConfig | None = None) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.config = config or DBAConfig()
        self.params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("model has no parameter that requires grad")
        self.groups = layer_groups(list(self.params))

    def compute(self, x: torch.Tensor, y: torch.Tensor) -> DBAResult:
        """Per-sample gradients, subset search and the mean gradient over the chosen subset(s)."""
        if x.shape[0] < 1 or x.shape[0] != y.shape[0]:
            raise ValueError(f"need a non-empty batch with one target per input; got {x.shape[0]} inputs "
                             f"and {y.shape[0]} targets")
        grads, losses = per_sample_grads(self.model, self.loss_fn, x, y)
        mask, score = select_subsets(gram_matrices(grads, self.groups), self.config)
        indices = [m.nonzero().flatten() for m in mask]
        means: dict[str, torch.Tensor] = {}
        for group, m in zip(self.groups, mask):
            weights = m.to(x.device, grads[group[0]].dtype) / m.sum()
            for name in group:
                means[name] = torch.tensordot(weights, grads[name], dims=1)
        return DBAResult(self.groups, indices, means, score, losses.mean().detach())

    def apply(self, result: DBAResult, scale: dict[str, float] | None = None) -> None:
        """Write ``grad * scale[name]`` (scale 1 by default) into ``p.grad``, in place when it exists
        (so gradients kept as views of a flat buffer stay views)."""
        for name, g in result.grads.items():
            p = self.params[name]
            g = g if scale is None else g * scale[name]
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.copy_(g)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> DBAResult:
        """`compute` then `apply`; the caller then runs ``optimizer.step()``."""
        result = self.compute(x, y)
        self.apply(result)
        return result
