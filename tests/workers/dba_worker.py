"""Worker: distributed DBA with unequal per-rank batches; dump every step's selection and gradient.

Each rank writes rank<R>.json with, per config, the dataset indices of its batch and of its selected
samples (per layer) in every completed step, the selected-count matrix, the synchronised gradient
after ``opt.step()``, and the final parameters. The test replays the union of all ranks' selections in
one process. ``--oom-rank/--oom-step`` makes that rank fail its DBA computation once (a simulated
out-of-memory error inside ``opt.guard()``): the step must be skipped and redone on every rank.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import horovod.torch as hvd
import torch
from torch.nn import functional as F

import dynamix_hvd as dx
from dynamix_hvd.dba.selection import DBAConfig
from dynamix_hvd.dba.distributed import DistributedDBA
from dynamix_hvd.optim.weighted import WeightedDistributedOptimizer

try:
    from workers.dataplane import IndexedData, make_model
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import IndexedData, make_model  # type: ignore[no-redef]

CONFIGS = {
    # name: (optimizer factory, DBA config)
    "sgd_variance_model": (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
                           DBAConfig(metric="variance", min_fraction=0.25)),
    "adam_snr_layer_rank": (lambda ps: torch.optim.Adam(ps, lr=1e-2),
                            DBAConfig(metric="snr", granularity="layer", search="rank", min_fraction=0.25)),
    "sgd_snr_setter": (lambda ps: torch.optim.SGD(ps, lr=0.1), DBAConfig(metric="snr", min_fraction=0.25)),
    "sgd_variance_layer_cosine": (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
                                  DBAConfig(metric="variance", granularity="layer", min_fraction=0.0,
                                            min_cosine=0.9)),
    "sgd_importance_layer": (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
                             DBAConfig(estimator="importance", granularity="layer", max_noise=0.5, seed=7)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", required=True, help="per-rank batch sizes, e.g. 6,13")
    ap.add_argument("--samples", type=int, default=61)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--oom-rank", type=int, default=-1)
    ap.add_argument("--oom-step", type=int, default=-1, help="loop iteration of the first config")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    data = IndexedData(args.samples)
    sizes = [int(s) for s in args.sizes.split(",")]
    result: dict = {"world": hvd.size(), "configs": {}}
    for c, (name, (make_opt, cfg)) in enumerate(CONFIGS.items()):
        model = make_model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loader = dx.AdaptiveLoader(data, sizes, rank, seed=3)
        opt = WeightedDistributedOptimizer(make_opt(model.parameters()), model.named_parameters(), loader)
        dba = DistributedDBA(model, F.cross_entropy, cfg, optimizer=opt)
        steps, iteration, redone = [], 0, 0
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            for idx, x, y in loader:
                opt.zero_grad()
                fail = c == 0 and rank == args.oom_rank and iteration == args.oom_step
                with opt.guard():
                    if fail:
                        original = dba.dba.compute
                        dba.dba.compute = _raise_oom  # type: ignore[method-assign]
                    try:
                        out = dba.step(x, y)
                    finally:
                        if fail:
                            dba.dba.compute = original  # type: ignore[method-assign]
                opt.step()
                iteration += 1
                if opt.last_status != "ok":
                    redone += 1
                    continue
                batch = idx.tolist()
                steps.append({
                    "batch": batch,
                    "selected": [[batch[i] for i in sel.tolist()] for sel in out.local.indices],
                    "counts": out.counts.tolist(),
                    "grads": {n: p.grad.flatten().tolist() for n, p in model.named_parameters()},
                    "local_grad_sq": loader.tracker.records[-1].local_grad_sq,
                })
        result["configs"][name] = {
            "steps": steps, "redone": redone, "skipped": dict(opt.skipped_steps),
            "params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
            "records": loader.tracker.to_dicts(),
        }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


def _raise_oom(x: torch.Tensor, y: torch.Tensor) -> None:
    raise RuntimeError("CUDA out of memory (simulated by the DBA test worker)")


if __name__ == "__main__":
    main()
