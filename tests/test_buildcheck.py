"""Horovod is built with what dynamix_hvd needs: PyTorch, MPI and Gloo (checked via its own CLI)."""
from __future__ import annotations

import re
import subprocess

from dynamix_hvd.tools.buildcheck import missing_horovod_features


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
