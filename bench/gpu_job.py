"""Worker: a training job through the whole dynamix_hvd stack on the GPU (on the CPU too: device auto).

Two modes (run by bench/gpu_check.sh; one rank with plain ``python``, two ranks sharing one GPU with
``horovodrun --gloo -np 2 -H localhost:2``, since NCCL refuses two ranks on one device):

``--mode train``: a small CNN with bf16 autocast (CUDA), fed by ``dx.AdaptiveLoader``, stepped by
``dx.WeightedDistributedOptimizer``, decided by ``dx.DynamixController`` with the shipped policy.
Checks: (a) the statistics (per-step local and global squared gradient norms, per-parameter norms from
the fused kernel) against a CPU float64 recomputation from the raw gradients, all-reduced in float64
on the CPU; (b) peak memory recorded from the CUDA allocator; (c) the recorded compute time against
CUDA-event device time of forward+backward; (d) the statistics overhead per step (track_grad_norms on
vs off, alternating blocks of steps; goal <= 2 %) and the decisions' overhead.

``--mode oom``: caps the process with ``torch.cuda.set_per_process_memory_fraction``, fits peak memory
over a few batch sizes with ``BatchBounds.record_memory``, finds the real failing size by bisection,
compares (goal: within 10 %), then trains through the stack starting above the cap and records the
trace: the batch shrinks, the step is redone, the bound is learned, training continues. Without CUDA
the cap, fit and bisection report "skipped: no CUDA" and ``--simulate-oom-above`` raises
``torch.OutOfMemoryError`` instead, so the stack path still runs.

Rank 0 writes ``--json``: {"status", "mode", "device", "checks": {name: {"pass": bool|None, ...}}, ...}.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import horovod.torch as hvd
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import dynamix_hvd as dx
from dynamix_hvd.control.actions import BatchBounds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["train", "oom"], default="train")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--steps", type=int, default=60, help="training steps (train: before the overhead phase)")
    ap.add_argument("--batch", type=int, default=256, help="initial local batch per rank (train)")
    ap.add_argument("--samples", type=int, default=16384, help="training samples (train)")
    ap.add_argument("--image", type=int, default=32, help="image side (train)")
    ap.add_argument("--width", type=int, default=64, help="channels of the first conv")
    ap.add_argument("--check-every", type=int, default=10, help="recompute the statistics every k steps")
    ap.add_argument("--decide-every", type=int, default=10)
    ap.add_argument("--overhead-blocks", type=int, default=6, help="blocks of --overhead-block steps, on/off")
    ap.add_argument("--overhead-block", type=int, default=10)
    ap.add_argument("--cap-gib", type=float, default=4.0, help="oom: memory cap of the process")
    ap.add_argument("--oom-image", type=int, default=64, help="oom: image side (activation memory)")
    ap.add_argument("--simulate-oom-above", type=int, default=0, help="oom without CUDA: fail above this")
    ap.add_argument("--json", default="", help="rank 0 writes the results here")
    return ap.parse_args(argv)


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch.cuda.is_available() is False")
        return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def make_cnn(width: int) -> nn.Module:
    w = width
    return nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, 2 * w, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Conv2d(2 * w, 4 * w, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 10))


def images(n: int, side: int, seed: int = 0) -> TensorDataset:
    """Ten classes, each a fixed random image plus noise: learnable, not trivial."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(10, 3, side, side, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(protos[y] + torch.randn(n, 3, side, side, generator=g), y)


