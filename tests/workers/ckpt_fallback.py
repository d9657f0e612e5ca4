"""Worker: write two checkpoints, corrupt the newest, and check that restore falls back to the older."""
from __future__ import annotations

import argparse
import sys

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.resilience.checkpoint import CheckpointError, Checkpointer


def build(ckpt: str):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = dx.AdaptiveLoader(torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))),
                               [4] * hvd.size(), hvd.rank())
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                          loader)
    return model, loader, opt, Checkpointer(ckpt, model, opt, loader)


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
            good = [p.detach().clone() for p in model.parameters()]
    newest = sorted(ckpt.directory.glob("step-*"))[-1]
    if hvd.rank() == 0:  # one rank damages the shared file; the others wait for it
        data = bytearray((newest / "state.pt").read_bytes())
        data[len(data) // 3] ^= 0xFF
        (newest / "state.pt").write_bytes(bytes(data))
    hvd.allreduce(torch.zeros(1), name="barrier.corrupt")
    model2, loader2, opt2, ckpt2 = build(args.ckpt)
    path = ckpt2.restore()
    assert path is not None and path.name.endswith("0000002"), path
    assert all(torch.equal(a, b) for a, b in zip(good, model2.parameters()))
    assert loader2.step == 2
    hvd.allreduce(torch.zeros(1), name="barrier.restored")
    if hvd.rank() == 0:
        for p in ckpt.directory.glob("step-*"):
            (p / "state.pt").write_bytes(b"garbage")
    hvd.allreduce(torch.zeros(1), name="barrier.garbage")
    try:
        ckpt2.restore()
    except CheckpointError as exc:
        print(f"FALLBACK-OK; all corrupt -> {exc}", flush=True)
        return
    sys.exit("restore() accepted corrupt checkpoints")


if __name__ == "__main__":
    main()
