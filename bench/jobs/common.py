"""What the benchmark jobs share: their common flags, the per-rank set-up and the controller's config.

Each job keeps its own model, data and training loop; the plumbing they share lives here. Environment variables give the defaults of the common flags (EPOCHS, BATCH_SIZES,
POLICY, POLICY_FILE, OUT, DYNAMIX_PROGRESS), so the launch wrappers can pass them to every rank.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import torch

import dynamix_hvd as dx
from dynamix_hvd.control.config import policy_config_from
from dynamix_hvd.control.controller import POLICY_NAMES
from dynamix_hvd.optim.lr_scaling import LR_RULES


def parser(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_flags(ap: argparse.ArgumentParser, *, epochs: int, out: str, default_batch: int,
                     decide_every: int | None = None, lr: float, run_log: bool = True) -> None:
    """The flags every example has; `run_log` adds --progress and --no-report (jobs writing a RunLog)."""
    ap.add_argument("--epochs", type=int, default=int(os.environ.get("EPOCHS", epochs)),
                    help="training epochs (env EPOCHS)")
    ap.add_argument("--batch-sizes", default=os.environ.get("BATCH_SIZES", ""),
                    help="comma-separated local batch size per rank, e.g. 16,48 (env BATCH_SIZES); "
                         f"default {default_batch} on every rank")
    ap.add_argument("--lr", type=float, default=lr, help="learning rate at the base global batch")
    ap.add_argument("--lr-rule", default="adascale", choices=list(LR_RULES),
                    help="how the LR follows the global batch: adascale (default; the "
                         "controller's AdaScale gain, under which its efficiency model holds), linear "
                         "(B/B0: SGD while B stays below the noise scale), sqrt (sqrt(B/B0): Adam-type), none")
    ap.add_argument("--policy", default=os.environ.get("POLICY", "model"), choices=POLICY_NAMES,
                    help="batch-size policy: model (default), ppo (DYNAMIX), static or a classic rule (env POLICY)")
    ap.add_argument("--policy-config", default="{}",
                    help="JSON fields of the policy's typed config (ControllerConfig.policy_config), e.g. "
                         "'{\"end\": 512}' for linear-ramp (LinearRampConfig), '{\"trust\": 4}' for model or ppo "
                         "(ProposalConfig)")
    ap.add_argument("--policy-file", default=os.environ.get("POLICY_FILE", "default"),
                    help="PPO policy to start from: name in policies/ or path; 'none' = fresh (env POLICY_FILE)")
    ap.add_argument("--learn", type=int, default=0, help="policy ppo: 1 keeps training the policy online; 0 acts greedily")
    ap.add_argument("--decide-every", type=int, default=decide_every,
                    help="decide every k steps (0: at the end of every epoch only; -1 or the default: at "
                         "every epoch end and inside epochs, so that the run gets about 32 decisions, the "
                         "first ones after 8, 8 more, then 16, ... steps)")
    ap.add_argument("--max-batch", type=int, default=1024,
                    help="largest local batch (per micro-batch) the controller may give a rank (its memory bound)")
    ap.add_argument("--max-passes", type=int, default=1,
                    help="micro-batches the controller may accumulate per optimizer step past --max-batch (1: none)")
    ap.add_argument("--slow-rank", type=int, default=-1, help="make this rank slow (straggler demo)")
    ap.add_argument("--slow-ms", type=float, default=0.0, help="extra milliseconds per step on --slow-rank")
    ap.add_argument("--out", default=os.environ.get("OUT", out), help="run directory for the records (env OUT)")
    if run_log:
        ap.add_argument("--progress", default=os.environ.get("DYNAMIX_PROGRESS", "auto"),
                        choices=["auto", "bar", "epoch", "off"],
                        help="rank 0's display: progress bar, one line per epoch, or nothing (env DYNAMIX_PROGRESS)")
        ap.add_argument("--no-report", action="store_true", help="do not write OUT/report.png at the end")
    ap.add_argument("--seed", type=int, default=0)


def make_slowdown(args: argparse.Namespace, rank: int) -> "Slowdown":
    """The Slowdown of this rank from the common and bench flags."""
    return Slowdown(rank == args.slow_rank, args.slow_ms, args.slow_factor, parse_slow_schedule(args.slow_schedule),
                    mode=args.slow_mode, stall_rate=args.stall_rate, stall_ms=args.stall_ms, seed=args.seed,
                    clock_kind=args.slow_clock)


ENGINES = ("horovod", "torch")
"""The engines a job can run on: Horovod (mpirun, horovodrun) or torch.distributed (torchrun, Gloo)."""


class World:
    """The job's ranks on its engine: rank, size and the sum over the ranks, the same calls under
    Horovod and under torch.distributed (a Gloo process group from torchrun's environment). Until
    `init` is called the engine is Horovod, already initialised by the script."""

    def __init__(self) -> None:
        self.engine = "horovod"

    def init(self, engine: str = "horovod") -> None:
        """``hvd.init()``, or ``dist.init_process_group("gloo")`` for "torch"."""
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: choose {' or '.join(ENGINES)}")
        self.engine = engine
        if engine == "torch":
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
        else:
            import horovod.torch as hvd

            hvd.init()

    @property
    def rank(self) -> int:
        if self.engine == "torch":
            import torch.distributed as dist

            return dist.get_rank()
        import horovod.torch as hvd

        return hvd.rank()

    @property
    def size(self) -> int:
        if self.engine == "torch":
            import torch.distributed as dist

            return dist.get_world_size()
        import horovod.torch as hvd

        return hvd.size()

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The sum of a CPU tensor over the ranks (a collective: every rank calls it with the same name)."""
        if self.engine == "torch":
            import torch.distributed as dist

            out = tensor.clone()
            dist.all_reduce(out)
            return out
        import horovod.torch as hvd

        return hvd.allreduce(tensor, op=hvd.Sum, name=name)

    def barrier(self, name: str) -> None:
        """Line the ranks up (one small allreduce)."""
        self.allreduce_sum(torch.zeros(1), name)

    def close(self) -> None:
        """torch: ``dist.destroy_process_group()`` (Horovod needs nothing)."""
        if self.engine == "torch":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


world = World()
"""This process's ranks (`start` initialises it)."""


def start(args: argparse.Namespace, default_batch: int) -> list[int]:
    """Threads from OMP_NUM_THREADS, the engine (``hvd.init()``, or a Gloo process group with
    ``--engine torch``), the seed; returns this job's per-rank batch sizes."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    world.init(getattr(args, "engine", "horovod"))
    dx.configure_logging()  # the library's messages (checkpoints, run logs) on stderr, rank-prefixed
    torch.manual_seed(args.seed)
    return [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [default_batch] * world.size


def step_due(optimizer: Any) -> bool:
    """Horovod's accumulation pattern: step once every micro-batch of the step is in
    (``WeightedDistributedOptimizer.should_step``; a plain Horovod optimizer here never accumulates)."""
    should_step = getattr(optimizer, "should_step", None)
    return True if should_step is None else should_step()


def controller_config(args: argparse.Namespace) -> dx.ControllerConfig:
    """The controller's configuration from the common flags."""
    return dx.ControllerConfig(
        policy=args.policy, policy_config=policy_config_from(args.policy, json.loads(args.policy_config)),
        policy_file=None if args.policy_file == "none" else args.policy_file,
        learn=bool(args.learn), total_epochs=args.epochs, max_batch=args.max_batch, max_passes=args.max_passes,
        decide_every_steps=None if args.decide_every is None or args.decide_every < 0 else args.decide_every,
        ppo={"seed": args.seed, "rollout_length": 8} if args.policy == "ppo" else {})


# --- what the benchmark suite (bench/suite.py) needs from every example ------------------------------
def add_bench_flags(ap: argparse.ArgumentParser) -> None:
    """Flags of the plain Horovod reference, the slowed rank (factor, schedule, mode, stalls) and the
    suite's records (see `bench.jobs.records`)."""
    ap.add_argument("--slow-factor", type=float, default=1.0,
                    help="--slow-rank computes this many times slower ((f-1) x the time of its own "
                         "forward+backward is added, so the slowdown scales with its batch)")
    ap.add_argument("--slow-schedule", default="",
                    help="slowdown changing over time: 'TIME:FACTOR,...', e.g. '0:2,15:1,30:3' (TIME: "
                         "training seconds, evaluation excluded, or with --slow-clock budget a fraction of the "
                         "budget; --slow-factor before the first entry)")
    ap.add_argument("--slow-clock", default="seconds", choices=["seconds", "budget"],
                    help="what --slow-schedule's times count: training seconds, or the samples trained as a "
                         "fraction of --epochs passes over the data (0-1: every arm meets each phase at the same "
                         "sample, however fast it runs; an arm that trains past its epochs stays in the last "
                         "phase; examples that report their budget)")
    ap.add_argument("--plain-horovod", action="store_true",
                    help="the reference a user would otherwise run: DistributedSampler + "
                         "hvd.DistributedOptimizer(op=Average) (bench.zoo_train --engine torch: "
                         "DistributedDataParallel and the plain optimizer), equal batches (the first of "
                         "--batch-sizes on every rank); no AdaptiveLoader, weighted optimizer or controller")
    ap.add_argument("--no-controller", action="store_true",
                    help="data plane only: AdaptiveLoader + weighted optimizer at fixed sizes, no controller")
    ap.add_argument("--slow-mode", default="spin", choices=["spin", "sleep"],
                    help="how --slow-rank is slower: spin (burns its core like a slower device) or sleep "
                         "(frees the core: for more ranks than cores)")
    ap.add_argument("--stall-rate", type=float, default=0.0,
                    help="--slow-rank pauses at random times, on average this many per second of training")
    ap.add_argument("--stall-ms", type=float, default=200.0,
                    help="scale of a pause: Pareto(alpha 1.5) x this many ms, at most 10x (heavy-tailed)")
    ap.add_argument("--eval-samples", type=int, default=0,
                    help="evaluate every N training samples (all ranks) and write OUT/suite_*.{csv,json}; 0: off")
    ap.add_argument("--target", type=float, default=float("nan"),
                    help="the suite's target metric (accuracy: at least, loss: at most)")


def parse_slow_schedule(text: str) -> list[tuple[float, float]]:
    """'0:2,15:1' -> [(0.0, 2.0), (15.0, 1.0)], sorted by time; factors must be >= 1."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        t, f = part.split(":")
        if float(f) < 1.0 or float(t) < 0:
            raise ValueError(f"slow schedule entry {part!r}: need TIME >= 0 and FACTOR >= 1")
        out.append((float(t), float(f)))
    return sorted(out)


class Slowdown:
    """Make one rank a slower device: before each forward pass it waits ``slow_ms`` plus (factor - 1)
    x the time its forward+backward takes (EMA per sample x local batch), and pauses now and then
    (`stall_rate` per second, Pareto-distributed lengths) when stalls are on.

    mode "spin" spends the wait as this thread's CPU time (a slower device; the factor stays a factor
    of real work when other processes compete for the cores); mode "sleep" sleeps (wall time), which
    leaves the core to other ranks when there are more ranks than cores. The wait happens *before* the
    forward pass because Horovod starts allreduces from hooks during backward: a wait after backward
    would not hold up the other ranks. `clock` gives the seconds the schedule and stalls follow;
    with `clock_kind` "budget" the schedule follows the fraction of the epoch budget trained instead
    (see :meth:`use_clock`) and stalls keep to seconds.
    """

    def __init__(self, active: bool, slow_ms: float, factor: float, schedule: list[tuple[float, float]],
                 mode: str = "spin", stall_rate: float = 0.0, stall_ms: float = 200.0, seed: int = 0,
                 clock_kind: str = "seconds") -> None:
        import random
        import time

        if mode not in ("spin", "sleep"):
            raise ValueError(f"slow mode {mode!r}: choose spin or sleep")
        if clock_kind not in ("seconds", "budget"):
            raise ValueError(f"slow clock {clock_kind!r}: choose seconds or budget")
        if clock_kind == "budget" and any(not 0 <= t <= 1 for t, _ in schedule):
            raise ValueError(f"slow schedule {schedule}: with the budget clock its times are fractions in [0, 1]")
        self.clock_kind = clock_kind
        self.schedule_clock: Callable[[], float] | None = None
        """What the schedule follows (None: `clock`)."""
        self.active, self.slow_s, self.factor, self.schedule = active, slow_ms / 1000.0, factor, schedule
        self.mode, self.stall_rate, self.stall_s = mode, stall_rate, stall_ms / 1000.0
        self._rng = random.Random(seed * 7919 + 17)
        t0 = time.perf_counter()
        self.clock = lambda: time.perf_counter() - t0
        self.next_stall = self._rng.expovariate(stall_rate) if stall_rate > 0 else float("inf")
        self.stalls: list[tuple[float, float]] = []
        self.per_sample: float | None = None
        self._t = 0.0

    def _now(self) -> float:
        import time

        return time.thread_time() if self.mode == "spin" else time.perf_counter()

    def _wait(self, seconds: float, wall: bool = False) -> None:
        """Sleep, or spin for `seconds` of this thread's CPU time (`wall`: of wall time)."""
        import time

        from bench.jobs import busy_wait

        if seconds <= 0:
            return
        if self.mode == "sleep":
            time.sleep(seconds)
        elif wall:
            busy_wait(seconds)
        else:
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass

    def use_clock(self, seconds: Callable[[], float], budget: Callable[[], float] | None = None) -> None:
        """Training seconds (stalls, and the schedule with the seconds clock) and the fraction of the
        epoch budget trained (the schedule with the budget clock)."""
        self.clock = seconds
        if self.clock_kind == "budget":
            if budget is None:
                raise ValueError("--slow-clock budget: this example does not report its budget; use seconds")
            self.schedule_clock = budget

    def factor_at(self, elapsed: float) -> float:
        factor = self.factor
        for t, f in self.schedule:
            if elapsed >= t:
                factor = f
        return factor

    def before_compute(self, batch: int) -> None:
        if not self.active:
            return
        now = self.clock()
        if now >= self.next_stall:
            pause = min(10.0, self._rng.paretovariate(1.5)) * self.stall_s
            self.stalls.append((round(now, 3), round(pause, 6)))
            self._wait(pause, wall=True)
            self.next_stall = now + self._rng.expovariate(self.stall_rate)
        self._wait(self.slow_s, wall=True)
        if self.per_sample is not None:
            at = now if self.schedule_clock is None else self.schedule_clock()
            self._wait((self.factor_at(at) - 1.0) * self.per_sample * batch)
        self._t = self._now()

    def after_compute(self, batch: int) -> None:
        if self.active:
            sample = (self._now() - self._t) / max(batch, 1)
            self.per_sample = sample if self.per_sample is None else 0.8 * self.per_sample + 0.2 * sample


