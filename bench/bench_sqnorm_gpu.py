"""GPU squared-norm throughput: fused Numba-CUDA kernel vs torch, on a model-shaped gradient buffer.

Run: ``python -m bench.bench_sqnorm_gpu [--gib 1.0] [--tensors 160] [--dtypes float32,bfloat16]
[--json OUT.json]``. For each dtype, builds ~160 tensors of transformer-like shapes (about ``--gib``
GiB of bytes) as views of one flat buffer and times, with CUDA events (``--inner`` back-to-back
calls between two events, so launch gaps hide behind the GPU queue; median of ``--reps`` after
warm-up): the raw segment kernel, :func:`segment_sq_norms`, the prepared :class:`SegmentSqNorms`,
and from ``bench/sqnorm_candidates.py`` the vectorised variant :class:`VecSegmentSqNorms` and
:func:`multi_tensor_sq_norms` on the views,
``torch._foreach_norm`` over the views and ``torch.linalg.vector_norm`` of the flat buffer (the read
ceiling). Prints TB/s of bytes read and the relative error of the total and of the worst segment
against float64. If no numba kernel reaches ``--goal`` TB/s (or ``--sweep always``), it sweeps
blocks per SM and threads per block for both kernels in the same run. Without a CUDA GPU it prints
"no CUDA GPU available" and exits 0 (writing ``{"status": "skipped"}`` to ``--json``).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from bench import sqnorm_candidates as cand

Shape = Tuple[int, ...]


def model_shapes(total_bytes: int = 1 << 30, n_tensors: int = 160, itemsize: int = 4) -> List[Shape]:
    """Transformer-like parameter shapes, ``n_tensors`` of them, totalling about ``total_bytes``.

    Blocks of 8 tensors (qkv weight/bias, projection weight/bias, MLP up/down weights and biases),
    one embedding that takes up the remainder, and small norm vectors to reach ``n_tensors``.
    """
    if n_tensors < 9:
        raise ValueError(f"n_tensors={n_tensors} must be >= 9 (one block of 8 plus an embedding)")
    elems = total_bytes // itemsize
    layers = (n_tensors - 1) // 8
    d = max(8, int(math.sqrt(0.9 * elems / (12 * layers))) // 8 * 8)
    block: List[Shape] = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes = [s for _ in range(layers) for s in block]
    extra = [(d,)] * (n_tensors - 1 - len(shapes))
    used = sum(math.prod(s) for s in shapes + extra)
    shapes.insert(0, (max(1, (elems - used) // d), d))
    return shapes + extra


def offsets_of(shapes: Sequence[Shape]) -> List[int]:
    """Segment bounds (n+1 ints) of ``shapes`` packed back to back."""
    out = [0]
    for s in shapes:
        out.append(out[-1] + math.prod(s))
    return out


def summarize(times_ms: Sequence[float], nbytes: int) -> Dict[str, float]:
    """Median time and the read bandwidth it implies (TB/s)."""
    med = statistics.median(times_ms)
    return dict(ms=med, tbps=nbytes / (med * 1e-3) / 1e12)


def rel_err(value: float, ref: float) -> float:
    return abs(value - ref) / abs(ref) if ref else abs(value)


def format_table(rows: Dict[str, Dict[str, float]]) -> str:
    head = f"{'method':<34} {'median ms':>10} {'TB/s read':>10} {'rel err':>10} {'worst seg':>10}"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<34} {r['ms']:>10.3f} {r['tbps']:>10.2f} {r['err']:>10.2e} "
                     f"{r.get('seg_err', float('nan')):>10.2e}")
    return "\n".join(lines)


def cuda_time(fn: Callable[[], torch.Tensor], reps: int, warmup: int = 5,
              inner: int = 1) -> Tuple[List[float], torch.Tensor]:
    """Milliseconds per call with CUDA events on the current stream (``inner`` calls per event pair),
    and the last result."""
    for _ in range(warmup):
        res = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            res = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return times, res


def seg_error(res: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst relative error over segments (NaN when the result is not per segment)."""
    if res.numel() != ref.numel():
        return float("nan")
    got = res.detach().double().cpu()
    return float(((got - ref).abs() / ref.clamp_min(1e-300)).max())


def candidates(flat: torch.Tensor, views: List[torch.Tensor], offsets: torch.Tensor,
               sqnorm) -> Dict[str, Callable[[], torch.Tensor]]:
    cands: Dict[str, Callable[[], torch.Tensor]] = {}
    if sqnorm.backend_for(flat) == "numba-cuda":
        cands.update(kernel_variants(flat, offsets, sqnorm, [(8, 256)], vec=flat.dtype in cand.VEC_KINDS))
    else:
        print("numba-cuda unusable here (see the debug log); timing torch only")
    cands["segment_sq_norms"] = lambda: sqnorm.segment_sq_norms(flat, offsets)
    cands["SegmentSqNorms (prepared)"] = sqnorm.SegmentSqNorms(flat, offsets)
    cands["multi_tensor_sq_norms"] = lambda: cand.multi_tensor_sq_norms(views)
    cands["torch._foreach_norm"] = lambda: torch.stack(
        torch._foreach_norm(views, 2, dtype=torch.float32)).double().square()
    cands["vector_norm (flat)"] = lambda: torch.linalg.vector_norm(
        flat, dtype=torch.float32).double().square().reshape(1)
    return cands


