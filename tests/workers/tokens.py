"""Worker: a float64 per-token model on variable-length sequences with unequal, changing per-rank
sizes; the loss is the mean over each rank's valid tokens (padding masked). Each rank writes
rank<R>.json with, per mode, the sample indices of every step and its final parameters; the test
replays the same optimizer steps in one process as the mean over all ranks' valid tokens."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn
from torch.utils.data import Dataset

import dynamix_hvd as dx

VOCAB = 11
MODES = {
    # name: (optimizer factory, loader kwargs, optimizer kwargs, first sizes, sizes after the change)
    "lengths-sgd": (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9), {"lengths": True},
                    {"loss_unit": "tokens"}, [2, 5, 3], [4, 1, 6]),
    "budget-adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
                     {"lengths": True, "budget": "tokens", "sort_window": 16}, {}, [40, 90, 25], [70, 20, 55]),
    "given-accum-sgd": (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9), {},
                        {"loss_unit": "tokens", "backward_passes_per_step": 2}, [3, 1, 4], [1, 5, 2]),
    "budget-accum-adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.02), {"lengths": True, "budget": "tokens"},
                           {"backward_passes_per_step": 2}, [30, 60, 20], [50, 15, 35]),
    # the controller picks the token budgets (rank 1 is slow); lr_rule="none" keeps the replay exact
    "budget-controller": (lambda ps: torch.optim.SGD(ps, lr=0.2), {"lengths": True, "budget": "tokens"},
                          {"lr_rule": "none"}, [40, 40, 40], None),
}
SLOW_S_PER_TOKEN = 2e-4  # rank 1 in "budget-controller"


class Sequences(Dataset):
    """Token sequences of 1-20 tokens from a seed; targets depend on the token and its position."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, 21, (n,), generator=g).tolist()
        self.seqs = [torch.randint(0, VOCAB, (m,), generator=g) for m in self.lengths]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        x = self.seqs[i]
        return i, x, (3 * x + torch.arange(len(x))) % VOCAB


def collate(items):
    """Pad to the longest sequence with a junk token; the mask says which tokens count."""
    idx = torch.tensor([i for i, _, _ in items])
    width = max(len(x) for _, x, _ in items)
    x = torch.full((len(items), width), 7)
    y = torch.full((len(items), width), 5)
    mask = torch.zeros(len(items), width, dtype=torch.float64)
    for k, (_, xs, ys) in enumerate(items):
        x[k, :len(xs)], y[k, :len(ys)], mask[k, :len(xs)] = xs, ys, 1.0
    return idx, x, y, mask


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 6), nn.Tanh(), nn.Linear(6, VOCAB)).double()


def token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the valid tokens' cross-entropies (the caller divides)."""
    logits = model(x)
    per_token = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=90)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--change-at", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    data = Sequences(args.samples)
    result = {"world": world, "modes": {}}
    for name in args.modes.split(","):
        make_opt, loader_kw, opt_kw, first, later = MODES[name]
        loader_kw = dict(loader_kw)
        if loader_kw.pop("lengths", False):
            loader_kw["lengths"] = data.lengths
        model = make_model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loader = dx.AdaptiveLoader(data, first[:world], rank, seed=3, collate_fn=collate, **loader_kw)
        opt = dx.WeightedDistributedOptimizer(make_opt(model.parameters()), model.named_parameters(),
                                              loader, **opt_kw)
        given = "lengths" not in loader_kw
        controller = None
        if later is None:
            controller = dx.DynamixController(loader, opt, dx.ControllerConfig(
                policy="model", decide_every_steps=2, min_batch=5, max_batch=400))
        steps, group = [], []
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            if controller is None:
                loader.set_batch_sizes(first[:world])
            for step, (idx, x, y, mask) in enumerate(loader):
                if controller is not None and rank == 1:
                    time.sleep(SLOW_S_PER_TOKEN * float(mask.sum()))
                loss = token_loss(model, x, y, mask) / mask.sum()
                if given:
                    opt.set_local_tokens(int(mask.sum()))
                loss.backward()
                planned = loader.current_step
                group.append({"indices": idx.tolist(), "counts": list(planned.counts),
                              "tokens": None if planned.tokens is None else list(planned.tokens),
                              "sizes": list(loader.batch_sizes)})
                if opt.should_step():
                    opt.step()
                    opt.zero_grad()
                    steps.append({"epoch": epoch, "micro": group})
                    group = []
                if step == args.change_at and controller is None:
                    loader.set_batch_sizes(later[:world])
        if controller is not None:
            controller.close()
        result["modes"][name] = {
            "steps": steps,
            "params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
            "records": loader.tracker.to_dicts(),
        }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
