"""Worker: restores are all or nothing, saves clean up, the directory is checked at construction.

Parts (each prints one OK line per rank): fit (a checkpoint whose checksum verifies but whose model does
not fit is skipped for the previous good one), nothing (a checkpoint that fails while being applied,
or is taken on another dataset, changes nothing), full (a save onto a full disk --full removes its
temporary files and names the path), readonly (a read-only --readonly directory is refused at
construction).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.resilience.checkpoint import CheckpointError, Checkpointer


def build(ckpt: str, samples: int = 40, ballast: int = 0, controller: bool = True):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    if ballast:
        model.register_buffer("ballast", torch.zeros(ballast))
    loader = dx.AdaptiveLoader(torch.utils.data.TensorDataset(torch.randn(samples, 4), torch.randint(0, 2, (samples,))),
                               [4] * hvd.size(), hvd.rank())
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          model.named_parameters(), loader)
    ctl = dx.DynamixController(loader, opt, dx.ControllerConfig(policy="static")) if controller else None
    return model, loader, opt, Checkpointer(ckpt, model, opt, loader, ctl)


def train(model, loader, opt, steps: int) -> None:
    it = iter(loader)
    for _ in range(steps):
        x, y = next(it)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def barrier(name: str) -> None:
    hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")


def plant(directory: Path, name: str, state: dict) -> None:
    barrier(f"before.{name}")
    if hvd.rank() == 0:
        buf = io.BytesIO()
        torch.save(state, buf)
        path = directory / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.pt").write_bytes(buf.getvalue())
        (path / "state.sha256").write_text(hashlib.sha256(buf.getvalue()).hexdigest())
    barrier(f"plant.{name}")


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def fail(message: str) -> None:
    sys.exit(f"rank {hvd.rank()}: {message}")


def part_fit(args) -> None:
    directory = Path(args.ckpt)
    model, loader, opt, ckpt = build(args.ckpt)
    train(model, loader, opt, 2)
    good, good_params = ckpt.save(), params(model)
    wrong = ckpt.state()
    wrong["model"] = {k: torch.zeros(3, *v.shape) for k, v in wrong["model"].items()}  # checksum fine, shapes not
    plant(directory, "step-00000-0000009", wrong)
    model2, loader2, opt2, ckpt2 = build(args.ckpt)
    path = ckpt2.restore()
    if path != good or not same(params(model2), good_params) or loader2.step != 2:
        fail(f"restore() returned {path}, step {loader2.step}")
    print(f"rank {hvd.rank()}: FIT-FALLBACK-OK {path.name}", flush=True)


def part_nothing(args) -> None:
    directory = Path(args.ckpt)
    model, loader, opt, ckpt = build(args.ckpt)
    train(model, loader, opt, 2)
    broken = ckpt.state()
    broken["model"] = {k: torch.full_like(v, 7.0) for k, v in broken["model"].items()}
    broken["controller"]["root"] = {"policy": None}  # passes the checks, fails while being applied
    plant(directory, "step-00000-0000002", broken)
    model2, loader2, opt2, ckpt2 = build(args.ckpt)
    train(model2, loader2, opt2, 1)
    before, opt_before = params(model2), str(opt2.state_dict())
    try:
        ckpt2.restore()
    except CheckpointError as exc:
        text = str(exc)
        if "could not be applied" not in text or "step-00000-0000002" not in text:
            fail(f"unclear error: {text}")
    else:
        fail("restore() accepted a checkpoint that cannot be applied")
    if not same(params(model2), before) or str(opt2.state_dict()) != opt_before or loader2.step != 1:
        fail("a failed restore changed the model, the optimizer or the loader")
    print(f"rank {hvd.rank()}: APPLY-ROLLED-BACK-OK", flush=True)

    other = build(args.ckpt, samples=48)  # another dataset: refused before anything is applied
    train(*other[:3], 1)
    before = params(other[0])
    try:
        other[3].restore()
    except CheckpointError as exc:
        if "48" not in str(exc) or "40" not in str(exc):
            fail(f"the dataset-size error names neither size: {exc}")
    else:
        fail("restore() accepted a checkpoint of another dataset")
    if not same(params(other[0]), before):
        fail("a checkpoint of another dataset overwrote the model")
    print(f"rank {hvd.rank()}: DATASET-REFUSED-OK", flush=True)


def part_full(args) -> None:
    directory = Path(args.full)
    model, loader, opt, ckpt = build(args.full, ballast=400_000, controller=False)  # 1.6 MB of state on a 1 MB disk
    train(model, loader, opt, 1)
    try:
        ckpt.save()
    except CheckpointError as exc:
        if str(directory / "step-00000-0000001") not in str(exc) or "No space left" not in str(exc):
            fail(f"unclear error: {exc}")
    else:
        fail("save() succeeded on a full disk")
    left = sorted(p.name for p in directory.iterdir())
    if left:
        fail(f"a failed save left {left}")
    print(f"rank {hvd.rank()}: FULL-DISK-CLEAN-OK", flush=True)


def part_readonly(args) -> None:
    try:
        build(args.readonly, controller=False)
    except CheckpointError as exc:
        if args.readonly not in str(exc) or "Read-only" not in str(exc):
            fail(f"unclear error: {exc}")
    else:
        fail("a read-only checkpoint directory was accepted")
    print(f"rank {hvd.rank()}: READONLY-REFUSED-OK", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", nargs="+", choices=("fit", "nothing", "full", "readonly"))
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--full", default="")
    ap.add_argument("--readonly", default="")
    args = ap.parse_args()
    hvd.init()
    dx.configure_logging()
    for part in args.parts:
        sub = argparse.Namespace(**vars(args))
        if part in ("fit", "nothing"):
            sub.ckpt = str(Path(args.ckpt) / part)
        globals()[f"part_{part}"](sub)
        barrier(f"done.{part}")


if __name__ == "__main__":
    main()