class Clock:
    """Device time of a region: CUDA events on the current stream, else the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    stop = start  # an end mark; reading it later does not stall the stream in between

    def seconds(self, start: Any, end: Any = None) -> float:
        """Seconds from ``start`` to ``end`` (default: now); waits for ``end`` to complete."""
        end = self.stop() if end is None else end
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def median(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.median(xs) if xs else math.nan


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


# ------------------------------------------------------------------------------------------ train
def run_train(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    rank, size = hvd.rank(), hvd.size()
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = make_cnn(args.width).to(dev)
    params = [p for p in model.parameters()]
    raw: list[torch.Tensor | None] = [None] * len(params)
    capture = {"on": False}

    def keep_raw(i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:  # registered before the optimizer's: the unscaled local mean
            if capture["on"]:
                raw[i] = grad.detach().clone()
        return hook

    for i, p in enumerate(params):
        p.register_hook(keep_raw(i))
    data = images(args.samples, args.image)
    loader = dx.AdaptiveLoader(data, [args.batch] * size, rank, seed=1, device=dev, pin_memory=cuda)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                          model.named_parameters(), loader)
    epochs = math.ceil((args.steps + 2 * args.overhead_blocks * args.overhead_block) * args.batch * size
                       / args.samples) + 1
    controller = dx.DynamixController(loader, opt, dx.ControllerConfig(
        policy="ppo", decide_every_steps=args.decide_every, total_epochs=epochs, max_batch=4 * args.batch),
        device=dev, model=model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    clock = Clock(dev)
    checks: list[dict[str, float]] = []
    steps: list[dict[str, Any]] = []
    callbacks = list(loader.step_end_callbacks)
    total_train = args.steps + 2 * args.overhead_blocks * args.overhead_block
    step, epoch = 0, 0
    while step < total_train:  # the policy may grow the batch: as many epochs as the steps need
        loader.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            if step >= total_train:
                break
            overhead_phase = step >= args.steps
            if overhead_phase and loader.step_end_callbacks:
                loader.step_end_callbacks.clear()  # no decisions while timing on/off blocks
            stats_on = not overhead_phase or ((step - args.steps) // args.overhead_block) % 2 == 0
            opt.track_grad_norms = stats_on
            check = not overhead_phase and step % args.check_every == 0
            capture["on"] = check
            t_wall, t_dev = time.perf_counter(), clock.start()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad()
            t_fb = clock.start()
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            t_fb_end = clock.stop()  # read after step(): a sync here would change what the library sees
            opt.step()
            step_dev_s, step_wall_s = clock.seconds(t_dev), time.perf_counter() - t_wall
            fb_s = clock.seconds(t_fb, t_fb_end)
            rec = loader.tracker.records[-1]
            my_peak = int(torch.cuda.max_memory_allocated(dev)) if cuda else 0
            if not overhead_phase:
                controller.record_loss(loss)
            steps.append({"step": step, "phase": "overhead" if overhead_phase else "train", "stats_on": stats_on,
                          "local_batch": rec.local_batch, "status": rec.status, "compute_s": rec.compute_s,
                          "sync_wait_s": rec.sync_wait_s, "step_s": rec.step_s, "device_fb_s": fb_s,
                          "step_device_s": step_dev_s, "step_wall_s": step_wall_s,
                          "peak_memory_bytes": rec.peak_memory_bytes, "memory_kind": rec.memory_kind,
                          "my_peak_bytes": my_peak, "checked": check})
            if check and rec.status == "ok":
                checks.append(recompute(rec, params, raw, opt, step, loader))
            step += 1
    loader.step_end_callbacks[:] = callbacks
    return {"rank": rank, "steps": steps, "checks": checks, "sqnorm_backend": opt.sqnorm_backend,
            "stats_kernel_s": time_stats_kernel(opt, clock),
            "decisions": [{"sizes": d.get("sizes"), "overhead_s": d.get("overhead_s")} for d in controller.history],
            "skipped": dict(opt.skipped_steps)}


def recompute(rec: Any, params: list[torch.Tensor], raw: list[torch.Tensor | None], opt: Any, step: int,
              loader: Any) -> dict[str, float]:
    """The step's statistics from scratch: CPU float64 from the raw local gradients."""
    counts = loader.current_step.counts
    weight = counts[loader.rank] / sum(counts)
    local = [r.double().cpu() if r is not None else torch.zeros(p.shape, dtype=torch.float64)
             for r, p in zip(raw, params)]
    local_sq = sum(float((g * g).sum()) for g in local)
    flat = torch.cat([g.reshape(-1) for g in local]) * weight
    glob = hvd.allreduce(flat, op=hvd.Sum, name=f"gpu_job.ref.{step}")  # float64, on the CPU
    glob_sq = float((glob * glob).sum())
    synced = [p.grad.detach().double().cpu() for p in params]  # the global mean gradient, after step
    fused = opt.flat.sq_norms().cpu().tolist()  # the fused kernel on that synchronised buffer
    seg = max(rel(f, float((g * g).sum())) for f, g in zip(fused, synced))
    synced_flat = torch.cat([g.reshape(-1) for g in synced])
    for i in range(len(raw)):
        raw[i] = None
    return {"step": step, "local_sq_err": rel(rec.local_grad_sq, local_sq),
            "global_sq_err": rel(rec.global_grad_sq, glob_sq), "fused_per_param_err": seg,
            "allreduce_rel_err": float((synced_flat - glob).norm() / glob.norm()),
            "local_sq": local_sq, "global_sq": glob_sq}


