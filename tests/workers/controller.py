"""Worker: the controller in a real job. Modes:

train   train a few epochs with decisions every k steps; dump every rank's decision history.
silent  rank `--silent` never takes part in the control plane; the others must time out with an
        error naming it (exit code 0 and a line "TIMEOUT-OK: <message>" when they do).

Several runs in one job: their arguments separated by --then (each train run with its own --out; a silent
run leaves the control plane unusable, so it goes last). Every rank records the warnings its controller's
construction issued (shown as usual too) in its results.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.comm import ControlPlaneTimeout
from dynamix_hvd.data.synthetic import teacher_classification

try:
    from workers.dataplane import runs
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import runs  # type: ignore[no-redef]


def main() -> None:
    argvs = runs(sys.argv[1:])  # one start of the ranks for several runs (--then between them)
    torch.set_num_threads(1)
    hvd.init()
    for argv in argvs:
        run(argv)


def run(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["train", "silent"], default="train")
    ap.add_argument("--out", default=".")
    ap.add_argument("--policy", default="ppo")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--every", type=int, default=5, help="decide every k steps; -1: the automatic cadence")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--target-decisions", type=int, default=32, help="with --every -1")
    ap.add_argument("--decision-budget", type=float, default=0.01, help="with --every -1 (0: no limit)")
    ap.add_argument("--max-interval", type=float, default=None,
                    help="CadenceConfig.max_decision_interval_s (default: its default)")
    ap.add_argument("--change-vote-s", type=float, default=None,
                    help="CadenceConfig.change_vote_s (default: its default; 0: no change votes)")
    ap.add_argument("--silent", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--keep-inputs", type=int, default=0, help="rank 0 dumps this many decisions' inputs")
    ap.add_argument("--sizes", default="", help="initial local batches, comma-separated (default 8 + 4 * rank)")
    ap.add_argument("--samples", type=int, default=1200)
    ap.add_argument("--sleep-per-sample", type=float, default=0.0,
                    help="every rank sleeps this long per sample in forward/backward (a cost a + c*b)")
    ap.add_argument("--sleep-fixed", type=float, default=0.0, help="... and this long per step")
    ap.add_argument("--slow-rank", type=int, default=-1, help="this rank's sleeps are --slow-factor times longer")
    ap.add_argument("--slow-factor", type=float, default=1.0)
    ap.add_argument("--slow-from-step", type=int, default=0, help="the slow rank is slow from this step of the job on")
    ap.add_argument("--fp16", action="store_true", help="Horovod's fp16 compression of the gradients")
    ap.add_argument("--with-model", action="store_true", help="give the controller model=")
    ap.add_argument("--adam", action="store_true", help="Adam in place of SGD (preconditioned noise statistics)")
    args = ap.parse_args(argv)
    rank, world = hvd.rank(), hvd.size()
    train, _ = teacher_classification(args.samples, seed=0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    sizes = [int(b) for b in args.sizes.split(",")] if args.sizes else [8 + 4 * r for r in range(world)]
    loader = dx.AdaptiveLoader(train, sizes, rank, seed=1)
    slow = args.slow_factor if rank == args.slow_rank else 1.0
    inner = torch.optim.Adam(model.parameters(), lr=1e-3) if args.adam else torch.optim.SGD(model.parameters(), lr=0.05)
    opt = dx.WeightedDistributedOptimizer(inner, model.named_parameters(),
                                          loader, lr_rule="adascale",
                                          compression=hvd.Compression.fp16 if args.fp16 else None,
                                          noise_preconditioner="auto")
    cfg = dx.ControllerConfig(policy=args.policy, decide_every_steps=None if args.every < 0 else args.every,
                              max_batch=args.max_batch,
                              min_batch=2, timeout_s=args.timeout, total_epochs=args.epochs,
                              ppo={"rollout_length": 4, "seed": 3} if args.policy == "ppo" else {},
                              advanced=dx.AdvancedConfig(keep_inputs=args.keep_inputs, cadence=dx.CadenceConfig(
                                  decision_budget=args.decision_budget, target_decisions=args.target_decisions,
                                  **({} if args.max_interval is None else
                                     {"max_decision_interval_s": args.max_interval}),
                                  **({} if args.change_vote_s is None else {"change_vote_s": args.change_vote_s}))))
    with warnings.catch_warnings(record=True) as caught:  # every run's, not only the process's first
        warnings.simplefilter("always")
        controller = dx.DynamixController(loader, opt, cfg, model=model if args.with_model else None)
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if args.mode == "silent":
        if rank == args.silent:
            time.sleep(args.timeout + 4)  # alive but never answers
            return
        try:
            controller.decide()
        except ControlPlaneTimeout as exc:
            print(f"TIMEOUT-OK rank {rank}: {exc}", flush=True)
            # Stay until the other waiting ranks hit their own deadlines: Horovod finalizes MPI on
            # every rank as soon as one exits, which would cut their waits short (rank 1 waits for rank 0
            # a grace of 1 + 0.1 timeout longer than rank 0 does).
            time.sleep(3)
            return
        sys.exit("expected a ControlPlaneTimeout")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    when = []  # (epoch, steps into it, its length under the sizes it ran with) at each decision
    at_step = []  # the job's step at each decision
    length, steps = [0], [0]
    measured = []  # per step: whether it takes the (preconditioned) noise statistics

    def after_controller(ldr: dx.AdaptiveLoader, epoch_end: bool) -> None:  # runs after the controller's
        steps[0] += 1
        if len(controller.history) > len(when):
            when.append([ldr.epoch, ldr.step, length[0]])
            at_step.append(steps[0])
            length[0] = len(ldr)  # a decision may change the sizes, hence the epoch's length
    loader.step_end_callbacks.append(after_controller)
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        length[0] = len(loader)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if args.sleep_per_sample or args.sleep_fixed:  # sleep, not spin: ranks share the cores
                factor = slow if steps[0] >= args.slow_from_step else 1.0
                time.sleep(factor * (args.sleep_fixed + args.sleep_per_sample * len(x)))
            measured.append(opt.flat.keeping)
            opt.step()
            controller.record_loss(loss)
    history = [{k: d.get(k) for k in ("decision", "sizes", "previous_sizes", "lr_gain", "reward", "overhead_s", "spacing",
                                 "recheck", "ceiling", "vote_every", "changed_by", "noise_every", "noise_point")}
               for d in controller.history]
    for h, d in zip(history, controller.history):  # rank 0: the network fit of each decision
        h["net"] = (d.get("fit") or {}).get("net")
    for h, d in zip(history, controller.history):  # rank 0: what each rank measured before the decision
        if "reports" in d:
            h["compute_s"] = [r["compute_s"] for r in d["reports"]]
            h["local_batch"] = [r["local_batch"] for r in d["reports"]]
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({
        "history": history, "backend": controller.channel.backend, "when": when, "at_step": at_step,
        "measured": measured, "noise_preconditioner": opt.noise_preconditioner,
        "bounds": [controller.bounds.upper(r) for r in range(world)],
        "final_sizes": list(loader.batch_sizes), "allreduce_bytes": opt.allreduce_bytes,
        "config": controller.config_dict(), "checkpointed_config": controller.state_dict()["config"],
        "warnings": [str(w.message) for w in caught]}))
    if rank == 0 and args.keep_inputs:  # the typed reports each decision was made on, and the decisions
        Path(args.out, "inputs.json").write_text(json.dumps({
            "inputs": [[i.to_dict() for i in inputs] for inputs in controller.inputs],
            "decisions": controller.history, "initial_batch": sum(8 + 4 * r for r in range(world)),
            "layer_names": opt.param_names}))
    controller.close()


if __name__ == "__main__":
    main()
