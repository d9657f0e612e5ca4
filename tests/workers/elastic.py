"""Worker for horovodrun elastic: the process on host --victim kills itself (SIGKILL) once, mid-epoch.

Rank 0 commits, every step, the samples every rank read (allgathered), with the world size and the
batch sizes; it writes them to <out>/rank0.json at the end. Every process writes
<out>/joined-<pid>.json when it (re)enters training, with its host and the batch size it got.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import dynamix_hvd as dx
from dynamix_hvd.data.synthetic import WithIndex, teacher_classification
from dynamix_hvd.resilience.elastic import ElasticState

MIN_EPOCHS, MAX_EPOCHS = 3, 30  # train on until the victim's host has rejoined (or MAX_EPOCHS)
SAMPLES = 480



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--victim", required=True, help="host name whose worker dies once")
    ap.add_argument("--kill-at", type=int, default=4, help="step of epoch 1 at which it dies")
    ap.add_argument("--step-sleep", type=float, default=0.15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    out, host = Path(args.out), os.environ.get("HOROVOD_HOSTNAME", "?")
    marker = out / "victim-killed"
    train_set, _ = teacher_classification(SAMPLES, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
    loader = dx.AdaptiveLoader(WithIndex(train_set), dx.checkpoint.redistribute(24, hvd.size()), hvd.rank(), seed=2)
    opt = dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                          loader)
    controller = dx.DynamixController(loader, opt, dx.ControllerConfig(policy="ppo", decide_every_steps=6,
                                                                       max_batch=32, timeout_s=60))
    state = ElasticState(model, opt, loader, controller, served=[])

    @hvd.elastic.run
    def train(state: ElasticState) -> None:
        (out / f"joined-{os.getpid()}-{hvd.rank()}.json").write_text(json.dumps({
            "host": host, "rank": hvd.rank(), "world": hvd.size(), "batch_sizes": list(loader.batch_sizes),
            "epoch": loader.epoch, "step": loader.step}))
        epoch = loader.epoch
        while epoch < MAX_EPOCHS:
            loader.set_epoch(epoch)
            for idx, x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                everyone = hvd.allgather_object(idx.tolist(), name="test.served")
                state.served.append({"epoch": epoch, "world": hvd.size(), "sizes": list(loader.current_step.counts),
                                     "indices": [i for part in everyone for i in part]})
                state.commit()
                if host == args.victim and epoch == 1 and loader.step == args.kill_at and not marker.exists():
                    marker.write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(args.step_sleep)  # leaves time for the victim's host to come back
            # Same answer on every rank (`served` is identical everywhere: allgathered, synced on reset).
            # Stop only once a step ran in the regrown world: a rejoin that lands on this epoch's end
            # would otherwise end the job before the 3-rank world trained at all.
            worlds = [s["world"] for s in state.served]
            rejoined = 2 in worlds and 3 in worlds[worlds.index(2):]
            if epoch + 1 >= MIN_EPOCHS and marker.exists() and rejoined:
                break
            epoch += 1

    train(state)
    if hvd.rank() == 0:
        (out / "rank0.json").write_text(json.dumps({"served": state.served,
                                                     "decisions": len(controller.history)}))


if __name__ == "__main__":
    main()