def time_stats_kernel(opt: Any, clock: Clock, reps: int = 20) -> float:
    """Median time of the fused per-parameter norm pass alone (what each step adds after allreduce)."""
    times = []
    for _ in range(reps):
        t = clock.start()
        opt.flat.sq_norms()
        times.append(clock.seconds(t))
    return median(times)


def summarize_train(ranks: list[dict[str, Any]], dev: torch.device) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    checks = [c for r in ranks for c in r["checks"]]
    train = [s for r in ranks for s in r["steps"] if s["phase"] == "train" and s["status"] == "ok"
             and not s["checked"] and s["step"] > 1]  # the first steps warm up
    over = [s for r in ranks for s in r["steps"] if s["phase"] == "overhead" and s["status"] == "ok"]
    out: dict[str, Any] = {}
    worst = {k: max((c[k] for c in checks), default=math.nan)
             for k in ("local_sq_err", "global_sq_err", "fused_per_param_err", "allreduce_rel_err")}
    # The local norms are taken in the gradient's precision (float32 here): ~1e-7. The fused kernel on
    # CUDA accumulates in float64 (~1e-15); the CPU data plane's dot products in float32 (~1e-7).
    # The global ones went through a float32 allreduce too (sums of two ranks rounded): ~1e-7.
    fused_tol = 1e-9 if cuda else 1e-5
    out["statistics_match_float64"] = dict(worst, checked_steps=len(checks), pass_=bool(checks)
                                           and worst["local_sq_err"] < 1e-5 and worst["fused_per_param_err"] < fused_tol
                                           and worst["global_sq_err"] < 1e-5 and worst["allreduce_rel_err"] < 1e-5)
    kinds = sorted({s["memory_kind"] for r in ranks for s in r["steps"]})
    peaks = [(s["peak_memory_bytes"], s["my_peak_bytes"]) for s in train]
    out["peak_memory_from_cuda_allocator"] = {
        "kinds": kinds, "median_peak_mib": median([p / 2**20 for p, _ in peaks]),
        "pass_": (kinds == ["cuda"] and all(0 < p <= m for p, m in peaks)) if cuda else None,
        **({} if cuda else {"reason": "skipped: no CUDA"})}
    dev_fb = median([s["device_fb_s"] for s in train])
    lib = median([s["compute_s"] for s in train])
    out["compute_time_is_device_time"] = {
        "device_forward_backward_ms": 1e3 * dev_fb, "library_compute_ms": 1e3 * lib,
        "library_sync_wait_ms": 1e3 * median([s["sync_wait_s"] for s in train]),
        "ratio_library_over_device": lib / dev_fb if dev_fb else math.nan,
        "pass_": (abs(lib / dev_fb - 1) < 0.2) if cuda else None,
        **({} if cuda else {"reason": "skipped: no CUDA (host clock on both sides)"})}
    on = [s for s in over if s["stats_on"]]
    off = [s for s in over if not s["stats_on"]]
    res: dict[str, Any] = {}
    for key in ("step_device_s", "step_wall_s"):
        m_on, m_off = median([s[key] for s in on]), median([s[key] for s in off])
        res[key.replace("_s", "_ms_on")], res[key.replace("_s", "_ms_off")] = 1e3 * m_on, 1e3 * m_off
        res[key.replace("_s", "_overhead_pct")] = 100 * (m_on / m_off - 1) if m_off else math.nan
    step_ms = 1e3 * median([s["step_wall_s"] for s in train])
    res["fused_kernel_ms"] = 1e3 * median([r["stats_kernel_s"] for r in ranks])
    res["fused_kernel_pct_of_step"] = 100 * res["fused_kernel_ms"] / step_ms if step_ms else math.nan
    dec = [d["overhead_s"] for d in ranks[0]["decisions"] if d["overhead_s"] is not None]
    n_train = sum(1 for s in ranks[0]["steps"] if s["phase"] == "train")
    res["decision_ms_per_step"] = 1e3 * sum(dec) / max(n_train, 1)
    res["decision_pct_of_step"] = 100 * res["decision_ms_per_step"] / step_ms if step_ms else math.nan
    res["pass_"] = bool(res["step_wall_ms_overhead_pct"] <= 2.0) if cuda else None
    if not cuda:
        res["reason"] = "skipped: no CUDA (CPU timings here are not the goal)"
    out["statistics_overhead"] = res
    out["median_step_ms"] = step_ms
    out["sizes_decided"] = [d["sizes"] for d in ranks[0]["decisions"]]
    out["sqnorm_backend"] = sorted({r["sqnorm_backend"] for r in ranks})
    return {k: _rename(v) for k, v in out.items()}


