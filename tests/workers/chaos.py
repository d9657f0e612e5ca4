"""Worker for the chaos soak (bench/chaos.py): float64 training that faults can be injected into.

Under mpirun (default) it resumes from --ckpt, saves every --save-every steps (a failed save, e.g. on a
full disk, is logged and training goes on) and takes SIGTERM through the Checkpointer. With --elastic it
runs under horovodrun's elastic mode with an ElasticState committed every step.

Files under --out (the orchestrator reads them):
  pids/<pid>.json          every process: {"pid", "rank", "host"} when it (re)enters training
  progress.json            rank 0 after every step: {"epoch", "end", "t"} (end: permutation position)
  restore-a<A>.json        rank 0 (mpirun): which checkpoint attempt A resumed from, and where
  served-a<A>-r<R>.jsonl   mpirun: one line per step of rank R: epoch, start, end, status, indices
  injected-a<A>.jsonl      mpirun: OOM / NaN injected by rank 1: kind, epoch, start (the step's key)
  save-failed-a<A>.txt     mpirun, rank 0: one line per failed save
  final.json               rank 0 at the end: parameters, epochs trained (elastic: every committed step)
Faults asked for by the orchestrator: the file trigger-oom or trigger-nan makes rank 1 inject one at
its next step; --replay FILE (a JSON list of injections) injects them at the same steps instead. The
job ends after --epochs epochs, or at the first epoch end after the file ``stop`` appears.
Several runs in one job (mpirun only): their arguments separated by --then, each with its own --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.data.synthetic import WithIndex, teacher_classification
from dynamix_hvd.resilience.checkpoint import CheckpointError, Checkpointer

try:
    from workers.dataplane import runs
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import runs  # type: ignore[no-redef]

SAMPLES, GLOBAL_BATCH = 480, 24


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def build(world: int, rank: int, timeout: float, decide_every: int):
    train, _ = teacher_classification(SAMPLES, seed=0)
    data = WithIndex(torch.utils.data.TensorDataset(train.tensors[0].double(), train.tensors[1]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10))
    loader = dx.AdaptiveLoader(data, dx.checkpoint.redistribute(GLOBAL_BATCH, world), rank, seed=3)
    opt = dx.WeightedDistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model.named_parameters(),
                                          loader)
    # Decisions every `decide_every` steps: a cadence fixed in steps, so that a reference run replaying
    # the same faults decides at the same steps (and with the same AdaScale gains) as the soak's jobs.
    cfg = dx.ControllerConfig(policy="static", timeout_s=timeout, decide_every_steps=decide_every)
    controller = dx.DynamixController(loader, opt, cfg)
    return model, loader, opt, controller


class Injector:
    """OOM and NaN on rank 1, each at most once per step key (epoch, start of the step)."""

    def __init__(self, out: Path, attempt: int, replay: list[dict]) -> None:
        self.out, self.attempt = out, attempt
        self.planned = {(r["epoch"], r["start"]): r["kind"] for r in replay}
        self.used: set[tuple[int, int]] = set()

    def take(self, key: tuple[int, int]) -> str | None:
        if key in self.used:
            return None
        kind = self.planned.get(key)
        for name in ("oom", "nan"):
            trigger = self.out / f"trigger-{name}"
            if kind is None and trigger.exists():
                try:
                    trigger.unlink()
                except FileNotFoundError:
                    continue
                kind = name
        if kind is not None:
            self.used.add(key)
            with open(self.out / f"injected-a{self.attempt}.jsonl", "a") as f:
                f.write(json.dumps({"kind": kind, "epoch": key[0], "start": key[1]}) + "\n")
        return kind


def train_step(model, opt, x, y, kind: str | None) -> None:
    opt.zero_grad()
    with opt.guard():
        if kind == "oom":
            raise torch.OutOfMemoryError("injected by the chaos soak")
        loss = nn.functional.cross_entropy(model(x), y)
        if kind == "nan":
            loss = loss * float("nan")
        loss.backward()
    opt.step()


def run_mpirun(args, out: Path) -> None:
    rank, world = hvd.rank(), hvd.size()
    model, loader, opt, controller = build(world, rank, args.timeout, args.decide_every)
    ckpt = Checkpointer(args.ckpt, model, opt, loader, controller, keep=2).install_signal_handlers()
    restored = ckpt.restore()
    if rank == 0:
        where = loader.state_dict()
        write_json(out / f"restore-a{args.attempt}.json", {
            "checkpoint": restored.name if restored else None, "epoch": where["epoch"], "cursor": where["cursor"]})
    write_json(out / "pids" / f"{os.getpid()}.json", {"pid": os.getpid(), "rank": rank, "host": "mpirun"})
    replay = json.loads(Path(args.replay).read_text()) if args.replay else []
    injector = Injector(out, args.attempt, replay) if rank == 1 else None
    served = open(out / f"served-a{args.attempt}-r{rank}.jsonl", "a")
    steps = 0
    epoch = loader.epoch
    while epoch < args.epochs:
        loader.set_epoch(epoch)
        for idx, x, y in loader:
            key = (epoch, loader.current_step.start)
            train_step(model, opt, x, y, injector.take(key) if injector else None)
            served.write(json.dumps({"epoch": epoch, "start": key[1], "end": loader.current_step.end,
                                     "status": opt.last_status, "indices": idx.tolist()}) + "\n")
            served.flush()
            steps += 1
            if rank == 0:
                write_json(out / "progress.json", {"epoch": epoch, "end": loader.current_step.end, "t": time.time()})
            if args.save_every and steps % args.save_every == 0:
                try:
                    ckpt.save()
                except CheckpointError as exc:
                    if rank == 0:
                        with open(out / f"save-failed-a{args.attempt}.txt", "a") as f:
                            f.write(f"{time.time()} {exc}\n")
            time.sleep(args.step_sleep)
        epoch += 1
        if hvd.broadcast_object((out / "stop").exists(), root_rank=0, name=f"chaos.stop.{epoch}"):
            break
    if rank == 0:
        write_json(out / "final.json", {"epochs": epoch,
                                        "params": [p.detach().flatten().tolist() for p in model.parameters()]})
    ckpt.close()
    controller.close()


def run_elastic(args, out: Path) -> None:
    from dynamix_hvd.resilience.elastic import ElasticState

    model, loader, opt, controller = build(hvd.size(), hvd.rank(), args.timeout, args.decide_every)
    state = ElasticState(model, opt, loader, controller, served=[], epochs_done=0)
    host = os.environ.get("HOROVOD_HOSTNAME", "?")

    @hvd.elastic.run
    def train(state: ElasticState) -> None:
        write_json(out / "pids" / f"{os.getpid()}.json", {"pid": os.getpid(), "rank": hvd.rank(), "host": host})
        epoch = loader.epoch
        while epoch < args.epochs:
            loader.set_epoch(epoch)
            for idx, x, y in loader:
                train_step(model, opt, x, y, None)
                everyone = hvd.allgather_object(idx.tolist(), name="chaos.served")
                state.served.append({"epoch": epoch, "world": hvd.size(), "status": opt.last_status,
                                     "indices": [i for part in everyone for i in part]})
                state.commit()
                if hvd.rank() == 0:
                    write_json(out / "progress.json", {"epoch": epoch, "end": loader.current_step.end,
                                                       "t": time.time()})
                time.sleep(args.step_sleep)
            epoch += 1
            state.epochs_done = epoch
            if hvd.broadcast_object((out / "stop").exists(), root_rank=0, name="chaos.stop"):
                break

    train(state)
    if hvd.rank() == 0:
        write_json(out / "final.json", {"epochs": state.epochs_done, "served": state.served,
                                        "params": [p.detach().flatten().tolist() for p in model.parameters()]})


def main() -> None:
    argvs = runs(sys.argv[1:])  # one start of the ranks for several runs (--then between them)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    hvd.init()
    dx.configure_logging()
    for argv in argvs:
        run(argv)


def run(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--elastic", action="store_true")
    ap.add_argument("--attempt", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=10**6)
    ap.add_argument("--timeout", type=float, default=8.0, help="ControllerConfig.timeout_s")
    ap.add_argument("--decide-every", type=int, default=8, help="ControllerConfig.decide_every_steps")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--replay", default="")
    args = ap.parse_args(argv)
    out = Path(args.out)
    (out / "pids").mkdir(parents=True, exist_ok=True)
    run_elastic(args, out) if args.elastic else run_mpirun(args, out)


if __name__ == "__main__":
    main()
