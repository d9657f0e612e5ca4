"""Worker under torchrun: the data plane of the torch.distributed engine, with DistributedDataParallel
(its communication hook) or without it (the flat-buffer allreduce); unequal sizes that change mid-epoch,
optionally micro-batches accumulated per optimizer step. Dumps, per optimizer config, the sample
indices every loader step read, which optimizer step it belonged to, and the final parameters.

With --no-horovod, importing Horovod fails in this process: the engine must not need it. With
--mpi-env (under mpirun), torch.distributed learns its rendezvous from the MPI world.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

if "--no-horovod" in sys.argv:
    sys.modules["horovod"] = None  # type: ignore[assignment]  # `import horovod...` raises ImportError

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dynamix_hvd as dx
try:
    from workers.dataplane import CONFIGS, IndexedData, first_sizes, make_model, run_parser, runs, size_schedule
except ImportError:  # run as a script: tests/workers/ itself is on sys.path
    from dataplane import (CONFIGS, IndexedData, first_sizes, make_model, run_parser,  # type: ignore[no-redef]
                           runs, size_schedule)


def main() -> None:
    argvs = runs([a for a in sys.argv[1:] if a not in ("--no-horovod", "--mpi-env")])
    torch.set_num_threads(1)
    if "--mpi-env" in sys.argv:  # launched by mpirun: torch.distributed's rendezvous from the MPI world
        dx.torch_env_from_mpi()
    dist.init_process_group("gloo")
    for one in argvs:
        run(one)
    dist.destroy_process_group()


def run(argv: list[str]) -> None:
    ap = run_parser()
    ap.add_argument("--wrap", choices=("ddp", "none"), default="ddp")
    ap.add_argument("--passes", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--tokens", action="store_true",
                    help="loss_unit='tokens': sample i stands for 1 + i % 4 tokens, each rank's loss is the mean "
                         "over its tokens and its count goes to optimizer.set_local_tokens()")
    args = ap.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule = first_sizes(size_schedule(world, args.epochs, seed=11), args.sizes)
    data = IndexedData(args.samples)
    result = {"world": world, "launcher_rank": rank, "schedule": schedule, "configs": {}}
    for name in args.configs.split(","):
        make_opt, kwargs = CONFIGS[name]
        model = make_model()
        net = DDP(model) if args.wrap == "ddp" else model
        loader = dx.AdaptiveLoader(data, schedule[0][0], rank, seed=5)
        extra = {"loss_unit": "tokens"} if args.tokens else {}
        opt = dx.WeightedDistributedOptimizer(make_opt(model.parameters()),
                                              net if args.wrap == "ddp" else model.named_parameters(), loader,
                                              backward_passes_per_step=args.passes, **kwargs, **extra)
        steps, group = [], 0
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            loader.set_batch_sizes(schedule[epoch][0])
            for step, (idx, x, y) in enumerate(loader):
                if args.tokens:
                    weights = (1 + idx % 4).to(torch.float64)
                    per_sample = nn.functional.cross_entropy(net(x), y, reduction="none")
                    loss = (weights * per_sample).sum() / weights.sum()
                    opt.set_local_tokens(int(weights.sum()))
                else:
                    loss = nn.functional.cross_entropy(net(x), y, reduction=kwargs.get("loss_reduction", "mean"))
                loss.backward()
                steps.append({"epoch": epoch, "step": step, "indices": idx.tolist(), "group": group,
                              "counts": list(loader.current_step.counts), "sizes": list(loader.batch_sizes)})
                if opt.should_step():
                    opt.step()
                    opt.zero_grad()
                    group += 1
                if step == args.change_at and not opt.accumulating:
                    loader.set_batch_sizes(schedule[epoch][1])
        result["configs"][name] = {
            "steps": steps, "engine": opt.engine, "horovod_imported": "horovod.torch" in sys.modules,
            "params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
            "records": loader.tracker.to_dicts(), "kwargs": kwargs,
        }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
