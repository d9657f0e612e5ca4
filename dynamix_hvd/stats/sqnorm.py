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
  through numba, or ``DYNAMIX_SQNORM_BACKEND=torch`` is set (read at import; see FORCE_TORCH).

``numba.cuda`` is imported only when a CUDA tensor is seen, so CPU-only hosts never touch it.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

log = logging.getLogger(__name__)

# The kernels' constants are not controller settings: they change how fast a squared norm is
# computed, never its value or a decision.
#: Threads per block; also the static shared-memory size of the CUDA kernel (power of two).
THREADS = 256
_UNROLL = 4
#: Buffers at least this long use the parallel CPU kernel. One core already streams tens of GB/s,
#: and the parallel kernel gained nothing (workqueue layer) or stalled ~24 ms per call (omp layer next
#: to torch's OpenMP), so the default keeps model-sized buffers serial. Env: DYNAMIX_SQNORM_PARALLEL_MIN.
PARALLEL_MIN_ELEMS = int(os.environ.get("DYNAMIX_SQNORM_PARALLEL_MIN", 1 << 26))
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
        if isinstance(x.dtype, _nbtypes.Integer):  # 16-bit words: look the value up
            return lambda x, table, i: np.float64(table[np.int64(x[i]) & 0xFFFF]) ** 2
        return lambda x, table, i: np.float64(x[i]) ** 2

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
    def _offsets_ok(offsets, n):
        if offsets.size == 0 or offsets[0] != 0 or offsets[offsets.size - 1] != n:
            return False
        for s in range(offsets.size - 1):
            if offsets[s] > offsets[s + 1]:
                return False
        return True

    @njit(cache=True)
    def _segments_serial(x, table, offsets, out):
        # Validates here too: one compiled call instead of several numpy calls per step (the hot path
        # runs right after backward, when the interpreter's caches are cold).
        if not _offsets_ok(offsets, x.size):
            return False
        for s in range(offsets.size - 1):
            out[s] = _span(x, table, offsets[s], offsets[s + 1])
        return True

    @njit(cache=True, parallel=True)
    def _segments_parallel(x, table, offsets, out, nchunks):
        # Each chunk owns the segments that lie wholly inside it (direct write); its first and last
        # (possibly shared) segments go to per-chunk slots that are added serially afterwards.
        n, nseg = x.size, offsets.size - 1
        chunk = (n + nchunks - 1) // nchunks
        edge_seg = np.full((nchunks, 2), -1, np.int64)
        edge_sum = np.zeros((nchunks, 2))
        for c in prange(nchunks):
            lo, hi = c * chunk, min(n, c * chunk + chunk)
            s = np.searchsorted(offsets, lo, side="right") - 1
            first = s
            while lo < hi and s < nseg and offsets[s] < hi:
                v = _span(x, table, max(lo, offsets[s]), min(hi, offsets[s + 1]))
                if s == first or offsets[s + 1] > hi:
                    k = 0 if s == first else 1
                    edge_seg[c, k], edge_sum[c, k] = s, v
                else:
                    out[s] = v
                s += 1
        for c in range(nchunks):
            for k in range(2):
                if edge_seg[c, k] >= 0:
                    out[edge_seg[c, k]] += edge_sum[c, k]


def _cpu_words(flat: torch.Tensor) -> np.ndarray:
    if flat.dtype in _HALF_DTYPES:
        return flat.view(torch.int16).numpy()
    return flat.numpy()


_NO_TABLE = np.zeros(1, dtype=np.float32)


