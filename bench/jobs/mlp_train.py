"""Benchmark job: a Horovod + PyTorch training script using dynamix_hvd's data plane.

Structured like Horovod's own ``pytorch_mnist.py``; the dynamix_hvd lines are marked ``# dx``.
Run with e.g. ``mpirun -np 2 python -m bench.jobs.mlp_train --batch-sizes 16,48``.
"""
from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.data.synthetic import teacher_classification
from bench.jobs.common import (PlainHorovodLoader, add_bench_flags, add_common_flags, controller_config,
                                         local_batches, make_slowdown, parser, plain_horovod_optimizer, start,
                                         step_due)
from bench.jobs.records import SuiteRecorder, sharded_sum
from dynamix_hvd.runs.runlog import RunLog
from dynamix_hvd.runs.progress import Progress


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__)
    add_common_flags(ap, epochs=3, out="runs/mlp", default_batch=32, lr=0.05)
    ap.add_argument("--samples", type=int, default=8192, help="training samples (generated)")
    ap.add_argument("--hidden", type=int, default=128, help="units of each hidden layer")
    ap.add_argument("--depth", type=int, default=1, help="hidden layers")
    add_bench_flags(ap)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    sizes = start(args, default_batch=32)

    train, test = teacher_classification(args.samples, 2048, seed=args.seed)
    widths = [32] + [args.hidden] * args.depth
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(widths[-1], 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    slow = make_slowdown(args, hvd.rank())
    rec = SuiteRecorder(args.out, args.eval_samples, args.target, "accuracy", {"example": "mlp_train", **vars(args)})

    if args.plain_horovod:  # the reference: what a Horovod user runs, equal batches
        loader = PlainHorovodLoader(train, sizes[0], hvd.rank(), hvd.size(), args.seed)
        optimizer = plain_horovod_optimizer(optimizer, model, args, sizes[0] * hvd.size(), sum(sizes))
        controller = run = None
    else:
        loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed)        # dx
        optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader,  # dx
                                                    lr_rule=args.lr_rule)          # dx
        controller = None if args.no_controller else dx.DynamixController(loader, optimizer, controller_config(args), model=model)  # dx
        run = RunLog(args.out, loader, controller=controller, meta={"example": "mlp_train", **vars(args)},  # dx
                     progress=Progress(args.epochs, rank=hvd.rank(), mode=args.progress))            # dx
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def accuracy() -> float:
        return sharded_sum(model, *test.tensors, lambda out, y: (out.argmax(1) == y).sum().item())

    rec.start()
    slow.use_clock(rec.train_s)

    for epoch in range(args.epochs):
        loader.set_epoch(epoch)                                                 # dx
        model.train()
        optimizer.zero_grad()
        for x, y in loader:
            rec.compute_start()
            slow.before_compute(len(y))
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            slow.after_compute(len(y))
            rec.compute_end()
            if step_due(optimizer):  # dx: every micro-batch of the step is in (accumulation)
                optimizer.step()
                optimizer.zero_grad()
            if controller is not None:
                controller.record_loss(loss)                                    # dx
            if run is not None:
                run.step(loss)                                                  # dx
            if rec.step_end(epoch, local_batches(loader, len(y))):
                rec.evaluate(accuracy, epoch)
        acc = rec.evaluate(accuracy, epoch)                                     # collective
        if run is not None:
            run.end_epoch(accuracy=acc)                                         # dx: collective
    rec.finish(extra={"stalls": slow.stalls})                                   # collective
    if run is None:
        return
    out = run.finish(report=not args.no_report)                                 # dx: collective
    if out is not None:
        print(f"run records: {out}/epochs.csv, {out}/trace.h5, {out}/meta.json, {out}/steps_rank*.csv"
              f"{'' if args.no_report else f', {out}/report.png'} (dynamix-hvd summarize {out})", flush=True)


if __name__ == "__main__":
    main()
