"""Per-step overhead against plain Horovod at the same fixed sizes (issue #13, item 5).

Run: ``python -m bench.bench_overhead [--np 2] [--steps 50] [--repeats 7] [--batch 64]`` (``--quick``
for a smoke test: 4 steps, 2 repetitions; its numbers mean nothing). Starts one ``mpirun -np NP``
job in which every rank builds three set-ups of the CNN of Horovod's pytorch_mnist.py on generated
28x28 images, each with its own model:

* ``horovod``: ``DistributedSampler`` + ``DataLoader`` + ``hvd.DistributedOptimizer(op=Average)``;
* ``weighted``: ``AdaptiveLoader`` + ``WeightedDistributedOptimizer`` (equal sizes, no controller);
* ``controller``: the same plus a ``DynamixController`` on its default schedule (a decision at every
  epoch's end: reports, gathers, statistics, reward) with ``policy="static"``, so the sizes stay
  fixed and every variant runs the same steps.

An epoch of each runs first (its time minus the variant's median is the first-epoch extra: compilation,
caches), then ``--repeats`` rounds, each one epoch of every variant in rotating order, timed between
two barriers. Printed: median epoch time and ms per step of each variant, its ratio to ``horovod``,
and the first-epoch extra relative to ``horovod``'s. Time it on a quiet machine, one rank per core.

``--profile`` instead runs one process (``hvd.init()`` alone): per variant, the calls per step that
read a tensor back to the host (``.item()``, ``.tolist()``, ``float()``, ``int()``, ``bool()``), by
call site (these counts do not depend on load), and a cProfile of the weighted step.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("horovod", "weighted", "controller")


def make_net() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Conv2d(10, 20, 5), nn.Dropout2d(),
                         nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(320, 50), nn.ReLU(), nn.Dropout(),
                         nn.Linear(50, 10), nn.LogSoftmax(dim=1))


class Setup:
    """One variant: its own model, loader and optimizer; `epoch(e)` trains one epoch."""

    def __init__(self, variant: str, dataset: Any, batch: int) -> None:
        import horovod.torch as hvd
        import torch

        import dynamix_hvd as dx

        torch.manual_seed(0)
        self.model = make_net()
        opt = torch.optim.SGD(self.model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
        self.controller = None
        if variant == "horovod":
            self.sampler = torch.utils.data.distributed.DistributedSampler(dataset, hvd.size(), hvd.rank())
            self.loader: Any = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=self.sampler)
            self.opt = hvd.DistributedOptimizer(opt, named_parameters=self.model.named_parameters(), op=hvd.Average)
        else:
            self.sampler = None
            self.loader = dx.AdaptiveLoader(dataset, [batch] * hvd.size(), hvd.rank(), seed=0)
            self.opt = dx.WeightedDistributedOptimizer(opt, self.model.named_parameters(), self.loader)
            if variant == "controller":
                self.controller = dx.DynamixController(self.loader, self.opt, dx.ControllerConfig(policy="static"))

    def epoch(self, e: int) -> None:
        import torch.nn.functional as F

        (self.sampler or self.loader).set_epoch(e)
        for x, y in self.loader:
            self.opt.zero_grad()
            loss = F.nll_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            if self.controller is not None:
                self.controller.record_loss(loss)

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()


def dataset(steps: int, batch: int, world: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    n = steps * batch * world
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(10, (n,), generator=g))


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    data = dataset(args.steps, args.batch, hvd.size())
    setups = {v: Setup(v, data, args.batch) for v in VARIANTS}
    barrier = torch.zeros(1)

    def timed(v: str, e: int) -> float:
        hvd.allreduce(barrier, name="bench.barrier")
        t = time.perf_counter()
        setups[v].epoch(e)
        hvd.allreduce(barrier, name="bench.barrier")
        return time.perf_counter() - t

    first = {v: timed(v, 0) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
        for v in order:
            times[v].append(timed(v, rep + 1))
    for s in setups.values():
        s.close()
    if hvd.rank() != 0:
        return
    med = {v: statistics.median(t) for v, t in times.items()}
    extra = {v: first[v] - med[v] for v in VARIANTS}
    result = {"np": hvd.size(), "steps": args.steps, "batch": args.batch, "repeats": args.repeats,
              "first_epoch_s": first, "epoch_s": times, "median_epoch_s": med,
              "ratio": {v: med[v] / med["horovod"] for v in VARIANTS},
              "first_epoch_extra_s": {v: extra[v] - extra["horovod"] for v in VARIANTS}}
    print(f"{hvd.size()} ranks, {args.steps} steps of {args.batch} per rank and epoch, median of {args.repeats}")
    print(f"{'variant':<12}{'epoch_s':>9}{'ms/step':>9}{'ratio':>8}{'1st-epoch extra_s':>19}")
    for v in VARIANTS:
        print(f"{v:<12}{med[v]:>9.3f}{1e3 * med[v] / args.steps:>9.2f}{result['ratio'][v]:>8.3f}"
              f"{result['first_epoch_extra_s'][v]:>19.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


# --- profile (one process) --------------------------------------------------------------------------
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


def count_host_reads(fn: Callable[[], None]) -> collections.Counter:
    """Run `fn`, counting Tensor methods that copy a value to the host, by (method, caller)."""
    import torch

    counts: collections.Counter = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name: str, original: Callable) -> Callable:
        def counted(self: Any, *a: Any, **k: Any) -> Any:
            f = sys._getframe(1)
            counts[(name, f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}")] += 1
            return original(self, *a, **k)
        return counted

    for name, original in saved.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        fn()
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
    return counts


def profile(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    data = dataset(args.steps, args.batch, 1)
    for v in VARIANTS:
        s = Setup(v, data, args.batch)
        s.epoch(0)  # compile and warm up
        counts = count_host_reads(lambda: s.epoch(1))
        print(f"\n{v}: host reads per step (over {args.steps} steps, one epoch incl. its decision)")
        for (name, site), n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {n / args.steps:7.2f}  .{name:<10} {site}")
        if v != "horovod":
            prof = cProfile.Profile()
            prof.runcall(s.epoch, 2)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            print(f"\n{v}: cProfile of one epoch ({args.steps} steps), by own time\n{out.getvalue()}")
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2, help="ranks of the mpirun job (default 2)")
    ap.add_argument("--steps", type=int, default=50, help="steps per epoch (default 50)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds, one epoch of each variant (default 7)")
    ap.add_argument("--batch", type=int, default=64, help="local batch size of every rank (default 64)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 4 steps, 2 rounds (numbers meaningless)")
    ap.add_argument("--profile", action="store_true", help="one process: host reads per step and cProfile")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file (rank 0)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 4, 2
    if args.profile:
        profile(args)
        return 0
    if args.worker:
        worker(args)
        return 0
    from dynamix_hvd.tools.launchcheck import command, local_env, local_plan

    argv_ = [sys.executable, "-m", "bench.bench_overhead", "--worker", "--steps", str(args.steps),
             "--repeats", str(args.repeats), "--batch", str(args.batch), *(["--json", args.json] if args.json else [])]
    cmd = command(local_plan("mpirun", args.np), argv_, forward=())
    return subprocess.run(cmd, cwd=REPO, env=local_env(pythonpath=REPO)).returncode


if __name__ == "__main__":
    sys.exit(main())
