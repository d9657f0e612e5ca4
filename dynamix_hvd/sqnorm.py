"""Fused squared L2 norms of gradient segments, accumulated in float64.

The data plane keeps every parameter's gradient as a view into one contiguous flat buffer per
(device, dtype), so per-parameter squared norms are *segment* sums of squares over that buffer.
:func:`segment_sq_norms` reads the buffer once, with no Python loop over segments:

* CUDA tensors: a Numba-CUDA kernel (contiguous chunk per block, grid-stride over chunks, 4-way
  unrolled coalesced loads, float64 accumulation, shared-memory block reduction, one float64 atomic
  per (block, segment) it touches), launched zero-copy via ``__cuda_array_interface__`` on the
  current torch stream. Atomics make the summation order vary run to run at the 1e-16 level.
* CPU tensors: a ``numba.njit`` loop (vectorised float64 reduction; chunked ``prange`` for large
  buffers), zero-copy on the numpy view.
* 16-bit floats (float16, bfloat16) are read as raw 16-bit words and converted through a 65,536-entry
  float32 table (exact), because numba has no CPU float16/bfloat16 arithmetic.
* ``torch`` fallback (``torch.segment_reduce`` in float64) when numba is missing, CUDA is unusable
  through numba, or ``DYNAMIX_SQNORM_BACKEND=torch`` is set.

``numba.cuda`` is imported only when a CUDA tensor is seen, so CPU-only hosts never touch it.
"""
from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

log = logging.getLogger(__name__)

#: Threads per block; also the static shared-memory size of the CUDA kernel (power of two).
THREADS = 256
_UNROLL = 4
#: Buffers at least this long use the parallel CPU kernel. On the 2-core test VM one core already
#: streams ~40 GB/s and prange gained nothing (workqueue) or stalled ~24 ms per call (omp layer next
#: to torch's OpenMP), so the default keeps model-sized buffers serial. Env: DYNAMIX_SQNORM_PARALLEL_MIN.
PARALLEL_MIN_ELEMS = int(os.environ.get("DYNAMIX_SQNORM_PARALLEL_MIN", 1 << 26))
#: Largest staging buffer :func:`multi_tensor_sq_norms` allocates for scattered tensors.
MAX_STAGE_BYTES = 256 << 20
_FLOAT_DTYPES = (torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)

try:  # numba (CPU) is a hard dependency, but keep the package importable without it.
    import numba
    from numba import njit, prange
    from numba.core import types as _nbtypes
    from numba.extending import overload
except ImportError:  # pragma: no cover - exercised only on broken installs
    numba = None


