"""A small transformer language model on variable-length text, trained the way a Horovod user would:
plain (padded fixed-size batches), or with dynamix_hvd planning by samples or by token budgets.

    mpirun -np 2 python -m bench.token_lm --arm plain  --out /tmp/plain.json
    mpirun -np 2 python -m bench.token_lm --arm samples --out /tmp/samples.json
    mpirun -np 2 python -m bench.token_lm --arm tokens --out /tmp/tokens.json

The corpus ships with Python: paragraphs (blocks between blank lines) of standard-library modules,
ASCII bytes, 16-320 characters each; the model predicts each next byte. Every arm pads a rank's batch
to its longest sequence and masks the padding out of the loss, a mean over the rank's valid tokens.
The plain arm is the usual script: DistributedSampler, a fixed local batch, hvd.DistributedOptimizer
averaging the ranks' means (each rank's mean weighs equally, whatever its token count). The dynamix_hvd
arms (lines marked ``# dx``) make each update the exact mean over all valid tokens; "tokens" also plans
each rank's step by a token budget with length bucketing, so padding stays small and a slow rank gets
fewer tokens. Validation loss (per token, all held-out paragraphs) is measured every `--eval-every`
training samples, on the same sample counts in every arm; its time is not training time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from bench.jobs.common import Slowdown

VOCAB = 128


def paragraphs(max_chars: int = 320, min_chars: int = 16, files: int = 40) -> list[bytes]:
    """Paragraphs of the first `files` standard-library modules (sorted by name), ASCII only."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.glob("*.py"))[:files]:
        for block in f.read_text(encoding="utf-8", errors="ignore").split("\n\n"):
            text = "".join(ch for ch in block.strip("\n") if ord(ch) < 128)
            if len(text) >= min_chars:
                out.append(text[:max_chars].encode("ascii"))
    return out


class Paragraphs(torch.utils.data.Dataset):
    """(input bytes, next bytes) of each paragraph; `lengths` are the tokens the loss counts."""

    def __init__(self, texts: list[bytes]) -> None:
        self.seqs = [torch.tensor(list(t), dtype=torch.long) for t in texts]
        self.lengths = [len(s) - 1 for s in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seqs[i]


def split(seed: int = 0, val_fraction: float = 0.05) -> tuple[Paragraphs, Paragraphs]:
    texts = paragraphs()
    perm = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(len(texts) * val_fraction)
    return Paragraphs([texts[i] for i in perm[n_val:]]), Paragraphs([texts[i] for i in perm[:n_val]])


def pad(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets and the mask of valid targets, padded to the batch's longest sequence."""
    width = max(len(s) for s in batch) - 1
    x = torch.zeros(len(batch), width, dtype=torch.long)
    y = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width)
    for k, s in enumerate(batch):
        x[k, :len(s) - 1], y[k, :len(s) - 1], mask[k, :len(s) - 1] = s[:-1], s[1:], 1.0
    return x, y, mask


class TinyLM(nn.Module):
    """Byte-level causal transformer (pre-norm, learned positions)."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, context: int = 320) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(context, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.embed(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.blocks(h, mask=causal, is_causal=True))


def token_loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_token = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum()


def evaluate(model: nn.Module, val: Paragraphs, rank: int, world: int) -> float:
    """Validation loss per token over every held-out paragraph (sharded over ranks, one allreduce)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    order = sorted(range(rank, len(val), world), key=lambda i: val.lengths[i])
    with torch.no_grad():
        for k in range(0, len(order), 32):
            x, y, mask = pad([val[i] for i in order[k:k + 32]])
            total += torch.tensor([float(token_loss_sum(model, x, y, mask)), float(mask.sum())], dtype=torch.float64)
    model.train()
    total = hvd.allreduce(total, op=hvd.Sum, name="token_lm.eval")
    return float(total[0] / total[1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", choices=("plain", "samples", "tokens"), required=True)
    ap.add_argument("--out", required=True, help="rank 0 writes the run's record (JSON) here")
    ap.add_argument("--batch", type=int, default=16, help="local batch (samples) of the plain script")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=2000, help="evaluate every this many training samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-factor", type=float, default=1.0, help="the slow rank computes this many times slower")
    ap.add_argument("--no-controller", action="store_true", help="dynamix_hvd arms: keep the initial split")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    train, val = split()
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    mean_len = sum(train.lengths) / len(train)
    controller = None
    if args.arm == "plain":
        sampler = torch.utils.data.distributed.DistributedSampler(train, world, rank, shuffle=True, seed=args.seed)
        loader = torch.utils.data.DataLoader(train, batch_size=args.batch, sampler=sampler, collate_fn=pad)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
    else:
        sizes = [args.batch] * world if args.arm == "samples" else [round(args.batch * mean_len)] * world
        loader = dx.AdaptiveLoader(train, sizes, rank, seed=args.seed, collate_fn=pad,             # dx
                                   lengths=train.lengths, budget=args.arm)                         # dx
        optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader,   # dx
                                                    loss_unit="tokens")                            # dx
        if not args.no_controller:
            controller = dx.DynamixController(loader, optimizer, dx.ControllerConfig(total_epochs=math.ceil(args.epochs)), model=model)  # dx
    slow = Slowdown(rank == args.slow_rank, 0.0, args.slow_factor, [])
    evals: list[dict] = []
    seen = valid = padded = 0  # samples of all ranks; this rank's valid and padded tokens
    next_eval, train_s, epoch = args.eval_every, 0.0, 0
    budget = int(args.epochs * len(train))
    t0 = time.perf_counter()
    while seen < budget:
        (sampler if args.arm == "plain" else loader).set_epoch(epoch)
        for x, y, mask in loader:
            slow.before_compute(x.numel())
            optimizer.zero_grad()
            loss = token_loss_sum(model, x, y, mask) / mask.sum()
            loss.backward()
            slow.after_compute(x.numel())
            optimizer.step()
            valid += int(mask.sum())
            padded += x.numel()
            seen += args.batch * world if args.arm == "plain" else loader.current_step.global_count
            if seen >= next_eval or seen >= budget:
                train_s += time.perf_counter() - t0
                evals.append({"samples": seen, "train_s": train_s, "val_loss": evaluate(model, val, rank, world)})
                next_eval += args.eval_every
                t0 = time.perf_counter()
            if seen >= budget:
                break
        epoch += 1
    totals = hvd.allreduce(torch.tensor([valid, padded], dtype=torch.float64), op=hvd.Sum, name="token_lm.totals")
    if controller is not None:
        controller.close()
    if rank == 0:
        record = {"arm": args.arm, "seed": args.seed, "slow_factor": args.slow_factor, "world": world,
                  "train_s": train_s, "valid_tokens": float(totals[0]), "padded_tokens": float(totals[1]),
                  "padding": 1 - float(totals[0] / totals[1]), "useful_tokens_per_s": float(totals[0]) / train_s,
                  "evals": evals,
                  "sizes": None if args.arm == "plain" else [h.get("sizes") for h in controller.history] if controller else None,
                  # the cost model's per token x length term at each decision (0: not fitted)
                  "attention": [(h.get("info") or {}).get("attention") for h in controller.history] if controller else None}
        Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