def kernel_variants(flat: torch.Tensor, offsets: torch.Tensor, sqnorm, configs: List[Tuple[int, int]],
                    vec: bool) -> Dict[str, Callable[[], torch.Tensor]]:
    """Raw scalar-kernel launches (and vector-kernel ones) at (blocks per SM, threads) configs."""
    from numba import cuda

    dev = flat.device
    lut = flat.dtype in (torch.float16, torch.bfloat16)
    words = flat.view(torch.int16) if lut else flat
    d_off = offsets.to(dev)
    out = torch.zeros(offsets.numel() - 1, dtype=torch.float64, device=dev)
    arrays = [cuda.as_cuda_array(t, sync=False) for t in (words, cand.kernel_table(flat.dtype, dev), d_off)]
    d_out = cuda.as_cuda_array(out, sync=False)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
    cands: Dict[str, Callable[[], torch.Tensor]] = {}
    for per_sm, threads in configs:
        def raw(per_sm=per_sm, threads=threads) -> torch.Tensor:
            out.zero_()
            sqnorm.launch_segment_kernel(*arrays, d_out, lut=lut, blocks=per_sm * sms, threads=threads,
                                         stream=stream)
            return out

        cands[f"numba kernel {per_sm}/SM x{threads}"] = raw
        if vec:
            prepared = cand.VecSegmentSqNorms(flat, offsets, blocks_per_sm=per_sm, threads=threads)
            cands[f"numba vec kernel {per_sm}/SM x{threads}"] = prepared
    return cands


def run_dtype(dtype: torch.dtype, args: argparse.Namespace, sqnorm) -> List[Dict[str, object]]:
    dev = torch.device("cuda", torch.cuda.current_device())
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shapes = model_shapes(int(args.gib * (1 << 30)), args.tensors, itemsize)
    bounds = offsets_of(shapes)
    flat = torch.randn(bounds[-1], device=dev).to(dtype)
    views = [flat[a:b].view(s) for a, b, s in zip(bounds[:-1], bounds[1:], shapes)]
    offsets = torch.tensor(bounds, dtype=torch.int64)
    nbytes = flat.numel() * flat.element_size()
    seg_ref = torch.stack([v.double().square().sum() for v in views]).cpu()
    ref = float(seg_ref.sum())
    print(f"\n{torch.cuda.get_device_name(dev)}: {len(shapes)} tensors, {nbytes / 2**30:.3f} GiB {dtype}, "
          f"backend {sqnorm.backend_for(flat)}")

    def measure(cands: Dict[str, Callable[[], torch.Tensor]], stage: str) -> List[Dict[str, object]]:
        out = []
        for name, fn in cands.items():
            try:
                times, res = cuda_time(fn, args.reps, inner=args.inner)
            except Exception as exc:  # e.g. NVVM missing at the first compile: keep the other rows
                print(f"{name}: {type(exc).__name__}: {exc}")
                out.append(dict(ms=math.nan, tbps=0.0, err=math.nan, seg_err=math.nan, method=name, stage=stage,
                                dtype=str(dtype).replace("torch.", ""), error=f"{type(exc).__name__}: {exc}"[:300]))
                continue
            row = dict(summarize(times, nbytes), err=rel_err(float(res.double().sum()), ref),
                       seg_err=seg_error(res, seg_ref))
            out.append(dict(row, dtype=str(dtype).replace("torch.", ""), method=name, stage=stage,
                            spread_ms=max(times) - min(times)))
        return out

    rows = measure(candidates(flat, views, offsets, sqnorm), "main")
    numba_rows = [r for r in rows if str(r["method"]).startswith("numba")]
    best = max((float(r["tbps"]) for r in numba_rows), default=0.0)
    sweep = numba_rows and (args.sweep == "always" or (args.sweep == "auto" and best < args.goal))
    if sweep:
        print(f"best numba kernel {best:.2f} TB/s < goal {args.goal} TB/s: sweeping grid and block sizes")
        configs = [(b, t) for b in (2, 4, 16, 32) for t in (128, 256)] + [(8, 128)]
        rows += measure(kernel_variants(flat, offsets, sqnorm, configs, vec=dtype in cand.VEC_KINDS), "sweep")
    print(format_table({f"{r['method']} [{r['stage']}]": r for r in rows}))
    del flat, views
    torch.cuda.empty_cache()
    return rows


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="gradient bytes per dtype, GiB")
    ap.add_argument("--tensors", type=int, default=160)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=10, help="calls between two CUDA events")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--goal", type=float, default=3.6, help="TB/s the fused kernel should reach")
    ap.add_argument("--sweep", choices=["auto", "always", "never"], default="auto")
    ap.add_argument("--json", default="", help="write all rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU available")
        if args.json:
            Path(args.json).write_text(json.dumps({"status": "skipped", "reason": "no CUDA"}))
        return 0
    from dynamix_hvd.stats import sqnorm

    rows: List[Dict[str, object]] = []
    for name in filter(None, args.dtypes.split(",")):
        rows += run_dtype(getattr(torch, name), args, sqnorm)
    best = {d: max((float(r["tbps"]) for r in rows if r["dtype"] == d and str(r["method"]).startswith("numba")),
                   default=0.0) for d in {str(r["dtype"]) for r in rows}}
    print("best numba kernel TB/s per dtype:", {d: round(v, 3) for d, v in best.items()}, "goal", args.goal)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "status": "ok", "device": torch.cuda.get_device_name(), "gib": args.gib, "tensors": args.tensors,
            "reps": args.reps, "inner": args.inner, "goal_tbps": args.goal, "best_numba_tbps": best,
            "goal_met": all(v >= args.goal for v in best.values()) and bool(best), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