def _rename(v: Any) -> Any:
    return {("pass" if k == "pass_" else k): x for k, x in v.items()} if isinstance(v, dict) else v


# -------------------------------------------------------------------------------------------- oom
class IndexImages(torch.utils.data.Dataset):
    """Indices and labels only; images are drawn on the device (big batches, no host data)."""

    def __init__(self, n: int) -> None:
        self.y = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return i, self.y[i]


def oom_batch(y: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    return protos[y] + torch.randn((len(y), *protos.shape[1:]), device=protos.device)


def try_size(model: nn.Module, protos: torch.Tensor, b: int) -> int | None:
    """Peak allocated bytes of one forward+backward at batch b, or None if it ran out of memory."""
    dev = protos.device
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        y = torch.randint(0, 10, (b,), device=dev)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(oom_batch(y, protos)), y)
        loss.backward()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev))
    except RuntimeError as exc:  # torch.OutOfMemoryError is one; cuDNN reports failed allocations its own way
        text = str(exc)
        if isinstance(exc, torch.OutOfMemoryError) or any(
                m in text for m in ("out of memory", "CUDNN_STATUS_ALLOC_FAILED", "NOT_ENOUGH_WORKSPACE")):
            return None
        raise
    finally:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def run_oom(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = make_cnn(args.width).to(dev)
    side = args.oom_image if cuda else 8
    protos = torch.randn(10, 3, side, side, device=dev)
    out: dict[str, Any] = {"rank": hvd.rank()}
    if cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        frac = min(1.0, args.cap_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(frac, dev)
        cap = int(frac * total)
        fit = BatchBounds(1, max_batch=10**7, memory_safety=1.0)
        probes = {}
        for b in (64, 128, 256, 512):
            probes[b] = try_size(model, protos, b)
            if probes[b] is None:
                raise RuntimeError(f"batch {b} does not fit under a {args.cap_gib} GiB cap; raise --cap-gib")
            fit.record_memory(0, b, probes[b], cap)
        predicted_fail = fit.upper(0) + 1
        library = BatchBounds(1, max_batch=10**7)  # the controller's default safety margin (0.9)
        for b, peak in probes.items():
            library.record_memory(0, b, peak, cap)
        out["library_bound_at_default_safety"] = library.upper(0)
        ok, bad = 512, 1024
        while try_size(model, protos, bad) is not None:  # grow until the cap bites
            ok, bad = bad, bad * 2
            if bad > 1 << 18:
                raise RuntimeError(f"batch {ok} still fits under {args.cap_gib} GiB; lower --cap-gib")
        while bad - ok > max(2, ok // 200):  # bisect to 0.5 %
            mid = (ok + bad) // 2
            ok, bad = (mid, bad) if try_size(model, protos, mid) is not None else (ok, mid)
        out.update(cap_bytes=cap, fraction=frac, probe_peaks=probes, predicted_fail=predicted_fail,
                   actual_fail=bad, largest_fit=ok, fit_error=rel(predicted_fail, bad))
        fail_above = bad - 1
    else:
        fail_above = args.simulate_oom_above or 40
        out.update(reason="skipped: no CUDA (cap, fit and bisection); OOM simulated above "
                          f"{fail_above} samples", actual_fail=fail_above + 1)
    start = int(1.5 * (fail_above + 1))
    out["trace"] = train_through_oom(model, protos, dev, start, args, None if cuda else fail_above)
    return out


def train_through_oom(model: nn.Module, protos: torch.Tensor, dev: torch.device, start: int,
                      args: argparse.Namespace, simulate_above: int | None) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    size = hvd.size()
    data = IndexImages(max(64 * start, 4096))
    loader = dx.AdaptiveLoader(data, [start] * size, hvd.rank(), seed=2, device=dev)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                          loader)
    controller = dx.DynamixController(loader, opt, dx.ControllerConfig(
        policy="ppo", decide_every_steps=5, max_batch=4 * start, total_epochs=4), device=dev, model=model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    trace = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        for idx, y in loader:
            if len(trace) >= args.steps:
                break
            opt.zero_grad()
            loss = None
            with opt.guard():
                if simulate_above is not None and len(y) > simulate_above:
                    raise torch.OutOfMemoryError(f"simulated: {len(y)} samples > {simulate_above}")
                y = y.to(dev)
                with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = F.cross_entropy(model(oom_batch(y, protos)), y)
                loss.backward()
            opt.step()
            rec = loader.tracker.records[-1]
            if loss is not None and rec.status == "ok":
                controller.record_loss(loss)
            trace.append({"step": len(trace), "local_batch": rec.local_batch, "status": rec.status,
                          "peak_mib": rec.peak_memory_bytes / 2**20, "memory_kind": rec.memory_kind,
                          "bound": controller.bounds.upper(hvd.rank()), "next_size": loader.batch_sizes[hvd.rank()]})
        if len(trace) >= args.steps:
            break
    statuses = [t["status"] for t in trace]
    first_ok = statuses.index("ok") if "ok" in statuses else len(statuses)
    return {"start": start, "steps": trace, "ooms": statuses.count("oom"),
            "ooms_after_first_ok": statuses[first_ok:].count("oom"), "ok_steps": statuses.count("ok"),
            "final_bound": controller.bounds.upper(hvd.rank()), "final_size": loader.batch_sizes[hvd.rank()],
            "sampler_total_bytes": controller.resources.latest().mem_total_bytes,  # what the memory fit divides
            "budget": controller.memory_budget.to_dict(),
            "first_failed": next((s["local_batch"] for s in trace if s["status"] == "oom"), 0),
            "largest_after_oom": max((s["local_batch"] for i, s in enumerate(trace) if s["status"] == "ok"
                                      and any(p["status"] == "oom" for p in trace[:i])), default=0),
            "skipped": dict(opt.skipped_steps)}


def summarize_oom(ranks: list[dict[str, Any]], dev: torch.device) -> dict[str, Any]:
    r = ranks[0]
    t = r["trace"]
    steps = t["steps"]
    shrank = bool(steps) and steps[0]["status"] == "oom" and any(s["local_batch"] < t["start"] for s in steps)
    out = {"oom_recovery": {
        "pass": shrank and t["ok_steps"] >= max(1, len(steps) // 2) and t["final_bound"] < r["actual_fail"],
        "start": t["start"], "ooms": t["ooms"], "ooms_after_first_ok": t["ooms_after_first_ok"],
        "ok_steps": t["ok_steps"], "final_bound": t["final_bound"], "actual_fail": r["actual_fail"],
        "controller_sees_total_gib": t["sampler_total_bytes"] / 2**30,
        "trace": [f"{s['step']}:{s['local_batch']}:{s['status']}:{s['bound']}" for s in steps]}}
    # the size that ran out of memory is never tried again, whatever the memory fits say later
    out["oom_size_never_again"] = {"pass": t["largest_after_oom"] < t["first_failed"] if t["first_failed"] else None,
                                   "first_failed": t["first_failed"], "largest_after_oom": t["largest_after_oom"]}
    if dev.type == "cuda":
        # the budget is this process's cap (total x per-process fraction), not the device's memory
        out["budget_is_the_process_cap"] = {"pass": abs(t["budget"]["bytes"] - r["cap_bytes"]) <= 2**20,
                                            "budget": t["budget"], "cap_bytes": r["cap_bytes"]}
        out["memory_fit_predicts_failure"] = {
            "pass": r["fit_error"] <= 0.10, "predicted_fail": r["predicted_fail"], "actual_fail": r["actual_fail"],
            "error": r["fit_error"], "cap_gib": r["cap_bytes"] / 2**30,
            "probe_peaks_mib": {k: (v or 0) / 2**20 for k, v in r["probe_peaks"].items()}}
    else:
        out["memory_fit_predicts_failure"] = {"pass": None, "reason": "skipped: no CUDA"}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    dev = pick_device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    mine = run_train(args, dev) if args.mode == "train" else run_oom(args, dev)
    ranks = hvd.allgather_object(mine, name="gpu_job.results")
    if hvd.rank() != 0:
        return 0
    summary = summarize_train(ranks, dev) if args.mode == "train" else summarize_oom(ranks, dev)
    checks = {k: v for k, v in summary.items() if isinstance(v, dict) and "pass" in v}
    result = {"status": "ok", "mode": args.mode, "ranks": hvd.size(), "device": str(dev),
              "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "wall_s": time.perf_counter() - t0, "checks": checks,
              **{k: v for k, v in summary.items() if k not in checks}, "raw": ranks}
    for name, c in checks.items():
        shown = {k: v for k, v in c.items() if k != "trace"}
        print(f"[gpu_job] {args.mode} x{hvd.size()} {name}: {json.dumps(shown, default=str)}", flush=True)
    if args.mode == "oom":
        print("[gpu_job] oom trace (step:batch:status:bound):", " ".join(checks["oom_recovery"]["trace"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
