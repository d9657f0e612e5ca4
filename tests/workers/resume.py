"""Worker: float64 training with a Checkpointer; optionally SIGTERM one rank at a given step.

Prints RESUMED-FROM <path> when it restarted from a checkpoint; writes rank<R>.json at the end, and rank 0
writes stats.json (steps, preemption votes, training seconds), also when a stop request ends the run.
Several runs in one job: their arguments separated by --then (each with its own --out and --ckpt; a run
that is stopped ends the job, so it goes last).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.resilience.checkpoint import Checkpointer
from dynamix_hvd.data.synthetic import WithIndex, teacher_classification

try:
    from workers.dataplane import runs
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import runs  # type: ignore[no-redef]

EPOCHS = 3



def main() -> None:
    argvs = runs(sys.argv[1:])  # one start of the ranks for several runs (--then between them)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    hvd.init()
    dx.configure_logging()
    for argv in argvs:
        run(argv)


def run(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--sigterm-at", type=int, default=-1, help="global step at which rank 1 gets SIGTERM")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (to be preempted)")
    ap.add_argument("--started", default="", help="file rank 0 writes after its first step")
    ap.add_argument("--check-every", type=int, default=1, help="preemption vote every k steps (0: by time)")
    ap.add_argument("--check-interval", type=float, default=1.0, help="seconds between votes by time")
    args = ap.parse_args(argv)
    rank, world = hvd.rank(), hvd.size()
    train, _ = teacher_classification(500, seed=0)
    data = WithIndex(torch.utils.data.TensorDataset(train.tensors[0].double(), train.tensors[1]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10))
    loader = dx.AdaptiveLoader(data, dx.checkpoint.redistribute(32, world), rank, seed=4)
    opt = dx.WeightedDistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model.named_parameters(),
                                          loader)
    controller = dx.DynamixController(loader, opt, dx.ControllerConfig(policy="static"))
    ckpt = Checkpointer(args.ckpt, model, opt, loader, controller, check_every=args.check_every or None,
                        check_interval_s=args.check_interval)
    ckpt.install_signal_handlers()
    votes = []  # the preemption votes the control channel ran (counted where they are issued)
    allgather = ckpt.channel.allgather_object

    def counted(obj, op):
        votes.append(op.name)
        return allgather(obj, op)

    ckpt.channel.allgather_object = counted
    restored = ckpt.restore()
    if restored is not None and rank == 0:
        print(f"RESUMED-FROM {restored} epoch {loader.epoch} step {loader.step}", flush=True)
    served = []
    t0 = time.perf_counter()
    try:
        for epoch in range(loader.epoch, EPOCHS):
            loader.set_epoch(epoch)
            for idx, x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                served.append({"epoch": epoch, "indices": idx.tolist()})
                if args.started and rank == 0 and len(served) == 1:
                    Path(args.started).write_text("started")
                time.sleep(args.step_sleep)
                if rank == 1 and epoch * 1000 + loader.step == args.sigterm_at:
                    os.kill(os.getpid(), signal.SIGTERM)
    finally:
        if rank == 0:
            stats = {"steps": len(served), "votes": ckpt.votes, "channel_votes": votes.count("dx.checkpoint.vote"),
                     "train_s": time.perf_counter() - t0}
            Path(args.out, "stats.json").write_text(json.dumps(stats))
            print(f"STEPS {stats['steps']} VOTES {stats['votes']} CHANNEL-VOTES {stats['channel_votes']} "
                  f"TRAIN-S {stats['train_s']:.3f}", flush=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({
        "params": [p.detach().flatten().tolist() for p in model.parameters()], "served": served,
        "decisions": len(controller.history)}))
    ckpt.close()
    controller.close()


if __name__ == "__main__":
    main()
