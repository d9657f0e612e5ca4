"""Example: a plain Horovod + PyTorch training script with dynamix_hvd; its lines are marked ``# dx``.

An MLP on generated data (a random teacher network labels Gaussian inputs), so it needs no download.
``dynamix-hvd run`` launches it; by hand: ``mpirun -np 2 python -m dynamix_hvd.examples.mlp --batch-sizes 16,48``.
Without the ``# dx`` lines (and with ``DistributedSampler`` + ``hvd.DistributedOptimizer``) it is the
script a Horovod user already has. Environment variables give the defaults of some flags (EPOCHS,
BATCH_SIZES, POLICY, POLICY_FILE, OUT, DYNAMIX_PROGRESS), so the launch wrappers can pass them to every rank.
"""
from __future__ import annotations

import argparse
import os
import time

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx                                                      # dx
from dynamix_hvd.control.controller import POLICY_NAMES
from dynamix_hvd.data.synthetic import teacher_classification
from dynamix_hvd.runs.progress import Progress                               # dx
from dynamix_hvd.runs.runlog import RunLog                                    # dx


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=int(os.environ.get("EPOCHS", 3)), help="training budget in base-batch epochs of progress (env EPOCHS)")
    ap.add_argument("--batch-sizes", default=os.environ.get("BATCH_SIZES", ""),
                    help="comma-separated local batch size per rank, e.g. 16,48 (env BATCH_SIZES); default 32 each")
    ap.add_argument("--samples", type=int, default=8192, help="generated training samples")
    ap.add_argument("--hidden", type=int, default=128, help="units of the hidden layer")
    ap.add_argument("--lr", type=float, default=0.05, help="learning rate at the initial batch")
    ap.add_argument("--policy", default=os.environ.get("POLICY", "model"), choices=POLICY_NAMES,
                    help="batch-size policy: model (default), ppo (DYNAMIX), static or a classic rule (env POLICY)")
    ap.add_argument("--policy-file", default=os.environ.get("POLICY_FILE", "default"),
                    help="PPO policy to start from: name in policies/ or path; 'none' = fresh (env POLICY_FILE)")
    ap.add_argument("--decide-every", type=int, default=-1,
                    help="decide every k steps (0: at epoch ends only; -1: about 32 decisions over the run)")
    ap.add_argument("--slow-rank", type=int, default=-1, help="make this rank slower (a straggler to watch)")
    ap.add_argument("--slow-ms", type=float, default=0.0, help="milliseconds --slow-rank spins before each step")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/mlp"), help="run directory for the records (env OUT)")
    ap.add_argument("--progress", default=os.environ.get("DYNAMIX_PROGRESS", "auto"),
                    choices=["auto", "bar", "epoch", "off"],
                    help="rank 0's display: progress bar, one line per epoch, or nothing (env DYNAMIX_PROGRESS)")
    ap.add_argument("--no-report", action="store_true", help="do not write OUT/report.png at the end")
    ap.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the epoch order")
    return ap.parse_args(argv)


def spin(seconds: float) -> None:
    """Burn CPU like a slower device would (sleeping would free the core for the other ranks)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    hvd.init()
    dx.configure_logging()                                                    # dx
    torch.manual_seed(args.seed)
    sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [32] * hvd.size()

    train, test = teacher_classification(args.samples, 2048, seed=args.seed)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed)      # dx
    optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader)  # dx
    config = dx.ControllerConfig(                                             # dx
        policy=args.policy, policy_file=None if args.policy_file == "none" else args.policy_file,
        total_epochs=args.epochs, decide_every_steps=None if args.decide_every < 0 else args.decide_every,
        ppo={"seed": args.seed, "rollout_length": 8} if args.policy == "ppo" else {})
    controller = dx.DynamixController(loader, optimizer, config, model=model)  # dx
    run = RunLog(args.out, loader, controller=controller, meta={"example": "mlp", **vars(args)},  # dx
                 progress=Progress(args.epochs, rank=hvd.rank(), mode=args.progress))  # dx
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    slow_s = args.slow_ms / 1000.0 if hvd.rank() == args.slow_rank else 0.0

    def accuracy() -> float:
        """Test accuracy over all ranks: each rank scores its share of the test set."""
        x, y = test.tensors
        model.eval()
        with torch.no_grad():
            part = slice(hvd.rank(), None, hvd.size())
            correct = (model(x[part]).argmax(1) == y[part]).sum()
        model.train()
        return float(hvd.allreduce(correct.double(), op=hvd.Sum, name="test_correct")) / len(y)

    epoch = 0
    # the budget in training progress (base-batch epochs), so it means the same whatever B does
    while not optimizer.progress_done(epochs=args.epochs):                   # dx
        loader.set_epoch(epoch)                                               # dx
        for x, y in loader:
            if slow_s:
                spin(slow_s)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            controller.record_loss(loss)                                      # dx
            run.step(loss)                                                    # dx
        acc = accuracy()                                                      # collective
        run.end_epoch(accuracy=acc)                                           # dx: collective
        epoch += 1
    out = run.finish(report=not args.no_report)                               # dx: collective
    controller.close()                                                        # dx
    if out is not None:
        print(f"run records: {out}/epochs.csv, {out}/trace.h5, {out}/meta.json, {out}/steps_rank*.csv"
              f"{'' if args.no_report else f', {out}/report.png'} (dynamix-hvd summarize {out})", flush=True)


if __name__ == "__main__":
    main()
