"""Worker: LR schedules driven by scale-invariant progress while the global batch changes, on real ranks.

Scenarios (each rank writes rank<R>.json; tests/test_progress_mpi.py checks them):
- fixed:    B = B0 all along, linear rule, StepLR driven by tau, until opt.progress_done(TOTAL);
- doubled:  the same, but B doubles after DOUBLE_AT steps (the warm-up ramp eases the factor in);
            midway the optimizer's state goes through a weights-only save/load (the coupling too);
- resumed:  the doubled run, but the LR coupling and the scheduler are replaced by fresh ones at
            RESUME_AT and restored from their saved state: it must continue exactly as `doubled`;
- controller: a real DynamixController (adabatch doubling B every few steps) with the optimizer's
            default rule, which must be adascale with the controller's gain;
- explicit: the same controller with lr_rule="linear": the controller's gain must not leak in;
- tuned:    the controller scenario with the LR tuned for TUNED_BATCH samples per step (above the
            loader's): the gain is over that base, so below 1 while B is smaller.
"""
from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.optim.lr_scaling import LRCoupling
from dynamix_hvd.optim.progress import ProgressScheduler
try:
    from workers.dataplane import IndexedData, make_model
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import IndexedData, make_model

SAMPLES = 96
B0 = 8
TOTAL = 30          # base iterations of the budget
STEP_SIZE = 5       # StepLR's step_size, in base iterations
DOUBLE_AT = 6
RESUME_AT = 10
WARMUP = 2
TUNED_BATCH = 4 * B0


def through_disk(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def run(scenario: str, rank: int, world: int) -> dict[str, Any]:
    data = IndexedData(SAMPLES)
    model = make_model()
    loader = dx.AdaptiveLoader(data, [B0 // world] * world, rank, seed=4)
    kwargs: dict[str, Any] = {"base_batch_size": TUNED_BATCH if scenario == "tuned" else B0}
    if scenario in ("fixed", "doubled", "resumed", "explicit"):
        kwargs["lr_rule"] = "linear"
    if scenario not in ("controller", "tuned"):
        kwargs["lr_warmup_steps"] = WARMUP
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                          loader, **kwargs)
    sched = ProgressScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZE, gamma=0.5), opt)
    controller = None
    if scenario in ("controller", "explicit", "tuned"):
        cfg = dx.ControllerConfig(policy="adabatch", policy_config=dx.AdaBatchConfig(every=1, end=32), decide_every_steps=4,
                                  max_batch=64, timeout_s=60.0)
        controller = dx.DynamixController(loader, opt, cfg)
    steps: list[dict[str, Any]] = []
    epoch = 0
    while not opt.progress_done(TOTAL):
        loader.set_epoch(epoch)
        for idx, x, y in loader:
            before = {"tau": opt.scale_invariant_steps, "batch": loader.global_micro_batch, "gain": opt.lr_gain,
                      "base_lr": opt.param_groups[0]["lr"], "done": sched.done}
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            rec = loader.tracker.records[-1]
            steps.append(before | {"effective_lr": rec.lr, "tau_after": opt.scale_invariant_steps,
                                   "epochs_after": opt.scale_invariant_epochs, "samples": rec.global_batch})
            n = len(steps)
            if scenario in ("doubled", "resumed") and n == DOUBLE_AT:
                loader.set_batch_sizes([2 * B0 // world] * world)
            if scenario == "doubled" and n == RESUME_AT:
                state = through_disk(opt.state_dict())
                opt.lr_coupling, opt.lr_gain = LRCoupling(WARMUP), 7.0  # forget, then restore
                opt.load_state_dict(state)
            if scenario == "resumed" and n == RESUME_AT:
                opt_state, sched_state = through_disk(opt.state_dict()), through_disk(sched.state_dict())
                opt.lr_coupling = LRCoupling(WARMUP)
                sched = ProgressScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZE, gamma=0.5), opt)
                opt.load_state_dict(opt_state)
                sched.load_state_dict(sched_state)
                old = through_disk(opt.state_dict())
                del old["dynamix"]["lr_coupling"]   # a checkpoint from before progress accounting
                opt.load_state_dict(old)            # still loads; the coupling keeps its state
            if opt.progress_done(TOTAL):
                break
        epoch += 1
    out: dict[str, Any] = {"steps": steps, "final_lr": sched.get_last_lr()[0], "done": sched.done,
                           "tau": opt.scale_invariant_steps, "rule": opt.lr_rule}
    if controller is not None:
        out["history"] = [{"sizes": d["sizes"], "lr_gain": d["lr_gain"]} for d in controller.history]
        controller.close()
    opt.remove_hooks()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    result = {s: run(s, rank, world) for s in ("fixed", "doubled", "resumed", "controller", "explicit", "tuned")}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
