"""Horovod's own examples, with the documented diff, under `horovodrun -np 2` as users launch them.

docs/integration/horovod/NAME.py keeps the plain-Horovod structure of Horovod's
examples/pytorch/NAME.py, docs/integration/dynamix/NAME.py is the same script on dynamix_hvd, and
docs/integration/NAME.diff (shown in docs/integration.md) is exactly `diff -u` of the two. Each of our
versions runs briefly and must train: loss falls, accuracy beats chance, the LR follows the schedule.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from launching import REPO, launch

DOCS = REPO / "docs"
INTEGRATION = DOCS / "integration"
NAMES = ["pytorch_mnist", "pytorch_synthetic_benchmark", "pytorch_imagenet_resnet50"]
CHANCE = 10.0  # percent: ten classes everywhere


def current_diff(name: str) -> str:
    proc = subprocess.run(["diff", "-u", "--label", f"horovod/{name}.py", "--label", f"dynamix/{name}.py",
                           str(INTEGRATION / "horovod" / f"{name}.py"), str(INTEGRATION / "dynamix" / f"{name}.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 1, f"diff exited {proc.returncode}: {proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("name", NAMES)
def test_documented_diff_is_the_real_diff(name):
    stored = (INTEGRATION / f"{name}.diff").read_text()
    assert stored == current_diff(name), (f"docs/integration/{name}.diff is stale: run "
                                          "docs/integration/regenerate.sh and update docs/integration.md")


@pytest.mark.parametrize("name", NAMES)
def test_docs_page_shows_each_diff(name):
    page = (DOCS / "integration.md").read_text()
    blocks = re.findall(r"```diff\n(.*?)```", page, flags=re.S)
    assert (INTEGRATION / f"{name}.diff").read_text() in blocks, f"docs/integration.md does not show {name}.diff"


def run_ours(name: str, *args: str, timeout: float = 480) -> str:
    out = launch("horovodrun", 2, str(INTEGRATION / "dynamix" / f"{name}.py"), *args, timeout=timeout).stdout
    return out.replace("[1,0]<stdout>:", "\n")  # horovodrun's prefixes may interleave lines


@pytest.mark.parametrize("mode", [[], ["--use-mixed-precision"]], ids=["fp32", "fp16-gradscaler"])
def test_mnist_trains(mode):
    # log every 3 steps: the controller decides inside the epoch too, and a larger batch means fewer steps
    out = run_ours("pytorch_mnist", "--epochs", "1", "--lr", "0.05", "--log-interval", "3", *mode)
    losses = [float(v) for v in re.findall(r"Train Epoch: 1 \[\d+/\d+\]\tLoss: ([0-9.]+)", out)]
    assert len(losses) >= 5, out[-3000:]
    assert losses[-1] < losses[0], f"training loss did not fall: {losses}"
    if mode:
        assert re.search(r"Loss Scale: [0-9.]+", out), out[-3000:]
    accuracy = float(re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", out)[-1])
    assert accuracy > 2 * CHANCE, f"test accuracy {accuracy}% after one epoch"


def test_synthetic_benchmark_trains():
    out = run_ours("pytorch_synthetic_benchmark", "--num-warmup-batches", "2", "--num-batches-per-iter", "5",
                   "--num-iters", "4")
    losses = [float(v) for v in re.findall(r"Iter #\d+: [0-9.]+ img/sec per CPU, loss ([0-9.]+)", out)]
    assert len(losses) == 4, out[-3000:]
    assert losses[-1] < losses[0], f"loss on the fixed batch did not fall: {losses}"
    assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+", out), out[-3000:]


def expected_lr(epoch: int, batch_idx: int, steps: int, *, base_lr: float, size: int, passes: int,
                warmup: float, decay: list[int]) -> float:
    """The example's adjust_learning_rate, for the sub-batch `batch_idx` of `epoch` (0-based)."""
    if epoch < warmup:
        e = epoch + float(batch_idx + 1) / steps
        lr_adj = 1. / size * (e * (size - 1) / warmup + 1)
    else:
        lr_adj = 0.1 ** sum(epoch >= d for d in decay)
    return base_lr * size * passes * lr_adj


def test_imagenet_style_warmup_step_schedule_and_accumulation(tmp_path):
    out = run_ours("pytorch_imagenet_resnet50", "--epochs", "3", "--warmup-epochs", "1", "--decay-epochs", "2",
                   "--train-samples", "512", "--val-samples", "256", "--batch-size", "16",
                   "--batches-per-allreduce", "2", "--base-lr", "0.05",
                   "--checkpoint-format", str(tmp_path / "checkpoint-{epoch}.pt"))
    steps = re.findall(r"Train Epoch #(\d+) \[(\d+)/(\d+)\] lr (\S+) loss ([0-9.]+)", out)
    # 512 samples, 2 ranks x 16 per sub-batch: 16 sub-batches, one update every 2 of them
    assert len(steps) == 3 * 8, out[-3000:]
    for epoch, idx, n, lr, _ in steps:
        assert int(n) == 16 and int(idx) % 2 == 1, (epoch, idx, n)
        want = expected_lr(int(epoch) - 1, int(idx), int(n), base_lr=0.05, size=2, passes=2, warmup=1, decay=[2])
        assert float(lr) == pytest.approx(want, rel=1e-12), (epoch, idx, lr, want)
    lrs = [float(s[3]) for s in steps]
    assert lrs[0] < lrs[7] == lrs[8] and lrs[-1] == pytest.approx(lrs[8] / 10), lrs
    losses = [float(s[4]) for s in steps]
    assert losses[-1] < losses[0], f"training loss did not fall: {losses}"
    accuracy = float(re.findall(r"Validate Epoch #3 loss [0-9.]+ accuracy ([0-9.]+)%", out)[-1])
    assert accuracy > 2 * CHANCE, f"validation accuracy {accuracy}%"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"checkpoint-{e}.pt" for e in (1, 2, 3)]
