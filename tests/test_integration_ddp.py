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

import pytest

from launching import REPO, launch

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


@pytest.mark.parametrize("mode", [[], ["--use-mixed-precision"]], ids=["fp32", "fp16-gradscaler"])
def test_ddp_mnist_trains(mode):
    out = launch("torchrun", 2, str(INTEGRATION / "dynamix" / "ddp_mnist.py"), "--epochs", "1", "--lr", "0.05",
                 "--log-interval", "3", *mode, timeout=400).stdout
    losses = [float(v) for v in re.findall(r"Train Epoch: 1 \[\d+/\d+\]\tLoss: ([0-9.]+)", out)]
    assert len(losses) >= 5, out[-3000:]
    assert losses[-1] < losses[0], f"training loss did not fall: {losses}"
    accuracy = float(re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", out)[-1])
    assert accuracy > 2 * CHANCE, f"test accuracy {accuracy}% after one epoch"