def _segment_cpu(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if (not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1
            or offsets.is_cuda or offsets.numel() == 0):
        _check_offsets(offsets, flat.numel())  # raises with the reason
        offsets = offsets.cpu()
    off = offsets.numpy()
    out = np.zeros(off.size - 1, dtype=np.float64)
    x = _cpu_words(flat)
    table = _table(flat.dtype, flat.device).numpy() if flat.dtype in _HALF_DTYPES else _NO_TABLE
    if x.size >= PARALLEL_MIN_ELEMS and numba.get_num_threads() > 1:
        _check_offsets(offsets, x.size)
        _segments_parallel(x, table, off, out, 4 * numba.get_num_threads())
    elif not _segments_serial(x, table, off, out):
        _check_offsets(offsets, x.size)  # raises with the reason
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
        n, nseg = x.size, offsets.size - 1
        c = cuda.blockIdx.x
        while c * chunk < n:  # grid-stride over block-sized chunks
            lo, hi = c * chunk, min(n, c * chunk + chunk)
            left, right = 0, nseg  # first j with offsets[j] > lo (exists: offsets[nseg] == n > lo)
            while left < right:
                mid = (left + right) // 2
                if offsets[mid] > lo:
                    right = mid
                else:
                    left = mid + 1
            s = left - 1
            while s < nseg and offsets[s] < hi:
                a, b = max(lo, offsets[s]), min(hi, offsets[s + 1])
                if a < b:  # uniform across the block, so the barriers below are safe
                    acc0 = acc1 = acc2 = acc3 = 0.0
                    i = a + tid
                    while i + 3 * nt < b:  # 4 independent loads in flight per thread
                        v0, v1 = load(x, table, i), load(x, table, i + nt)
                        v2, v3 = load(x, table, i + 2 * nt), load(x, table, i + 3 * nt)
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
    quantum = threads * _UNROLL
    blocks = max(1, min(blocks, -(-n // quantum)))
    chunk = -(-(-(-n // blocks)) // quantum) * quantum  # ceil(ceil(n / blocks) / quantum) * quantum
    kernel = cuda_segment_kernel(lut)
    with warnings.catch_warnings():  # small buffers get small grids on purpose
        warnings.filterwarnings("ignore", message=".*under-utilization.*")
        kernel[blocks, threads, stream](x, table, offsets, out, chunk)


_SM_COUNT: Dict[int, int] = {}
_DEVICE_OFFSETS: Dict[Tuple[str, bytes], torch.Tensor] = {}


def _cuda_prepare(flat: torch.Tensor, offsets: np.ndarray) -> Tuple[Any, ...]:
    """Zero-copy numba views of (words, table, offsets) plus launch parameters, for :func:`_cuda_run`."""
    from numba import cuda

    dev = flat.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    key = (str(dev), offsets.tobytes())
    if key not in _DEVICE_OFFSETS:
        if len(_DEVICE_OFFSETS) > 64:
            _DEVICE_OFFSETS.clear()
        _DEVICE_OFFSETS[key] = torch.from_numpy(offsets).to(dev)
    lut = flat.dtype in _HALF_DTYPES
    keep = (flat.view(torch.int16) if lut else flat, _table(flat.dtype, dev), _DEVICE_OFFSETS[key])
    with cuda.gpus[index]:
        if index not in _SM_COUNT:
            _SM_COUNT[index] = cuda.get_current_device().MULTIPROCESSOR_COUNT
        arrays = tuple(cuda.as_cuda_array(t, sync=False) for t in keep)
    return dev, index, lut, offsets.size - 1, arrays, keep


def _cuda_run(state: Tuple[Any, ...]) -> torch.Tensor:
    from numba import cuda

    dev, index, lut, nseg, arrays, _ = state
    out = torch.zeros(nseg, dtype=torch.float64, device=dev)  # on torch's current stream, like the launch
    with cuda.gpus[index]:
        stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
        launch_segment_kernel(*arrays, cuda.as_cuda_array(out, sync=False), lut=lut,
                              blocks=8 * _SM_COUNT[index], stream=stream)
    return out


def _segment_cuda(flat: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    return _cuda_run(_cuda_prepare(flat, offsets))


# --------------------------------------------------------------------------- torch fallback, API
def _segment_torch(flat: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    lengths = torch.from_numpy(np.diff(offsets)).to(flat.device)
    if lengths.numel() == 0:
        return torch.zeros(0, dtype=torch.float64, device=flat.device)
    sq = flat.to(torch.float64).square()
    return torch.segment_reduce(sq, "sum", lengths=lengths, unsafe=True)


_CUDA_OK: Optional[bool] = None  # None: not probed yet
_LOGGED: set = set()


def _numba_cuda_ok() -> bool:
    global _CUDA_OK
    if _CUDA_OK is None:
        try:
            from numba import cuda

            _CUDA_OK = bool(cuda.is_available())
        except Exception as exc:  # ImportError (e.g. numba-cuda vs numpy 2.5), CudaSupportError, ...
            log.debug("numba.cuda unusable (%s); CUDA tensors use the torch backend", exc)
            _CUDA_OK = False
    return _CUDA_OK


#: ``DYNAMIX_SQNORM_BACKEND=torch`` (read at import) forces the torch fallback everywhere.
FORCE_TORCH = os.environ.get("DYNAMIX_SQNORM_BACKEND", "") == "torch"


def backend_for(tensor: torch.Tensor) -> str:
    """Backend that :func:`segment_sq_norms` uses for ``tensor``: numba-cuda, numba-cpu or torch."""
    kind = tensor.device.type
    choice = "torch"
    if not FORCE_TORCH and numba is not None:
        if kind == "cpu":
            choice = "numba-cpu"
        elif kind == "cuda" and _numba_cuda_ok():
            choice = "numba-cuda"
    if (kind, choice) not in _LOGGED:
        _LOGGED.add((kind, choice))
        log.debug("squared norms of %s tensors: %s backend", kind, choice)
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
    if np.any(np.diff(off) < 0):
        bad = int(np.argmax(np.diff(off) < 0))
        raise ValueError(f"offsets must be non-decreasing, offsets[{bad}]={int(off[bad])} > "
                         f"offsets[{bad + 1}]={int(off[bad + 1])}")
    return np.ascontiguousarray(off)


def _check_flat(flat: torch.Tensor) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a 1-D contiguous tensor, got {type(flat).__name__} of shape "
                         f"{tuple(getattr(flat, 'shape', ()))}")
    if flat.dtype not in _FLOAT_DTYPES + _HALF_DTYPES:
        raise ValueError(f"flat.dtype={flat.dtype} is not float32/float64/float16/bfloat16")


def segment_sq_norms(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-segment sums of squares of ``flat`` (float64, on ``flat``'s device), in one pass.

    ``flat``: 1-D contiguous float32/float64/float16/bfloat16 tensor; ``offsets``: int64 tensor of
    n+1 non-decreasing bounds with ``offsets[0] == 0`` and ``offsets[-1] == flat.numel()``; segment
    ``s`` is ``flat[offsets[s]:offsets[s+1]]`` (empty segments give 0). NaN/Inf propagate.
    """
    _check_flat(flat)
    if flat.requires_grad:
        flat = flat.detach()
    backend = backend_for(flat)
    if backend == "numba-cpu":
        return _segment_cpu(flat, offsets)
    off = _check_offsets(offsets, flat.numel())
    if backend == "numba-cuda":
        try:
            return _segment_cuda(flat, off)
        except Exception as exc:
            _disable_cuda(exc)
    return _segment_torch(flat, off)


def _disable_cuda(exc: Exception) -> None:
    """E.g. NVVM missing at the first compile: a statistic must not stop training."""
    global _CUDA_OK
    _CUDA_OK = False
    log.warning("numba-cuda squared norms failed (%s: %s); using the torch backend from now on",
                type(exc).__name__, exc)


class SegmentSqNorms:
    """:func:`segment_sq_norms` prepared for one long-lived (flat, offsets) pair, e.g. a gradient
    buffer of the data plane: validates once and keeps the zero-copy views, so a CPU call is a single
    compiled call (about 60 us less Python per call right after backward, when caches are cold).
    Holds a reference to ``flat``; build a new one if the data plane reallocates the buffer."""

    def __init__(self, flat: torch.Tensor, offsets: torch.Tensor) -> None:
        _check_flat(flat)
        self.offsets = _check_offsets(offsets, flat.numel())
        self.flat = flat.detach()
        self.backend = backend_for(self.flat)
        self._cpu = self._cuda = None
        if self.backend == "numba-cpu" and flat.numel() < PARALLEL_MIN_ELEMS:
            table = _table(flat.dtype, flat.device).numpy() if flat.dtype in _HALF_DTYPES else _NO_TABLE
            self._cpu = (_cpu_words(self.flat), table, self.offsets)
        elif self.backend == "numba-cuda":
            try:
                self._cuda = _cuda_prepare(self.flat, self.offsets)  # saves 3 as_cuda_array per call
            except Exception as exc:
                _disable_cuda(exc)

    def __call__(self) -> torch.Tensor:
        """float64 squared norm of every segment, as a new tensor on ``flat``'s device."""
        if self._cpu is not None and not FORCE_TORCH:
            out = np.zeros(self.offsets.size - 1)
            _segments_serial(*self._cpu, out)
            return torch.from_numpy(out)
        if self._cuda is not None and _CUDA_OK and not FORCE_TORCH:
            try:
                return _cuda_run(self._cuda)
            except Exception as exc:
                _disable_cuda(exc)
        return segment_sq_norms(self.flat, torch.from_numpy(self.offsets))
