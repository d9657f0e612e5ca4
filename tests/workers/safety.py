"""Worker: checkpoints are plain data (part "checkpoint") and objects shut down cleanly (part "close").

checkpoint: writes a good checkpoint, then makes restore() face the crafted files the test prepared
(a torch.save file and a raw pickle that run a command when unpickled, with valid checksums), a
checkpoint of another format version (skipped), and a state that is not plain data. Prints one OK
line per case.
close: a Checkpointer changes no signal handler until asked and puts them back on close(); a
controller used as a context manager stops its resource thread, detaches and frees its channel.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import shutil
import signal
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.resilience.checkpoint import FORMAT, CheckpointError, Checkpointer


class WithOddExtraState(nn.Linear):
    def get_extra_state(self) -> Fraction:  # not plain data: save() must refuse it
        return Fraction(1, 3)

    def set_extra_state(self, state: Fraction) -> None:
        pass


def build(ckpt: str, model: nn.Module | None = None):
    torch.manual_seed(0)
    model = model or nn.Linear(4, 2)
    loader = dx.AdaptiveLoader(torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))),
                               [4] * hvd.size(), hvd.rank())
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                          loader)
    return model, loader, opt, Checkpointer(ckpt, model, opt, loader)


def barrier(name: str) -> None:
    hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")


def plant(directory: Path, name: str, data: bytes) -> Path:
    """Rank 0 writes `data` as checkpoint `name`, with a checksum that verifies."""
    path = directory / name
    barrier(f"before.{name}")  # every rank is done with the previous files
    if hvd.rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.pt").write_bytes(data)
        (path / "state.sha256").write_text(hashlib.sha256(data).hexdigest())
    barrier(f"plant.{name}")
    return path


def expect_refusal(ckpt: Checkpointer, error: type, *needles: str) -> str:
    try:
        ckpt.restore()
    except error as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        if missing:
            sys.exit(f"rank {hvd.rank()}: error lacks {missing}: {text}")
        return text
    sys.exit(f"rank {hvd.rank()}: restore() accepted a checkpoint it must refuse")


def part_checkpoint(args: argparse.Namespace) -> None:
    directory, marker = Path(args.ckpt), Path(args.marker)
    model, loader, opt, ckpt = build(args.ckpt)
    it = iter(loader)
    for _ in range(2):
        x, y = next(it)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    good = ckpt.save()
    barrier("saved")
    evil = plant(directory, "step-00000-0000009", Path(args.evil_torch).read_bytes())
    path = ckpt.restore()  # the crafted newest is refused; the older good one is used
    if path != good or marker.exists():
        sys.exit(f"rank {hvd.rank()}: restore() returned {path}, marker exists: {marker.exists()}")
    print(f"rank {hvd.rank()}: FALLBACK-PAST-CRAFTED-OK {path.name}", flush=True)
    barrier("fallback")
    if hvd.rank() == 0:
        shutil.rmtree(good)
    barrier("removed-good")
    text = expect_refusal(ckpt, CheckpointError, str(evil / "state.pt"), "refused")
    print(f"rank {hvd.rank()}: CRAFTED-TORCH-REFUSED-OK {text}", flush=True)
    plant(directory, evil.name, Path(args.evil_raw).read_bytes())
    text = expect_refusal(ckpt, CheckpointError, str(evil / "state.pt"), "refused")
    print(f"rank {hvd.rank()}: CRAFTED-RAW-REFUSED-OK {text}", flush=True)

    buf = io.BytesIO()
    torch.save({**ckpt.state(), "version": 99}, buf)
    future = plant(directory, "step-00000-0000010", buf.getvalue())
    # Skipped like any unusable checkpoint; with nothing usable behind it, the error names both files.
    text = expect_refusal(ckpt, CheckpointError, str(future / "state.pt"), "version 99", "version 2",
                          str(evil / "state.pt"))
    print(f"rank {hvd.rank()}: VERSION-SKIPPED-OK {text}", flush=True)
    header = {k: ckpt.state().get(k) for k in ("format", "version")}
    if header != {"format": FORMAT, "version": 2}:
        sys.exit(f"checkpoint state lacks its header: {header}")

    odd = build(str(directory / "odd"), WithOddExtraState(4, 2))[3]
    try:
        odd.save()  # every rank must get the error (no rank left waiting for rank 0)
    except CheckpointError as exc:
        if "Fraction" not in str(exc) or "'model'" not in str(exc):
            sys.exit(f"rank {hvd.rank()}: the error does not name the entry: {exc}")
        print(f"rank {hvd.rank()}: NONPLAIN-REFUSED-OK {exc}", flush=True)
    else:
        sys.exit("save() wrote a state that is not plain data")
    if list((directory / "odd").glob("step-*")):
        sys.exit("a refused checkpoint left files behind")


def part_close(args: argparse.Namespace) -> None:
    watched = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in watched}
    model, loader, opt, ckpt = build(args.ckpt)
    if {s: signal.getsignal(s) for s in watched} != before:
        sys.exit("constructing a Checkpointer changed signal handlers")
    ckpt.install_signal_handlers((signal.SIGTERM, signal.SIGUSR1))
    if signal.getsignal(signal.SIGTERM) != ckpt._on_signal or signal.getsignal(signal.SIGUSR1) != ckpt._on_signal:
        sys.exit("install_signal_handlers() did not install the handlers")
    signal.raise_signal(signal.SIGUSR1)
    if not ckpt.requested:
        sys.exit("a signal after install_signal_handlers() did not request a checkpoint")
    ckpt.close()
    if {s: signal.getsignal(s) for s in watched} != before or ckpt._on_step_end in loader.step_end_callbacks:
        sys.exit("Checkpointer.close() did not restore the handlers and detach from the loader")
    print(f"rank {hvd.rank()}: SIGNALS-OK", flush=True)

    config = dx.ControllerConfig(policy="static", advanced=dx.AdvancedConfig(resource_period_s=60.0))
    with dx.DynamixController(loader, opt, config) as controller:
        thread = controller.resources._thread
        if thread is None or not thread.is_alive():
            sys.exit("the resource thread did not start")
    t0 = time.monotonic()
    thread.join(timeout=1.0)
    gone = time.monotonic() - t0
    names = [t.name for t in threading.enumerate()]
    if thread.is_alive() or "dynamix-resources" in names:
        sys.exit(f"the resource thread outlived close() by more than a second: {names}")
    if controller._on_step_end in loader.step_end_callbacks or controller.channel._comm is not None:
        sys.exit("close() left the controller attached to the loader or its channel open")
    controller.close()  # idempotent
    print(f"rank {hvd.rank()}: CLOSE-OK thread gone {gone:.3f} s after close()", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=("checkpoint", "close"))
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--marker", default="")
    ap.add_argument("--evil-torch", default="")
    ap.add_argument("--evil-raw", default="")
    args = ap.parse_args()
    hvd.init()
    dx.configure_logging()
    part_checkpoint(args) if args.part == "checkpoint" else part_close(args)


if __name__ == "__main__":
    main()
