"""Worker for bench_decision_overhead.py: time controller.decide() (gather + decide + broadcast)."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.comm import Collective, library_channel
from dynamix_hvd.data.synthetic import teacher_classification

TIMINGS = Collective("bench.decision_times", 300.0, "bench/decision_worker.py: every rank's timings to rank 0")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decisions", type=int, default=40)
    ap.add_argument("--steps-between", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    train, _ = teacher_classification(64 * world * 1000, seed=0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    loader = dx.AdaptiveLoader(train, [16] * world, rank, seed=0)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                          loader)
    controller = dx.DynamixController(loader, opt, dx.ControllerConfig(
        policy="ppo", decide_every_steps=10**9, max_batch=64), model=model)
    times, batches = [], iter(loader)
    for _ in range(args.decisions):
        for _ in range(args.steps_between):
            x, y = next(batches)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            controller.record_loss(loss)
        t0 = time.perf_counter()
        controller.decide()
        times.append(time.perf_counter() - t0)
        batches = iter(loader)  # new sizes: continue the epoch from the cursor
    step_s = statistics.median(r.step_s for r in loader.tracker.records)
    per_rank = library_channel().gather_object(times, TIMINGS)
    if rank == 0:
        slowest = [max(ts) for ts in zip(*per_rank)]  # a decision ends when the last rank has it
        with open(args.out, "w") as f:
            json.dump({"ranks": world, "median_s": statistics.median(slowest),
                       "p90_s": sorted(slowest)[int(0.9 * len(slowest))], "max_s": max(slowest),
                       "mean_s": statistics.fmean(slowest), "step_s": step_s,
                       "steps_between": args.steps_between,
                       "param_tensors": sum(1 for _ in model.parameters())}, f)


if __name__ == "__main__":
    main()
