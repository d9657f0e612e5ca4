"""The noise statistics of Adam-type optimizers, measured on the gradient as the optimizer preconditions it:
weighted squared norms, the weights read from the optimizer's second moments, the choice of mode, and the
noise scale they give on a problem whose preconditioned noise scale is known."""
from __future__ import annotations

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
def test_weighted_squared_norms_are_of_the_gradient_times_its_weights(dtypes):
    params = _params(dtypes)
    flat = FlatGradients(params)
    for p in params:
        p.grad.copy_(torch.randn_like(p))
    raw = flat.sq_norms().clone()
    with pytest.raises(RuntimeError, match="before enable_weights"):
        flat.sq_norms(weighted=True)
    flat.enable_weights()
    torch.testing.assert_close(flat.sq_norms(weighted=True), raw, rtol=1e-6, atol=0)  # weights start at 1
    weights = [torch.rand(p.numel(), dtype=torch.float64) + 0.5 for p in params]
    for i, w in enumerate(weights):
        flat.weight_line(i).copy_(w)
    want = torch.tensor([float(((p.grad.double().reshape(-1) * w) ** 2).sum()) for p, w in zip(params, weights)],
                        dtype=torch.float64)
    rel = 1e-2 if dtypes[0] == torch.bfloat16 else 1e-6
    torch.testing.assert_close(flat.sq_norms(weighted=True), want, rtol=rel, atol=0)
    assert torch.equal(flat.sq_norms(), raw)  # the unweighted norms are untouched
    # one parameter at a time, of its view and of another tensor of its shape
    for i in range(len(params)):
        flat.put_sq_norm(i)
    torch.testing.assert_close(flat.slot_sq_norms(torch.zeros(4, dtype=torch.float64)), want, rtol=rel, atol=0)
    flat.clear_slots()
    other = [torch.randn_like(p) for p in params]
    for i, g in enumerate(other):
        flat.put_sq_norm(i, g)
    want = torch.tensor([float(((g.double().reshape(-1) * w) ** 2).sum()) for g, w in zip(other, weights)],
                        dtype=torch.float64)
    torch.testing.assert_close(flat.slot_sq_norms(torch.zeros(4, dtype=torch.float64)), want, rtol=rel, atol=0)


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
def test_the_weights_are_adams_after_its_first_step_and_every_sixteenth(amsgrad):
    model = nn.Linear(6, 3)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, amsgrad=amsgrad)
    flat = FlatGradients(params)
    pre = precondition.AdamPreconditioner(opt, params, flat)
    key = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"

    def adams():
        return [1 / ((opt.state[p][key] / (1 - 0.99 ** float(opt.state[p]["step"]))).sqrt() + 1e-6).reshape(-1)
                for p in params]

    torch.manual_seed(1)
    for step in range(40):
        flat.zero()
        model(torch.randn(8, 6)).square().mean().backward()
        weights = [flat.weight_line(i).clone() for i in range(len(params))]
        if step == 0:
            assert all(bool((w == 1).all()) for w in weights)
        opt.step()
        pre.after_step()
        now = [flat.weight_line(i) for i in range(len(params))]
        if step % precondition.REFRESH_STEPS == 0:
            for w, a in zip(now, adams()):
                torch.testing.assert_close(w, a)
        else:
            assert all(torch.equal(w, b) for w, b in zip(now, weights))  # read every 16 steps only
    # a loaded state is read at once
    state = opt.state_dict()
    for s in state["state"].values():
        s[key] = s[key] * 4
    opt.load_state_dict(state)
    pre.refresh()
    for w, a in zip([flat.weight_line(i) for i in range(len(params))], adams()):
        torch.testing.assert_close(w, a)


def test_an_adam_type_state_without_second_moments_is_named():
    params = _params([torch.float32] * 4)
    opt = torch.optim.Adamax(params)
    pre = precondition.AdamPreconditioner(opt, params, FlatGradients(params))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    pre._steps = 1
    with pytest.raises(RuntimeError, match="holds no 'exp_avg_sq'.*noise_preconditioner='none'"):
        pre.refresh()


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
        for grads, lw, gw in ((ranks, local_w, global_w),):
            row = []
            for g in grads:
                flat.put_sq_norm(0, torch.from_numpy(g))
                row.append(float(flat.slot_sq_norms(torch.zeros(1, dtype=torch.float64))[0]))
                flat.clear_slots()
            lw.append(row)
            params[0].grad.copy_(torch.from_numpy((grads[0] + grads[1]) / 2))
            gw.append(float(flat.sq_norms(weighted=True)[0]))
            local_r.append([float((g**2).sum()) for g in grads])
            global_r.append(float(flat.sq_norms()[0]))
    pre = pooled_estimate([b, b], np.mean(local_w, 0), np.mean(global_w))
    raw = pooled_estimate([b, b], np.mean(local_r, 0), np.mean(global_r))
    assert pre.trace_sigma / pre.grad_sq == pytest.approx(want_pre, rel=0.05)
    assert raw.trace_sigma / raw.grad_sq == pytest.approx(want_raw, rel=0.05)
    assert want_pre > 10 * want_raw


@pytest.mark.parametrize("ddp", [False, True])
def test_the_optimizer_records_preconditioned_norms_on_torch_distributed(process_group, ddp):
    """One process: the local and the global gradient coincide; both recorded squared norms are those
    of the gradient times the weights, which are Adam's after the first step. SGD records the raw ones."""
    for make_opt, weighted in ((lambda ps: torch.optim.Adam(ps, lr=1e-2), True),
                               (lambda ps: torch.optim.SGD(ps, lr=0.1), False)):
        torch.manual_seed(0)
        model = make_model()
        loader = dx.AdaptiveLoader(IndexedData(40), [8], 0, seed=1)
        net = DDP(model) if ddp else model
        opt = dx.WeightedDistributedOptimizer(make_opt(model.parameters()), net if ddp else model.named_parameters(),
                                              loader)
        assert opt.noise_preconditioner == ("adam" if weighted else "none")
        params = list(model.parameters())
        for idx, x, y in loader:
            opt.zero_grad()
            weights = ([opt.flat.weight_line(i).clone() for i in range(len(params))] if weighted
                       else [torch.ones(p.numel()) for p in params])
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            want = sum(float(((p.grad.reshape(-1).double() * w.double()) ** 2).sum()) for p, w in zip(params, weights))
            rec = loader.tracker.records[-1]
            assert rec.global_grad_sq == pytest.approx(want, rel=1e-5)
            assert rec.local_grad_sq == pytest.approx(want, rel=1e-5)
            assert rec.grad_norm**2 == pytest.approx(sum(float((p.grad.double() ** 2).sum()) for p in params), rel=1e-5)
