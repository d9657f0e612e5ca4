"""Squared-norm candidates the GPU benchmark (bench/bench_sqnorm_gpu.py) measures against the
package's kernel (`dynamix_hvd.stats.sqnorm`), which the data plane does not use:

* :func:`multi_tensor_sq_norms`: squared norms of arbitrary tensors (zero-copy when they are
  back-to-back views of one storage, otherwise staged by ``torch.cat``);
* the vectorised Numba-CUDA kernel (:func:`cuda_segment_kernel_vec`, :class:`VecSegmentSqNorms`):
  8-byte loads instead of the scalar kernel's 4/2-byte ones.

tests/test_sqnorm.py and tests/test_gpu_check.py check them (CPU, and the CUDA simulator / PTX).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dynamix_hvd.stats import sqnorm
from dynamix_hvd.stats.sqnorm import THREADS

#: Words each thread of the vector kernel reads per loop turn (its four accumulators).
UNROLL = 4
#: The dtypes the package's kernel reads (float32/float64 directly, float16/bfloat16 through a table).
FLOAT_DTYPES = (torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)

#: Largest staging buffer :func:`multi_tensor_sq_norms` allocates for scattered tensors.
MAX_STAGE_BYTES = 256 << 20


def _flat_view(group: List[torch.Tensor]) -> Optional[Tuple[torch.Tensor, np.ndarray, np.ndarray]]:
    """Zero-copy flat view when ``group`` are contiguous, ascending, non-overlapping views of one
    storage with small gaps; returns (flat, offsets, index of each tensor's segment) or None."""
    first = group[0]
    storage_ptr = first.untyped_storage().data_ptr()
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != storage_ptr for t in group):
        return None
    bounds, which = [group[0].storage_offset()], []
    for t in group:
        if t.storage_offset() < bounds[-1]:
            return None
        if t.storage_offset() > bounds[-1]:
            bounds.append(t.storage_offset())  # gap segment, dropped from the result
        which.append(len(bounds) - 1)
        bounds.append(t.storage_offset() + t.numel())
    span = bounds[-1] - bounds[0]
    if span > 2 * sum(t.numel() for t in group):
        return None
    flat = first.new_empty(0).set_(first.untyped_storage(), bounds[0], (span,))
    return flat, np.asarray(bounds, dtype=np.int64) - bounds[0], np.asarray(which)


def multi_tensor_sq_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norms of arbitrary tensors, float64, in input order (on the first tensor's device).

    Tensors are grouped by (device, dtype). A group that turns out to be back-to-back views of one
    storage is reduced zero-copy by :func:`segment_sq_norms`. Otherwise the group is gathered with
    ``torch.cat`` (one batched copy kernel on GPU) into staging buffers of at most
    :data:`MAX_STAGE_BYTES` and each is reduced by the same single-launch segment kernel.
    Why a copy: numba cannot index a device array of raw pointers without a hand-written LLVM
    intrinsic (which the simulator cannot run, so it would be untestable here), and a kernel over a
    tuple of arrays with ``literal_unroll`` recompiles for every distinct tuple type and exceeds the
    kernel parameter space at ~160 tensors (each array argument lowers to ~7 scalars). The staging
    copy costs two extra passes over memory, so gradients should live in a flat buffer.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    out = torch.zeros(len(tensors), dtype=torch.float64, device=tensors[0].device)
    groups: Dict[Tuple[str, torch.dtype], List[int]] = {}
    for k, t in enumerate(tensors):
        if t.dtype not in FLOAT_DTYPES + HALF_DTYPES:
            raise ValueError(f"tensors[{k}].dtype={t.dtype} is not float32/float64/float16/bfloat16")
        groups.setdefault((str(t.device), t.dtype), []).append(k)
    for idx in groups.values():
        group = [tensors[k].detach() for k in idx]
        view = _flat_view(group)
        if view is not None:
            flat, bounds, which = view
            res = sqnorm.segment_sq_norms(flat, torch.from_numpy(bounds))[torch.from_numpy(which).to(flat.device)]
            out[idx] = res.to(out.device)
            continue
        limit, start = MAX_STAGE_BYTES // group[0].element_size(), 0
        while start < len(group):  # greedy runs of at most `limit` elements (or one big tensor)
            stop, total = start + 1, group[start].numel()
            while stop < len(group) and total + group[stop].numel() <= limit:
                total, stop = total + group[stop].numel(), stop + 1
            part = group[start:stop]
            flat = torch.cat([t.reshape(-1) for t in part]) if len(part) > 1 else part[0].reshape(-1)
            bounds = torch.tensor([0] + [t.numel() for t in part], dtype=torch.int64).cumsum(0)
            out[idx[start:stop]] = sqnorm.segment_sq_norms(flat.contiguous(), bounds).to(out.device)
            start = stop
    return out


# ------------------------------------------------------------------- CUDA: vectorised variant
# Each thread reads 8-byte words: float32 as complex64 pairs, bfloat16 as int64 quads converted by a
# shift (exact, no table lookups). Segment edges that split a word are read element by element.
def check_flat(flat: torch.Tensor) -> None:
    """The package kernel's contract on the buffer: 1-D, contiguous, one of its four dtypes."""
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a 1-D contiguous tensor, got {type(flat).__name__} of shape "
                         f"{tuple(getattr(flat, 'shape', ()))}")
    if flat.dtype not in FLOAT_DTYPES + HALF_DTYPES:
        raise ValueError(f"flat.dtype={flat.dtype} is not float32/float64/float16/bfloat16")


