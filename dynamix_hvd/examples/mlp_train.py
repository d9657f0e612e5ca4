"""Example job: a Horovod + PyTorch training script using dynamix_hvd's data plane.

Structured like Horovod's own ``pytorch_mnist.py``; the dynamix_hvd lines are marked ``# dx``.
Run with e.g. ``mpirun -np 2 python -m dynamix_hvd.examples.mlp_train --batch-sizes 16,48``.
"""
from __future__ import annotations

import argparse
import os

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.examples import busy_wait
from dynamix_hvd.control.controller import POLICY_NAMES
from dynamix_hvd.data.synthetic import teacher_classification
from dynamix_hvd.tools.progress import Progress
from dynamix_hvd.runs.runlog import RunLog


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=int(os.environ.get("EPOCHS", 3)),
                    help="training epochs (env EPOCHS)")
    ap.add_argument("--batch-sizes", default=os.environ.get("BATCH_SIZES", ""),
                    help="comma-separated local batch size per rank, e.g. 16,48 (env BATCH_SIZES); "
                         "default 32 on every rank")
    ap.add_argument("--samples", type=int, default=8192, help="training samples (generated)")
    ap.add_argument("--lr", type=float, default=0.05, help="learning rate at the base global batch")
    ap.add_argument("--lr-rule", default="sqrt", choices=["none", "linear", "sqrt", "adascale"],
                    help="how the LR follows the global batch")
    ap.add_argument("--policy", default=os.environ.get("POLICY", "ppo"), choices=POLICY_NAMES,
                    help="batch-size policy: ppo (DYNAMIX), static or a classic rule (env POLICY)")
    ap.add_argument("--policy-file", default=os.environ.get("POLICY_FILE", "default"),
                    help="PPO policy to start from: name in policies/ or path; 'none' = fresh (env POLICY_FILE)")
    ap.add_argument("--learn", type=int, default=0, help="1: keep training the policy online; 0: act greedily")
    ap.add_argument("--decide-every", type=int, default=0,
                    help="decide every k steps (0: at the end of every epoch)")
    ap.add_argument("--slow-rank", type=int, default=-1, help="make this rank slow (straggler demo)")
    ap.add_argument("--slow-ms", type=float, default=0.0, help="extra milliseconds per step on --slow-rank")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/mlp"),
                    help="run directory: epochs.csv, trace.h5, meta.json, report.png (env OUT)")
    ap.add_argument("--progress", default=os.environ.get("DYNAMIX_PROGRESS", "auto"),
                    choices=["auto", "bar", "epoch", "off"],
                    help="rank 0's display: progress bar, one line per epoch, or nothing (env DYNAMIX_PROGRESS)")
    ap.add_argument("--no-report", action="store_true", help="do not write OUT/report.png at the end")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    hvd.init()
    dx.configure_logging()  # the library's messages (checkpoints, run logs) on stderr, rank-prefixed
    torch.manual_seed(args.seed)
    sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [32] * hvd.size()

    train, test = teacher_classification(args.samples, 2048, seed=args.seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed)        # dx
    optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader,  # dx
                                                lr_rule=args.lr_rule)          # dx
    controller = dx.DynamixController(loader, optimizer, dx.ControllerConfig(                # dx
        policy=args.policy, policy_file=None if args.policy_file == "none" else args.policy_file,
        learn=bool(args.learn), total_epochs=args.epochs,
        decide_every_steps=args.decide_every, ppo=dx.PPOConfig(seed=args.seed, rollout_length=8)))
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
