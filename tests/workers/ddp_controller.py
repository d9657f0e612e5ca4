"""Worker under torchrun: the controller and the checkpointer on the torch.distributed engine
(DistributedDataParallel, control messages over Gloo). Modes:

train   a few epochs, rank `--slow-rank` sleeping longer per sample; dumps every rank's decisions.
silent  rank `--silent` never takes part in the control plane; the others must time out with an
        error naming it (a line "TIMEOUT-OK rank R: <message>" when they do).
With --stop-rank R (train), rank R stops itself (SIGSTOP) mid-training: the others must end the job
naming it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

if "--no-horovod" in sys.argv:
    sys.modules["horovod"] = None  # type: ignore[assignment]  # `import horovod...` raises ImportError

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dynamix_hvd as dx
from dynamix_hvd.comm import ControlPlaneTimeout
from dynamix_hvd.data.synthetic import teacher_classification


class SleepyNet(nn.Module):
    """A small classifier whose forward sleeps per sample: a rank's speed is set by its sleep."""

    def __init__(self, per_sample_s: float, batchnorm: bool = False) -> None:
        super().__init__()
        norm = [nn.BatchNorm1d(32)] if batchnorm else []
        self.net = nn.Sequential(nn.Linear(32, 32), *norm, nn.ReLU(), nn.Linear(32, 10))
        self.per_sample_s = per_sample_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.per_sample_s * len(x))
        return self.net(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["train", "silent"], default="train")
    ap.add_argument("--out", default=".")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=3200)
    ap.add_argument("--every", type=int, default=-1, help="decide every k steps; -1: the automatic cadence")
    ap.add_argument("--per-sample", type=float, default=0.001, help="seconds of sleep per sample")
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--silent", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--checkpoints", default="", help="a folder: write a checkpoint at every epoch's end")
    ap.add_argument("--stop-rank", type=int, default=-1, help="this rank stops itself (SIGSTOP) ...")
    ap.add_argument("--stop-at-step", type=int, default=30, help="... before this step of the job")
    ap.add_argument("--policy", default="model")
    ap.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer (DDP broadcasts its buffers)")
    ap.add_argument("--batch", type=int, default=16, help="every rank's first batch size")
    ap.add_argument("--sleep-after-backward", action="store_true",
                    help="sleep after backward instead of in forward (the others then wait in the next forward)")
    ap.add_argument("--sigterm-checkpoint", action="store_true", help="SIGTERM writes a checkpoint and ends the job")
    ap.add_argument("--started", default="", help="rank 0 creates this file after its first step")
    ap.add_argument("--no-horovod", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    slow = args.slow_factor if rank == args.slow_rank else 1.0
    model = SleepyNet(0.0 if args.sleep_after_backward else args.per_sample * slow, args.batchnorm)
    ddp = DDP(model)
    train, _ = teacher_classification(args.samples, seed=0)
    loader = dx.AdaptiveLoader(train, [args.batch] * world, rank, seed=1)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), ddp, loader)
    cfg = dx.ControllerConfig(policy=args.policy, decide_every_steps=None if args.every < 0 else args.every,
                              min_batch=2, max_batch=64, timeout_s=args.timeout, total_epochs=args.epochs)
    controller = dx.DynamixController(loader, opt, cfg, model=ddp)
    if args.mode == "silent":
        if rank == args.silent:
            time.sleep(args.timeout + 4)  # alive but never answers
            return
        try:
            controller.decide()
        except ControlPlaneTimeout as exc:
            print(f"TIMEOUT-OK rank {rank}: {exc}", flush=True)
            time.sleep(2 + 0.1 * args.timeout)  # the other waiting ranks reach their own deadlines
        return
    ckpt = dx.Checkpointer(args.checkpoints, ddp, opt, loader, controller) if args.checkpoints else None
    restored = ckpt.restore() if ckpt is not None else None
    if ckpt is not None and args.sigterm_checkpoint:
        ckpt.install_signal_handlers()
    if restored is not None:
        print(f"rank {rank}: RESUMED-FROM {restored.name} epoch {loader.epoch} step {loader.step}", flush=True)
    t0 = time.perf_counter()
    steps = loader.epoch * len(loader) + loader.step
    with controller:
        for epoch in range(loader.epoch, args.epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                steps += 1
                if args.started and rank == 0 and not Path(args.started).exists():
                    Path(args.started).touch()
                if rank == args.stop_rank and steps == args.stop_at_step:
                    print(f"rank {rank}: stopping itself at step {steps}", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                loss = nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
                if args.sleep_after_backward:
                    time.sleep(args.per_sample * slow * len(y))
                opt.step()
                opt.zero_grad()
                controller.record_loss(loss)
            if ckpt is not None:
                ckpt.save()
    out = {"rank": rank, "engine": opt.engine, "backend": controller.channel.backend,
           "seconds": time.perf_counter() - t0, "horovod_imported": "horovod.torch" in sys.modules,
           "decisions": [{"sizes": list(h["sizes"]), "epoch": h["epoch"], "transition": str((h.get("info") or {}).get("transition"))[:1500]} for h in controller.history],
           "params": [p.detach().flatten().tolist() for p in model.parameters()],
           "median_compute_s": statistics.median(r["compute_s"] for r in loader.tracker.to_dicts()),
           "median_sync_wait_s": statistics.median(r["sync_wait_s"] for r in loader.tracker.to_dicts())}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
