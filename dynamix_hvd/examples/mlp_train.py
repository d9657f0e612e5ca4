"""Example job: a Horovod + PyTorch training script using dynamix_hvd's data plane.

Structured like Horovod's own ``pytorch_mnist.py``; the dynamix_hvd lines are marked ``# dx``.
Run with e.g. ``mpirun -np 2 python -m dynamix_hvd.examples.mlp_train --batch-sizes 16,48``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import horovod.torch as hvd
import pandas as pd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.data import teacher_classification


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
    ap.add_argument("--policy", default=os.environ.get("POLICY", "ppo"), choices=["ppo", "static"],
                    help="batch-size policy (env POLICY)")
    ap.add_argument("--policy-file", default=os.environ.get("POLICY_FILE") or None,
                    help="PPO policy to start from: name in policies/ or path (env POLICY_FILE)")
    ap.add_argument("--decide-every", type=int, default=0,
                    help="decide every k steps (0: at the end of every epoch)")
    ap.add_argument("--slow-rank", type=int, default=-1, help="make this rank slow (straggler demo)")
    ap.add_argument("--slow-ms", type=float, default=0.0, help="extra milliseconds per step on --slow-rank")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/mlp"),
                    help="directory for per-step records (env OUT)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    hvd.init()
    torch.manual_seed(args.seed)
    sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [32] * hvd.size()

    train, test = teacher_classification(args.samples, 2048, seed=args.seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed)        # dx
    optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader,  # dx
                                                lr_rule=args.lr_rule)          # dx
    controller = dx.DynamixController(loader, optimizer, dx.ControllerConfig(                # dx
        policy=args.policy, policy_file=args.policy_file, total_epochs=args.epochs,
        decide_every_steps=args.decide_every, ppo=dx.PPOConfig(seed=args.seed, rollout_length=8)))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    for epoch in range(args.epochs):
        loader.set_epoch(epoch)                                                 # dx
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            if hvd.rank() == args.slow_rank:
                _busy_wait(args.slow_ms / 1000.0)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            controller.record_loss(loss)                                        # dx
        model.eval()
        with torch.no_grad():
            acc = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        records = loader.tracker.to_dataframe()
        epoch_rec = records[records.epoch == epoch]
        wait = hvd.allgather_object(float(epoch_rec.sync_wait_s.mean()))
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} test acc {acc:.4f} sizes {list(loader.batch_sizes)} "
                  f"samples/s (rank 0) {epoch_rec.samples_per_s.median():.0f} "
                  f"mean allreduce wait per rank (ms) {[round(w * 1e3, 2) for w in wait]}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loader.tracker.to_dataframe().to_csv(out / f"steps_rank{hvd.rank()}.csv", index=False)
    if hvd.rank() == 0:
        pd.DataFrame([{k: v for k, v in d.items() if k not in ("reports", "info")} for d in controller.history]
                     ).to_csv(out / "decisions.csv", index=False)
        print(f"per-step records: {out}/steps_rank*.csv; decisions: {out}/decisions.csv")


def _busy_wait(seconds: float) -> None:
    """Burn CPU like a slower device would (sleeping would free the core for the other ranks)."""
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


if __name__ == "__main__":
    main()