def _half_table(dtype: torch.dtype) -> np.ndarray:
    """float32 value of every 16-bit pattern of ``dtype`` (exact: both formats embed in float32)."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    if dtype == torch.bfloat16:
        return (bits << 16).view(np.float32).copy()
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


_TABLES: Dict[Tuple[torch.dtype, str], torch.Tensor] = {}


def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, str(device))
    if key not in _TABLES:
        if dtype in _HALF_DTYPES:
            _TABLES[key] = torch.from_numpy(_half_table(dtype)).to(device)
        else:  # unused placeholder so both kernel variants share one signature
            _TABLES[key] = torch.zeros(1, dtype=torch.float32, device=device)
    return _TABLES[key]


# ----------------------------------------------------------------------------------------- CPU
if numba is not None:
    _FASTMATH = {"reassoc", "contract"}  # lets LLVM vectorise the reduction; keeps NaN/Inf semantics

    def _sq(x, table, i):  # pragma: no cover - replaced by the overload inside jitted code
        raise NotImplementedError

    @overload(_sq, inline="always")
    def _sq_impl(x, table, i):
        if isinstance(x.dtype, _nbtypes.Integer):
            def impl(x, table, i):
                v = np.float64(table[np.int64(x[i]) & 0xFFFF])
                return v * v
        else:
            def impl(x, table, i):
                v = np.float64(x[i])
                return v * v
        return impl

    @njit(cache=True, fastmath=_FASTMATH)
    def _span(x, table, a, b):
        # Index a slice with range(size): the index is provably >= 0, so numba emits no negative-
        # index wraparound and LLVM vectorises with plain loads (a loop over range(a, b) gathers).
        xs = x[a:b]
        acc = 0.0
        for i in range(xs.size):
            acc += _sq(xs, table, i)
        return acc

    @njit(cache=True)
    def _segments_serial(x, table, offsets, out):
        for s in range(offsets.size - 1):
            out[s] = _span(x, table, offsets[s], offsets[s + 1])

    @njit(cache=True, parallel=True)
    def _segments_parallel(x, table, offsets, out, nchunks):
        # Each chunk owns the segments that lie wholly inside it (direct write); its first and last
        # (possibly shared) segments go to per-chunk slots that are added serially afterwards.
        n = x.size
        nseg = offsets.size - 1
        chunk = (n + nchunks - 1) // nchunks
        first_seg = np.full(nchunks, -1, np.int64)
        last_seg = np.full(nchunks, -1, np.int64)
        first_sum = np.zeros(nchunks)
        last_sum = np.zeros(nchunks)
        for c in prange(nchunks):
            lo = c * chunk
            hi = min(n, lo + chunk)
            if lo >= hi:
                continue
            s = np.searchsorted(offsets, lo, side="right") - 1
            first = s
            while s < nseg and offsets[s] < hi:
                v = _span(x, table, max(lo, offsets[s]), min(hi, offsets[s + 1]))
                if s == first:
                    first_seg[c] = s
                    first_sum[c] = v
                elif offsets[s + 1] > hi:
                    last_seg[c] = s
                    last_sum[c] = v
                else:
                    out[s] = v
                s += 1
        for c in range(nchunks):
            if first_seg[c] >= 0:
                out[first_seg[c]] += first_sum[c]
            if last_seg[c] >= 0:
                out[last_seg[c]] += last_sum[c]


def _cpu_words(flat: torch.Tensor) -> np.ndarray:
    if flat.dtype in _HALF_DTYPES:
        return flat.view(torch.int16).numpy()
    return flat.numpy()


def _segment_cpu(flat: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    out = np.zeros(offsets.size - 1, dtype=np.float64)
    x = _cpu_words(flat)
    table = _table(flat.dtype, flat.device).numpy()
    nthreads = numba.get_num_threads()
    if x.size >= PARALLEL_MIN_ELEMS and nthreads > 1:
        _segments_parallel(x, table, offsets, out, 4 * nthreads)
    else:
        _segments_serial(x, table, offsets, out)
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------------------- CUDA
_CUDA_KERNELS: Dict[bool, Any] = {}
cuda: Any = None  # numba.cuda, bound on first use only


def cuda_segment_kernel(lut: bool) -> Any:
    """The Numba-CUDA kernel ``k(x, table, offsets, out, chunk)`` (built on first use).

    ``x``: 1-D device array of floats, or of 16-bit words when ``lut`` (converted through ``table``);
    ``offsets``: int64 segment bounds; ``out``: zeroed float64 of ``len(offsets) - 1``; ``chunk``:
    elements per block-chunk, a multiple of ``blockDim * 4``. ``blockDim`` must be a power of two
    <= :data:`THREADS`. Works on the CUDA simulator with numpy-backed device arrays.
    """
    if lut in _CUDA_KERNELS:
        return _CUDA_KERNELS[lut]
    global cuda
    from numba import cuda, float64, int32  # module global: the simulator swaps it inside kernels

    if lut:
        @cuda.jit(device=True, inline="always")
        def load(x, table, i):
            return float64(table[int32(x[i]) & 0xFFFF])
    else:
        @cuda.jit(device=True, inline="always")
        def load(x, table, i):
            return float64(x[i])

    @cuda.jit
    def kernel(x, table, offsets, out, chunk):
        sh = cuda.shared.array(THREADS, float64)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        n = x.size
        nseg = offsets.size - 1
        c = cuda.blockIdx.x
        while c * chunk < n:  # grid-stride over block-sized chunks
            lo = c * chunk
            hi = min(n, lo + chunk)
            left = 0  # first j with offsets[j] > lo (exists: offsets[nseg] == n > lo)
            right = nseg
            while left < right:
                mid = (left + right) // 2
                if offsets[mid] > lo:
                    right = mid
                else:
                    left = mid + 1
            s = left - 1
            while s < nseg and offsets[s] < hi:
                a = max(lo, offsets[s])
                b = min(hi, offsets[s + 1])
                if a < b:  # uniform across the block, so the barriers below are safe
                    acc0 = 0.0
                    acc1 = 0.0
                    acc2 = 0.0
                    acc3 = 0.0
                    i = a + tid
                    while i + 3 * nt < b:
                        v0 = load(x, table, i)
                        v1 = load(x, table, i + nt)
                        v2 = load(x, table, i + 2 * nt)
                        v3 = load(x, table, i + 3 * nt)
                        acc0 += v0 * v0
                        acc1 += v1 * v1
                        acc2 += v2 * v2
                        acc3 += v3 * v3
                        i += 4 * nt
                    while i < b:
                        v0 = load(x, table, i)
                        acc0 += v0 * v0
                        i += nt
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

    _CUDA_KERNELS[lut] = kernel
    return kernel


def launch_segment_kernel(x: Any, table: Any, offsets: Any, out: Any, *, lut: bool, blocks: int,
                          threads: int = THREADS, stream: Any = 0) -> None:
    """Launch :func:`cuda_segment_kernel` on device arrays; ``out`` must be zeroed (float64)."""
    if threads > THREADS or threads & (threads - 1):
        raise ValueError(f"threads={threads} must be a power of two <= {THREADS}")
    n = int(x.shape[0])
    if n == 0 or int(offsets.shape[0]) <= 1:
        return
    blocks = max(1, min(blocks, -(-n // (threads * _UNROLL))))
    quantum = threads * _UNROLL
    per_block = -(-n // blocks)
    chunk = -(-per_block // quantum) * quantum
    kernel = cuda_segment_kernel(lut)
    with warnings.catch_warnings():  # small buffers get small grids on purpose
        warnings.filterwarnings("ignore", message=".*under-utilization.*")
        kernel[blocks, threads, stream](x, table, offsets, out, chunk)


_SM_COUNT: Dict[int, int] = {}
_DEVICE_OFFSETS: Dict[Tuple[str, bytes], torch.Tensor] = {}


def _segment_cuda(flat: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    from numba import cuda

    dev = flat.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    key = (str(dev), offsets.tobytes())
    d_off = _DEVICE_OFFSETS.get(key)
    if d_off is None:
        if len(_DEVICE_OFFSETS) > 64:
            _DEVICE_OFFSETS.clear()
        d_off = _DEVICE_OFFSETS[key] = torch.from_numpy(offsets).to(dev)
    out = torch.zeros(offsets.size - 1, dtype=torch.float64, device=dev)
    lut = flat.dtype in _HALF_DTYPES
    words = flat.view(torch.int16) if lut else flat
    with cuda.gpus[index]:
        if index not in _SM_COUNT:
            _SM_COUNT[index] = cuda.get_current_device().MULTIPROCESSOR_COUNT
        stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
        launch_segment_kernel(
            cuda.as_cuda_array(words, sync=False), cuda.as_cuda_array(_table(flat.dtype, dev), sync=False),
            cuda.as_cuda_array(d_off, sync=False), cuda.as_cuda_array(out, sync=False),
            lut=lut, blocks=8 * _SM_COUNT[index], stream=stream)
    return out


# --------------------------------------------------------------------------- torch fallback, API
def _segment_torch(flat: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    lengths = torch.from_numpy(np.diff(offsets)).to(flat.device)
    if lengths.numel() == 0:
        return torch.zeros(0, dtype=torch.float64, device=flat.device)
    sq = flat.to(torch.float64).square()
    return torch.segment_reduce(sq, "sum", lengths=lengths, unsafe=True)


_CUDA_OK: Optional[bool] = None
_LOGGED: set = set()


def _numba_cuda_ok() -> bool:
    global _CUDA_OK
    if _CUDA_OK is None:
        try:
            from numba import cuda

            _CUDA_OK = bool(cuda.is_available())
        except Exception as exc:  # ImportError, CudaSupportError, NVVM lookup errors, ...
            log.debug("numba.cuda unusable (%s); CUDA tensors use the torch backend", exc)
            _CUDA_OK = False
    return _CUDA_OK


def backend_for(tensor: torch.Tensor) -> str:
    """Backend that :func:`segment_sq_norms` uses for ``tensor``: numba-cuda, numba-cpu or torch."""
    if os.environ.get("DYNAMIX_SQNORM_BACKEND", "") == "torch" or numba is None:
        choice = "torch"
    elif tensor.is_cuda:
        choice = "numba-cuda" if _numba_cuda_ok() else "torch"
    elif tensor.device.type == "cpu":
        choice = "numba-cpu"
    else:
        choice = "torch"
    key = (tensor.device.type, choice)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.debug("squared norms of %s tensors: %s backend", tensor.device.type, choice)
    return choice


def _check_offsets(offsets: torch.Tensor, numel: int) -> np.ndarray:
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise ValueError(f"offsets must be a 1-D int64 tensor, got {offsets!r}")
    off = offsets.detach().cpu().numpy()
    if off.size == 0:
        raise ValueError("offsets must have length n+1 >= 1, got an empty tensor")
    if off[0] != 0 or off[-1] != numel:
        raise ValueError(f"offsets must start at 0 and end at flat.numel()={numel}, got "
                         f"offsets[0]={int(off[0])}, offsets[-1]={int(off[-1])}")
    if off.size > 1 and np.any(np.diff(off) < 0):
        bad = int(np.argmax(np.diff(off) < 0))
        raise ValueError(f"offsets must be non-decreasing, offsets[{bad}]={int(off[bad])} > "
                         f"offsets[{bad + 1}]={int(off[bad + 1])}")
    return np.ascontiguousarray(off)


def segment_sq_norms(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-segment sums of squares of ``flat`` (float64, on ``flat``'s device), in one pass.

    ``flat``: 1-D contiguous float32/float64/float16/bfloat16 tensor; ``offsets``: int64 tensor of
    n+1 non-decreasing bounds with ``offsets[0] == 0`` and ``offsets[-1] == flat.numel()``; segment
    ``s`` is ``flat[offsets[s]:offsets[s+1]]`` (empty segments give 0). NaN/Inf propagate.
    """
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a 1-D contiguous tensor, got shape "
                         f"{tuple(getattr(flat, 'shape', ()))} (contiguous="
                         f"{getattr(flat, 'is_contiguous', lambda: None)()})")
    if flat.dtype not in _FLOAT_DTYPES + _HALF_DTYPES:
        raise ValueError(f"flat.dtype={flat.dtype} is not float32/float64/float16/bfloat16")
    off = _check_offsets(offsets, flat.numel())
    flat = flat.detach()
    backend = backend_for(flat)
    if backend == "numba-cuda":
        return _segment_cuda(flat, off)
    if backend == "numba-cpu":
        return _segment_cpu(flat, off)
    return _segment_torch(flat, off)


