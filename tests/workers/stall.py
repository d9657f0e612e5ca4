"""Worker: rank --victim stops itself with SIGSTOP at global step --stop-at (or, with --epoch-vote,
at the end of the first epoch, before the script's own epoch-end ``hvd.broadcast_object``); the others
must end the job, unless --stop-for S resumes it after S seconds (a helper process sends SIGCONT).
With --fail the victim raises there instead (leaving the controller's ``with`` block on an error),
with --leave it leaves training and closes its controller.

Before stopping, the victim writes <out>/victim.json (its pid and the wall time); the test kills it
(SIGCONT + SIGKILL) at teardown if it is still there. --ckpt adds a Checkpointer (preemption vote at
every step), --every k decides every k steps (0: at the end of every epoch), --busy S makes the victim
sleep S seconds before it stops (as if evaluating), --linger S makes rank 0 sleep S seconds after
training, with its controller still open, while the others have finished and exit.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.data.synthetic import teacher_classification
from dynamix_hvd.resilience.checkpoint import Checkpointer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--every", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=4.0)
    ap.add_argument("--victim", type=int, default=1, help="-1: nobody stops")
    ap.add_argument("--stop-at", type=int, default=5)
    ap.add_argument("--epoch-vote", action="store_true")
    ap.add_argument("--stop-for", type=float, default=0.0)
    ap.add_argument("--busy", type=float, default=0.0)
    ap.add_argument("--linger", type=float, default=0.0)
    ap.add_argument("--fail", action="store_true", help="the victim raises instead of stopping")
    ap.add_argument("--leave", action="store_true", help="the victim leaves training (closing its controller) "
                                                         "instead of stopping")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    dx.configure_logging()
    rank, world = hvd.rank(), hvd.size()
    train, _ = teacher_classification(4000, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
    loader = dx.AdaptiveLoader(train, [8] * world, rank, seed=1)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                          loader)
    controller = dx.DynamixController(loader, opt, dx.ControllerConfig(
        policy="static", decide_every_steps=args.every, timeout_s=args.timeout))
    if args.ckpt:
        # a vote at every step, so the other rank waits for the stopped one in the preemption vote
        Checkpointer(args.ckpt, model, opt, loader, controller, check_every=1).install_signal_handlers()
    with controller:  # as the README writes it: closed on leaving the block, by an error too
        if train_until_stop(args, rank, loader, opt, model):
            return  # left training: the others must not take this for the end of the job
        if rank == 0:
            time.sleep(args.linger)
    print(f"rank {rank}: FINISHED", flush=True)


def train_until_stop(args: argparse.Namespace, rank: int, loader: dx.AdaptiveLoader,
                     opt: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Three epochs; True where the victim left training early (--leave)."""
    step = 0
    for epoch in range(3):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if rank == args.victim and step == args.stop_at and not args.epoch_vote:
                if stop(args):
                    return True
        if args.epoch_vote:
            if rank == args.victim and epoch == 0 and stop(args):
                return True
            hvd.broadcast_object(epoch, root_rank=0, name=f"stall.epoch.{epoch}")
    return False

def stop(args: argparse.Namespace) -> bool:
    """The victim's fault (after --busy seconds): True when it leaves training, else it stops (or raises)."""
    time.sleep(args.busy)
    Path(args.out, "victim.json").write_text(json.dumps({"pid": os.getpid(), "t": time.time()}))
    if args.leave:
        return True
    if args.fail:
        raise RuntimeError("the victim fails")
    if args.stop_for:
        subprocess.Popen(["sh", "-c", f"sleep {args.stop_for}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    return False

if __name__ == "__main__":
    main()
