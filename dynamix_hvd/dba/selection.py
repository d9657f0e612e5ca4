"""Dynamic Batch Adaptation (DBA, arXiv 2208.00815): per-sample gradient statistics, subset selection.

Pure torch (no MPI, no Horovod). Each step:

1. one Gram matrix per layer, ``K[l, i, j] = <g_i, g_j>`` over the parameters of layer l (one module,
   e.g. a Linear's weight and bias): from activations and output gradients captured by hooks
   (`dynamix_hvd.dba.ghost`, no per-sample gradients of the model), or from per-sample gradients with
   ``torch.func`` where the model has layers the hooks do not cover (``DBAConfig.engine``);
2. a selection on the Gram matrices only: a search over subsets S for the one whose mean gradient
   scores best on the metric (``estimator="subset"``), or a random draw with importance weights that
   keeps the update an unbiased estimate of the full-batch mean (``"importance"``,
   `dynamix_hvd.dba.importance`);
3. the weighted gradient over the selection, which replaces the batch-mean gradient in the update.

Metrics, for layer l and subset S of k samples, m_S = mean gradient, sigma_S^2 = unbiased trace of
the per-sample gradient covariance within S (both from K: ``|sum_S g|^2 = w'Kw``):

- ``"variance"`` (the paper's): variance of the update, ``sigma_S^2 / k``;
- ``"snr"``: inverse signal-to-noise ratio of the update, ``sigma_S^2 / (k |m_S|^2)``.

Each layer's value is divided by the full batch's, so 1.0 means "as good as the whole batch", and the
layers are averaged (``granularity="model"``) or each layer picks its own subset (``"layer"``).
Both metrics are lower-is-better and include 1/k, so shrinking the batch must pay for itself by
removing disagreeing samples. ``min_cosine`` admits only subsets whose mean keeps that cosine to the
full batch's mean (per layer), which is what stops the elimination before it reaches the easy samples.
"""
from __future__ import annotations


from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..optim.grads import assign_gradients
from . import fastgreedy, ghost
from .importance import importance_weights
from .. import validate

