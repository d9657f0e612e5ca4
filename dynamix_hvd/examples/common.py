"""What the example jobs share: their common flags, the per-rank set-up and the controller's config.

Each example keeps its own model, data and training loop; only the plumbing that was copied between
them lives here. Environment variables give the defaults of the common flags (EPOCHS, BATCH_SIZES,
POLICY, POLICY_FILE, OUT, DYNAMIX_PROGRESS), so the launch wrappers can pass them to every rank.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import dynamix_hvd as dx
from dynamix_hvd.control.controller import POLICY_NAMES


def parser(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_flags(ap: argparse.ArgumentParser, *, epochs: int, out: str, default_batch: int,
                     decide_every: int = 0, lr: float, run_log: bool = True) -> None:
    """The flags every example has; `run_log` adds --progress and --no-report (jobs writing a RunLog)."""
    ap.add_argument("--epochs", type=int, default=int(os.environ.get("EPOCHS", epochs)),
                    help="training epochs (env EPOCHS)")
    ap.add_argument("--batch-sizes", default=os.environ.get("BATCH_SIZES", ""),
                    help="comma-separated local batch size per rank, e.g. 16,48 (env BATCH_SIZES); "
                         f"default {default_batch} on every rank")
    ap.add_argument("--lr", type=float, default=lr, help="learning rate at the base global batch")
    ap.add_argument("--lr-rule", default="sqrt", choices=["none", "linear", "sqrt", "adascale"],
                    help="how the LR follows the global batch")
    ap.add_argument("--policy", default=os.environ.get("POLICY", "ppo"), choices=POLICY_NAMES,
                    help="batch-size policy: ppo (DYNAMIX), static or a classic rule (env POLICY)")
    ap.add_argument("--policy-kwargs", default="{}", help="JSON parameters of a classic rule, e.g. '{\"end\": 512}'")
    ap.add_argument("--policy-file", default=os.environ.get("POLICY_FILE", "default"),
                    help="PPO policy to start from: name in policies/ or path; 'none' = fresh (env POLICY_FILE)")
    ap.add_argument("--learn", type=int, default=0, help="1: keep training the policy online; 0: act greedily")
    ap.add_argument("--decide-every", type=int, default=decide_every,
                    help="decide every k steps (0: at the end of every epoch)")
    ap.add_argument("--slow-rank", type=int, default=-1, help="make this rank slow (straggler demo)")
    ap.add_argument("--slow-ms", type=float, default=0.0, help="extra milliseconds per step on --slow-rank")
    ap.add_argument("--out", default=os.environ.get("OUT", out), help="run directory for the records (env OUT)")
    if run_log:
        ap.add_argument("--progress", default=os.environ.get("DYNAMIX_PROGRESS", "auto"),
                        choices=["auto", "bar", "epoch", "off"],
                        help="rank 0's display: progress bar, one line per epoch, or nothing (env DYNAMIX_PROGRESS)")
        ap.add_argument("--no-report", action="store_true", help="do not write OUT/report.png at the end")
    ap.add_argument("--seed", type=int, default=0)


def start(args: argparse.Namespace, default_batch: int) -> list[int]:
    """Threads from OMP_NUM_THREADS, `hvd.init()`, the seed; returns this job's per-rank batch sizes."""
    import horovod.torch as hvd

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    hvd.init()
    dx.configure_logging()  # the library's messages (checkpoints, run logs) on stderr, rank-prefixed
    torch.manual_seed(args.seed)
    return [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [default_batch] * hvd.size()


def controller_config(args: argparse.Namespace) -> dx.ControllerConfig:
    """The controller's configuration from the common flags."""
    return dx.ControllerConfig(
        policy=args.policy, policy_kwargs=json.loads(args.policy_kwargs),
        policy_file=None if args.policy_file == "none" else args.policy_file,
        learn=bool(args.learn), total_epochs=args.epochs, decide_every_steps=args.decide_every,
        ppo=dx.PPOConfig(seed=args.seed, rollout_length=8))
