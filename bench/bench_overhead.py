"""Per-step overhead against plain Horovod at the same fixed sizes.

Run: ``python -m bench.bench_overhead [--np 2] [--steps 100] [--chunk 10] [--repeats 100] [--batch 64]
[--variants horovod,weighted,controller] [--job ZOO_JOB]`` (``--quick``: a smoke test, its numbers mean
nothing). Starts one ``mpirun -np NP`` job in which every rank builds a set-up per variant, each with
its own model: the CNN of Horovod's pytorch_mnist.py on generated 28x28 images with SGD, or with
``--job`` a job of the workload zoo (`bench.zoo`: its model, the first samples of its training data,
its optimizer, clipping and loss; ``--batch`` defaults to the job's):

* ``horovod``: ``DistributedSampler`` + ``DataLoader`` + ``hvd.DistributedOptimizer(op=Average)``;
* ``weighted``: ``AdaptiveLoader`` + ``WeightedDistributedOptimizer`` (equal sizes, no controller);
* ``controller``: the same plus a ``DynamixController`` deciding at every epoch's end
  (``decide_every_steps=0``: reports, gathers, statistics, reward) with ``policy="static"``, so the sizes stay
  fixed and every variant runs the same steps;
* ``default``: the controller as a user turns it on (``ControllerConfig`` defaults: the cost-model proposal, decisions
  inside epochs on the default cadence, ``model=`` given); it may move the sizes, which the summary
  reports (a move on equal ranks is itself harm);
* ``user``: what a user runs: ``default`` plus a ``Checkpointer`` (signal handlers installed, its
  preemption votes on their default cadence) and a ``RunLog`` (``step(loss)`` every step,
  ``end_epoch()`` at every epoch's end, ``finish()`` after the timing); read it against the A/A row
  (``--variants horovod,horovod-again,user``, best with ``--np 1``, where no allreduce wait hides the
  host's work);
* ablations (``--variants``, see ``ABLATIONS``) that take one part away from the data plane, or add one
  of its parts to plain Horovod, at a time.

Every variant trains epoch after epoch of ``--steps`` steps. After a throw-away plain set-up has taken
the process's own warm-up (``--chunk`` steps), each variant's first epoch is timed alone (minus
``--steps`` times its median step, relative to ``horovod``'s: the first-epoch extra of compilation and
caches); then ``--repeats`` rounds, each ``--chunk`` steps of every variant in rotating order, each
chunk timed between two barriers. Short chunks interleave the variants finely, so the machine's slow
drifts hit them alike. Printed per variant: the median ms per step; the **paired ratio** to
``horovod`` (per round, this variant's chunk over horovod's chunk of the same round; the median over
rounds with a 90% bootstrap interval: the figure to read); the **CPU ratio**, the same pairing of rank
0's training-thread CPU seconds (``time.thread_time``: the work a variant adds, without the machine's
scheduling noise; Horovod's wait for the allreduce polls and so counts as CPU too, so with ``--np 1``,
where nothing waits, it is the data plane's own work); the ratio of the totals (every chunk,
decisions at epoch ends included; noisier); the first-epoch extra; and where the time goes (rank 0's
mean ms per step in the data wait, forward+backward, ``step()`` (allreduce wait included) and the
controller's per-step calls; decisions fall in the data wait of the step after an epoch's end; and
the CPU time of the training thread). Time it on a quiet machine, one rank per core.

``--engine torch`` runs the same under torchrun on the torch.distributed engine (``DDP_VARIANTS``).

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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("horovod", "weighted", "controller", "default", "user")
DDP_VARIANTS = ("ddp", "ddp-again", "weighted", "default", "user")
"""With ``--engine torch`` (under torchrun): ``ddp`` is the plain DDP script (DistributedSampler +
DataLoader + ``DistributedDataParallel``), ``ddp-again`` a second one (A/A), and the dynamix_hvd
variants wrap the same DDP model (the optimizer's communication hook)."""
ABLATIONS = {  # --variants may add these, to find where a difference comes from
    "horovod-again": "a second plain Horovod set-up (A/A: the noise floor of the paired ratio)",
    "weighted-nostats": "weighted without the local/global squared norms (track_grad_norms=False)",
    "controller-nothreads": "controller without its resource sampler thread (resource_period_s=0)",
    "horovod-flat": "plain Horovod with every gradient a view into one flat buffer, zeroed in place (the data "
                    "plane's gradient layout, without its weighting)",
    "horovod-sum": "plain Horovod with op=Sum and the LR divided by the ranks (the data plane's reduction op; "
                   "the same updates as op=Average for SGD only)",
}
PHASES = ("data", "forward+backward", "step", "controller", "main-thread CPU")


def make_net() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Conv2d(10, 20, 5), nn.Dropout2d(),
                         nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(320, 50), nn.ReLU(), nn.Dropout(),
                         nn.Linear(50, 10), nn.LogSoftmax(dim=1))


