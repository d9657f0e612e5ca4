"""Horovod is built with what dynamix_hvd needs: PyTorch, MPI and Gloo (checked via its own CLI); the
build check reports CUDA and NCCL and refuses a CPU build where a GPU build is expected."""
from __future__ import annotations

import re
import subprocess
import sys

from dynamix_hvd.tools.buildcheck import missing_horovod_features, nccl_version_string


def test_horovodrun_check_build_lists_pytorch_mpi_and_gloo():
    out = subprocess.run(["horovodrun", "--check-build"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    frameworks = out.split("Available Controllers")[0]
    controllers, operations = out.split("Available Controllers")[1].split("Available Tensor Operations")
    assert re.search(r"\[X\] PyTorch", frameworks), out
    assert re.search(r"\[X\] MPI", controllers) and re.search(r"\[X\] Gloo", controllers), out
    assert re.search(r"\[X\] MPI", operations) and re.search(r"\[X\] Gloo", operations), out


def test_buildcheck_module_agrees():
    assert missing_horovod_features() == []


def test_buildcheck_reports_the_build_and_refuses_it_where_a_gpu_build_is_expected():
    ok = subprocess.run([sys.executable, "-m", "dynamix_hvd.tools.buildcheck"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and "MPI yes, Gloo yes" in ok.stdout, ok.stdout + ok.stderr
    import torch

    if torch.version.cuda is None:  # this CPU build has neither CUDA nor NCCL: --expect-gpu names both
        assert "CUDA no, NCCL none" in ok.stdout
        gpu = subprocess.run([sys.executable, "-m", "dynamix_hvd.tools.buildcheck", "--expect-gpu"],
                             capture_output=True, text=True, timeout=120)
        assert gpu.returncode == 1, gpu.stdout + gpu.stderr
        assert "CUDA (this torch has no CUDA)" in gpu.stderr and "NCCL operations" in gpu.stderr


def test_nccl_version_codes():
    assert nccl_version_string(22907) == "2.29.7"   # NCCL >= 2.9: major * 10000 + minor * 100 + patch
    assert nccl_version_string(2804) == "2.8.4"     # older 2.x: major * 1000 + minor * 100 + patch
    assert nccl_version_string(0) == "none"
