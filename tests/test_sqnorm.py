"""Fused squared norms: numba CPU path, CUDA kernel under the simulator, torch fallback, wrappers."""
from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import sqnorm_candidates
from bench.sqnorm_candidates import multi_tensor_sq_norms
from dynamix_hvd.stats import sqnorm
from dynamix_hvd.stats.sqnorm import backend_for, segment_sq_norms

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def offsets_for(sizes) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]), dtype=torch.int64)


def reference(flat: torch.Tensor, offsets: torch.Tensor) -> np.ndarray:
    """Per-segment float64 sums of the exactly upcast values (math.fsum: correctly rounded)."""
    import math

    x = flat.double().numpy() ** 2
    off = offsets.numpy()
    return np.array([math.fsum(x[a:b]) for a, b in zip(off[:-1], off[1:])])


def assert_close(got: torch.Tensor, ref: np.ndarray, rtol: float = 1e-10) -> None:
    assert got.dtype == torch.float64 and got.shape == ref.shape
    err = np.abs(got.numpy() - ref) / np.maximum(np.abs(ref), 1e-300)
    assert err.max(initial=0.0) < rtol, f"max relative error {err.max():.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_reference(dtype):
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 5000, 200)
    sizes[[0, 17, -1]] = 0
    off = offsets_for(sizes)
    flat = (torch.randn(int(off[-1]), dtype=torch.float64) * 3).to(dtype)
    assert_close(segment_sq_norms(flat, off), reference(flat, off))


@pytest.mark.parametrize("sizes", [[], [0], [0, 0, 0], [1], [3, 0, 1023], [0, 4097, 0, 1, 0], [7] * 13])
def test_odd_sizes_and_empty_segments(sizes):
    off = offsets_for(sizes)
    flat = torch.randn(int(off[-1]), dtype=torch.float64)
    got = segment_sq_norms(flat, off)
    assert_close(got, reference(flat, off))
    assert np.all(got.numpy()[np.asarray(sizes, dtype=np.int64) == 0] == 0.0) if sizes else got.numel() == 0


def test_many_segments_and_total():
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 40, 20000)
    off = offsets_for(sizes)
    flat = torch.randn(int(off[-1]))
    got = segment_sq_norms(flat, off)
    assert_close(got, reference(flat, off))
    assert abs(float(got.sum()) / float((flat.double() ** 2).sum()) - 1) < 1e-12


@pytest.mark.parametrize("nchunks", [1, 2, 3, 7, 64, 5000])
def test_parallel_kernel_matches_serial(nchunks):
    """Chunk boundaries inside, at the edges of, and spanning segments (incl. more chunks than elements)."""
    rng = np.random.default_rng(nchunks)
    sizes = rng.integers(0, 900, 50)
    sizes[[0, 10, 11, -1]] = 0
    sizes[5] = 3000  # spans several chunks
    off = offsets_for(sizes)
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn(int(off[-1])).to(dtype)
        out = np.zeros(len(sizes))
        sqnorm._segments_parallel(sqnorm._cpu_words(flat), sqnorm._table(dtype, flat.device).numpy(),
                                  off.numpy(), out, nchunks)
        assert_close(torch.from_numpy(out), reference(flat, off))


def test_nan_and_inf_stay_in_their_segment():
    flat = torch.ones(30)
    flat[3], flat[15] = float("nan"), float("inf")
    got = segment_sq_norms(flat, offsets_for([10, 10, 10])).numpy()
    assert np.isnan(got[0]) and np.isinf(got[1]) and got[2] == 10.0