class Setup:
    """One variant: its own model, loader and optimizer; `epoch(e)` trains one epoch."""

    def __init__(self, variant: str, dataset: Any, batch: int, world: Any, job: Any = None) -> None:
        """`world`: `bench.jobs.common.world`, initialised on the benchmark's engine."""
        import torch

        import dynamix_hvd as dx

        torch.manual_seed(0)
        self.job = job
        if job is None:
            self.model = make_net()
            opt = torch.optim.SGD(self.model.parameters(), lr=0.01 * world.size, momentum=0.5)
        else:
            from bench.zoo_train import build

            self.model, opt, _ = build(job, max(1, len(dataset) // (batch * world.size)))
        self.net = self.model  # what the forward pass goes through (the DDP module under torch.distributed)
        if world.engine == "torch":
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(self.model)
        self.clip = job.clip if job is not None else 0.0
        self.controller = None
        self.flat = None
        self.checkpointer = self.runlog = self.tmp = None
        if variant.startswith("ddp"):
            self.sampler = torch.utils.data.distributed.DistributedSampler(dataset, world.size, world.rank)
            self.loader: Any = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=self.sampler)
            self.opt = opt
        elif variant.startswith("horovod"):
            import horovod.torch as hvd

            self.sampler = torch.utils.data.distributed.DistributedSampler(dataset, hvd.size(), hvd.rank())
            self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=self.sampler)
            op = hvd.Average
            if variant == "horovod-sum":
                op = hvd.Sum
                for group in opt.param_groups:
                    group["lr"] /= hvd.size()
            self.opt = hvd.DistributedOptimizer(opt, named_parameters=self.model.named_parameters(), op=op)
            if variant == "horovod-flat":
                from dynamix_hvd.optim.flat import FlatGradients

                self.flat = FlatGradients([p for p in self.model.parameters() if p.requires_grad])
        else:
            self.sampler = None
            self.loader = dx.AdaptiveLoader(dataset, [batch] * world.size, world.rank, seed=0)
            params = self.net if world.engine == "torch" else self.model.named_parameters()
            self.opt = dx.WeightedDistributedOptimizer(opt, params, self.loader,
                                                       max_grad_norm=self.clip or None,
                                                       track_grad_norms=variant != "weighted-nostats")
            if variant.startswith("controller"):
                period = 0.0 if variant == "controller-nothreads" else dx.AdvancedConfig().resource_period_s
                self.controller = dx.DynamixController(self.loader, self.opt,
                                                       dx.ControllerConfig(policy="static", advanced=dx.AdvancedConfig(resource_period_s=period),
                                                                           decide_every_steps=0),
                                                       model=self.net)
            elif variant in ("default", "user"):  # as bench.zoo_train's default arm builds it
                cfg = dx.ControllerConfig(total_epochs=job.epochs if job is not None else 10)
                self.controller = dx.DynamixController(self.loader, self.opt, cfg, model=self.net)
            if variant == "user":
                from dynamix_hvd.runs.runlog import RunLog

                self.tmp = tempfile.mkdtemp(prefix=f"dx-bench-overhead-r{world.rank}-")
                self.checkpointer = dx.Checkpointer(Path(self.tmp, "ckpt"), self.model, self.opt, self.loader,
                                                    self.controller).install_signal_handlers()
                self.runlog = RunLog(Path(self.tmp, "run"), self.loader, controller=self.controller)

        self.phases = dict.fromkeys(PHASES, 0.0)  # seconds summed over the timed epochs
        self.steps = 0
        self.samples = 0  # this rank's samples over the timed steps

    def loss(self, x: Any, y: Any) -> Any:
        import torch.nn.functional as F

        if self.job is None:
            return F.nll_loss(self.net(x), y)
        from bench.zoo_train import loss_and_metric

        return loss_and_metric(self.job, self.net, x, y, train=True)[0]

    def update(self) -> None:
        """The optimizer step as the plain script or the weighted optimizer does it (clipping included)."""
        if self.clip and self.sampler is not None and not hasattr(self.opt, "synchronize"):  # plain DDP
            import torch

            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.opt.step()
        elif self.clip and self.sampler is not None:  # Horovod's documented way to clip
            import torch

            self.opt.synchronize()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            with self.opt.skip_synchronize():
                self.opt.step()
        else:
            self.opt.step()

    def run(self) -> Iterator[None]:
        """Train epoch after epoch; yields after every optimizer step."""
        e = 0
        while True:
            yield from self._epoch(e, True)
            e += 1

    def epoch(self, e: int, timed: bool = True) -> None:
        for _ in self._epoch(e, timed):
            pass

    def _epoch(self, e: int, timed: bool) -> Iterator[None]:
        (self.sampler or self.loader).set_epoch(e)
        clock, cpu, ph = time.perf_counter, time.thread_time, self.phases
        batches = iter(self.loader)
        t0, c0 = clock(), cpu()
        for x, y in batches:  # the controller decides inside next() (a loader step-end callback)
            t1 = clock()
            if self.flat is not None:
                self.flat.zero()
            else:
                self.opt.zero_grad()
            loss = self.loss(x, y)
            loss.backward()
            t2 = clock()
            self.update()
            t3 = clock()
            if self.controller is not None:
                self.controller.record_loss(loss)
            if self.runlog is not None:
                self.runlog.step(loss)
            t4 = clock()
            if timed:
                ph["data"] += t1 - t0
                ph["forward+backward"] += t2 - t1
                ph["step"] += t3 - t2
                ph["controller"] += t4 - t3
                ph["main-thread CPU"] += cpu() - c0
                self.steps += 1
                self.samples += len(y)
            yield
            t0, c0 = clock(), cpu()
        if self.runlog is not None:
            self.runlog.end_epoch()  # a collective, as in a user's script
        if timed:
            ph["data"] += clock() - t0  # the epoch's last next(): end-of-epoch callbacks, the decision
            ph["main-thread CPU"] += cpu() - c0

    def close(self) -> None:
        if self.runlog is not None:
            self.runlog.finish(self.controller.history)
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.controller is not None:
            self.controller.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def dataset(steps: int, batch: int, world: int, job: Any = None) -> Any:
    """`steps` steps of `batch` samples per rank: generated images, or the zoo job's training samples
    (its first ones, cycled when it has fewer)."""
    import torch

    n = steps * batch * world
    if job is not None:
        train = job.data()[0]
        idx = torch.arange(n) % len(train)
        return torch.utils.data.TensorDataset(*(t[idx] for t in train.tensors))
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(10, (n,), generator=g))


