"""Worker: the optimizer as a drop-in for real training scripts, on real Horovod ranks.

Runs, in one job, (1) every LR scheduler on the weighted optimizer with an LR rule and changing
batch sizes, plus state_dict / broadcast_optimizer_state; (2) mixed precision in Horovod's pattern
(float64 under a GradScaler with an injected inf step, fp16 autocast + scaler, bf16 autocast);
(3) gradient accumulation; (4) the noise statistics of AdamW's preconditioned gradient. Each rank writes rank<R>.json; tests/test_dropin_mpi.py replays the
steps in one process.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
try:
    from workers.dataplane import IndexedData, make_model
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import IndexedData, make_model

SAMPLES = 61
B0 = 8
INF_STEP = 4  # global step index (from 0) whose loss is made infinite on the last rank

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer, int], Any]] = {
    "steplr": lambda o, n: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "onecycle": lambda o, n: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=n),
    "lambdalr": lambda o, n: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "plateau": lambda o, n: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "warmup_step": lambda o, n: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=4),
            torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)], milestones=[4]),
}


def params_of(model: nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}


def step_info(loader: dx.AdaptiveLoader, idx: torch.Tensor) -> dict[str, Any]:
    return {"indices": idx.tolist(), "sizes": list(loader.batch_sizes),
            "counts": list(loader.current_step.counts)}


def run_scheduler(name: str, rank: int, world: int, lr_rule: str) -> dict[str, Any]:
    data = IndexedData(SAMPLES)
    model = make_model()
    loader = dx.AdaptiveLoader(data, [3 + 2 * r for r in range(world)], rank, seed=3)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          model.named_parameters(), loader, lr_rule=lr_rule, base_batch_size=B0)
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, dx.WeightedDistributedOptimizer)
    total = 2 * len(loader) + 4
    sched = SCHEDULERS[name](opt, total)
    steps = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, (idx, x, y) in enumerate(loader):
            opt.zero_grad()
            base_lr, momentum = opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
            if lr_rule == "adascale":
                opt.lr_gain = 1.0 + 0.25 * (len(steps) % 3)  # what the controller would set
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            rec = loader.tracker.records[-1]
            steps.append(step_info(loader, idx) | {"base_lr": base_lr, "effective_lr": rec.lr, "momentum": momentum,
                                                   "gain": opt.lr_gain, "after_lr": opt.param_groups[0]["lr"]})
            if name == "plateau":
                sched.step(hvd.allreduce(loss.detach(), op=hvd.Average).item())  # the same on every rank
            else:
                sched.step()
            if i == 2:
                loader.set_batch_sizes([5 + r for r in range(world)])
    return {"steps": steps, "params": params_of(model), "total": total}


def run_state(rank: int, world: int) -> dict[str, Any]:
    """broadcast_optimizer_state before and after training, and a state_dict round trip."""
    data = IndexedData(SAMPLES)
    model = make_model()
    loader = dx.AdaptiveLoader(data, [4] * world, rank, seed=3)
    opt = dx.WeightedDistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          model.named_parameters(), loader)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # fresh: creates the state without an allreduce
    initialised = len(opt.state_dict()["state"])
    loader.set_epoch(0)
    for idx, x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if rank == world - 1:
        for s in opt.state.values():
            s["exp_avg"].mul_(3.0)  # diverge, then let rank 0's state win
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    exp_avg = [opt.state[p]["exp_avg"].flatten().tolist() for p in model.parameters()]
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    same = all(torch.equal(opt.state[p]["exp_avg"], torch.tensor(e, dtype=torch.float64).view_as(p))
               for p, e in zip(model.parameters(), exp_avg))
    refused = []
    for wrapped in (opt, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                  named_parameters=model.named_parameters())):
        try:
            dx.WeightedDistributedOptimizer(wrapped, model.named_parameters(), loader)
        except TypeError as exc:
            refused.append(str(exc))
    return {"refused": refused, "initialised": initialised, "exp_avg": exp_avg, "roundtrip_same": same,
            "is_optimizer": isinstance(opt, torch.optim.Optimizer), "class": type(opt).__name__}


def run_amp(mode: str, rank: int, world: int) -> dict[str, Any]:
    double = mode.startswith("fp64")
    data = IndexedData(SAMPLES)
    model = make_model() if double else make_model().float()
    loader = dx.AdaptiveLoader(data, [3 + 4 * r for r in range(world)], rank, seed=7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2) if "scaler" in mode else None
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          model.named_parameters(), loader, grad_scaler=scaler,
                                          max_grad_norm=0.5 if double else None)
    dtype = torch.float16 if "fp16" in mode else torch.bfloat16
    steps = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for idx, x, y in loader:
            opt.zero_grad()
            if not double:
                x = x.float()
            with torch.autocast("cpu", dtype=dtype, enabled=not double):
                loss = nn.functional.cross_entropy(model(x), y)
            if len(steps) == INF_STEP and rank == world - 1 and mode != "bf16":
                loss = loss * math.inf
            scale = scaler.get_scale() if scaler is not None else 1.0
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                opt.synchronize()
                if mode != "fp64_scaler_ready":
                    scaler.unscale_(opt)  # Horovod's pattern; "ready" leaves unscaling to the optimizer
                with opt.skip_synchronize():
                    scaler.step(opt)
                scaler.update()
            rec = loader.tracker.records[-1]
            steps.append(step_info(loader, idx) | {"status": rec.status, "scale": scale,
                                                   "global_grad_sq": rec.global_grad_sq,
                                                   "local_grad_sq": rec.local_grad_sq})
    return {"steps": steps, "params": params_of(model), "skipped": opt.skipped_steps}


def run_accum(opt_name: str, k: int, rank: int, world: int) -> dict[str, Any]:
    data = IndexedData(SAMPLES)
    model = make_model()
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2)}[opt_name]
    loader = dx.AdaptiveLoader(data, [2 + 3 * r for r in range(world)], rank, seed=9)
    opt = dx.WeightedDistributedOptimizer(make(model.parameters()), model.named_parameters(), loader,
                                          backward_passes_per_step=k, max_grad_norm=1.0)
    groups, micro = [], []
    for epoch in range(2):
        loader.set_epoch(epoch)
        opt.zero_grad()
        for i, (idx, x, y) in enumerate(loader):
            nn.functional.cross_entropy(model(x), y).backward()
            micro.append(step_info(loader, idx))
            if i == 4:
                loader.set_batch_sizes([4 + r for r in range(world)])  # mid-group change
            if opt.should_step():
                opt.step()
                opt.zero_grad()
                rec = loader.tracker.records[-1]
                groups.append({"micro": micro, "local_batch": rec.local_batch, "global_batch": rec.global_batch})
                micro = []
    return {"groups": groups, "params": params_of(model)}


def run_adam_noise(rank: int, world: int) -> dict[str, Any]:
    """AdamW (amsgrad) with unequal batches: each step's recorded squared norms against this rank's own
    computation of its local and of the global mean gradient times the weights of the step AdamW took,
    ``1 / (sqrt(max v_hat) + eps)`` read from its state after the step."""
    data = IndexedData(SAMPLES)
    model = make_model()
    loader = dx.AdaptiveLoader(data, [3 + 2 * r for r in range(world)], rank, seed=5)
    opt = dx.WeightedDistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True),
                                          model.named_parameters(), loader, noise_preconditioner="auto")
    params = [p for p in model.parameters()]
    steps = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        for idx, x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            local = torch.autograd.grad(loss, params, retain_graph=True)
            loss.backward()
            opt.step()
            rec = loader.tracker.records[-1]
            adam = [1 / ((opt.state[p]["max_exp_avg_sq"].reshape(-1) / (1 - 0.999 ** float(opt.state[p]["step"]))).sqrt()
                         + 1e-8) for p in params]
            used = [opt.flat.weight_line(i) for i in range(len(params))]
            sq = lambda grads: sum(float(((g.reshape(-1).double() * w.double()) ** 2).sum())  # noqa: E731
                                   for g, w in zip(grads, adam))
            steps.append({"local_grad_sq": rec.local_grad_sq, "global_grad_sq": rec.global_grad_sq,
                          "raw_global_sq": rec.grad_norm ** 2,
                          "local_expected": sq(local), "global_expected": sq([p.grad for p in params]),
                          "weights_vs_adam": max(float(((w - a) / a).abs().max()) for w, a in zip(used, adam))})
    return {"steps": steps, "mode": opt.noise_preconditioner}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    result: dict[str, Any] = {"world": world, "schedulers": {}, "amp": {}, "accum": {}}
    for name in SCHEDULERS:
        result["schedulers"][name] = run_scheduler(name, rank, world, "sqrt")
    result["schedulers"]["steplr_adascale"] = run_scheduler("steplr", rank, world, "adascale")
    result["state"] = run_state(rank, world)
    for mode in ("fp64_plain", "fp64_scaler", "fp64_scaler_ready", "fp16_scaler", "bf16"):
        result["amp"][mode] = run_amp(mode, rank, world)
    for opt_name, k in (("sgd", 3), ("adam", 2), ("sgd", 1)):
        result["accum"][f"{opt_name}_k{k}"] = run_accum(opt_name, k, rank, world)
    result["adam_noise"] = run_adam_noise(rank, world)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
