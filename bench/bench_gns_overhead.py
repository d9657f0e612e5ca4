"""Per-step CPU cost of the gradient-noise statistics (goal: <= 2% of a training step).

Run: ``python -m bench.bench_gns_overhead [--repeats 7] [--steps 20]``. For an MLP and a small CNN on
synthetic data, the gradients live in one flat buffer (as in the data plane). A step is
zero_grad + forward + backward + SGD step; "+stats" adds what the optimizer does per step:
per-segment squared norms of the local flat gradient (before the allreduce), of the global gradient
and the estimator update (3 simulated ranks, ``GradientStatistics.record``: O(1) per step, the
maths runs vectorised when the controller reads; that bulk cost is timed separately) plus the loss. A single process has no
allreduce: both variants copy the flat buffer into a second one as its stand-in (so, as after a real
allreduce, the global buffer was just written), and "+stats" reads the global norms from that copy. Reported: medians over alternating
single steps, the A/B overhead, the statistics timed alone (steadier on a busy machine), and the
bulk estimator cost per recorded step paid when the controller reads (``snapshot()``).
The allgather of the per-rank squared norms (a few hundred bytes) is not included.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
from torch import nn

from dynamix_hvd.stats.noise_scale import GradientStatistics, StatsConfig
from dynamix_hvd.stats.sqnorm import SegmentSqNorms, backend_for

RANK_BATCHES = (3, 7, 12)


def make_mlp() -> Tuple[nn.Module, Tuple[int, ...], int]:
    """784-512-512-10 MLP (~670k parameters), batch 256."""
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)), (784,), 256


def make_cnn() -> Tuple[nn.Module, Tuple[int, ...], int]:
    """Two conv layers + two linear layers on 3x32x32 (~0.55M parameters), batch 64."""
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))
    return net, (3, 32, 32), 64


def flatten_grads(model: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """Point every p.grad into one flat buffer; returns (buffer, int64 segment offsets)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes))
    offsets = torch.tensor([0] + list(np.cumsum(sizes)), dtype=torch.int64)
    for p, a, n in zip(params, offsets[:-1].tolist(), sizes):
        p.grad = flat[a:a + n].view_as(p)
    return flat, offsets


class Trainer:
    """One model, its flat gradient buffer and the two step variants."""

    def __init__(self, factory: Callable[[], Tuple[nn.Module, Tuple[int, ...], int]], seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model, shape, self.batch = factory()
        self.x = torch.randn(self.batch, *shape)
        self.y = torch.randint(0, 10, (self.batch,))
        self.flat, self.offsets = flatten_grads(self.model)
        self.global_flat = torch.zeros_like(self.flat)  # receives the stand-in "allreduce"
        self.local_norms = SegmentSqNorms(self.flat, self.offsets)  # prepared once per buffer
        self.global_norms = SegmentSqNorms(self.global_flat, self.offsets)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.stats = GradientStatistics(StatsConfig())
        self.last_loss = torch.zeros(())

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)  # keeps p.grad as views of self.flat
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.global_flat.copy_(self.flat)  # stand-in for the allreduce
        self.opt.step()
        self.last_loss = loss.detach()

    def local_statistics(self) -> np.ndarray:
        return self.local_norms().numpy()

    def global_statistics(self, local: np.ndarray) -> None:
        glob = self.global_norms().numpy()
        local_sq = np.stack([local, local * 1.25, local * 0.8])  # three simulated ranks
        self.stats.record(RANK_BATCHES, local_sq, glob, loss=float(self.last_loss))

    def statistics(self) -> None:
        self.global_statistics(self.local_statistics())

    def step_with_statistics(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.last_loss = loss.detach()
        local = self.local_statistics()  # must precede the (in-place) allreduce
        self.global_flat.copy_(self.flat)
        self.global_statistics(local)
        self.opt.step()

    def check_flat(self) -> None:
        lo, hi = self.flat.data_ptr(), self.flat.data_ptr() + self.flat.numel() * 4
        if not all(lo <= p.grad.data_ptr() < hi for p in self.model.parameters()):
            raise RuntimeError("autograd replaced a .grad: gradients are no longer in the flat buffer")


def measure(factory: Callable, repeats: int, steps: int) -> Dict[str, float]:
    """Median per-step seconds of both variants (alternating single steps, so load drifts hit both)
    and of the statistics alone."""
    tr = Trainer(factory)
    for _ in range(3):  # warm-up, including numba compilation
        tr.step()
        tr.step_with_statistics()
    tr.check_flat()
    base: List[float] = []
    with_stats: List[float] = []
    alone: List[float] = []
    bulk: List[float] = []
    clock = time.perf_counter
    for _ in range(repeats):
        for _ in range(steps):
            t0 = clock()
            tr.step()
            t1 = clock()
            tr.step_with_statistics()
            t2 = clock()
            tr.statistics()
            t3 = clock()
            base.append(t1 - t0)
            with_stats.append(t2 - t1)
            alone.append(t3 - t2)
        t0 = clock()
        tr.stats.snapshot()  # the controller's read: runs the estimator maths for the 2*steps recorded
        bulk.append((clock() - t0) / (2 * steps))
    tr.check_flat()
    med = statistics.median
    return dict(params=float(tr.flat.numel()), segments=float(tr.offsets.numel() - 1), batch=float(tr.batch),
                base=med(base), stats=med(with_stats), alone=med(alone), bulk=med(bulk),
                overhead=100.0 * (med(with_stats) - med(base)) / med(base), alone_pct=100.0 * med(alone) / med(base))


def format_table(rows: Dict[str, Dict[str, float]]) -> str:
    head = (f"{'model':<6} {'params':>9} {'segs':>5} {'batch':>5} {'step ms':>9} {'+stats ms':>10} "
            f"{'overhead %':>10} {'stats alone ms':>15} {'alone %':>8} {'read us/step':>12}")
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<6} {int(r['params']):>9} {int(r['segments']):>5} {int(r['batch']):>5} "
                     f"{r['base'] * 1e3:>9.3f} {r['stats'] * 1e3:>10.3f} {r['overhead']:>10.2f} "
                     f"{r['alone'] * 1e3:>15.3f} {r['alone_pct']:>8.2f} {r['bulk'] * 1e6:>12.1f}")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="blocks of alternating steps")
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        import numba

        numba.set_num_threads(1)
    except ImportError:
        pass
    rows = {name: measure(f, args.repeats, args.steps) for name, f in (("mlp", make_mlp), ("cnn", make_cnn))}
    print(f"torch {torch.__version__}, 1 thread, sq-norm backend {backend_for(torch.zeros(1))}, "
          f"median of {args.repeats * args.steps} alternating steps per variant")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