def check_offsets(offsets: torch.Tensor, numel: int) -> np.ndarray:
    """The package kernel's contract on segment bounds: 1-D int64, from 0 to ``numel``,
    non-decreasing; returns them as a contiguous numpy array."""
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise ValueError(f"offsets must be a 1-D int64 tensor, got {offsets!r}")
    off = offsets.detach().cpu().numpy()
    if off.size == 0:
        raise ValueError("offsets must have length n+1 >= 1, got an empty tensor")
    if off[0] != 0 or off[-1] != numel:
        raise ValueError(f"offsets must start at 0 and end at flat.numel()={numel}, got "
                         f"offsets[0]={int(off[0])}, offsets[-1]={int(off[-1])}")
    if np.any(np.diff(off) < 0):
        bad = int(np.argmax(np.diff(off) < 0))
        raise ValueError(f"offsets must be non-decreasing, offsets[{bad}]={int(off[bad])} > "
                         f"offsets[{bad + 1}]={int(off[bad + 1])}")
    return np.ascontiguousarray(off)


def kernel_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The lookup table the package's scalar kernel takes (``launch_segment_kernel``): the float32
    value of every 16-bit pattern of a half dtype, or a one-element placeholder for float32/64."""
    if dtype not in HALF_DTYPES:
        return torch.zeros(1, dtype=torch.float32, device=device)
    bits = np.arange(1 << 16, dtype=np.uint32)
    if dtype == torch.bfloat16:
        table = (bits << 16).view(np.float32).copy()
    else:
        table = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return torch.from_numpy(table).to(device)


VEC_KINDS = {torch.float32: ("f32x2", torch.complex64, 2), torch.bfloat16: ("bf16x4", torch.int64, 4)}
_VEC_KERNELS: Dict[str, Any] = {}


def cuda_segment_kernel_vec(kind: str) -> Any:
    """Kernel ``k(x, words, offsets, out, chunk)``: ``x`` the scalar view (float32, or int16 words
    of bfloat16), ``words`` the same memory as complex64 (``f32x2``) or int64 (``bf16x4``), ``chunk``
    a multiple of ``blockDim * 4 * per_word`` elements. Same contract as :func:`cuda_segment_kernel`."""
    if kind in _VEC_KERNELS:
        return _VEC_KERNELS[kind]
    if kind not in ("f32x2", "bf16x4"):
        raise ValueError(f"kind={kind!r}; choose f32x2 or bf16x4")
    global cuda
    from numba import config, cuda, float64, int32  # module global: the simulator swaps it inside kernels

    per = 2 if kind == "f32x2" else 4
    if config.ENABLE_CUDASIM:
        def bits_f32(b):  # the simulator runs device functions as Python
            return float64(np.uint32(np.int64(b) & 0xFFFFFFFF).view(np.float32))
    else:
        from numba.cuda import libdevice

        @cuda.jit(device=True, inline="always")
        def bits_f32(b):
            return float64(libdevice.int_as_float(int32(b)))

    if kind == "f32x2":
        @cuda.jit(device=True, inline="always")
        def elem(x, i):
            v = float64(x[i])
            return v * v

        @cuda.jit(device=True, inline="always")
        def word(w, k):
            v = w[k]
            a, b = float64(v.real), float64(v.imag)
            return a * a + b * b
    else:
        @cuda.jit(device=True, inline="always")
        def elem(x, i):
            v = bits_f32((int32(x[i]) & 0xFFFF) << 16)
            return v * v

        @cuda.jit(device=True, inline="always")
        def word(w, k):
            v = w[k]
            a, b = bits_f32((v & 0xFFFF) << 16), bits_f32(((v >> 16) & 0xFFFF) << 16)
            c, d = bits_f32(((v >> 32) & 0xFFFF) << 16), bits_f32(((v >> 48) & 0xFFFF) << 16)
            return (a * a + b * b) + (c * c + d * d)

    @cuda.jit
    def kernel(x, words, offsets, out, chunk):
        sh = cuda.shared.array(THREADS, float64)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        n, nseg = x.size, offsets.size - 1
        c = cuda.blockIdx.x
        while c * chunk < n:
            lo, hi = c * chunk, min(n, c * chunk + chunk)
            left, right = 0, nseg
            while left < right:
                mid = (left + right) // 2
                if offsets[mid] > lo:
                    right = mid
                else:
                    left = mid + 1
            s = left - 1
            while s < nseg and offsets[s] < hi:
                a, b = max(lo, offsets[s]), min(hi, offsets[s + 1])
                if a < b:  # uniform across the block
                    wa, wb = (a + per - 1) // per, b // per  # whole words [wa, wb)
                    head_end = min(b, wa * per)
                    tail_start = max(head_end, wb * per)
                    acc0 = acc1 = acc2 = acc3 = 0.0
                    if a + tid < head_end:
                        acc0 += elem(x, a + tid)
                    if tail_start + tid < b:
                        acc1 += elem(x, tail_start + tid)
                    if wa < wb:
                        k = wa + tid
                        while k + 3 * nt < wb:
                            v0, v1 = word(words, k), word(words, k + nt)
                            v2, v3 = word(words, k + 2 * nt), word(words, k + 3 * nt)
                            acc0 += v0
                            acc1 += v1
                            acc2 += v2
                            acc3 += v3
                            k += 4 * nt
                        while k < wb:
                            acc0 += word(words, k)
                            k += nt
                    sh[tid] = (acc0 + acc1) + (acc2 + acc3)
                    cuda.syncthreads()
                    step = nt // 2
                    while step > 0:
                        if tid < step:
                            sh[tid] += sh[tid + step]
                        cuda.syncthreads()
                        step //= 2
                    if tid == 0:
                        cuda.atomic.add(out, s, sh[0])
                    cuda.syncthreads()
                s += 1
            c += cuda.gridDim.x

    _VEC_KERNELS[kind] = kernel
    return kernel


def launch_segment_kernel_vec(x: Any, words: Any, offsets: Any, out: Any, *, kind: str, blocks: int,
                              threads: int = THREADS, stream: Any = 0) -> None:
    """Launch :func:`cuda_segment_kernel_vec`; ``out`` must be zeroed (float64)."""
    if threads > THREADS or threads & (threads - 1):
        raise ValueError(f"threads={threads} must be a power of two <= {THREADS}")
    n = int(x.shape[0])
    if n == 0 or int(offsets.shape[0]) <= 1:
        return
    quantum = threads * UNROLL * (2 if kind == "f32x2" else 4)
    blocks = max(1, min(blocks, -(-n // quantum)))
    chunk = -(-(-(-n // blocks)) // quantum) * quantum
    kernel = cuda_segment_kernel_vec(kind)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*under-utilization.*")
        kernel[blocks, threads, stream](x, words, offsets, out, chunk)


def vec_views(flat: torch.Tensor) -> Tuple[str, torch.Tensor, torch.Tensor]:
    """(kind, scalar view, word view) of a float32/bfloat16 CUDA or CPU buffer for the vector kernel."""
    check_flat(flat)
    if flat.dtype not in VEC_KINDS:
        raise ValueError(f"flat.dtype={flat.dtype}: the vector kernel reads float32 or bfloat16 only")
    kind, word_dtype, per = VEC_KINDS[flat.dtype]
    if flat.data_ptr() % 8:
        raise ValueError(f"flat.data_ptr()={flat.data_ptr():#x} is not 8-byte aligned")
    whole = flat.numel() // per * per
    words = flat[:whole].view(word_dtype) if whole else torch.zeros(1, dtype=word_dtype, device=flat.device)
    return kind, (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat), words


class VecSegmentSqNorms:
    """Prepared vector-kernel launch for one CUDA (flat, offsets) pair: ``__call__`` returns float64
    per-segment squared norms on the device (the bench's candidate to replace the scalar kernel)."""

    def __init__(self, flat: torch.Tensor, offsets: torch.Tensor, blocks_per_sm: int = 8,
                 threads: int = THREADS) -> None:
        from numba import cuda

        off = check_offsets(offsets, flat.numel())
        self.flat = flat.detach()
        self.kind, x, words = vec_views(self.flat)
        self.device = flat.device
        self.threads = threads
        self._keep = (x, words, torch.from_numpy(off).to(flat.device))
        self._arrays = tuple(cuda.as_cuda_array(t, sync=False) for t in self._keep)
        self.blocks = blocks_per_sm * cuda.get_current_device().MULTIPROCESSOR_COUNT
        self.nseg = off.size - 1

    def __call__(self) -> torch.Tensor:
        from numba import cuda

        out = torch.zeros(self.nseg, dtype=torch.float64, device=self.device)
        stream = cuda.external_stream(torch.cuda.current_stream(self.device).cuda_stream)
        launch_segment_kernel_vec(*self._arrays[:2], self._arrays[2], cuda.as_cuda_array(out, sync=False),
                                  kind=self.kind, blocks=self.blocks, threads=self.threads, stream=stream)
        return out
