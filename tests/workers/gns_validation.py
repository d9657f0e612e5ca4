"""Worker: gradient-noise estimates from the real data plane vs brute-force per-sample gradients.

The parameters are held fixed (SGD with lr 0), so the true tr(Sigma) and |G|^2 are constants: rank 0
computes them with torch.func (per-sample gradients over the whole dataset) and compares them with
the controller's smoothed estimates, built from unequal local batches (--sizes) over many steps.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import dynamix_hvd as dx
from dynamix_hvd.data.synthetic import teacher_classification
from dynamix_hvd.stats.noise_scale import StatsConfig


def truth(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(tr(Sigma), |G|^2) of the per-sample gradient distribution over the dataset."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in per_sample.values()], dim=1).double()
    mean = flat.mean(0)
    return float(((flat - mean) ** 2).sum(1).mean()), float(mean.square().sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="3,7,12")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    train, _ = teacher_classification(2000, seed=args.seed, label_noise=0.3)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10))
    sizes = [int(s) for s in args.sizes.split(",")]
    loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed, last_step="drop")
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                                          loader)
    controller = dx.DynamixController(loader, opt, dx.ControllerConfig(
        policy="static", decide_every_steps=50, advanced=dx.AdvancedConfig(stats=StatsConfig(ema_beta=0.99))))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    if hvd.rank() == 0:
        true_trace, true_g2 = truth(model, *train.tensors)
        snap = controller.stats.snapshot()
        Path(args.out, "gns.json").write_text(json.dumps({
            "steps": snap["gns_steps"], "trace_est": snap["trace_sigma"], "g2_est": snap["grad_sq"],
            "trace_true": true_trace, "g2_true": true_g2, "b_noise_est": snap["b_noise"],
            "b_noise_true": true_trace / true_g2,
            "layer_variance": controller.history[-1]["layer_variance"]}))


if __name__ == "__main__":
    main()
