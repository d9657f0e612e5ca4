"""Worker: the controller accumulates micro-batches past the memory bounds, on real Horovod ranks.

A schedule (linear-ramp) asks for global batches beyond the ranks' memory bounds (max_batch); with
``max_passes`` the decision makes each optimizer step several micro-batches. The training loop is
the Horovod accumulation pattern (step when ``optimizer.should_step()``). Each rank writes
rank<R>.json with every optimizer step's micro-batches (sample indices, counts), what its StepRecord
says, the effective LR, and the final parameters; tests/test_accumulate_mpi.py replays the steps in
one process.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
try:
    from workers.dataplane import IndexedData, make_model
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import IndexedData, make_model

SAMPLES = 240
EPOCHS = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sleep-per-sample", type=float, default=0.002,
                    help="every rank sleeps this long per sample in forward/backward (sleep: ranks share cores)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    data = IndexedData(SAMPLES)
    model = make_model()
    loader = dx.AdaptiveLoader(data, [4] * world, rank, seed=5)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          model.named_parameters(), loader, lr_rule="adascale")
    cfg = dx.ControllerConfig(policy="linear-ramp", policy_config=dx.LinearRampConfig(end=12 * world, ramp=3),
                              max_batch=4, max_passes=4, decide_every_steps=5, total_epochs=EPOCHS,
                              timeout_s=60.0)
    controller = dx.DynamixController(loader, opt, cfg)
    decided_mid_step = []

    def after_controller(ldr: dx.AdaptiveLoader, epoch_end: bool) -> None:  # runs after the controller's
        if len(controller.history) > len(decided_mid_step):
            decided_mid_step.append(opt.accumulating)
    loader.step_end_callbacks.append(after_controller)
    groups, micro = [], []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        opt.zero_grad()
        for idx, x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(args.sleep_per_sample * len(y))
            micro.append({"indices": idx.tolist(), "counts": list(loader.current_step.counts),
                          "passes": opt.backward_passes_per_step})
            if opt.should_step():
                opt.step()
                opt.zero_grad()
                rec = loader.tracker.records[-1]
                groups.append({"micro": micro, "epoch": epoch, "local_batch": rec.local_batch,
                               "global_batch": rec.global_batch, "micro_batches": rec.micro_batches,
                               "compute_s": rec.compute_s, "data_wait_s": rec.data_wait_s, "lr": rec.lr})
                micro = []
            controller.record_loss(loss)
    history = [{k: d.get(k) for k in ("decision", "sizes", "passes", "lr_gain")} for d in controller.history]
    # restore: the optimizer's state and the controller's both carry the micro-batches per step
    saved_opt, saved_ctl, passes = opt.state_dict(), controller.state_dict(), opt.backward_passes_per_step
    opt.set_backward_passes_per_step(1)
    opt.load_state_dict(saved_opt)
    from_optimizer = opt.backward_passes_per_step
    opt.set_backward_passes_per_step(1)
    controller.load_state_dict(saved_ctl)  # what an elastic sync does on a joining rank
    restored = {"passes": passes, "optimizer": from_optimizer, "controller": opt.backward_passes_per_step}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({
        "groups": groups, "history": history, "decided_mid_step": decided_mid_step, "restored": restored,
        "params": {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()},
        "sleep_per_sample": args.sleep_per_sample}))
    controller.close()


if __name__ == "__main__":
    main()
