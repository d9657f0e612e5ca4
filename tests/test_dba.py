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


# --- hook engine (ghost Gram matrices) against torch.func per-sample gradients -----------------------
class SmallCNN(nn.Module):
    def __init__(self, stride: int = 1, padding: int = 1, dilation: int = 1) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=stride, padding=padding, dilation=dilation)
        self.c2 = nn.Conv2d(4, 3, 2, bias=False)
        self.fc = nn.Linear(3 * 9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(torch.relu(self.c1(x)), 2)
        h = F.adaptive_avg_pool2d(torch.tanh(self.c2(h)), 3)
        return self.fc(h.flatten(1))


class Sequence(nn.Module):
    """Linear layers applied at every position: one cheap enough for the ghost form, one not."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).mean(1)


def models_and_batches():
    torch.manual_seed(0)
    n = 7
    yield "mlp", Scaled().double(), torch.randn(n, 6, dtype=torch.float64), 3, ["ghost", "ghost"]
    for kw in ({}, {"stride": 2, "padding": 2}, {"dilation": 2, "padding": 0}):
        yield (f"cnn{kw}", SmallCNN(**kw).double(), torch.randn(n, 2, 14, 14, dtype=torch.float64), 5,
               ["psg", "psg", "ghost"])
    # routes per hooked layer: T^2 (in + out) < in * out takes the ghost form, else materialised
    yield "seq-mixed", Sequence(32).double(), torch.randn(n, 2, 32, dtype=torch.float64), 4, ["ghost", "psg"]
    yield "seq-materialised", Sequence(4).double(), torch.randn(n, 5, 4, dtype=torch.float64), 4, ["psg", "psg"]
    yield "root-linear", nn.Linear(6, 3).double(), torch.randn(n, 6, dtype=torch.float64), 3, ["ghost"]
    conv = nn.Sequential(nn.Conv2d(8, 64, 3), nn.Flatten(), nn.Linear(64 * 4, 3)).double()
    yield "conv-ghost", conv, torch.randn(n, 8, 4, 4, dtype=torch.float64), 3, ["ghost", "ghost"]


@pytest.mark.parametrize("case", list(models_and_batches()), ids=lambda c: c[0])
def test_ghost_gram_and_weighted_grads_equal_the_per_sample_path(case):
    from dynamix_hvd.dba.ghost import ghost_stats
    _, model, x, classes, routes = case
    y = torch.randint(0, classes, (len(x),))
    dba = DynamicBatchAdaptation(model, F.cross_entropy)
    assert dba.engine == "ghost"
    grads, losses = per_sample_grads(model, F.cross_entropy, x, y)
    stats = ghost_stats(model, F.cross_entropy, x, y, dba.groups)
    layers = list({id(layer): layer for layer, _ in stats.layers}.values())
    assert ["ghost" if layer.per_sample is None else "psg" for layer in layers] == routes
    torch.testing.assert_close(stats.gram, gram_matrices(grads, dba.groups), rtol=1e-10, atol=1e-12)
    assert stats.loss.item() == pytest.approx(losses.mean().item())
    w = torch.rand(len(dba.groups), len(x), dtype=torch.float64)
    got = stats.weighted_grads(w)
    for group, wl in zip(dba.groups, w):
        for name in group:
            torch.testing.assert_close(got[name], torch.tensordot(wl, grads[name], dims=1), rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters()), "the hook engine must not fill p.grad"


@pytest.mark.parametrize("variant", ["literal", "cosine", "unbiased"])
def test_both_engines_make_the_same_selection(variant):
    from dynamix_hvd.dba.selection import VARIANTS
    import dataclasses
    model, x, y = problem(n=20, seed=4)
    ghost = DynamicBatchAdaptation(model, F.cross_entropy, VARIANTS[variant]).compute(x, y)
    func = DynamicBatchAdaptation(model, F.cross_entropy,
                                  dataclasses.replace(VARIANTS[variant], engine="func")).compute(x, y)
    assert [i.tolist() for i in ghost.indices] == [i.tolist() for i in func.indices]
    for name in ghost.grads:
        torch.testing.assert_close(ghost.grads[name], func.grads[name], rtol=1e-10, atol=1e-12)


def test_engine_choice_and_unsupported_models():
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double().eval()
    assert DynamicBatchAdaptation(bn, F.cross_entropy).engine == "func"  # auto falls back
    with pytest.raises(ValueError, match="engine='ghost'.*BatchNorm|engine='ghost'.*1.weight"):
        DynamicBatchAdaptation(bn, F.cross_entropy, DBAConfig(engine="ghost"))
    assert DynamicBatchAdaptation(nn.Sequential(nn.Conv2d(2, 2, 3, groups=2)), F.mse_loss).engine == "func"
    lin = nn.Linear(3, 3).double()
    twice = nn.Sequential(lin, nn.Tanh(), lin)
    dba = DynamicBatchAdaptation(twice, F.cross_entropy, DBAConfig(engine="ghost"))
    with pytest.raises(RuntimeError, match="ran 2 times"):
        dba.compute(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0]))


# --- cosine bound -----------------------------------------------------------------------------------
def cosine_to_full(gram: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = mask.to(gram.dtype).expand(gram.shape[0], -1)
    full = torch.ones_like(w)
    dot = lambda a, b: torch.einsum("ln,lnm,lm->l", a, gram, b)  # noqa: E731
    return dot(w, full) / (dot(w, w) * dot(full, full)).sqrt()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 14), layers=st.integers(1, 3), seed=st.integers(0, 10_000),
       metric=st.sampled_from(["variance", "snr"]), search=st.sampled_from(["greedy", "rank"]),
       granularity=st.sampled_from(["model", "layer"]), bound=st.sampled_from([0.5, 0.9, 0.99]))
def test_cosine_bound_holds_for_every_selection(n, layers, seed, metric, search, granularity, bound):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(layers, n, 4, generator=g, dtype=torch.float64) * torch.rand(layers, n, 1, generator=g) + 0.3
    gram = vectors_gram(v)
    cfg = DBAConfig(metric=metric, search=search, granularity=granularity, min_fraction=0.0, min_cosine=bound)
    mask, score = select_subsets(gram, cfg)
    assert (cosine_to_full(gram, mask) >= bound - 1e-12).all()
    torch.testing.assert_close(score, subset_metric(gram, mask, metric))
    if granularity == "model":
        assert (mask == mask[0]).all()


def test_cosine_bound_greedy_equals_brute_force_and_stops_early():
    g = torch.Generator().manual_seed(11)
    v = torch.randn(1, 12, 5, generator=g, dtype=torch.float64) * torch.rand(1, 12, 1, generator=g) * 3 + 0.3
    gram = vectors_gram(v)
    free, _ = select_subsets(gram, DBAConfig(metric="variance", min_fraction=0.0))
    bounded, _ = select_subsets(gram, DBAConfig(metric="variance", min_fraction=0.0, min_cosine=0.97))
    assert bounded.sum() > free.sum(), "the bound should stop the elimination before the free search"
    # brute force: greedy over admissible removals only, best point on the path
    mask, best, best_mask = torch.ones(12, dtype=torch.bool), 1.0, torch.ones(12, dtype=torch.bool)
    while mask.sum() > 2:
        cands = {}
        for j in range(12):
            if mask[j]:
                m = mask & (torch.arange(12) != j)
                if cosine_to_full(gram, m).item() >= 0.97:
                    cands[j] = subset_metric(gram, m, "variance").item()
        if not cands:
            break
        j = min(cands, key=lambda i: (cands[i], i))
        mask[j] = False
        if cands[j] < best * (1 - 1e-9):
            best, best_mask = cands[j], mask.clone()
    assert torch.equal(bounded[0], best_mask)


# --- unbiased importance draws ------------------------------------------------------------------------
def test_importance_draws_are_unbiased_and_within_the_noise_bound():
    from dynamix_hvd.dba.importance import importance_weights
    g = torch.Generator().manual_seed(5)
    v = torch.randn(2, 16, 6, generator=g, dtype=torch.float64) * torch.rand(2, 16, 1, generator=g) * 2 + 0.4
    gram = vectors_gram(v)
    full = v.mean(1)                                                        # [L, d]
    draws, errors, kept = 4000, [], []
    total = torch.zeros_like(full)
    for _ in range(draws):
        w, bound = importance_weights(gram, 0.5, False, torch.rand(16, generator=g, dtype=torch.float64))
        u = torch.einsum("ln,lnd->ld", w, v)
        total += u
        errors.append(((u - full).norm(dim=1) / full.norm(dim=1)) ** 2)
        kept.append((w > 0).sum(1).double())
    mean_error = torch.stack(errors).mean(0).sqrt()
    assert (bound <= 0.5 + 1e-12).all()
    torch.testing.assert_close(mean_error, bound, rtol=0.1, atol=0.0)       # the bound is the exact RMS here
    stderr = bound.max() * full.norm(dim=1).max() / draws**0.5
    assert ((total / draws - full).norm(dim=1) < 4 * stderr).all()            # unbiased
    assert (torch.stack(kept).mean(0) < 16).all(), "nothing was dropped: the test would not test weighting"


def test_importance_keeps_everything_when_gradients_cancel_and_few_when_they_agree():
    from dynamix_hvd.dba.importance import importance_weights
    u = torch.rand(8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    agree = vectors_gram(torch.ones(1, 8, 3, dtype=torch.float64))
    w, _ = importance_weights(agree, 0.5, False, u)
    assert 0 < (w > 0).sum() < 8
    cancel = torch.ones(1, 8, 3, dtype=torch.float64)
    cancel[0, ::2] *= -1
    w, _ = importance_weights(vectors_gram(cancel), 0.5, False, u)
    assert (w > 0).all()                                                    # zero mean: no sample may go


def test_variants_literal_collapses_cosine_and_unbiased_stay_aligned():
    from dynamix_hvd.dba.selection import VARIANTS
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4)).double()
    x = torch.randn(64, 10, dtype=torch.float64)
    y = (x[:, :4] + 0.8 * torch.randn(64, 4, dtype=torch.float64)).argmax(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(60):                                    # fit a little, so easy and hard samples exist
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    res = {k: DynamicBatchAdaptation(model, F.cross_entropy, cfg).compute(x, y) for k, cfg in VARIANTS.items()}
    cos = {k: r.alignment()[0] for k, r in res.items()}
    assert (cos["cosine"] >= 0.9 - 1e-12).all()
    assert cos["literal"].min() < 0.9, "the literal search should turn away from the full batch here"
    assert min(res["literal"].counts) < min(res["cosine"].counts)
    assert res["unbiased"].counts == [64, 64] and max(res["unbiased"].kept) < 64


def test_alignment_matches_explicit_vectors():
    model, x, y = problem(n=10, seed=3)
    r = DynamicBatchAdaptation(model, F.cross_entropy, DBAConfig(min_fraction=0.0)).compute(x, y)
    grads, _ = per_sample_grads(model, F.cross_entropy, x, y)
    cos, length = r.alignment()
    for l, group in enumerate(r.groups):
        flat = torch.cat([grads[n].flatten(1) for n in group], 1)
        upd, full = r.weights[l] @ flat, flat.mean(0)
        assert cos[l].item() == pytest.approx(F.cosine_similarity(upd, full, dim=0).item())
        assert length[l].item() == pytest.approx((upd.norm() / full.norm()).item())


@pytest.mark.parametrize("kwargs, needle", [
    ({"min_cosine": 1.5}, "min_cosine=1.5"),
    ({"estimator": "sampled"}, "estimator='sampled'"),
    ({"engine": "opacus"}, "engine='opacus'"),
    ({"max_noise": 0.0}, "max_noise=0.0"),
    ({"max_noise": True}, "max_noise=True"),
    ({"seed": 1.5}, "seed=1.5"),
])
def test_bad_new_config_names_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        DBAConfig(**kwargs)


def test_assign_gradients_checks_names_and_shapes():
    from dynamix_hvd.optim.grads import assign_gradients
    p = {"w": nn.Parameter(torch.zeros(2, 3))}
    with pytest.raises(ValueError, match="'v'"):
        assign_gradients(p, {"v": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"'w' has shape \(3, 2\)"):
        assign_gradients(p, {"w": torch.zeros(3, 2)})
    assign_gradients(p, {"w": torch.ones(2, 3)})
    buf = p["w"].grad
    assign_gradients(p, {"w": torch.full((2, 3), 2.0)})
    assert p["w"].grad is buf and (buf == 2).all()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 16), layers=st.integers(1, 3), seed=st.integers(0, 10_000),
       metric=st.sampled_from(["variance", "snr"]), granularity=st.sampled_from(["model", "layer"]),
       bound=st.sampled_from([None, 0.5, 0.95]), min_fraction=st.sampled_from([0.0, 0.5]))
def test_compiled_greedy_equals_the_torch_loop(n, layers, seed, metric, granularity, bound, min_fraction):
    from dynamix_hvd.dba import fastgreedy, selection
    assert fastgreedy._compiled is not None, "numba is a dependency: the compiled loop must be in use"
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(layers, n, 4, generator=g, dtype=torch.float64) * torch.rand(layers, n, 1, generator=g) + 0.2
    gram = vectors_gram(v)
    cfg = DBAConfig(metric=metric, granularity=granularity, min_cosine=bound, min_fraction=min_fraction)
    diag, full_c = gram.diagonal(0, 1, 2), gram.sum(2)
    base = selection._raw_metric(full_c.sum(1), diag.sum(1), torch.full((layers,), float(n), dtype=torch.float64),
                                 metric).clamp_min(torch.finfo(torch.float64).tiny)
    fast = selection._greedy(gram, diag, full_c, base, cfg)
    slow = selection._greedy_torch(gram, diag, full_c, base, cfg)
    assert [o.tolist() for o in fast[1]] == [o.tolist() for o in slow[1]]
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-9, atol=1e-12)  # same sums, other rounding
