"""Worker: inject a NaN loss and an out-of-memory error; dump what every rank saw.

--nan-step K    rank 1 returns a NaN loss at global step K (the step must be skipped everywhere)
--oom-above N   rank 1 raises torch.OutOfMemoryError whenever its local batch exceeds N
--oom-in backward  ... raised inside backward, from the first layer's gradient hook, after the last
                layer's gradients went to Horovod (default: in the forward pass)
--passes K      micro-batches per optimizer step (the OOM then hits a micro-batch)
Several runs in one job: their arguments separated by --then (each with its own --out).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.data.synthetic import WithIndex, teacher_classification

try:
    from workers.dataplane import runs
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import runs  # type: ignore[no-redef]



def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    argvs = runs(sys.argv[1:])  # one start of the ranks for several runs (--then between them)
    for argv in argvs:
        run(argv)


def run(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nan-step", type=int, default=-1)
    ap.add_argument("--oom-above", type=int, default=10**9)
    ap.add_argument("--oom-in", choices=("forward", "backward"), default="forward")
    ap.add_argument("--passes", type=int, default=1)
    args = ap.parse_args(argv)
    rank = hvd.rank()
    train, _ = teacher_classification(600, seed=0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    loader = dx.AdaptiveLoader(WithIndex(train), [8, 24], rank, seed=1)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                          loader, backward_passes_per_step=args.passes)
    too_big = {"now": False}

    def oom_in_backward(grad):
        if too_big["now"]:
            raise torch.OutOfMemoryError("injected in backward: the first layer's gradient does not fit")
        return grad

    if args.oom_in == "backward":
        model[0].weight.register_hook(oom_in_backward)
    controller = dx.DynamixController(loader, opt, dx.ControllerConfig(policy="static", max_batch=64))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    served, statuses, global_step = [], [], 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for idx, x, y in loader:
            if not opt._micro:
                opt.zero_grad()
            loss = None
            too_big["now"] = rank == 1 and len(idx) > args.oom_above
            with opt.guard():
                if too_big["now"] and args.oom_in == "forward":
                    raise torch.OutOfMemoryError(f"injected: {len(idx)} samples do not fit")
                loss = nn.functional.cross_entropy(model(x), y)
                if rank == 1 and global_step == args.nan_step:
                    loss = loss * float("nan")
                loss.backward()
            if not opt.should_step():
                served.append({"epoch": epoch, "indices": idx.tolist(), "status": "pending"})
                continue
            opt.step()
            if loss is not None:
                controller.record_loss(loss)
            statuses.append(opt.last_status)
            for s in served[::-1]:  # the step's earlier micro-batches share its verdict
                if s["status"] != "pending":
                    break
                s["status"] = opt.last_status
            served.append({"epoch": epoch, "indices": idx.tolist(), "status": opt.last_status})
            global_step += 1
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({
        "served": served, "statuses": statuses, "skipped": opt.skipped_steps,
        "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "bound_rank1": controller.bounds.upper(1), "final_sizes": list(loader.batch_sizes),
        "noise_scale": controller.stats.noise_scale if rank == 0 else None,
        "decision_losses": [d["loss"] for d in controller.history] if rank == 0 else []}))
    controller.close()


if __name__ == "__main__":
    main()
