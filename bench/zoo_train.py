"""Train one job of the workload zoo (`bench.zoo`) the way a Horovod or a DDP user would, plain or with dynamix_hvd.

    mpirun -np 2 python -m bench.zoo_train --job mnist-cnn --plain-horovod       # the reference script
    mpirun -np 2 python -m bench.zoo_train --job mnist-cnn                       # dynamix_hvd, default
    mpirun -np 2 python -m bench.zoo_train --job mnist-cnn --batch-sizes 96,32 --no-controller   # a fixed split
    torchrun --standalone --nproc-per-node 2 -m bench.zoo_train --job mnist-cnn --engine torch --plain-horovod
    torchrun --standalone --nproc-per-node 2 -m bench.zoo_train --job mnist-cnn --engine torch

The loop is the same for every arm; the dynamix_hvd lines are marked ``# dx``. The plain script
uses DistributedSampler + ``hvd.DistributedOptimizer(op=Average)`` and steps its LR scheduler per
optimizer step; with dynamix_hvd, ``dx.ProgressScheduler`` steps it by training progress, so a
schedule written for the plain script's step count stays right when the batch changes. Clipping
follows Horovod's documented pattern (synchronize, clip, step under skip_synchronize) in the plain
script and the weighted optimizer's ``max_grad_norm`` with dynamix_hvd.

``--engine torch`` runs the job on torch.distributed (a Gloo process group, launched by torchrun):
the plain script is then what a DDP user writes, DistributedSampler + ``DDP(model)`` + the plain
optimizer, clipping with ``clip_grad_norm_`` before ``step()`` (DDP has averaged the gradients in
backward); with dynamix_hvd, ``DDP(model)`` + ``dx.WeightedDistributedOptimizer(optimizer,
ddp_model, loader, ...)`` and the controller given the DDP model. Both forward through the DDP
module, and neither broadcasts parameters (DDP does at construction). Records for the suite come
from `bench.jobs.records.SuiteRecorder`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from torch import nn

from bench.zoo import JOBS, ZooJob


def build(job: ZooJob, steps_per_epoch: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The job's model, optimizer and LR scheduler (None: constant LR) for `steps_per_epoch` steps per epoch."""
    model = job.model()
    total = max(1, steps_per_epoch * job.epochs)
    if job.optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=job.lr, momentum=job.momentum,
                                      weight_decay=job.weight_decay), None
    if job.optimizer == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=job.lr, weight_decay=job.weight_decay), None
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
    if job.optimizer == "adamw-onecycle":
        return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=job.lr, total_steps=total + 1,
                                                               pct_start=0.25)
    warm = max(1, total // 20)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))


def shift(x: torch.Tensor) -> torch.Tensor:
    """Random shifts of up to 2 pixels, one per batch (cheap augmentation)."""
    dx, dy = torch.randint(-2, 3, (2,)).tolist()
    return torch.roll(x, shifts=(dy, dx), dims=(2, 3))


def loss_and_metric(job: ZooJob, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                    train: bool) -> tuple[torch.Tensor, float]:
    """Mean loss over the batch and the metric's sum over it (correct predictions, or summed loss)."""
    if train and job.augment:
        x = shift(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=job.bf16):
        out = model(x)
    out = out.float()
    if job.task == "regress":
        loss = nn.functional.mse_loss(out, y)
        return loss, float(nn.functional.mse_loss(out.detach(), y, reduction="sum"))
    if job.task == "lm":
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        return loss, float(loss.detach()) * len(y)
    loss = nn.functional.cross_entropy(out, y, label_smoothing=job.label_smoothing if train else 0.0)
    return loss, float((out.argmax(1) == y).sum())


def main(argv: list[str] | None = None) -> None:
    import dynamix_hvd as dx
    from bench.jobs.common import (ENGINES, PlainHorovodLoader, add_bench_flags, add_common_flags,
                                   controller_config, local_batches, make_slowdown, parser, start, step_due,
                                   world)
    from bench.jobs.records import SuiteRecorder, sharded_sum

    ap = parser(__doc__)
    ap.add_argument("--job", required=True, choices=sorted(JOBS), help="the zoo job to train")
    add_common_flags(ap, epochs=0, out="runs/zoo", default_batch=0, lr=0.0, run_log=False)
    add_bench_flags(ap)
    ap.add_argument("--batchnorm-floor", type=int, default=0,
                    help="AdvancedConfig.batchnorm_min_batch (0: its default); 1 lets a BatchNorm model's "
                         "ranks go down to one sample")
    ap.add_argument("--adaptive", choices=["0", "1"], default="0",
                    help="WeightedDistributedOptimizer(adaptive=): 0 (the AdaScale gain, the default), 1 (its "
                         "square root, the square-root rule for Adam-type optimizers)")
    ap.add_argument("--noise-preconditioner", choices=["none", "adam", "auto"], default="none",
                    help="WeightedDistributedOptimizer(noise_preconditioner=): what the noise statistics are "
                         "measured on (none, the default: the gradient; auto: Adam's step direction for "
                         "Adam-type optimizers)")
    ap.add_argument("--budget", choices=["epochs", "progress"], default="epochs",
                    help="end after --epochs passes over the data, or (dynamix_hvd) after --epochs base-batch "
                         "epochs of training progress, the loop docs/usage.md recommends (plain Horovod: the same)")
    ap.add_argument("--engine", choices=ENGINES, default="horovod",
                    help="horovod (mpirun or horovodrun; the default) or torch (torchrun: a Gloo process group "
                         "and DistributedDataParallel; --plain-horovod is then the plain DDP script)")
    args = ap.parse_args(argv)
    job = JOBS[args.job]
    epochs = args.epochs = args.epochs or job.epochs
    sizes = start(args, default_batch=job.batch)
    torch_engine = args.engine == "torch"
    slow = make_slowdown(args, world.rank)
    metric = "accuracy" if job.higher_is_better else "loss"  # the recorder's direction
    rec = SuiteRecorder(args.out, args.eval_samples or job.eval_every, args.target if math.isfinite(args.target)
                        else job.target, metric, {"example": f"zoo:{job.name}", **vars(args)})

    train, test = job.data()
    steps_per_epoch = math.ceil(len(train) / (job.batch * world.size))  # the plain script's schedule length
    model, optimizer, scheduler = build(job, steps_per_epoch)
    if torch_engine:  # DDP broadcasts rank 0's parameters here; every forward pass goes through it
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    controller = None
    if args.plain_horovod:  # the reference: what a Horovod (DDP) user runs, equal batches
        loader: Any = PlainHorovodLoader(train, sizes[0], world.rank, world.size, args.seed)
        if not torch_engine:  # DDP averages the gradients in backward: the plain optimizer steps
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                 op=hvd.Average)
    else:
        loader = dx.AdaptiveLoader(train, sizes, world.rank, seed=args.seed)                        # dx
        # dx: Horovod takes the named parameters, torch.distributed the DDP model (its comm hook)
        params = model if torch_engine else model.named_parameters()
        optimizer = dx.WeightedDistributedOptimizer(optimizer, params, loader,                   # dx
                                                    max_grad_norm=job.clip or None,             # dx
                                                    base_batch_size=job.batch * world.size,    # dx: the LR's batch
                                                    adaptive=args.adaptive == "1",              # dx
                                                    noise_preconditioner=args.noise_preconditioner)
        if scheduler is not None:
            scheduler = dx.ProgressScheduler(scheduler, optimizer)                                 # dx
        if not args.no_controller:
            config = controller_config(args)
            if args.batchnorm_floor:
                config = dataclasses.replace(config, advanced=dataclasses.replace(
                    config.advanced, batchnorm_min_batch=args.batchnorm_floor))
            controller = dx.DynamixController(loader, optimizer, config, model=model)              # dx
    if not torch_engine:
        import horovod.torch as hvd

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def evaluate() -> float:
        return _evaluate(job, model, *test.tensors, sharded_sum)

    # progress in base-batch epochs: samples / epoch under plain Horovod, AdaScale's scale-invariant
    # epochs under dynamix_hvd (what the steps were worth at the batch sizes the controller chose)
    rec.progress = ((lambda: rec.samples / len(train)) if args.plain_horovod
                    else (lambda: optimizer.scale_invariant_epochs))
    rec.start()
    # the budget clock: samples trained over --epochs passes over the data (every arm, every rank alike)
    slow.use_clock(rec.train_s, budget=lambda: rec.samples / (epochs * len(train)))
    def more(epoch: int) -> bool:
        if args.budget == "progress" and not args.plain_horovod:
            return not optimizer.progress_done(epochs=epochs)                                       # dx
        return epoch < epochs

    epoch = 0
    while more(epoch):
        loader.set_epoch(epoch)                                                                     # dx
        model.train()
        optimizer.zero_grad()
        for x, y in loader:
            rec.compute_start()
            slow.before_compute(len(y))
            loss, _ = loss_and_metric(job, model, x, y, train=True)
            loss.backward()
            slow.after_compute(len(y))
            rec.compute_end()
            if args.plain_horovod:
                if job.clip and torch_engine:  # DDP has averaged the gradients in backward: clip, step
                    nn.utils.clip_grad_norm_(model.parameters(), job.clip)
                    optimizer.step()
                elif job.clip:  # Horovod's documented way to clip: synchronize, clip, step
                    optimizer.synchronize()
                    nn.utils.clip_grad_norm_(model.parameters(), job.clip)
                    with optimizer.skip_synchronize():
                        optimizer.step()
                else:
                    optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()
            elif step_due(optimizer):  # dx: every micro-batch of the step is in (accumulation)
                optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()                                                                # dx
            if controller is not None:
                controller.record_loss(loss)                                                        # dx
            if rec.step_end(epoch, local_batches(loader, len(y))):
                rec.evaluate(evaluate, epoch)
            if args.budget == "progress" and not args.plain_horovod and optimizer.progress_done(epochs=epochs):
                break                                                                               # dx
        epoch += 1
    rec.finish(evaluate, extra={"stalls": slow.stalls, "thread_cpu_s": thread_cpu_seconds()})     # collective
    if controller is not None and world.rank == 0:
        write_decisions(controller.history, args.out)
    if torch_engine:
        if controller is not None:
            controller.close()                                                                      # dx
        world.close()


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds each Python thread of this process used (Linux /proc), by thread name: what the
    library's helper threads take from training."""
    import threading

    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        try:
            fields = open(f"/proc/self/task/{t.native_id}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[t.name] = out.get(t.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def write_decisions(history: list[dict], out: str) -> None:
    """Rank 0's decisions (sizes, B, noise scale and its bounds) as OUT/decisions.csv."""
    import pandas as pd

    keep = ("decision", "epoch", "sizes", "passes", "lr_gain", "noise_scale", "noise_lower", "noise_point",
            "efficiency", "throughput", "loss", "overhead_s", "total_steps", "changed_by", "spacing", "recheck",
            "vote_every")
    network = ("net_s", "latency_s", "bus_bandwidth_Bps")
    info = ("split_gain", "gap_bound", "gap_intervals", "margin_lifted", "speed_shift", "neutral", "dithered", "switched", "may_grow",
            "growth_late", "budget_cap", "predicted_goodput",
            "goodput_now", "split_check")
    rows = [{k: h.get(k) for k in keep} | {k: (h.get("info") or {}).get(k) for k in info}
            | {k: ((h.get("fit") or {}).get("net") or {}).get(k) for k in network}
            | {"global_batch": h.get("passes", 1) * sum(h.get("sizes", []))} for h in history]
    pd.DataFrame(rows).to_csv(os.path.join(out, "decisions.csv"), index=False)


def _evaluate(job: ZooJob, model: nn.Module, x: torch.Tensor, y: torch.Tensor, sharded_sum: Any) -> float:
    """The metric over the whole test set (every rank scores its share; one allreduce)."""
    def score(out: torch.Tensor, target: torch.Tensor) -> float:
        out = out.float()
        if job.task == "regress":
            return float(nn.functional.mse_loss(out, target, reduction="sum"))
        if job.task == "lm":
            return float(nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))) * len(target)
        return float((out.argmax(1) == target).sum())

    value = sharded_sum(model, x, y, score)
    return math.sqrt(value) if job.metric == "rmse" else value


if __name__ == "__main__":
    main()
