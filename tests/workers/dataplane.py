"""Worker: train a small float64 MLP with unequal, changing per-rank batch sizes; dump what happened.

Each rank writes rank<R>.json with, per optimizer config, the sample indices it read in every step
and its final parameters. The test replays the same steps in one process to check exactness.
Several runs in one job: their arguments separated by --then (each with its own --out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import dynamix_hvd as dx

CONFIGS = {
    # name: (optimizer factory, WeightedDistributedOptimizer kwargs)
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}),
    "sgd_linear_lr": (lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
                      {"lr_rule": "linear", "base_batch_size": 8}),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2), {}),
    "adamw_clip": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), {"max_grad_norm": 0.05}),
    # the loss summed over the local batch (the update is still the mean over all samples)
    "sgd_sum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"loss_reduction": "sum"}),
}


class IndexedData(Dataset):
    """Synthetic classification data generated from a seed; items carry their own index."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g, dtype=torch.float64)
        w = torch.randn(8, 4, generator=g, dtype=torch.float64)
        self.y = (self.x @ w).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def size_schedule(world: int, epochs: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(sizes at epoch start, sizes after the mid-epoch change) per epoch, random but seeded."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda: torch.randint(1, 16, (world,), generator=g).tolist()  # noqa: E731
    return [(draw(), draw()) for _ in range(epochs)]


def runs(argv: list[str]) -> list[list[str]]:
    """The worker's argument lists: several runs in one job are separated by --then (the ranks start,
    import torch and Horovod and join the job once)."""
    out = [[]]
    for arg in argv:
        if arg == "--then":
            out.append([])
        else:
            out[-1].append(arg)
    return out


def run_parser() -> argparse.ArgumentParser:
    """The arguments of one run that every data-plane worker takes."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="", help="first epoch's sizes, e.g. 3,7,12 (default random)")
    ap.add_argument("--samples", type=int, default=101)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--change-at", type=int, default=2, help="step of each epoch after which sizes change")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    return ap


def first_sizes(schedule: list[tuple[list[int], list[int]]], sizes: str) -> list[tuple[list[int], list[int]]]:
    """`schedule` with its first epoch starting at `sizes` ("3,7,12"; empty: as drawn)."""
    if sizes:
        schedule[0] = ([int(s) for s in sizes.split(",")], schedule[0][1])
    return schedule


def main(argv: list[str] | None = None) -> None:
    import horovod.torch as hvd  # here, so that the torch.distributed worker can share this module's data

    argvs = runs(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    hvd.init()
    for one in argvs:
        run(one)


def run(argv: list[str]) -> None:
    ap = run_parser()
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-s", type=float, default=0.0)
    args = ap.parse_args(argv)
    import horovod.torch as hvd

    rank, world = hvd.rank(), hvd.size()
    schedule = first_sizes(size_schedule(world, args.epochs, seed=11), args.sizes)
    data = IndexedData(args.samples)
    result = {"world": world, "launcher_rank": rank, "schedule": schedule, "configs": {}}
    for name in args.configs.split(","):
        make_opt, kwargs = CONFIGS[name]
        model = make_model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loader = dx.AdaptiveLoader(data, schedule[0][0], rank, seed=5)
        opt = dx.WeightedDistributedOptimizer(make_opt(model.parameters()), model.named_parameters(),
                                              loader, **kwargs)
        steps = []
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            loader.set_batch_sizes(schedule[epoch][0])
            for step, (idx, x, y) in enumerate(loader):
                opt.zero_grad()
                if rank == args.slow_rank:
                    time.sleep(args.slow_s)
                loss = nn.functional.cross_entropy(model(x), y, reduction=kwargs.get("loss_reduction", "mean"))
                loss.backward()
                opt.step()
                steps.append({"epoch": epoch, "step": step, "indices": idx.tolist(),
                              "counts": list(loader.current_step.counts),
                              "sizes": list(loader.batch_sizes)})
                if step == args.change_at:
                    loader.set_batch_sizes(schedule[epoch][1])
        result["configs"][name] = {
            "steps": steps,
            "params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
            "records": loader.tracker.to_dicts(),
            "kwargs": kwargs,
        }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
