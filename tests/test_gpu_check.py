"""The prepared GPU check (bench/gpu_check.sh, docs/gpu.md): what of it runs without a GPU.

The script parses; the vectorised squared-norm kernel matches float64 under the CUDA simulator and
lowers to 8-byte loads for sm_90; the training job runs its CPU rehearsal (train and oom modes, a few
steps, one rank) and its statistics match a float64 recomputation; the report turns step results
into the summary the device call prints.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launching import REPO, job_env

CUDASIM_VEC = """
import numpy as np, torch
from numba import cuda
from bench import sqnorm_candidates as sq
rng = np.random.default_rng(5)
worst = 0.0
for extra in range(4):  # totals of every residue mod 4, so words split at segment and buffer ends
    sizes = rng.integers(0, 90, 14); sizes[[0, 5, -1]] = 0; sizes[2] = 1; sizes[3] = 3; sizes[7] = 700
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    off[-1] += extra
    for dtype in (torch.float32, torch.bfloat16):
        t = (torch.randn(int(off[-1]), dtype=torch.float64) * 3).to(dtype)
        kind, x, words = sq.vec_views(t)
        ref = np.array([np.sum(t[a:b].double().numpy() ** 2) for a, b in zip(off[:-1], off[1:])])
        for blocks, threads in ((3, 16), (1, 8), (50, 32)):
            out = cuda.to_device(np.zeros(off.size - 1))
            sq.launch_segment_kernel_vec(cuda.to_device(x.numpy()), cuda.to_device(words.numpy()),
                                         cuda.to_device(off), out, kind=kind, blocks=blocks, threads=threads)
            got = out.copy_to_host()
            worst = max(worst, float(np.max(np.abs(got - ref) / np.maximum(ref, 1e-300))))
for bad in (torch.ones(4, dtype=torch.float16), torch.ones(9)[1:]):
    try:
        sq.vec_views(bad)
    except ValueError as e:
        print("refused:", e)
print("worst", worst)
"""

PTX_VEC = """
import re, numba
from numba import cuda
from bench import sqnorm_candidates as sq
for kind, xt, wt in (("f32x2", numba.float32, numba.complex64), ("bf16x4", numba.int16, numba.int64)):
    sig = (xt[::1], wt[::1], numba.int64[::1], numba.float64[::1], numba.int64)
    ptx, _ = cuda.compile_ptx(sq.cuda_segment_kernel_vec(kind).py_func, sig, cc=(9, 0))
    assert "atom.global.add.f64" in ptx and "ld.global.u64" in ptx, kind
print("ok")
"""


def python(code_or_args, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    argv = ["-c", code_or_args] if isinstance(code_or_args, str) else list(code_or_args)
    return subprocess.run([sys.executable, *argv], cwd=REPO, env={**job_env(), **env}, capture_output=True,
                          text=True, timeout=timeout)


def test_gpu_check_script_parses():
    for script in ("bench/gpu_check.sh", "bench/gpu_fetch_wheels.sh", "launch/cxx17", "launch/setup_env.sh",
                   "launch/horovod_build.sh", "launch/rehearse_cuda_build.sh"):
        res = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
        assert res.returncode == 0, f"{script}: {res.stderr}"


def test_cxx17_wrapper_rewrites_the_standard(tmp_path):
    src = tmp_path / "t.cc"
    src.write_text("#include <optional>\nint main() { std::optional<int> x = 3; return *x - 3; }\n")
    res = subprocess.run(["bash", str(REPO / "launch/cxx17"), "-std=c++14", str(src), "-o", str(tmp_path / "t")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert subprocess.run([str(tmp_path / "t")]).returncode == 0


def test_vector_kernel_matches_float64_under_the_simulator():
    res = python(CUDASIM_VEC, NUMBA_ENABLE_CUDASIM="1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert float(res.stdout.split("worst")[-1]) < 1e-12, res.stdout
    assert res.stdout.count("refused:") == 2 and "float16" in res.stdout and "aligned" in res.stdout


def test_vector_kernel_compiles_to_8_byte_loads_for_sm90():
    res = python(PTX_VEC)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_job_rehearsal_on_cpu_and_report(tmp_path):
    """Both modes of bench/gpu_job.py, briefly, one rank; then bench/gpu_report.py on their results."""
    small = ["--samples", "256", "--image", "8", "--width", "4", "--batch", "16", "--steps", "6",
             "--check-every", "2", "--decide-every", "3", "--overhead-blocks", "1", "--overhead-block", "2"]
    res = python(["bench/gpu_job.py", "--mode", "train", *small, "--json", str(tmp_path / "train1.json")])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    train = json.loads((tmp_path / "train1.json").read_text())
    stats = train["checks"]["statistics_match_float64"]
    assert stats["pass"] is True and stats["checked_steps"] == 3, stats
    assert train["checks"]["peak_memory_from_cuda_allocator"]["reason"] == "skipped: no CUDA"
    assert train["sqnorm_backend"] == ["torch-dot"]  # the CPU data plane; CUDA uses the Numba kernel
    res = python(["bench/gpu_job.py", "--mode", "oom", "--steps", "6", "--width", "4", "--simulate-oom-above", "20",
                  "--json", str(tmp_path / "oom1.json")])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    checks = json.loads((tmp_path / "oom1.json").read_text())["checks"]
    assert checks["oom_size_never_again"] == {"pass": True, "first_failed": 31, "largest_after_oom": 19}, checks
    oom = checks["oom_recovery"]
    # 31 fails, redone at int(0.8 * 31) = 24, fails, redone at 19: fits from then on
    assert oom["pass"] and oom["trace"][:3] == ["0:31:oom:24", "1:24:oom:19", "2:19:ok:19"], oom
    assert oom["ooms_after_first_ok"] == 0 and oom["final_bound"] == 19
    (tmp_path / "steps.tsv").write_text("env\tok\t3\t\nkernel\tskipped\t1\tskipped: no CUDA\n"
                                        "train1\tok\t20\t\noom1\tok\t20\t\n")
    (tmp_path / "kernel.json").write_text(json.dumps({"status": "skipped", "reason": "no CUDA"}))
    out = tmp_path / "out"
    out.mkdir()
    res = python(["bench/gpu_report.py", str(tmp_path), str(out), "44", "480"])
    assert res.returncode == 0, res.stderr
    summary = (out / "summary.md").read_text()
    assert "| kernel | skipped | 1 | skipped: no CUDA |" in summary and "kernel: no CUDA" in summary
    assert "| statistics_match_float64 | True |" in summary and "0:31:oom:24" in summary
    assert "- kernel: skipped: no CUDA" in summary
    assert json.loads((out / "results.json").read_text())["results"]["train1"]["checks"]
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "summary.md"]
