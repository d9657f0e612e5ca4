"""The noise statistics of Adam-type optimizers, measured on the gradient as the optimizer preconditions it:
weighted squared norms, the weights read from the optimizer's second moments, the choice of mode, and the
noise scale they give on a problem whose preconditioned noise scale is known."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dynamix_hvd as dx
from dynamix_hvd.optim import precondition
from dynamix_hvd.optim.flat import FlatGradients
from dynamix_hvd.stats.noise_scale import pooled_estimate
from workers.dataplane import IndexedData, make_model


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _params(dtypes):
    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (0,), (2, 2)]
    params = [torch.randn(s, dtype=d, requires_grad=True) for s, d in zip(shapes, dtypes)]
    return params


@pytest.mark.parametrize("dtypes", [[torch.float32] * 4, [torch.float64, torch.float32, torch.float32, torch.float64],
                                    [torch.bfloat16] * 4])
def test_weighted_squared_norms_of_the_global_and_the_kept_local_gradients(dtypes):
    params = _params(dtypes)
    flat = FlatGradients(params)
    for p in params:
        p.grad.copy_(torch.randn_like(p))
    raw = flat.sq_norms().clone()
    with pytest.raises(RuntimeError, match="before enable_weights"):
        flat.sq_norms(weighted=True)
    with pytest.raises(ValueError, match="pass weighted=True"):
        flat.sq_norms(local=True)
    flat.enable_weights()
    torch.testing.assert_close(flat.sq_norms(weighted=True), raw, rtol=1e-6, atol=0)  # weights start at 1
    weights = [torch.rand(p.numel(), dtype=torch.float64) + 0.5 for p in params]
    for i, w in enumerate(weights):
        flat.weight_line(i).copy_(w)
    rel = 1e-2 if dtypes[0] == torch.bfloat16 else 1e-6

    def want(grads):
        return torch.tensor([float(((g.double().reshape(-1) * w) ** 2).sum()) for g, w in zip(grads, weights)],
                            dtype=torch.float64)
    # the local gradients are kept (of the views, or of other tensors), not measured, until the weights are known
    local = [p.grad.clone() for p in params]
    for i in range(2):
        flat.put_sq_norm(i)
    other = [torch.randn_like(p) for p in params[2:]]
    for i, g in enumerate(other, start=2):
        flat.put_sq_norm(i, g)
    assert not flat.slot_sq_norms(torch.zeros(4, dtype=torch.float64)).any()
    for p in params:
        p.grad.mul_(3)  # "the allreduce"
    torch.testing.assert_close(flat.sq_norms(weighted=True, local=True), want(local[:2] + other), rtol=rel, atol=0)
    torch.testing.assert_close(flat.sq_norms(weighted=True), want([p.grad for p in params]), rtol=rel, atol=0)
    torch.testing.assert_close(flat.sq_norms(), raw * 9, rtol=rel, atol=0)  # the unweighted norms as before
    flat.keep_all_local()
    torch.testing.assert_close(flat.sq_norms(weighted=True, local=True), want([p.grad for p in params]), rtol=rel, atol=0)


@pytest.mark.parametrize("mode", ["Adam", "adamw", "", None, 1])
def test_an_unknown_mode_is_named(mode):
    with pytest.raises(ValueError, match=f"noise_preconditioner={mode!r}"):
        precondition.choose(mode, torch.optim.Adam(_params([torch.float32] * 4)))


def test_which_optimizers_are_preconditioned():
    ps = _params([torch.float32] * 4)
    for opt in (torch.optim.Adam(ps), torch.optim.AdamW(ps), torch.optim.NAdam(ps), torch.optim.RAdam(ps)):
        assert precondition.choose("auto", opt) and not precondition.choose("none", opt)
    for opt in (torch.optim.SGD(ps, lr=0.1), torch.optim.Adagrad(ps), torch.optim.RMSprop(ps)):
        assert not precondition.choose("auto", opt)
    assert precondition.choose("adam", torch.optim.Adamax(ps))  # betas and eps: the user says it is Adam-type
    with pytest.raises(ValueError, match="SGD whose parameter groups have no betas or eps"):
        precondition.choose("adam", torch.optim.SGD(ps, lr=0.1))


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("grad_scale", [1.0, 1024.0])
def test_the_weights_are_those_of_the_step_adam_takes(amsgrad, grad_scale):
    model = nn.Linear(6, 3)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, amsgrad=amsgrad)
    flat = FlatGradients(params)
    pre = precondition.AdamPreconditioner(opt, params, flat)
    key = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"
    torch.manual_seed(1)
    for step in range(30):
        flat.zero()
        model(torch.randn(8, 6) * (1 + step % 7)).square().mean().backward()
        for p in params:
            p.grad.mul_(grad_scale)
        pre.weigh(grad_scale)
        for p in params:
            p.grad.div_(grad_scale)
        opt.step()
        adam = [1 / ((opt.state[p][key] / (1 - 0.99 ** float(opt.state[p]["step"]))).sqrt() + 1e-6).reshape(-1)
                for p in params]
        for i, a in enumerate(adam):
            torch.testing.assert_close(flat.weight_line(i), a, rtol=1e-5, atol=0)
    # a loaded state is what the next step's weights start from
    state = opt.state_dict()
    for s in state["state"].values():
        s[key] = s[key] * 4
        s["exp_avg_sq"] = s["exp_avg_sq"] * 4
    opt.load_state_dict(state)
    pre.weigh()
    opt.step()
    for i, p in enumerate(params):
        a = 1 / ((opt.state[p][key] / (1 - 0.99 ** float(opt.state[p]["step"]))).sqrt() + 1e-6).reshape(-1)
        torch.testing.assert_close(flat.weight_line(i), a, rtol=1e-5, atol=0)


def test_an_adam_type_state_without_second_moments_is_named():
    params = _params([torch.float32] * 4)
    opt = torch.optim.Adamax(params)
    pre = precondition.AdamPreconditioner(opt, params, FlatGradients(params))
    pre.weigh()  # no state yet: nothing to check
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="holds no 'exp_avg_sq'.*noise_preconditioner='none'"):
        pre.weigh()


def test_the_noise_scale_of_the_preconditioned_gradient():
    """Coordinates with mean G_j and per-sample noise s_j; Adam's weights 1/sqrt(E g_j^2) at batch b.
    Two ranks' weighted squared norms, pooled over draws, give tr(P S P) / |P G|^2 within 5%; the
    unweighted ones give tr(S) / |G|^2, here 40x smaller: the noisy coordinates have small means."""
    rng = np.random.default_rng(0)
    n, b = 400, 16
    G = np.where(np.arange(n) < 40, 1.0, 0.005)
    s = np.where(np.arange(n) < 40, 2.0, 0.1)
    P = 1 / np.sqrt(G**2 + s**2 / b)
    want_pre = (P**2 * s**2).sum() / (P**2 * G**2).sum()
    want_raw = (s**2).sum() / (G**2).sum()
    params = [torch.zeros(n, dtype=torch.float64, requires_grad=True)]
    flat = FlatGradients(params)
    flat.enable_weights()
    flat.weight_line(0).copy_(torch.from_numpy(P))
    local_w, global_w, local_r, global_r = [], [], [], []
    for _ in range(4000):
        ranks = [G + s * rng.standard_normal((b, n)).mean(0) for _ in range(2)]
        row = []
        for g in ranks:
            flat.put_sq_norm(0, torch.from_numpy(g))
            row.append(float(flat.sq_norms(weighted=True, local=True)[0]))
        local_w.append(row)
        params[0].grad.copy_(torch.from_numpy((ranks[0] + ranks[1]) / 2))
        global_w.append(float(flat.sq_norms(weighted=True)[0]))
        local_r.append([float((g**2).sum()) for g in ranks])
        global_r.append(float(flat.sq_norms()[0]))
    pre = pooled_estimate([b, b], np.mean(local_w, 0), np.mean(global_w))
    raw = pooled_estimate([b, b], np.mean(local_r, 0), np.mean(global_r))
    assert pre.trace_sigma / pre.grad_sq == pytest.approx(want_pre, rel=0.05)
    assert raw.trace_sigma / raw.grad_sq == pytest.approx(want_raw, rel=0.05)
    assert want_pre > 10 * want_raw


@pytest.mark.parametrize("ddp", [False, True])
def test_the_optimizer_records_preconditioned_norms_on_torch_distributed(process_group, ddp):
    """One process: the local and the global gradient coincide; both recorded squared norms are those
    of the gradient times the weights of the step Adam took. SGD records the raw ones."""
    for make_opt, weighted in ((lambda ps: torch.optim.Adam(ps, lr=1e-2), True),
                               (lambda ps: torch.optim.SGD(ps, lr=0.1), False)):
        torch.manual_seed(0)
        model = make_model()
        loader = dx.AdaptiveLoader(IndexedData(40), [8], 0, seed=1)
        net = DDP(model) if ddp else model
        opt = dx.WeightedDistributedOptimizer(make_opt(model.parameters()), net if ddp else model.named_parameters(),
                                              loader, noise_preconditioner="auto")
        assert opt.noise_preconditioner == ("adam" if weighted else "none")
        assert dx.WeightedDistributedOptimizer(make_opt(model.parameters()), model.named_parameters(),
                                               loader).noise_preconditioner == "none"  # opt-in
        params = list(model.parameters())
        for idx, x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            weights = ([1 / ((opt.state[p]["exp_avg_sq"] / (1 - 0.999 ** float(opt.state[p]["step"]))).sqrt() + 1e-8)
                        for p in params] if weighted else [torch.ones_like(p) for p in params])
            want = sum(float(((p.grad.double() * w.double()) ** 2).sum()) for p, w in zip(params, weights))
            rec = loader.tracker.records[-1]
            assert rec.global_grad_sq == pytest.approx(want, rel=1e-5)
            assert rec.local_grad_sq == pytest.approx(want, rel=1e-5)
            assert rec.grad_norm**2 == pytest.approx(sum(float((p.grad.double() ** 2).sum()) for p in params), rel=1e-5)


def test_a_bad_noise_preconditioner_is_named_at_construction(process_group):
    model = make_model()
    loader = dx.AdaptiveLoader(IndexedData(40), [8], 0, seed=1)
    with pytest.raises(ValueError, match="noise_preconditioner='sqrt'"):
        dx.WeightedDistributedOptimizer(torch.optim.Adam(model.parameters()), model.named_parameters(), loader,
                                        noise_preconditioner="sqrt")
    with pytest.raises(ValueError, match="noise_preconditioner='adam' with a SGD"):
        dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), loader,
                                        noise_preconditioner="adam")


def test_how_often_the_preconditioned_norms_are_taken():
    assert precondition.every(0.0002, 0.1) == 1                   # 0.2% of the step: every step
    assert precondition.every(0.0002, 0.01) == 4                  # 2%: every 4th (0.5% each step)
    assert precondition.every(0.01, 0.001) == precondition.MAX_EVERY
    assert precondition.every(0.001, 0.0) == precondition.every(0.001, math.nan) == 1


@pytest.mark.parametrize("make_opt, measured_every", [(lambda ps: torch.optim.AdamW(ps, lr=1e-2), 3),
                                                      (lambda ps: torch.optim.SGD(ps, lr=0.1), 1)])
def test_set_noise_every_leaves_out_the_steps_between(process_group, make_opt, measured_every):
    """After set_noise_every(3) the next step and every third after it take Adam's norms, the others
    record NaN (and add nothing to the per-layer means); SGD's raw norms are taken on every step."""
    torch.manual_seed(0)
    model = make_model()
    loader = dx.AdaptiveLoader(IndexedData(80), [4], 0, seed=1)
    opt = dx.WeightedDistributedOptimizer(make_opt(model.parameters()), model.named_parameters(), loader,
                                          noise_preconditioner="auto")
    with pytest.raises(ValueError, match=r"set_noise_every\(0\)"):
        opt.set_noise_every(0)
    for idx, x, y in loader:  # a first step, measured
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        break
    opt.pop_layer_means()
    opt.set_noise_every(3)
    measured = []
    for k, (idx, x, y) in enumerate(loader):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        rec = loader.tracker.records[-1]
        measured.append(math.isfinite(rec.local_grad_sq) and math.isfinite(rec.global_grad_sq))
        assert math.isfinite(rec.grad_norm)
        if k == 9:
            break
    assert measured == [k % measured_every == 0 for k in range(10)]
    local, _ = opt.pop_layer_means()
    assert all(math.isfinite(v) for v in local)
    assert opt._layer_steps == 0
    cost_every = opt.noise_every_for(1e-6)
    assert cost_every == (precondition.MAX_EVERY if measured_every == 3 else 1)