def worker(args: argparse.Namespace) -> None:
    import torch

    from bench.jobs.common import world

    world.init(args.engine)
    torch.set_num_threads(1)
    job = zoo_job(args.job)
    data = dataset(args.steps, args.batch, world.size, job)
    variants = args.variants
    base = variants[0]
    setups = {v: Setup(v, data, args.batch, world, job) for v in variants}
    runs = {v: setups[v].run() for v in variants}

    cpu: dict[str, list[float]] = {v: [] for v in variants}  # training-thread CPU seconds per timed chunk

    def timed(v: str, steps: int) -> float:
        world.barrier("bench.barrier")
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            next(runs[v])
        c = time.thread_time() - c
        world.barrier("bench.barrier")
        cpu[v].append(c)
        return time.perf_counter() - t

    # Process warm-up (MPI connections, Horovod's first negotiations, allocator, thread pools) belongs to
    # no variant: a throw-away plain set-up absorbs it, or the first variant timed would carry it all.
    warm = Setup(base, data, args.batch, world, job).run()
    for _ in range(args.chunk):
        next(warm)
    first = {v: timed(v, args.steps) for v in variants}  # the first epoch: compilation, caches
    for s in setups.values():
        s.phases, s.steps, s.samples = dict.fromkeys(PHASES, 0.0), 0, 0
    for c in cpu.values():
        c.clear()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            times[v].append(timed(v, args.chunk))
    for s in setups.values():
        s.close()
    if world.rank != 0:
        return
    per_step = {v: statistics.median(t) / args.chunk for v, t in times.items()}
    extra = {v: first[v] - args.steps * per_step[v] for v in variants}
    paired = {v: [a / b for a, b in zip(times[v], times[base])] for v in variants}
    paired_cpu = {v: [a / b for a, b in zip(cpu[v], cpu[base])] for v in variants}
    phases = {v: {k: 1e3 * t / max(setups[v].steps, 1) for k, t in setups[v].phases.items()} for v in variants}
    samples = {v: setups[v].samples / max(setups[v].steps, 1) for v in variants}
    result = {"np": world.size, "engine": args.engine, "job": args.job, "cpu": cpu_model(),
              "steps_per_epoch": args.steps, "chunk": args.chunk, "batch": args.batch,
              "rank0_samples_per_step": samples,
              "rounds": args.repeats, "first_epoch_s": first, "chunk_s": times,
              "median_step_ms": {v: 1e3 * t for v, t in per_step.items()},
              "paired_ratio": {v: statistics.median(r) for v, r in paired.items()},
              "paired_ratio_90ci": {v: bootstrap_median_ci(r) for v, r in paired.items()},
              "paired_cpu_ratio": {v: statistics.median(r) for v, r in paired_cpu.items()},
              "paired_cpu_ratio_90ci": {v: bootstrap_median_ci(r) for v, r in paired_cpu.items()},
              "ratio_of_totals": {v: sum(times[v]) / sum(times[base]) for v in variants},
              "first_epoch_extra_s": {v: extra[v] - extra[base] for v in variants},
              "rank0_ms_per_step": phases}
    print(f"{args.job or 'pytorch_mnist CNN'}: "
          f"{world.size} ranks ({args.engine}), {args.batch} samples per rank and step, epochs of {args.steps} steps; "
          f"{args.repeats} rounds of {args.chunk} steps of every variant")
    print(f"{'variant':<22}{'ms/step':>9}{'paired ratio [90% CI]':>24}{'CPU ratio [90% CI]':>24}{'ratio of totals':>17}"
          f"{'1st-epoch extra_s':>19}{'rank-0 samples/step':>21}")
    for v in variants:
        lo, hi = result["paired_ratio_90ci"][v]
        clo, chi = result["paired_cpu_ratio_90ci"][v]
        print(f"{v:<22}{1e3 * per_step[v]:>9.2f}{result['paired_ratio'][v]:>10.3f} [{lo:.3f}, {hi:.3f}]"
              f"{result['paired_cpu_ratio'][v]:>10.3f} [{clo:.3f}, {chi:.3f}]"
              f"{result['ratio_of_totals'][v]:>17.3f}{result['first_epoch_extra_s'][v]:>19.3f}{samples[v]:>21.2f}")
    print("where the time goes, rank 0, mean ms per step:")
    print(f"{'':<22}" + "".join(f"{k:>18}" for k in PHASES))
    for v in variants:
        print(f"{v:<22}" + "".join(f"{phases[v][k]:>18.3f}" for k in PHASES))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def cpu_model() -> str:
    """The processor's model name (from /proc/cpuinfo), so that a result says which machine it is from."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def zoo_job_names() -> list[str]:
    from bench.zoo import JOBS

    return sorted(JOBS)


def zoo_job(name: str | None) -> Any:
    if name is None:
        return None
    from bench.zoo import JOBS

    return JOBS[name]


def bootstrap_median_ci(values: list[float], level: float = 0.90, draws: int = 4000) -> tuple[float, float]:
    """Percentile bootstrap interval of the median (resampling rounds; fixed seed, so reruns agree)."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = (1 - level) / 2
    return meds[int(tail * draws)], meds[min(int((1 - tail) * draws), draws - 1)]


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
    import torch

    from bench.jobs.common import world

    world.init("horovod")  # one process: hvd.init() alone
    torch.set_num_threads(1)
    job = zoo_job(args.job)
    data = dataset(args.steps, args.batch, 1, job)
    for v in args.variants:
        s = Setup(v, data, args.batch, world, job)
        s.epoch(0, False)  # compile and warm up
        counts = count_host_reads(lambda: s.epoch(1, False))
        print(f"\n{v}: host reads per step (over {args.steps} steps, one epoch incl. its decision)")
        for (name, site), n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {n / args.steps:7.2f}  .{name:<10} {site}")
        if v != "horovod":
            prof = cProfile.Profile()
            prof.runcall(s.epoch, 2, False)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            print(f"\n{v}: cProfile of one epoch ({args.steps} steps), by own time\n{out.getvalue()}")
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2, help="ranks of the mpirun job (default 2)")
    ap.add_argument("--steps", type=int, default=100, help="steps per epoch (default 100)")
    ap.add_argument("--chunk", type=int, default=10, help="steps per timed unit (default 10)")
    ap.add_argument("--repeats", type=int, default=100,
                    help="timed rounds, one chunk of every variant in rotating order (default 100)")
    ap.add_argument("--batch", type=int, default=0,
                    help="local batch size of every rank (default: 64, or the --job's batch)")
    ap.add_argument("--job", default=None, help="a job of the workload zoo (bench.zoo) instead of the CNN")
    ap.add_argument("--quick", action="store_true", help="smoke test: 4 steps, 2 rounds (numbers meaningless)")
    ap.add_argument("--profile", action="store_true", help="one process: host reads per step and cProfile")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, horovod first (default %(default)s); ablations: "
                    + "; ".join(f"{k}: {v}" for k, v in ABLATIONS.items()))
    ap.add_argument("--json", default=None, help="also write the results to this JSON file (rank 0)")
    ap.add_argument("--engine", choices=["horovod", "torch"], default="horovod",
                    help="horovod (an mpirun job) or torch (a torchrun job: DDP; variants "
                         f"{','.join(DDP_VARIANTS)}, ddp first)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine == "torch" and args.variants == ",".join(VARIANTS):
        args.variants = ",".join(DDP_VARIANTS)
    args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    known = DDP_VARIANTS if args.engine == "torch" else VARIANTS + tuple(ABLATIONS)
    base = "ddp" if args.engine == "torch" else "horovod"
    unknown = [v for v in args.variants if v not in known]
    if unknown or args.variants[:1] != (base,):
        ap.error(f"--variants={','.join(args.variants)!r} with --engine {args.engine}: start with {base}; known: "
                 f"{', '.join(known)}")
    if args.job is not None and zoo_job_names().count(args.job) == 0:
        ap.error(f"--job={args.job!r}; choose one of {', '.join(zoo_job_names())}")
    args.batch = args.batch or (zoo_job(args.job).batch if args.job else 64)
    if args.quick:
        args.steps, args.chunk, args.repeats = 4, 2, 3
    if args.profile:
        profile(args)
        return 0
    if args.worker:
        worker(args)
        return 0
    from dynamix_hvd.tools.launchcheck import command, local_env, local_plan

    argv_ = [sys.executable, "-m", "bench.bench_overhead", "--worker", "--steps", str(args.steps), "--chunk", str(args.chunk),
             "--repeats", str(args.repeats), "--batch", str(args.batch), "--variants", ",".join(args.variants),
             "--engine", args.engine,
             *(["--job", args.job] if args.job else []), *(["--json", args.json] if args.json else [])]
    cmd = command(local_plan("torchrun" if args.engine == "torch" else "mpirun", args.np), argv_, forward=())
    return subprocess.run(cmd, cwd=REPO, env=local_env(pythonpath=REPO)).returncode


if __name__ == "__main__":
    sys.exit(main())