@pytest.mark.parametrize("flat, offsets, match", [
    (torch.ones(5), torch.tensor([0, 4]), "end at flat.numel"),
    (torch.ones(5), torch.tensor([1, 5]), "offsets\\[0\\]=1"),
    (torch.ones(5), torch.tensor([0, 3, 2, 5]), "offsets\\[1\\]=3 > offsets\\[2\\]=2"),
    (torch.ones(5), torch.tensor([0, 5], dtype=torch.int32), "int64"),
    (torch.ones(5), torch.zeros(0, dtype=torch.int64), "empty"),
    (torch.ones(2, 3), torch.tensor([0, 6]), "1-D contiguous"),
    (torch.ones(10)[::2], torch.tensor([0, 5]), "contiguous"),
    (torch.ones(5, dtype=torch.int32), torch.tensor([0, 5]), "dtype=torch.int32"),
])
def test_bad_input_raises(flat, offsets, match):
    with pytest.raises(ValueError, match=match):
        segment_sq_norms(flat, offsets)


def test_torch_fallback_and_backend_choice(monkeypatch, caplog):
    off = offsets_for([5, 0, 17])
    flat = torch.randn(22, dtype=torch.float64)
    assert_close(sqnorm._segment_torch(flat, off.numpy()), reference(flat, off))
    sqnorm._LOGGED.clear()
    with caplog.at_level(logging.DEBUG, logger="dynamix_hvd.stats.sqnorm"):
        assert backend_for(flat) == "numba-cpu"
        backend_for(flat)
    assert sum("numba-cpu backend" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(sqnorm, "FORCE_TORCH", True)
    assert backend_for(flat) == "torch"
    assert_close(segment_sq_norms(flat, off), reference(flat, off))


def test_prepared_segment_norms(monkeypatch):
    off = offsets_for([0, 5, 300, 0, 17])
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn(int(off[-1])).to(dtype)
        prepared = sqnorm.SegmentSqNorms(flat, off)
        assert prepared.backend == "numba-cpu"
        assert_close(prepared(), reference(flat, off))
        flat.mul_(2)  # sees the buffer's current values
        assert_close(prepared(), reference(flat, off))
        assert prepared().data_ptr() != prepared().data_ptr()  # a fresh result each call
    monkeypatch.setattr(sqnorm, "FORCE_TORCH", True)
    assert_close(prepared(), reference(flat, off))
    with pytest.raises(ValueError, match="end at flat.numel"):
        sqnorm.SegmentSqNorms(flat, offsets_for([1]))


def test_failing_cuda_backend_falls_back_to_torch(monkeypatch, caplog):
    def broken(flat, off):
        raise RuntimeError("libnvvm not found")

    monkeypatch.setattr(sqnorm, "backend_for", lambda t: "numba-cuda")
    monkeypatch.setattr(sqnorm, "_segment_cuda", broken)
    monkeypatch.setattr(sqnorm, "_CUDA_OK", True)
    off = offsets_for([3, 4])
    flat = torch.randn(7, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="dynamix_hvd.stats.sqnorm"):
        assert_close(segment_sq_norms(flat, off), reference(flat, off))
    assert sqnorm._CUDA_OK is False and "libnvvm not found" in caplog.text


def test_multi_tensor_mixed_inputs(monkeypatch):
    ts = [torch.randn(30, 40).t(), torch.randn(0), torch.randn(7, dtype=torch.float64),
          torch.randn(5, 3).to(torch.bfloat16), torch.randn(2, 2), torch.randn(9).to(torch.float16)]
    expect = np.array([float((t.double() ** 2).sum()) for t in ts])
    monkeypatch.setattr(sqnorm_candidates, "MAX_STAGE_BYTES", 64)  # forces several staging buffers
    got = multi_tensor_sq_norms(ts)
    assert np.allclose(got.numpy(), expect, rtol=1e-12, atol=0)
    assert multi_tensor_sq_norms([]).numel() == 0
    with pytest.raises(ValueError, match="tensors\\[1\\].dtype=torch.int64"):
        multi_tensor_sq_norms([torch.ones(2), torch.ones(2, dtype=torch.int64)])


def test_multi_tensor_views_of_one_buffer_are_zero_copy():
    buf = torch.randn(1000)
    views = [buf[0:10].view(2, 5), buf[10:300], buf[320:1000]]  # gap 300..320 is skipped
    flat, bounds, which = sqnorm_candidates._flat_view(views)
    assert flat.data_ptr() == buf.data_ptr() and bounds.tolist() == [0, 10, 300, 320, 1000]
    assert which.tolist() == [0, 1, 3]
    expect = [float((v.double() ** 2).sum()) for v in views]
    assert np.allclose(multi_tensor_sq_norms(views).numpy(), expect, rtol=1e-12)
    assert sqnorm_candidates._flat_view([buf[5:10], buf[0:5]]) is None  # not ascending: staged instead
    assert np.allclose(multi_tensor_sq_norms([buf[5:10], buf[0:5]]).numpy(),
                       [float((buf[5:10].double() ** 2).sum()), float((buf[0:5].double() ** 2).sum())])


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    full_env = {**{k: v for k, v in os.environ.items() if k != "DYNAMIX_SQNORM_BACKEND"}, "PYTHONPATH": path, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cpu_use_never_imports_numba_cuda_and_env_forces_torch():
    res = run_python("""
        import importlib, os, sys, torch, dynamix_hvd, dynamix_hvd.stats.sqnorm as s
        s.segment_sq_norms(torch.ones(4), torch.tensor([0, 4]))
        s.SegmentSqNorms(torch.ones(4), torch.tensor([0, 4]))()
        from bench.sqnorm_candidates import multi_tensor_sq_norms
        multi_tensor_sq_norms([torch.ones(3), torch.ones(2).t()])
        assert "numba.cuda" not in sys.modules, "numba.cuda imported"
        os.environ["DYNAMIX_SQNORM_BACKEND"] = "torch"
        importlib.reload(s)
        print(s.backend_for(torch.ones(1)))
    """)
    assert res.returncode == 0 and res.stdout.strip() == "torch", res.stderr


CUDASIM_CODE = """
    import numpy as np, torch
    from numba import cuda
    from dynamix_hvd.stats import sqnorm as sq
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 120, 20); sizes[[0, 6, 7, -1]] = 0; sizes[3] = 500
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(off[-1])
    worst = 0.0
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        t = (torch.randn(n, dtype=torch.float64) * 5).to(dtype)
        lut = dtype in (torch.bfloat16, torch.float16)
        x = t.view(torch.int16).numpy() if lut else t.numpy()
        ref = np.array([np.sum(t[a:b].double().numpy() ** 2) for a, b in zip(off[:-1], off[1:])])
        args = (cuda.to_device(x), cuda.to_device(sq._table(dtype, t.device).numpy()), cuda.to_device(off))
        out = cuda.to_device(np.zeros(off.size - 1))
        if dtype in (torch.float64, torch.bfloat16):
            sq.launch_segment_kernel(*args, out, lut=lut, blocks=3, threads=16)
        else:  # 2 blocks walk many 64-element chunks (grid-stride loop)
            sq.cuda_segment_kernel(lut)[2, 16](*args, out, 64)
        got = out.copy_to_host()
        worst = max(worst, float(np.max(np.abs(got - ref) / np.maximum(ref, 1e-300))))
    try:
        sq.launch_segment_kernel(*args, out, lut=True, blocks=1, threads=24)
    except ValueError as e:
        assert "threads=24" in str(e)
    else:
        raise AssertionError("threads=24 accepted")
    print("worst", worst)
"""


def test_cuda_kernel_under_simulator():
    res = run_python(CUDASIM_CODE, NUMBA_ENABLE_CUDASIM="1")
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("worst")[-1])
    assert worst < 1e-12, res.stdout


def test_cuda_kernel_compiles_to_ptx():
    """Type-checks and lowers the real kernels for sm_90 (NVRTC + NVVM from PyPI, no GPU needed)."""
    res = run_python("""
        import numba
        from numba import cuda
        from dynamix_hvd.stats import sqnorm as sq
        for lut, xt in ((False, numba.float32), (False, numba.float64), (True, numba.int16)):
            sig = (xt[::1], numba.float32[::1], numba.int64[::1], numba.float64[::1], numba.int64)
            ptx, _ = cuda.compile_ptx(sq.cuda_segment_kernel(lut).py_func, sig, cc=(9, 0))
            assert "atom.global.add.f64" in ptx
        print("ok")
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok" in res.stdout


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_bench_helpers_and_cpu_exit(capsys):
    import math

    bench = load_bench("bench_sqnorm_gpu")
    shapes = bench.model_shapes(1 << 30, 160)
    total = sum(math.prod(s) for s in shapes) * 4
    assert len(shapes) == 160 and abs(total / 2**30 - 1) < 0.01
    assert bench.offsets_of([(2, 3), (4,)]) == [0, 6, 10]
    assert bench.summarize([2.0, 1.0, 3.0], 2 * 10**9)["tbps"] == pytest.approx(1.0)
    assert "segment_sq_norms" in bench.format_table({"segment_sq_norms": dict(ms=1.0, tbps=2.0, err=1e-12)})
    if not torch.cuda.is_available():
        assert bench.main([]) == 0
        assert "no CUDA GPU available" in capsys.readouterr().out


def test_overhead_bench_smoke():
    bench = load_bench("bench_gns_overhead")
    torch.set_num_threads(1)
    row = bench.measure(bench.make_cnn, repeats=1, steps=2)
    assert row["segments"] == 8 and row["base"] > 0 and row["alone"] > 0
    assert "overhead %" in bench.format_table({"cnn": row})


def test_flat_gradients_take_back_a_view_whose_storage_was_replaced():
    """Horovod's synchronize() with fp16 compression ends with ``p.grad.set_(decompressed)``: the view
    object that is p.grad then holds other storage. attach() puts it back into the flat buffer with its
    values, so zeroing and the norms (which hold the view objects) see the real gradient again."""
    from dynamix_hvd.optim.flat import FlatGradients

    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4))]
    flat = FlatGradients(params)
    view = params[0].grad
    params[0].grad.set_(torch.arange(6, dtype=torch.float32).view(3, 2))  # what Horovod's synchronize does
    params[1].grad = torch.full((4,), 2.0)                                # a gradient replaced outright
    assert view.data_ptr() != flat.buffers[0].data_ptr()
    flat.attach()
    assert params[0].grad is view and view.data_ptr() == flat.buffers[0].data_ptr()
    assert flat.buffers[0].tolist() == [0, 1, 2, 3, 4, 5, 2, 2, 2, 2]
    assert flat.sq_norms().tolist() == pytest.approx([55.0, 16.0], rel=1e-6)
    flat.zero()
    assert flat.sq_norms().tolist() == [0.0, 0.0] and float(params[0].grad.abs().sum()) == 0.0


@pytest.mark.parametrize("dtype", DTYPES + [torch.complex64])
def test_a_local_gradients_squared_norm_is_its_sum_of_squared_magnitudes(dtype):
    from dynamix_hvd.optim.flat import sq_norm

    g = torch.Generator().manual_seed(3)
    grad = torch.randn(37, 11, generator=g).to(dtype) if not dtype.is_complex else torch.randn(
        37, 11, generator=g, dtype=dtype)
    for tensor in (grad, grad.t(), grad[:0]):  # contiguous, a transposed view, no elements
        got = sq_norm(tensor)
        assert got.dim() == 0 and not got.is_complex()
        exact = float((tensor.to(torch.complex128).abs() ** 2).sum()) if dtype.is_complex else \
            float((tensor.double() ** 2).sum())
        tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
        assert abs(float(got) - exact) <= tol * max(exact, 1e-12), (dtype, float(got), exact)
