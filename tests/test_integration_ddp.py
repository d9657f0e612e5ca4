"""An ordinary torchrun + DistributedDataParallel script, with the documented diff, under
``torchrun --nproc-per-node 2`` as users launch it.

docs/integration/torch/ddp_mnist.py is the plain DDP script (DistributedSampler, DDP),
docs/integration/dynamix/ddp_mnist.py the same on dynamix_hvd, and docs/integration/ddp_mnist.diff (shown
in docs/integration.md and the README) is exactly `diff -u` of the two. Ours must train, in fp32 and under
mixed precision with a GradScaler.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launching import REPO, Job, launch_side_by_side

INTEGRATION = REPO / "docs" / "integration"
CHANCE = 10.0


def test_documented_diff_is_the_real_diff():
    proc = subprocess.run(["diff", "-u", "--label", "torch/ddp_mnist.py", "--label", "dynamix/ddp_mnist.py",
                           str(INTEGRATION / "torch" / "ddp_mnist.py"), str(INTEGRATION / "dynamix" / "ddp_mnist.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert (INTEGRATION / "ddp_mnist.diff").read_text() == proc.stdout, \
        "docs/integration/ddp_mnist.diff is stale: run docs/integration/regenerate.sh"
    blocks = re.findall(r"```diff\n(.*?)```", (REPO / "docs" / "integration.md").read_text(), flags=re.S)
    assert proc.stdout in blocks, "docs/integration.md does not show ddp_mnist.diff"


MODES = {"fp32": [], "fp16-gradscaler": ["--use-mixed-precision"]}


@pytest.fixture(scope="module")
def runs() -> dict[str, Job]:
    """Both modes side by side (correctness only: nothing here is timed)."""
    script = str(INTEGRATION / "dynamix" / "ddp_mnist.py")
    return launch_side_by_side({name: ("torchrun", 2, [sys.executable, script, "--epochs", "1", "--lr", "0.05",
                                                       "--log-interval", "3", *mode])
                                for name, mode in MODES.items()}, timeout=400)


@pytest.mark.parametrize("mode", list(MODES))
def test_ddp_mnist_trains(runs, mode):
    job = runs[mode].proc
    out = job.stdout
    assert job.returncode == 0, out[-3000:]
    losses = [float(v) for v in re.findall(r"Train Epoch: 1 \[\d+/\d+\]\tLoss: ([0-9.]+)", out)]
    assert len(losses) >= 5, out[-3000:]
    assert losses[-1] < losses[0], f"training loss did not fall: {losses}"
    accuracy = float(re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", out)[-1])
    assert accuracy > 2 * CHANCE, f"test accuracy {accuracy}% after one epoch"