def _flat_view(group: List[torch.Tensor]) -> Optional[Tuple[torch.Tensor, np.ndarray, np.ndarray]]:
    """Zero-copy flat view when ``group`` are contiguous, ascending, non-overlapping views of one
    storage with small gaps; returns (flat, offsets, index of each tensor's segment) or None."""
    first = group[0]
    storage_ptr = first.untyped_storage().data_ptr()
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != storage_ptr for t in group):
        return None
    starts = [t.storage_offset() for t in group]
    bounds: List[int] = [starts[0]]
    which: List[int] = []
    for k, t in enumerate(group):
        if starts[k] < bounds[-1]:
            return None
        if starts[k] > bounds[-1]:
            bounds.append(starts[k])  # gap segment, dropped from the result
        which.append(len(bounds) - 1)
        bounds.append(starts[k] + t.numel())
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
        if t.dtype not in _FLOAT_DTYPES + _HALF_DTYPES:
            raise ValueError(f"tensors[{k}].dtype={t.dtype} is not float32/float64/float16/bfloat16")
        groups.setdefault((str(t.device), t.dtype), []).append(k)
    for idx in groups.values():
        group = [tensors[k].detach() for k in idx]
        view = _flat_view(group)
        if view is not None:
            flat, bounds, which = view
            res = segment_sq_norms(flat, torch.from_numpy(bounds))[torch.from_numpy(which).to(flat.device)]
            out[idx] = res.to(out.device)
            continue
        limit = max(1, MAX_STAGE_BYTES // group[0].element_size())
        start = 0
        while start < len(group):
            stop, total = start, 0
            while stop < len(group) and (stop == start or total + group[stop].numel() <= limit):
                total += group[stop].numel()
                stop += 1
            part = group[start:stop]
            flat = part[0].reshape(-1) if len(part) == 1 else torch.cat([t.reshape(-1) for t in part])
            bounds = np.concatenate([[0], np.cumsum([t.numel() for t in part])]).astype(np.int64)
            out[idx[start:stop]] = segment_sq_norms(flat.contiguous(), torch.from_numpy(bounds)).to(out.device)
            start = stop
    return out
