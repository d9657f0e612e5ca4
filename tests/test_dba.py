"""Dynamic Batch Adaptation (single process): per-sample gradients, metric, subset search, config."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from dynamix_hvd.dba.selection import (DBAConfig, DynamicBatchAdaptation, gram_matrices, layer_groups,
                             per_sample_grads, select_subsets, subset_metric)


class Scaled(nn.Module):
    """MLP with a frozen layer and a buffer, to check both are handled like the module does."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.frozen = nn.Linear(10, 10)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(10, 3)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) * self.gain
        return self.out(torch.tanh(self.frozen(h)))


def problem(n: int = 12, seed: int = 0):
    torch.manual_seed(seed)
    model = Scaled().double()
    x = torch.randn(n, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    return model, x, y


def loop_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rows) -> dict[str, torch.Tensor]:
    """Reference: autograd on the mean loss of the given rows, one parameter at a time."""
    model.zero_grad()
    F.cross_entropy(model(x[rows]), y[rows]).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


def vectors_gram(vectors: torch.Tensor) -> torch.Tensor:
    """Gram of explicit per-sample vectors [L, n, d] -> [L, n, n]."""
    return vectors @ vectors.transpose(1, 2)


def direct_metric(v: torch.Tensor, metric: str) -> torch.Tensor:
    """Per-layer metric computed from vectors [L, k, d] the textbook way (not from a Gram)."""
    k = v.shape[1]
    mean = v.mean(1)
    var_of_mean = ((v - mean[:, None]) ** 2).sum((1, 2)) / (k - 1) / k
    return var_of_mean if metric == "variance" else var_of_mean / (mean**2).sum(1)


def test_per_sample_grads_equal_a_loop_over_samples():
    model, x, y = problem()
    grads, losses = per_sample_grads(model, F.cross_entropy, x, y)
    assert set(grads) == {"inp.weight", "inp.bias", "out.weight", "out.bias"}  # frozen layer excluded
    for i in range(len(x)):
        ref = loop_grads(model, x, y, [i])
        for name, g in grads.items():
            torch.testing.assert_close(g[i], ref[name], rtol=1e-10, atol=1e-12)
        assert losses[i].item() == pytest.approx(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).item())


def test_layer_groups_and_gram():
    assert layer_groups(["a.0.weight", "a.0.bias", "b.weight", "scale"]) == [
        ["a.0.weight", "a.0.bias"], ["b.weight"], ["scale"]]
    model, x, y = problem(n=5)
    grads, _ = per_sample_grads(model, F.cross_entropy, x, y)
    groups = layer_groups(list(grads))
    gram = gram_matrices(grads, groups)
    assert gram.shape == (2, 5, 5) and gram.dtype == torch.float64
    for l, group in enumerate(groups):
        flat = torch.cat([grads[n].flatten(1) for n in group], 1)
        torch.testing.assert_close(gram[l], flat @ flat.T)


@pytest.mark.parametrize("metric", ["variance", "snr"])
def test_metric_from_gram_equals_the_textbook_formula(metric):
    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, 9, 7, generator=g, dtype=torch.float64) + 0.5
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    got = subset_metric(vectors_gram(v), mask, metric)
    want = direct_metric(v[:, mask], metric) / direct_metric(v, metric)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(subset_metric(vectors_gram(v), torch.ones(9, dtype=torch.bool), metric),
                               torch.ones(3, dtype=torch.float64))


def test_variance_metric_drops_the_outlier_and_keeps_consistent_batches_whole():
    g = torch.Generator().manual_seed(0)
    v = torch.ones(1, 10, 4, dtype=torch.float64) + 0.01 * torch.randn(1, 10, 4, generator=g, dtype=torch.float64)
    v[0, 6] = torch.tensor([-30.0, 25.0, 0.0, 9.0])
    mask, score = select_subsets(vectors_gram(v), DBAConfig(min_fraction=0.0))
    assert not mask[0, 6] and score.item() < 1e-3
    same = torch.ones(2, 8, 3, dtype=torch.float64)  # identical gradients: nothing to improve
    mask, score = select_subsets(vectors_gram(same), DBAConfig(min_fraction=0.0))
    assert mask.all() and torch.equal(score, torch.zeros(2, dtype=torch.float64))


def brute_greedy(gram: torch.Tensor, cfg: DBAConfig) -> torch.Tensor:
    """Model-mode greedy elimination recomputing every candidate's metric from scratch."""
    n = gram.shape[1]
    mask = torch.ones(n, dtype=torch.bool)
    path, masks = [subset_metric(gram, mask, cfg.metric).mean()], [mask.clone()]
    while int(mask.sum()) > cfg.min_size(n):
        cands = {j: subset_metric(gram, mask & (torch.arange(n) != j), cfg.metric).mean()
                 for j in range(n) if mask[j]}
        j = min(cands, key=lambda i: (cands[i].item(), i))
        mask[j] = False
        path.append(cands[j])
        masks.append(mask.clone())
    best = 0
    for r, value in enumerate(path):
        if value < path[best] * (1 - cfg.tolerance):
            best = r
    return masks[best]