class EpochOrder(torch.utils.data.Dataset):
    """`dataset` in the epoch's permutation of `dynamix_hvd.data.plan.epoch_permutation`: under a
    DistributedSampler(shuffle=False), global step k then holds the same samples as AdaptiveLoader's
    step k at equal sizes, so the plain Horovod arm sees the data in the same order as every other arm."""

    def __init__(self, dataset: torch.utils.data.Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.order = torch.arange(len(dataset))  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        from dynamix_hvd.data.plan import epoch_permutation

        self.order = epoch_permutation(len(self.order), self.seed, epoch)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int):  # noqa: ANN204 - whatever the dataset returns
        return self.dataset[int(self.order[i])]


class PlainHorovodLoader:
    """What a Horovod user writes: ``DataLoader(dataset, batch_size=b, sampler=DistributedSampler(...))``
    with ``sampler.set_epoch(epoch)``; here over `EpochOrder` (same order as the other arms)."""

    def __init__(self, dataset: torch.utils.data.Dataset, batch_size: int, rank: int, size: int, seed: int) -> None:
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        self.data = EpochOrder(dataset, seed)
        self.sampler = DistributedSampler(self.data, num_replicas=size, rank=rank, shuffle=False)
        self.loader = DataLoader(self.data, batch_size=batch_size, sampler=self.sampler)
        self.batch_sizes = (batch_size,) * size
        self.size = size

    def set_epoch(self, epoch: int) -> None:
        self.data.set_epoch(epoch)
        self.sampler.set_epoch(epoch)

    def __iter__(self):  # noqa: ANN204
        return iter(self.loader)


def plain_horovod_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, args: argparse.Namespace,
                            global_batch: int, base_batch: int) -> torch.optim.Optimizer:
    """``hvd.DistributedOptimizer(op=hvd.Average)`` with the LR the weighted optimizer would use at
    this fixed global batch (the same `--lr-rule` factor, set once, as a user scales it by hand;
    adascale has no gradient statistics here, so its factor is 1, as the weighted optimizer's is
    without a controller)."""
    import horovod.torch as hvd

    from dynamix_hvd.optim.lr_scaling import lr_factor

    factor = lr_factor(args.lr_rule if args.lr_rule != "adascale" else "none", global_batch, base_batch)
    for group in optimizer.param_groups:
        group["lr"] *= factor
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)


def local_batches(loader: object, local: int) -> list[int]:
    """Every rank's sample count in the step just taken; `local` is this rank's (len of its batch).
    Under DistributedSampler every rank has the same count, the last batch of an epoch included."""
    if isinstance(loader, PlainHorovodLoader):
        return [local] * loader.size
    return list(loader.current_step.counts)  # type: ignore[attr-defined]
