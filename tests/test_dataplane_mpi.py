"""The data plane in real multi-process jobs: exact mean gradients and exact epoch coverage.

Each case runs tests/workers/dataplane.py under a real launcher (the cases of one launcher and world size
in one job) and then replays the same steps in this process as single-process full-batch training: the
parameters must match to 1e-6 (float64).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dynamix_hvd.optim.lr_scaling import LRCoupling
from launching import launch
from workers.dataplane import CONFIGS, IndexedData, make_model

SAMPLES = 101
EPOCHS = 3
TOLERANCE = 1e-6

CASES = [  # (launcher, ranks, first epoch's sizes)
    ("mpirun", 2, "5,11"),
    ("mpirun", 3, "3,7,12"),
    ("mpirun", 3, "6,6,6"),  # equal sizes until the change: one factor for all ranks, applied after the sum
    ("horovodrun", 2, "3,7"),
    ("horovodrun-gloo", 3, "3,7,12"),
]


def reference_params(config: str, steps: list[list[dict]]) -> dict[str, torch.Tensor]:
    """Single-process full-batch replay: each step's batch is the union of all ranks' samples."""
    make_opt, kwargs = CONFIGS[config]
    data = IndexedData(SAMPLES)
    model = make_model()
    opt = make_opt(model.parameters())
    base_lr = [g["lr"] for g in opt.param_groups]
    coupling = LRCoupling()
    for per_rank in zip(*steps):
        idx = torch.tensor([i for s in per_rank for i in s["indices"]])
        opt.zero_grad()
        nn.functional.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
        if "max_grad_norm" in kwargs:
            nn.utils.clip_grad_norm_(model.parameters(), kwargs["max_grad_norm"])
        factor = 1.0
        if "lr_rule" in kwargs:  # B / B0, eased in over the default warm-up after B grows
            B = sum(per_rank[0]["sizes"])
            factor = coupling.plan(kwargs["lr_rule"], B, kwargs["base_batch_size"], None, math.ceil(SAMPLES / B))
            coupling.commit()
        for g, lr in zip(opt.param_groups, base_lr):
            g["lr"] = lr * factor
        opt.step()
    return {n: p.detach().flatten() for n, p in model.named_parameters()}


# Runs of tests/workers/dataplane.py by launcher and world size: name -> the worker's arguments. The runs of
# one launcher and world size share one job (--then between them, each in its own folder), so that its
# ranks start, import torch and Horovod and join once; tests/test_slow_rank_mpi.py adds a run of its own.
RUNS: dict[tuple[str, int], dict[str, list[str]]] = {}
for _launcher, _ranks, _sizes in CASES:
    RUNS.setdefault((_launcher, _ranks), {})[_sizes] = ["--sizes", _sizes, "--samples", str(SAMPLES),
                                                        "--epochs", str(EPOCHS)]
_JOBS: dict[tuple[str, int], dict[str, Path] | BaseException] = {}


def dataplane_run(launcher: str, ranks: int, name: str, factory: pytest.TempPathFactory) -> list[dict]:
    """Every rank's results of run `name`; the first call for a launcher and world size runs the job."""
    key = (launcher, ranks)
    if key not in _JOBS:
        folders, argv = {}, []
        root = factory.mktemp(f"{launcher}{ranks}")
        for run_name, args in RUNS[key].items():
            folders[run_name] = root / f"run{len(folders)}"
            folders[run_name].mkdir()
            argv += [*(["--then"] if argv else []), "--out", str(folders[run_name]), *args]
        try:
            launch(launcher, ranks, "dataplane.py", *argv)
            _JOBS[key] = folders
        except BaseException as exc:  # the job failed: every test of it fails with its output, none reruns it
            _JOBS[key] = exc
    if isinstance(_JOBS[key], BaseException):
        raise _JOBS[key]
    folder = _JOBS[key][name]
    return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-np{c[1]}-{c[2].replace(',', '.')}")
def job(request, tmp_path_factory):
    launcher, ranks, sizes = request.param
    return ranks, sizes, dataplane_run(launcher, ranks, sizes, tmp_path_factory)


def test_every_rank_reports_the_whole_world(job):
    ranks, _, results = job
    assert [r["world"] for r in results] == [ranks] * ranks


@pytest.mark.parametrize("config", list(CONFIGS))
def test_epoch_covers_every_sample_once_with_equal_step_counts(job, config):
    ranks, sizes, results = job
    steps = [r["configs"][config]["steps"] for r in results]
    assert len({len(s) for s in steps}) == 1, "ranks ran different numbers of steps"
    assert steps[0][0]["sizes"] == [int(s) for s in sizes.split(",")]
    for epoch in range(EPOCHS):
        seen = [i for s in steps for rec in s if rec["epoch"] == epoch for i in rec["indices"]]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch} lost or repeated samples"
    for per_rank in zip(*steps):
        assert len({(s["epoch"], s["step"]) for s in per_rank}) == 1
        for rank, s in enumerate(per_rank):
            assert len(s["indices"]) == s["counts"][rank] >= 1
    # the mid-epoch change really happened: some epoch ran with two different size vectors
    per_epoch = {}
    for s in steps[0]:
        per_epoch.setdefault(s["epoch"], set()).add(tuple(s["sizes"]))
    assert any(len(v) > 1 for v in per_epoch.values())


@pytest.mark.parametrize("config", list(CONFIGS))
def test_parameters_equal_single_process_full_batch(job, config):
    _, _, results = job
    steps = [r["configs"][config]["steps"] for r in results]
    ref = reference_params(config, steps)
    worst = 0.0
    for r in results:
        for name, values in r["configs"][config]["params"].items():
            diff = (torch.tensor(values, dtype=torch.float64) - ref[name]).abs().max().item()
            worst = max(worst, diff)
    print(f"max |param - reference| for {config}: {worst:.3e}")
    assert worst < TOLERANCE


def test_timing_fields_are_populated(job):
    _, _, results = job
    for r in results:
        records = r["configs"]["sgd"]["records"]
        assert len(records) == len(r["configs"]["sgd"]["steps"])
        for rec in records:
            for key in ("data_wait_s", "compute_s", "sync_wait_s", "optimizer_s", "step_s"):
                assert rec[key] >= 0.0, (key, rec)
            assert rec["samples_per_s"] > 0 and rec["peak_memory_bytes"] > 0
            assert rec["local_grad_sq"] > 0 and rec["global_grad_sq"] > 0
