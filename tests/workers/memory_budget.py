"""Worker: the default controller, growth on, in a job whose memory budget is the binding limit.

Every step pays a fixed cost (a sleep) and little compute, so a larger global batch pays; each sample
holds a wide activation, so memory is what stops the growth. Writes
``rank{r}.json``: the budget the controller read, its memory floor, every decision's sizes and
bounds, and this rank's peak resident memory over the whole job.
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.data.synthetic import teacher_classification
from dynamix_hvd.runs.runlog import RunLog


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--width", type=int, default=8192, help="hidden units: the activation memory per sample")
    ap.add_argument("--batch", type=int, default=32, help="initial local batch of every rank")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--sleep-fixed", type=float, default=0.03, help="seconds every step sleeps (a fixed cost)")
    ap.add_argument("--policy", default="", help="ControllerConfig.policy (default: the controller's default); "
                    "'adabatch' doubles the global batch at every decision, whatever it costs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    train, _ = teacher_classification(args.samples, seed=0)
    model = nn.Sequential(nn.Linear(32, args.width), nn.ReLU(), nn.Linear(args.width, 10))
    loader = dx.AdaptiveLoader(train, [args.batch] * world, rank, seed=1)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02), model.named_parameters(),
                                          loader)
    policy = {"policy": args.policy} if args.policy else {}
    if args.policy == "adabatch":
        policy["policy_config"] = dx.AdaBatchConfig(every=1, end=64 * args.max_batch)
    cfg = dx.ControllerConfig(max_batch=args.max_batch, total_epochs=args.epochs, timeout_s=60.0, **policy)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with dx.DynamixController(loader, opt, cfg, model=model) as controller:
        run = RunLog(Path(args.out, "run"), loader, controller=controller)
        bounds_after: list[list[int]] = []  # rank 0: every rank's bound right after each decision

        def after_decision(ldr: dx.AdaptiveLoader, epoch_end: bool) -> None:  # runs after the controller's
            if len(controller.history) > len(bounds_after):
                bounds_after.append([controller.bounds.upper(r) for r in range(world)])
        loader.step_end_callbacks.append(after_decision)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                time.sleep(args.sleep_fixed)
                opt.step()
                controller.record_loss(loss)
                run.step(loss)
            run.end_epoch()
        run.finish()
        history = [{"sizes": d["sizes"], "previous_sizes": d.get("previous_sizes"), "bounds": b,
                    "peaks": [r["peak_memory_bytes"] for r in d["reports"]] if "reports" in d else None,
                    "noise_scale": d.get("noise_scale"), "info": str(d.get("info"))[-900:]}
                   for d, b in zip(controller.history, bounds_after)]
        Path(args.out, f"rank{rank}.json").write_text(json.dumps({
            "budget": controller.memory_budget.to_dict(), "floor": controller.memory_floor_bytes,
            "history": history, "final_bounds": [controller.bounds.upper(r) for r in range(world)],
            "final_sizes": list(loader.batch_sizes),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


if __name__ == "__main__":
    main()
