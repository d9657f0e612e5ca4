"""GPU squared-norm throughput: fused Numba-CUDA kernel vs torch, on a model-shaped gradient buffer.

Run: ``python -m bench.bench_sqnorm_gpu [--gib 1.0] [--tensors 160] [--reps 30]``. Builds ~160
float32 tensors of transformer-like shapes (about 1 GiB) as views of one flat buffer and times, with
CUDA events (median of ``--reps`` after warm-up): the raw segment kernel on the flat buffer,
:func:`segment_sq_norms` (the wrapper: offsets cache, output allocation, launch), the prepared
:class:`SegmentSqNorms`, :func:`multi_tensor_sq_norms` on the views, ``torch._foreach_norm``
over the views, and ``torch.linalg.vector_norm`` of the flat buffer. Prints TB/s of bytes read and
the relative error of the total squared norm against a float64 reference. Without a CUDA GPU it
prints "no CUDA GPU available" and exits 0.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Callable, Dict, List, Sequence, Tuple

import torch

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
    head = f"{'method':<28} {'median ms':>10} {'TB/s read':>10} {'rel err':>10}"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<28} {r['ms']:>10.3f} {r['tbps']:>10.2f} {r['err']:>10.2e}")
    return "\n".join(lines)


def cuda_time(fn: Callable[[], torch.Tensor], reps: int, warmup: int = 5) -> Tuple[List[float], torch.Tensor]:
    """Per-call milliseconds with CUDA events on the current stream, and the last result."""
    for _ in range(warmup):
        res = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        res = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, res


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="total float32 gradient size in GiB")
    ap.add_argument("--tensors", type=int, default=160)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU available")
        return 0
    from dynamix_hvd.stats import sqnorm

    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = model_shapes(int(args.gib * (1 << 30)), args.tensors)
    bounds = offsets_of(shapes)
    flat = torch.randn(bounds[-1], device=dev)
    views = [flat[a:b].view(s) for a, b, s in zip(bounds[:-1], bounds[1:], shapes)]
    offsets = torch.tensor(bounds, dtype=torch.int64)
    nbytes = flat.numel() * flat.element_size()
    chunk = 1 << 26
    ref = sum(float(flat[i:i + chunk].double().square().sum()) for i in range(0, flat.numel(), chunk))
    print(f"{torch.cuda.get_device_name(dev)}: {len(shapes)} tensors, {nbytes / 2**30:.3f} GiB float32, "
          f"backend {sqnorm.backend_for(flat)}")

    cands: Dict[str, Callable[[], torch.Tensor]] = {}
    if sqnorm.backend_for(flat) == "numba-cuda":
        from numba import cuda

        d_off = offsets.to(dev)
        out = torch.zeros(len(shapes), dtype=torch.float64, device=dev)
        arrays = [cuda.as_cuda_array(t, sync=False) for t in (flat, sqnorm._table(flat.dtype, dev), d_off, out)]
        blocks = 8 * cuda.get_current_device().MULTIPROCESSOR_COUNT

        def raw() -> torch.Tensor:
            out.zero_()
            stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
            sqnorm.launch_segment_kernel(*arrays, lut=False, blocks=blocks, stream=stream)
            return out

        cands["numba kernel (flat)"] = raw
    else:
        print("numba-cuda unusable here (see the debug log); timing torch only")
    cands["segment_sq_norms"] = lambda: sqnorm.segment_sq_norms(flat, offsets)
    cands["SegmentSqNorms (prepared)"] = sqnorm.SegmentSqNorms(flat, offsets)
    cands["multi_tensor_sq_norms"] = lambda: sqnorm.multi_tensor_sq_norms(views)
    cands["torch._foreach_norm"] = lambda: torch.stack(torch._foreach_norm(views)).double().square()
    cands["vector_norm (flat)"] = lambda: torch.linalg.vector_norm(flat).double().square().reshape(1)

    rows = {}
    for name, fn in cands.items():
        times, res = cuda_time(fn, args.reps)
        rows[name] = dict(summarize(times, nbytes), err=rel_err(float(res.sum()), ref))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