Metric = Literal["variance", "snr"]
Search = Literal["greedy", "rank"]
Granularity = Literal["model", "layer"]
Estimator = Literal["subset", "importance"]
Engine = Literal["auto", "ghost", "func"]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
METRICS = ("variance", "snr")
SEARCHES = ("greedy", "rank")
GRANULARITIES = ("model", "layer")
ESTIMATORS = ("subset", "importance")
ENGINES = ("auto", "ghost", "func")


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
    Without ``min_cosine`` both metrics keep improving as the subset shrinks to a few near-identical
    gradients (often one class), so the search usually ends at this bound: it sets the typical
    effective batch. With ``min_cosine`` set it to 0 and let the bound decide (see `VARIANTS`)."""

    tolerance: float = 1e-9
    """A smaller subset must beat a larger one by more than this (relative) to be preferred, so that
    rounding noise never shrinks the batch."""

    min_cosine: float | None = None
    """If set (in [-1, 1]): a candidate subset must keep, in every layer, cosine >= this between its
    mean gradient and the full batch's. The elimination stops where no removal keeps the bound, so the
    bound, not ``min_fraction``, sets the subset size; the update cannot turn away from the full-batch
    direction onto the samples the model already fits. None: no bound (the paper's search)."""

    estimator: Estimator = "subset"
    """``"subset"``: the search above, update = mean over the chosen subset (biased by design).
    ``"importance"``: keep sample i at random with probability p_i ~ |g_i| (per layer, or one for the
    model with ``granularity="model"``) and weight it 1/(n p_i): an unbiased estimate of the full-batch
    mean whose relative RMS error is at most ``max_noise`` (`dynamix_hvd.dba.importance`). Ignores
    metric, search and the minimum sizes."""

    max_noise: float = 0.5
    """``estimator="importance"``: bound on the RMS of |update - full-batch mean| / |full-batch mean|;
    it decides how many samples are kept (larger = fewer). Must be > 0."""

    seed: int = 0
    """Seed of the importance draws (`DistributedDBA` adds the rank)."""

    engine: Engine = "auto"
    """How the per-sample Gram matrices are computed. ``"ghost"``: forward/backward hooks on Linear and
    Conv2d layers, from activations and output gradients (`dynamix_hvd.dba.ghost`); ``"func"``:
    per-sample gradients with ``torch.func`` then their inner products (any layer, n x parameters
    memory); ``"auto"``: ghost when every trainable parameter belongs to a layer it supports."""

    def __post_init__(self) -> None:
        for name, allowed in (("metric", METRICS), ("search", SEARCHES), ("granularity", GRANULARITIES),
                              ("estimator", ESTIMATORS), ("engine", ENGINES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"DBAConfig.{name}={value!r}; choose one of {', '.join(allowed)}")
        validate.integer("DBAConfig.min_subset", self.min_subset, 2)
        validate.number("DBAConfig.min_fraction", self.min_fraction, 0.0, maximum=1.0, what="a number in [0, 1]")
        validate.number("DBAConfig.tolerance", self.tolerance, 0.0, below=1.0, what="a number in [0, 1)")
        if self.min_cosine is not None:
            validate.number("DBAConfig.min_cosine", self.min_cosine, -1.0, maximum=1.0, what="None or a number in [-1, 1]")
        validate.number("DBAConfig.max_noise", self.max_noise, above=0)
        validate.integer("DBAConfig.seed", self.seed)

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
    tolerance, since the full batch is always a candidate). With ``min_cosine`` only subsets whose
    mean gradient keeps that cosine to the full batch's (every layer) are candidates.
    """
    L, n, _ = gram.shape
    tiny = torch.finfo(gram.dtype).tiny
    diag = gram.diagonal(0, 1, 2)                                    # [L, n] |g_j|^2
    full_c = gram.sum(2)                                             # [L, n] <sum_B g, g_j>
    s2, q = full_c.sum(1), diag.sum(1)                               # [L]
    base = _raw_metric(s2, q, torch.full_like(s2, n), config.metric).clamp_min(tiny)
    first = _raw_metric(s2, q, torch.full_like(s2, n), config.metric) / base
    search = _greedy if config.search == "greedy" else _ranked
    values, order = search(gram, diag, full_c, base, config)        # [steps, L], removal per step
    values = torch.cat([first[None], values]) if len(values) else first[None]
    model = config.granularity == "model"
    choice = values.mean(1) if model else values
    best = _first_best(choice, config.tolerance).expand(L)          # [L] removals to keep
    rows = torch.arange(L, device=gram.device)
    mask = torch.ones(L, n, dtype=torch.bool, device=gram.device)
    if order:  # removal r of layer l is applied when r < best[l]: one scatter for all of them
        removed = torch.stack(order)                                 # [steps, L]
        applied = torch.arange(len(order), device=gram.device)[:, None] < best[None, :]
        mask[rows.expand_as(removed)[applied], removed[applied]] = False
    return mask, values[best, rows]


def _cosine_ok(s2_new: torch.Tensor, t_new: torch.Tensor, s2_full: torch.Tensor, bound: float | None,
               ) -> torch.Tensor | None:
    """cos(sum_S g, sum_B g) >= bound, from |sum_S|^2, <sum_S, sum_B> and |sum_B|^2 (broadcast)."""
    if bound is None:
        return None
    tiny = torch.finfo(s2_new.dtype).tiny
    return t_new >= bound * (s2_new.clamp_min(0.0) * s2_full).sqrt().clamp_min(tiny)


def _greedy(gram: torch.Tensor, diag: torch.Tensor, full_c: torch.Tensor, base: torch.Tensor,
            config: DBAConfig) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`_greedy_torch`, run as one compiled loop on CPU when numba is there (`fastgreedy`)."""
    fast = fastgreedy.greedy(gram, diag, full_c, base, config.metric == "variance", config.granularity == "model",
                             config.min_cosine, gram.shape[1] - config.min_size(gram.shape[1]))
    return fast if fast is not None else _greedy_torch(gram, diag, full_c, base, config)


def _greedy_torch(gram: torch.Tensor, diag: torch.Tensor, full_c: torch.Tensor, base: torch.Tensor,
                  config: DBAConfig) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Backward elimination: each step removes the sample whose removal scores best (per layer, or
    the best mean over layers); a layer (all layers in model mode) stops when no admissible removal is
    left. Returns the relative metric after each removal [steps, L] (inf once stopped) and the removals."""
    L, n, _ = gram.shape
    model = config.granularity == "model"
    rows = torch.arange(L, device=gram.device)
    w = torch.ones(L, n, dtype=torch.bool, device=gram.device)
    c, s2_full = full_c.clone(), full_c.sum(1)
    s2, q, t = s2_full.clone(), diag.sum(1), s2_full.clone()         # |sum_S|^2, sum_S |g|^2, <sum_S, sum_B>
    size = torch.full_like(s2, n)
    active = torch.ones(L, dtype=torch.bool, device=gram.device)
    path, order = [], []
    for _ in range(n - config.min_size(n)):
        s2_new = s2.unsqueeze(1) - 2 * c + diag
        scores = _raw_metric(s2_new, q.unsqueeze(1) - diag, (size - 1).unsqueeze(1), config.metric)
        scores = torch.where(w, scores / base.unsqueeze(1), torch.inf)
        ok = _cosine_ok(s2_new, t.unsqueeze(1) - full_c, s2_full.unsqueeze(1), config.min_cosine)
        if ok is not None:
            scores = torch.where(ok, scores, torch.inf)
        if model:
            mean = scores.mean(0)
            j = mean.argmin().expand(L)
            step_ok = mean[j[0]].isfinite().expand(L)
        else:
            j = scores.argmin(1)
            step_ok = scores[rows, j].isfinite()
        active = active & step_ok
        if not bool(active.any()):
            break
        path.append(torch.where(active, scores[rows, j], torch.inf))
        order.append(torch.where(active, j, 0))
        w[rows, j] = w[rows, j] & ~active
        c = torch.where(active[:, None], c - gram[rows, :, j], c)
        s2 = torch.where(active, s2 - 2 * c[rows, j] - diag[rows, j], s2)  # c excludes j: |s - g_j|^2
        q = torch.where(active, q - diag[rows, j], q)
        t = torch.where(active, t - full_c[rows, j], t)
        size = torch.where(active, size - 1, size)
    return (torch.stack(path) if path else gram.new_zeros(0, L)), order


def _ranked(gram: torch.Tensor, diag: torch.Tensor, full_c: torch.Tensor, base: torch.Tensor,
            config: DBAConfig) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rank the samples once by the effect of removing each from the full batch, then score every
    prefix of that ranking at once (cumulative sums of the permuted Gram: no loop over sizes)."""
    L, n, _ = gram.shape
    removals = n - config.min_size(n)
    if removals <= 0:
        return gram.new_zeros(0, L), []
    model = config.granularity == "model"
    s2, q = full_c.sum(1), diag.sum(1)
    first = _raw_metric(s2.unsqueeze(1) - 2 * full_c + diag, q.unsqueeze(1) - diag,
                        torch.full_like(full_c, n - 1), config.metric) / base.unsqueeze(1)
    key = first.mean(0, keepdim=True).expand(L, n) if model else first
    ranking = key.argsort(1)[:, :removals]                          # [L, R] most helpful removals first
    rows = torch.arange(L, device=gram.device)[:, None, None]
    removed2 = gram[rows, ranking[:, :, None], ranking[:, None, :]].cumsum(1).cumsum(2).diagonal(0, 1, 2)
    cross = full_c.gather(1, ranking).cumsum(1)                      # <sum_B, sum_R>
    s2_new = s2.unsqueeze(1) - 2 * cross + removed2                  # |sum_B - sum_R|^2
    q_new = q.unsqueeze(1) - diag.gather(1, ranking).cumsum(1)
    size = n - torch.arange(1, removals + 1, device=gram.device, dtype=gram.dtype).expand(L, removals)
    values = _raw_metric(s2_new, q_new, size, config.metric) / base.unsqueeze(1)
    ok = _cosine_ok(s2_new, s2.unsqueeze(1) - cross, s2.unsqueeze(1), config.min_cosine)
    if ok is not None:
        ok = ok.cumprod(1).bool()                                    # the path stops at the first violation
        if model:
            ok = ok.all(0, keepdim=True).expand(L, removals)
        values = torch.where(ok, values, torch.inf)
    return values.T, list(ranking.T)


def _first_best(values: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Along dim 0 (subset path, largest first): the first point where later points never improve by
    more than `tolerance` relative. ``values`` is [P] or [P, L]; returns [L] (broadcast for [P])."""
    # A short sequential scan over a small array: on the host, one copy instead of two kernels a point.
    host = values.detach().to("cpu", torch.float64).numpy()
    flat = host.reshape(host.shape[0], -1)
    best = np.zeros(flat.shape[1], dtype=np.int64)
    for col in range(flat.shape[1]):
        best_val = flat[0, col]
        for r in range(1, flat.shape[0]):
            if flat[r, col] < best_val * (1.0 - tolerance):
                best[col], best_val = r, flat[r, col]
    return torch.from_numpy(best.reshape(host.shape[1:])).to(values.device)


# --- one step -------------------------------------------------------------------------------------
@dataclass
class DBAResult:
    """What one DBA step chose on a local batch."""

    groups: list[list[str]]
    """Parameter names of each layer, in model order."""
    indices: list[torch.Tensor]
    """Selected positions in the batch (sorted int64), one tensor per layer (equal in model mode)."""
    grads: dict[str, torch.Tensor]
    """Weighted gradient over its layer's selected samples, per parameter name."""
    score: torch.Tensor
    """Per layer: for subsets the metric of the selection relative to the full batch (1.0 = no
    better); for importance draws the bound on the relative RMS error of the update."""
    loss: torch.Tensor
    """Mean loss over the whole batch (detached)."""
    weights: torch.Tensor
    """Per-sample weights of the update, [layers, n] (1/k on a subset of k; 1/(n p_i) for draws)."""
    counts: list[int]
    """Samples each layer's update stands for: the subset size, or the whole batch for an unbiased
    importance draw (its estimate is of the full-batch mean). `DistributedDBA` weights ranks by it."""
    gram: torch.Tensor
    """The per-layer Gram matrices the selection was made on, float64 [layers, n, n]."""

    @property
    def kept(self) -> list[int]:
        """Samples with a nonzero weight, per layer."""
        return [int(i.numel()) for i in self.indices]

    def alignment(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per layer: cosine between the update and the full-batch mean gradient, and the ratio of
        their lengths (both from the Gram matrices)."""
        n = self.gram.shape[1]
        ones = torch.full((n,), 1.0 / n, dtype=self.gram.dtype, device=self.gram.device)
        w = self.weights.to(self.gram.device, self.gram.dtype)
        uu = torch.einsum("ln,lnm,lm->l", w, self.gram, w).clamp_min(0.0)
        uf = torch.einsum("ln,lnm,m->l", w, self.gram, ones)
        ff = torch.einsum("n,lnm,m->l", ones, self.gram, ones).clamp_min(torch.finfo(self.gram.dtype).tiny)
        return uf / (uu * ff).sqrt().clamp_min(torch.finfo(self.gram.dtype).tiny), (uu / ff).sqrt()


VARIANTS: dict[str, DBAConfig] = {
    # The paper's reading: per-layer variance, greedy elimination, the size where the metric is lowest.
    "literal": DBAConfig(metric="variance", granularity="layer", min_fraction=0.0),
    # The same search, constrained to stay within cosine 0.9 of the full-batch direction per layer.
    "cosine": DBAConfig(metric="variance", granularity="layer", min_fraction=0.0, min_cosine=0.9),
    # Unbiased importance draws per layer, relative RMS error at most 0.5.
    "unbiased": DBAConfig(estimator="importance", granularity="layer", max_noise=0.5),
}
"""Named configurations measured in bench/bench_dba_digits.py and described in docs/dba.md."""


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
        reason = ghost.supported(model, self.groups)
        if self.config.engine == "ghost" and reason is not None:
            raise ValueError(f"DBAConfig.engine='ghost' cannot handle this model: {reason}")
        self.engine = "func" if self.config.engine == "func" or reason is not None else "ghost"
        self.generator = torch.Generator().manual_seed(self.config.seed)

    def compute(self, x: torch.Tensor, y: torch.Tensor) -> DBAResult:
        """Per-layer Gram matrices, selection, and the weighted gradient over the selection."""
        if x.shape[0] < 1 or x.shape[0] != y.shape[0]:
            raise ValueError(f"need a non-empty batch with one target per input; got {x.shape[0]} inputs "
                             f"and {y.shape[0]} targets")
        n = x.shape[0]
        if self.engine == "ghost":
            stats = ghost.ghost_stats(self.model, self.loss_fn, x, y, self.groups)
            gram, loss, weighted = stats.gram, stats.loss, stats.weighted_grads
        else:
            grads, losses = per_sample_grads(self.model, self.loss_fn, x, y)
            gram, loss = gram_matrices(grads, self.groups), losses.mean().detach()

            def weighted(w: torch.Tensor) -> dict[str, torch.Tensor]:
                return {name: torch.tensordot(wl.to(grads[name].dtype), grads[name], dims=1)
                        for group, wl in zip(self.groups, w) for name in group}
        cfg = self.config
        if cfg.estimator == "importance":
            uniform = torch.rand(n, generator=self.generator, dtype=torch.float64)
            weights, score = importance_weights(gram, cfg.max_noise, cfg.granularity == "model", uniform)
            counts = [n] * len(self.groups)
        else:
            mask, score = select_subsets(gram, cfg)
            counts = [int(k) for k in mask.sum(1)]
            weights = mask.to(gram.dtype) / mask.sum(1, keepdim=True).to(gram.dtype)
        indices = [w.nonzero().flatten() for w in weights]
        return DBAResult(self.groups, indices, weighted(weights.to(x.device)), score, loss, weights, counts, gram)

    def apply(self, result: DBAResult, scale: dict[str, float] | None = None) -> None:
        """Write ``grad * scale[name]`` (scale 1 by default) into ``p.grad``, in place when it exists
        (so gradients kept as views of a flat buffer stay views)."""
        grads = result.grads if scale is None else {n: g * scale[n] for n, g in result.grads.items()}
        assign_gradients(self.params, grads)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> DBAResult:
        """`compute` then `apply`; the caller then runs ``optimizer.step()``."""
        result = self.compute(x, y)
        self.apply(result)
        return result
