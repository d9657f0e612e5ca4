"""Worker: a corrupt newest checkpoint of every kind is skipped for the older good one, on every rank alike.

Writes two checkpoints (steps 2 and 4), then, for each kind in KINDS, damages the newest the way that
kind does (rank 0 writes, the others wait), restores into fresh objects and checks that every rank got
the step-2 checkpoint with its parameters: prints ``KIND-OK <kind>`` per rank. Then the ranks see
different files (each its own copy of the directory, as with node-local disks): the newest is broken
or missing on rank 1 only, and both ranks must still restore the same, older one (``AGREE-OK``).
Last, every checkpoint is broken and restore() must fail naming each file (``NONE-USABLE-OK``).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import shutil
import sys
import zipfile
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.resilience.checkpoint import CheckpointError, Checkpointer


def build(ckpt: str | Path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = dx.AdaptiveLoader(torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))),
                               [4] * hvd.size(), hvd.rank())
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                          loader)
    return model, loader, opt, Checkpointer(ckpt, model, opt, loader)


def barrier(name: str) -> None:
    hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")


def summed(path: Path, data: bytes) -> None:
    """`data` as the checkpoint's state, with a checksum that verifies."""
    (path / "state.pt").write_bytes(data)
    (path / "state.sha256").write_text(hashlib.sha256(data).hexdigest())


def zip_without_state() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("archive/notes.txt", "no state in here")
    return buf.getvalue()


def other_version(good: bytes) -> bytes:
    state = torch.load(io.BytesIO(good), weights_only=True)
    buf = io.BytesIO()
    torch.save({**state, "version": 99}, buf)
    return buf.getvalue()


def flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 3] ^= 0xFF
    return bytes(out)


def plain_object() -> bytes:
    buf = io.BytesIO()
    torch.save([1, 2, 3], buf)
    return buf.getvalue()


# kind -> (how the newest checkpoint is damaged, text the warning must contain)
KINDS = {
    "checksum": (lambda p, good: (p / "state.pt").write_bytes(flip(good)), "fails its checksum"),
    "not-zip": (lambda p, good: summed(p, b"overwritten by something else\n" * 20), "not a zip archive"),
    "no-state": (lambda p, good: summed(p, zip_without_state()), "zip archive without a state"),
    "version": (lambda p, good: summed(p, other_version(good)), "format version 99, this dynamix_hvd reads version 2"),
    "truncated": (lambda p, good: summed(p, good[: len(good) // 2]), "cut short (truncated)"),
    "truncated-unsummed": (lambda p, good: (p / "state.pt").write_bytes(good[: len(good) // 2]), "fails its checksum"),
    "no-checksum": (lambda p, good: (p / "state.sha256").unlink(), "cannot be read"),
    "no-state-file": (lambda p, good: (p / "state.pt").unlink(), "cannot be read"),
    "not-a-dict": (lambda p, good: summed(p, plain_object()), "holds a list, not a checkpoint"),
}


def fail(message: str) -> None:
    sys.exit(f"rank {hvd.rank()}: {message}")


def expect_good(directory: Path, good_params: list[torch.Tensor], what: str) -> Path:
    model, loader, _, ckpt = build(directory)
    path = ckpt.restore()
    ckpt.close()
    if path is None or not path.name.endswith("0000002"):
        fail(f"{what}: restore() returned {path}, not the step-2 checkpoint")
    if not all(torch.equal(a, b) for a, b in zip(good_params, model.parameters())) or loader.step != 2:
        fail(f"{what}: restored parameters or loader position differ from the step-2 checkpoint")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    args = ap.parse_args()
    hvd.init()
    dx.configure_logging()
    model, loader, opt, ckpt = build(args.ckpt)
    it = iter(loader)
    for target in (2, 4):
        while loader.step < target:
            x, y = next(it)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        ckpt.save()
        if target == 2:
            good_params = [p.detach().clone() for p in model.parameters()]
    older, newest = sorted(ckpt.directory.glob("step-*"))
    pristine = {f.name: f.read_bytes() for f in newest.iterdir()}

    for kind, (damage, _) in KINDS.items():
        barrier(f"before.{kind}")
        if hvd.rank() == 0:
            for name, data in pristine.items():
                (newest / name).write_bytes(data)
            damage(newest, pristine["state.pt"])
        barrier(f"damaged.{kind}")
        path = expect_good(ckpt.directory, good_params, kind)
        print(f"rank {hvd.rank()}: KIND-OK {kind} -> {path.name}", flush=True)

    # Each rank its own copy of the directory; rank 1's newest is broken, then missing.
    for case in ("broken", "missing"):
        barrier(f"before.{case}")
        if hvd.rank() == 0:
            for name, data in pristine.items():
                (newest / name).write_bytes(data)
        barrier(f"restored.{case}")
        view = ckpt.directory.parent / f"view-{case}-rank{hvd.rank()}"
        shutil.copytree(ckpt.directory, view)
        if hvd.rank() == 1:
            if case == "broken":
                (view / newest.name / "state.pt").write_bytes(flip(pristine["state.pt"]))
            else:
                shutil.rmtree(view / newest.name)
        barrier(f"views.{case}")
        path = expect_good(view, good_params, f"rank 1's newest {case}")
        print(f"rank {hvd.rank()}: AGREE-OK {case} -> {path.name}", flush=True)

    barrier("before.garbage")
    if hvd.rank() == 0:
        for p in (older, newest):
            summed(p, b"garbage")
    barrier("garbage")
    _, _, _, last = build(ckpt.directory)
    try:
        last.restore()
    except CheckpointError as exc:
        text = str(exc)
        if not all(f"{p.name}: checkpoint {p / 'state.pt'} is refused" in text for p in (older, newest)):
            fail(f"the error does not name every file tried and why: {text}")
        print(f"rank {hvd.rank()}: NONE-USABLE-OK {text}", flush=True)
        return
    fail("restore() accepted corrupt checkpoints")


if __name__ == "__main__":
    main()
