"""AdaptDL's joint fit of compute, network and overlap. Pure: torch and NumPy, no MPI, no Horovod.

:class:`~dynamix_hvd.control.costmodel.CostModel` fits in stages: each rank's arrival line on its own
points, then T_net and the overlap exponent gamma on what the slowest arrival leaves of each step.
AdaptDL (``adaptdl/goodput.py``) fits all of its performance parameters at once, so that the step
times inform the compute parameters too. This module does the same on the cost model's points: it
minimises, over the identified ranks' (a_i, c_i), T_net and gamma together,

    mean_points,ranks rho(log arrival_pred - log arrival) + mean_points rho(log T_sync_pred - log T_sync)

(rho: a pseudo-Huber loss of width `delta` on the log error, so a stall does not pull the fit), from the
staged fit as its start, with L-BFGS. Ranks whose line is not identified keep their pinned values,
and gamma stays 1 unless the arrival times vary (as in the staged fit: with one arrival time gamma
and T_net are not separable). The `goodput` rule uses it (``ProposalConfig.joint_fit``).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .costmodel import CostFit, CostModel, NetworkFit

GAMMA_MAX = 10.0
"""Largest overlap exponent the joint fit may reach. Not a setting: the staged fit's grid
(:data:`~dynamix_hvd.control.costmodel.GAMMAS`) ends there too, and at 10 compute and allreduce
already overlap almost fully."""


def fit_joint(model: CostModel, delta: float = 0.05, iterations: int = 20) -> tuple[CostFit, NetworkFit] | None:
    """The jointly refined (lines, network) of `model`'s points (None before the first point).

    `delta` (the log error beyond which a point's loss grows linearly) and `iterations` (L-BFGS's)
    are not settings: the fit starts from the staged one, which already follows the points, and only
    refines it."""
    staged, net = model.fit(), model.fit_network()
    if staged is None:
        return None
    b, t, w = model._b, model._t, model._weights()
    w_lines = model.line_weights()
    S = np.maximum(model._sync, model._arrival)
    timed = np.isfinite(S) & (S > 0)
    ident = np.asarray(staged.identified, dtype=bool)
    if not ident.any() and not timed.any():
        return staged, net
    dt = torch.float64
    B = torch.tensor(np.maximum(b, staged.knee), dtype=dt)
    logT = torch.log(torch.tensor(t, dtype=dt))
    W = torch.tensor(w_lines / w_lines.sum(0).clip(min=1e-300), dtype=dt)  # per rank: its line's points
    logS = torch.log(torch.tensor(np.where(timed, S, 1.0), dtype=dt))
    # a step's sync time is predicted from every rank's line: only steps all of them still count
    Ws = torch.tensor(np.where(timed & (w_lines > 0).all(1), w, 0.0), dtype=dt)
    Ws = Ws / Ws.sum() if bool(Ws.sum() > 0) else Ws
    mask = torch.tensor(ident)
    a_staged = torch.tensor(staged.fixed_s, dtype=dt)
    a0 = torch.tensor(np.maximum(staged.fixed_s, 1e-6 * staged.mean_time), dtype=dt)  # log-space start
    c0 = torch.tensor(staged.per_sample_s, dtype=dt)
    varied = model._arrival[w > 1e-3 * w.max()]
    free_gamma = bool(timed.any()) and varied.max() > 1.2 * varied.min()
    start_g = min(max(net.gamma, 1.05), GAMMA_MAX - 0.05) if free_gamma else 1.0
    theta = {"log_a": torch.log(a0).clone().requires_grad_(True),
             "log_c": torch.log(c0).clone().requires_grad_(True),
             "log_net": torch.tensor(math.log(max(net.net_s, 1e-6)), dtype=dt, requires_grad=True),
             "g": torch.tensor(_logit((start_g - 1.0) / (GAMMA_MAX - 1.0)), dtype=dt, requires_grad=True)}

    def unpack() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        a = torch.where(mask, torch.exp(theta["log_a"]), a_staged)
        c = torch.where(mask, torch.exp(theta["log_c"]), c0)
        g = 1.0 + (GAMMA_MAX - 1.0) * torch.sigmoid(theta["g"]) if free_gamma else torch.ones((), dtype=dt)
        return a, c, torch.exp(theta["log_net"]), g

    def rho(x: torch.Tensor) -> torch.Tensor:
        return delta ** 2 * (torch.sqrt(1.0 + (x / delta) ** 2) - 1.0)

    def loss(a: torch.Tensor, c: torch.Tensor, net_s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        arrival = a + c * B
        err = (W * rho(torch.log(arrival) - logT))[:, mask].sum() / max(int(mask.sum()), 1)
        if bool(Ws.sum() > 0):
            top = arrival.max(1).values
            sync = torch.exp(torch.logsumexp(torch.stack([g * torch.log(top), g * torch.log(net_s).expand_as(top)]),
                                             0) / g)  # (top^g + net^g)^(1/g), stably
            err = err + (Ws * rho(torch.log(sync) - logS)).sum()
        return err

    def objective() -> torch.Tensor:
        return loss(*unpack())

    params = [theta["log_a"], theta["log_c"], theta["log_net"]] + ([theta["g"]] if free_gamma else [])
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = objective()
        value.backward()
        return value

    with torch.no_grad():  # the staged fit exactly (the start differs where a or gamma sit on a bound)
        before = float(loss(a_staged, c0, torch.tensor(max(net.net_s, 1e-12), dtype=dt),
                            torch.tensor(net.gamma, dtype=dt)))
    opt.step(closure)
    with torch.no_grad():
        after = float(objective())
        a, c, net_s, g = unpack()
    if not (math.isfinite(after) and after <= before):  # never worse than the staged fit
        return staged, net
    joint = CostFit(a.numpy().copy(), c.numpy().copy(), staged.identified, staged.fixed_se, staged.per_sample_se,
                    staged.spread, staged.mean_batch, staged.mean_time, staged.knee)
    return joint, NetworkFit(float(net_s), float(g), net.overhead_s).with_link(net.bus_bytes, net.latency_s)


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))
