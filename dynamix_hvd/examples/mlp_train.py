"""Example job: a Horovod + PyTorch training script using dynamix_hvd's data plane.

Structured like Horovod's own ``pytorch_mnist.py``; the dynamix_hvd lines are marked ``# dx``.
Run with e.g. ``mpirun -np 2 python -m dynamix_hvd.examples.mlp_train --batch-sizes 16,48``.
"""
from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.data.synthetic import teacher_classification
from dynamix_hvd.examples import busy_wait
from dynamix_hvd.examples.common import add_common_flags, controller_config, parser, start
from dynamix_hvd.runs.runlog import RunLog
from dynamix_hvd.tools.progress import Progress


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__)
    add_common_flags(ap, epochs=3, out="runs/mlp", default_batch=32, lr=0.05)
    ap.add_argument("--samples", type=int, default=8192, help="training samples (generated)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    sizes = start(args, default_batch=32)

    train, test = teacher_classification(args.samples, 2048, seed=args.seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed)        # dx
    optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader,  # dx
                                                lr_rule=args.lr_rule)          # dx
    controller = dx.DynamixController(loader, optimizer, controller_config(args))        # dx
    run = RunLog(args.out, loader, controller=controller, meta={"example": "mlp_train", **vars(args)},  # dx
                 progress=Progress(args.epochs, rank=hvd.rank(), mode=args.progress))            # dx
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    for epoch in range(args.epochs):
        loader.set_epoch(epoch)                                                 # dx
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            if hvd.rank() == args.slow_rank:
                busy_wait(args.slow_ms / 1000.0)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            controller.record_loss(loss)                                        # dx
            run.step(loss)                                                      # dx
        model.eval()
        with torch.no_grad():
            acc = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        run.end_epoch(accuracy=acc)                                             # dx: collective
    out = run.finish(report=not args.no_report)                                 # dx: collective
    if out is not None:
        print(f"run records: {out}/epochs.csv, {out}/trace.h5, {out}/meta.json, {out}/steps_rank*.csv"
              f"{'' if args.no_report else f', {out}/report.png'} (dynamix-hvd summarize {out})", flush=True)


if __name__ == "__main__":
    main()