@pytest.mark.parametrize("metric", ["variance", "snr"])
def test_incremental_greedy_equals_brute_force(metric):
    g = torch.Generator().manual_seed(7)
    v = torch.randn(2, 11, 5, generator=g, dtype=torch.float64) * torch.rand(1, 11, 1, generator=g) * 3 + 0.3
    cfg = DBAConfig(metric=metric, min_fraction=0.0)
    mask, _ = select_subsets(vectors_gram(v), cfg)
    assert torch.equal(mask[0], brute_greedy(vectors_gram(v), cfg)) and torch.equal(mask[0], mask[1])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 14), layers=st.integers(1, 3), seed=st.integers(0, 10_000),
       metric=st.sampled_from(["variance", "snr"]), search=st.sampled_from(["greedy", "rank"]),
       granularity=st.sampled_from(["model", "layer"]), min_fraction=st.sampled_from([0.0, 0.3, 1.0]))
def test_selection_invariants(n, layers, seed, metric, search, granularity, min_fraction):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(layers, n, 4, generator=g, dtype=torch.float64) * torch.rand(layers, n, 1, generator=g) + 0.2
    gram = vectors_gram(v)
    cfg = DBAConfig(metric=metric, search=search, granularity=granularity, min_fraction=min_fraction)
    mask, score = select_subsets(gram, cfg)
    assert mask.shape == (layers, n) and mask.dtype == torch.bool
    assert (mask.sum(1) >= cfg.min_size(n)).all()
    if n <= max(2, cfg.min_size(n)) or min_fraction == 1.0:
        assert mask.all()
    if granularity == "model":
        assert (mask == mask[0]).all()
        assert score.mean().item() <= 1.0 + 1e-9  # never worse than the whole batch
    else:
        assert (score <= 1.0 + 1e-9).all()
    torch.testing.assert_close(score, subset_metric(gram, mask, metric))  # bookkeeping is exact


@pytest.mark.parametrize("granularity", ["model", "layer"])
def test_step_writes_the_mean_gradient_over_the_selected_samples(granularity):
    model, x, y = problem(n=16, seed=1)
    dba = DynamicBatchAdaptation(model, F.cross_entropy, DBAConfig(metric="snr", granularity=granularity))
    result = dba.compute(x, y)
    assert all(torch.equal(i, i.unique()) for i in result.indices)  # sorted, no repeats
    assert result.counts == [int(i.numel()) for i in result.indices] and min(result.counts) >= 4
    assert result.counts != [16, 16], "this batch should not be used whole"
    for group, idx in zip(result.groups, result.indices):
        ref = loop_grads(model, x, y, idx)
        for name in group:
            torch.testing.assert_close(result.grads[name], ref[name], rtol=1e-10, atol=1e-12)
    views = {}
    for name, p in model.named_parameters():
        p.grad = views[name] = torch.full_like(p, 7.0)
    dba.apply(result)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is views[name]  # written in place: flat-buffer views stay views
            torch.testing.assert_close(p.grad, result.grads[name])
    assert result.loss.item() == pytest.approx(F.cross_entropy(model(x), y).item())


def test_step_rejects_bad_batches():
    model, x, y = problem(n=4)
    dba = DynamicBatchAdaptation(model, F.cross_entropy)
    with pytest.raises(ValueError, match="3 targets"):
        dba.compute(x, y[:3])
    with pytest.raises(ValueError, match="requires grad"):
        DynamicBatchAdaptation(nn.Linear(2, 2).requires_grad_(False), F.cross_entropy)


@pytest.mark.parametrize("kwargs, needle", [
    ({"metric": "varience"}, "metric='varience'"),
    ({"search": "beam"}, "search='beam'"),
    ({"granularity": "param"}, "granularity='param'"),
    ({"min_subset": 1}, "min_subset=1"),
    ({"min_subset": 2.5}, "min_subset=2.5"),
    ({"min_subset": True}, "min_subset=True"),
    ({"min_fraction": 1.5}, "min_fraction=1.5"),
    ({"min_fraction": -0.1}, "min_fraction=-0.1"),
    ({"tolerance": 1.0}, "tolerance=1.0"),
])
def test_bad_config_names_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        DBAConfig(**kwargs)


def test_min_size():
    cfg = DBAConfig(min_subset=3, min_fraction=0.25)
    assert [cfg.min_size(n) for n in (1, 2, 3, 8, 12, 13, 64)] == [1, 2, 3, 3, 3, 4, 16]
