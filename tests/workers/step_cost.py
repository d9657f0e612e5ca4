"""Worker: what a user runs (the default controller, a Checkpointer voting on its default cadence, a
RunLog), with every collective besides the gradients' own counted by name where it is issued.

Counts, once everything is built and until training ends: the control channels' collectives (the
controller's, which the Checkpointer shares, and the library's, which the RunLog uses; a collective
made of others counts once), Horovod's collectives called by name through ``horovod.torch``, and the
gradient allreduces Horovod's optimizer starts. Each rank writes rank<R>.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import threading
import time
from collections import Counter
from pathlib import Path

import horovod.torch as hvd
import horovod.torch.optimizer as hvd_optimizer
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.comm import Collective, ControlChannel
from dynamix_hvd.data.synthetic import teacher_classification
from dynamix_hvd.runs.runlog import RunLog

CHANNEL_CALLS = ("allgather_object", "gather_object", "broadcast_object", "any_true", "allgather_tensor",
                 "gather_arrays", "gather_array", "broadcast_array")
HOROVOD_CALLS = ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
                 "grouped_allreduce_async", "allgather", "allgather_async", "broadcast", "broadcast_",
                 "broadcast_async", "broadcast_async_", "alltoall", "broadcast_object", "allgather_object",
                 "barrier", "join")


class Counting:
    """Counts collectives by name while `on`; a collective called inside a counted one is not counted."""

    def __init__(self) -> None:
        self.on = False
        self.control: Counter = Counter()
        self.horovod: Counter = Counter()
        self.gradients = 0
        self._depth = threading.local()

    def _wrap(self, fn, counter: Counter, name_of):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if self.on and depth == 0 and threading.current_thread() is threading.main_thread():
                counter[name_of(args, kwargs)] += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
        return counted

    def install(self) -> None:
        for call in CHANNEL_CALLS:
            setattr(ControlChannel, call, self._wrap(getattr(ControlChannel, call), self.control, _op_name))
        for call in HOROVOD_CALLS:
            if hasattr(hvd, call):
                setattr(hvd, call, self._wrap(getattr(hvd, call), self.horovod,
                                              lambda a, k, call=call: f"{k.get('name')} ({call})"))
        start = hvd_optimizer.allreduce_async_

        def gradient(*args, **kwargs):
            if self.on:
                self.gradients += 1
            return start(*args, **kwargs)

        hvd_optimizer.allreduce_async_ = gradient


def _op_name(args: tuple, kwargs: dict) -> str:
    return next(x for x in (*args, *kwargs.values()) if isinstance(x, Collective)).name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.01, help="seconds each step sleeps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    counting = Counting()
    counting.install()
    train, _ = teacher_classification(args.samples, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    loader = dx.AdaptiveLoader(train, [args.batch] * world, rank, seed=0)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                          model.named_parameters(), loader)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out = Path(args.out)
    steps = 0
    with dx.DynamixController(loader, opt, dx.ControllerConfig(total_epochs=args.epochs), model=model) as controller:
        ckpt = dx.Checkpointer(out / f"ckpt{rank}", model, opt, loader, controller).install_signal_handlers()
        run = RunLog(out / "run", loader, controller=controller)
        counting.on = True
        t0 = time.perf_counter()
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                controller.record_loss(loss)
                run.step(loss)
                steps += 1
                time.sleep(args.step_sleep)
            run.end_epoch()
        train_s = time.perf_counter() - t0
        counting.on = False
        run.finish()
        ckpt.close()
        decisions = len(controller.history)
        # where each interval between decisions began and how often it voted on a change of speed
        intervals = [(int(d["total_steps"]), int(d.get("vote_every") or 0)) for d in controller.history]
    params = sum(1 for p in model.parameters() if p.requires_grad)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "steps": steps, "train_s": train_s, "decisions": decisions, "votes": ckpt.votes, "params": params,
        "intervals": intervals,
        "epochs": args.epochs, "control": dict(counting.control), "horovod": dict(counting.horovod),
        "gradient_allreduces": counting.gradients}))


if __name__ == "__main__":
    main()
