"""Benchmark job: a small character-level transformer language model with dynamix_hvd, trained to a target.

Structured like ``mlp_train.py`` (the dynamix_hvd lines are marked ``# dx``). The text is Python's
own standard-library source code (read from this interpreter's installation, nothing downloaded).
Training stops when the loss on a fixed validation batch falls below ``--target-loss`` (every rank
computes it on identical weights, so all stop at the same step without talking), and the script prints
``time_to_target_s`` — the metric of ``bench/bench_transfer.py``.

Run with e.g. ``mpirun -np 2 python -m bench.jobs.charlm_train --batch-sizes 16,16``.
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import horovod.torch as hvd
import pandas as pd
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dynamix_hvd as dx
from bench.jobs.common import (PlainHorovodLoader, add_bench_flags, add_common_flags, controller_config,
                                         local_batches, make_slowdown, parser, plain_horovod_optimizer, start,
                                         step_due)
from bench.jobs.records import SuiteRecorder, sharded_sum

STDLIB_FILES = ("textwrap.py", "difflib.py", "argparse.py", "string.py", "fractions.py", "heapq.py",
                "bisect.py", "calendar.py", "shlex.py", "glob.py", "fnmatch.py", "statistics.py")


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__)
    add_common_flags(ap, epochs=20, out="runs/charlm", default_batch=16, decide_every=20, lr=2e-3, run_log=False)
    ap.add_argument("--context", type=int, default=64, help="characters per training sequence")
    ap.add_argument("--chars", type=int, default=300_000, help="characters of text to train on")
    ap.add_argument("--d-model", type=int, default=64, help="transformer width")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers")
    ap.add_argument("--target-loss", type=float, default=2.0, help="stop when the validation loss is below this")
    ap.add_argument("--eval-every", type=int, default=20, help="validation every k optimizer steps (0: never)")
    add_bench_flags(ap)
    ap.add_argument("--transitions", default="", help="rank 0 writes the policy's transitions here (HDF5)")
    return ap.parse_args()


def stdlib_text(num_chars: int) -> str:
    """Source code of a fixed list of standard-library modules, concatenated, ASCII only."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / f).read_text(encoding="utf-8", errors="ignore") for f in STDLIB_FILES if (root / f).exists()]
    text = "".join(ch for ch in "\n".join(parts) if ord(ch) < 128)
    return (text * (1 + num_chars // max(len(text), 1)))[:num_chars]


def char_dataset(num_chars: int, context: int, seed: int) -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``context + 1`` characters as (input, next-character) pairs, with
    the last 5% held out; returns (train set, validation inputs, validation targets)."""
    data = torch.tensor(list(stdlib_text(num_chars).encode("ascii")), dtype=torch.long)
    n = (len(data) - 1) // context
    x = data[: n * context].view(n, context)
    y = data[1: n * context + 1].view(n, context)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = min(128, max(1, n // 20))
    val, train = perm[:n_val], perm[n_val:]
    return TensorDataset(x[train], y[train]), x[val], y[val]


class CharTransformer(nn.Module):
    """Decoder-only transformer over 128 ASCII characters (pre-norm, causal mask, learned positions)."""

    def __init__(self, context: int, d_model: int, layers: int, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=2 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        h = self.embed(x) + self.pos[:T]
        return self.head(self.blocks(h, mask=self.mask[:T, :T], is_causal=True))


def main() -> None:
    args = parse_args()
    sizes = start(args, default_batch=16)

    train, x_val, y_val = char_dataset(args.chars, args.context, args.seed)
    model = CharTransformer(args.context, args.d_model, args.layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    slow = make_slowdown(args, hvd.rank())
    rec = SuiteRecorder(args.out, args.eval_samples, args.target, "loss", {"example": "charlm_train", **vars(args)})
    if args.plain_horovod:  # the reference: what a Horovod user runs, equal batches, clipping included
        loader = PlainHorovodLoader(train, sizes[0], hvd.rank(), hvd.size(), args.seed)
        optimizer = plain_horovod_optimizer(optimizer, model, args, sizes[0] * hvd.size(), sum(sizes))
        controller = None
    else:
        loader = dx.AdaptiveLoader(train, sizes, hvd.rank(), seed=args.seed)                 # dx
        optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), loader,  # dx
                                                    lr_rule=args.lr_rule, max_grad_norm=1.0)   # dx
        controller = None if args.no_controller else dx.DynamixController(loader, optimizer, controller_config(args), model=model)  # dx
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def validation_loss() -> float:
        return sharded_sum(model, x_val, y_val, lambda out, y: loss_fn(out.reshape(-1, 128), y.reshape(-1)).item() * len(y))

    rec.start()
    slow.use_clock(rec.train_s)
    t0 = time.perf_counter()
    steps, reached, val_loss = 0, False, math.inf
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)                                                          # dx
        model.train()
        optimizer.zero_grad()
        for x, y in loader:
            rec.compute_start()
            slow.before_compute(len(y))
            loss = loss_fn(model(x).reshape(-1, 128), y.reshape(-1))
            loss.backward()
            slow.after_compute(len(y))
            rec.compute_end()
            if args.plain_horovod:  # Horovod's documented way to clip: synchronize, clip, step
                optimizer.synchronize()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with optimizer.skip_synchronize():
                    optimizer.step()
                optimizer.zero_grad()
            elif step_due(optimizer):  # dx: every micro-batch of the step is in (accumulation)
                optimizer.step()
                optimizer.zero_grad()
            if controller is not None:
                controller.record_loss(loss)                                             # dx
            steps += 1
            if rec.step_end(epoch, local_batches(loader, len(y))):
                rec.evaluate(validation_loss, epoch)
            if args.eval_every and steps % args.eval_every == 0:  # identical weights on every rank: all stop together
                model.eval()
                with torch.no_grad():
                    val_loss = loss_fn(model(x_val).reshape(-1, 128), y_val.reshape(-1)).item()
                model.train()
                if val_loss < args.target_loss:
                    reached = True
                    break
        if hvd.rank() == 0:
            print(f"epoch {epoch}: step {steps} val loss {val_loss:.4f} sizes {list(loader.batch_sizes)} "
                  f"elapsed {time.perf_counter() - t0:.1f}s", flush=True)
        if reached:
            break
    elapsed = time.perf_counter() - t0
    rec.finish(validation_loss, extra={"stalls": slow.stalls})                                    # collective
    if args.plain_horovod:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loader.tracker.to_dataframe().to_csv(out / f"steps_rank{hvd.rank()}.csv", index=False)
    if hvd.rank() == 0:
        pd.DataFrame([{k: v for k, v in d.items() if k not in ("reports", "info", "layer_variance")}
                      for d in (controller.history if controller is not None else [])]).to_csv(out / "decisions.csv", index=False)
        records = loader.tracker.to_dataframe()
        summary = {"time_to_target_s": elapsed if reached else math.inf, "reached": reached, "steps": steps,
                   "samples": int(records.global_batch.sum()), "median_step_s": float(records.step_s.median()),
                   "val_loss": val_loss, "final_sizes": list(loader.batch_sizes), "policy": args.policy,
                   "policy_file": args.policy_file, "decisions": len(controller.history) if controller is not None else 0}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if args.transitions and controller is not None and len(controller.history) > 1:
            from bench.lab.pretrain import transitions_from_history, write_transitions_h5

            obs, acts, rews = transitions_from_history(controller.history, args.epochs)
            write_transitions_h5(args.transitions, obs, acts, rews, attrs={"source": "charlm_train"})
        print(f"time_to_target_s {summary['time_to_target_s']:.2f} reached {reached} steps {steps} "
              f"val loss {val_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
