"""The torch.distributed engine in real torchrun jobs: exact mean gradients and exact epoch coverage.

One ``torchrun --nproc-per-node 3`` job runs tests/workers/ddp_dataplane.py over several cases (with
DistributedDataParallel and without it, unequal and equal sizes, accumulation), in a process where
importing Horovod fails; one ``mpirun -np 3`` job runs DDP with the rendezvous taken from MPI. Each
case is replayed here as single-process full-batch training in float64: the parameters must match to 1e-6.
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
RANKS = 3

CASES = {  # name: worker arguments (a name with "tokens": the loss is the mean over tokens)
    "ddp-3.7.12": ["--wrap", "ddp", "--sizes", "3,7,12"],
    "ddp-equal": ["--wrap", "ddp", "--sizes", "6,6,6"],
    "flat-3.7.12": ["--wrap", "none", "--sizes", "3,7,12"],
    "ddp-accumulate3": ["--wrap", "ddp", "--sizes", "2,5,3", "--passes", "3", "--configs", "sgd,adamw_clip,sgd_sum"],
    "ddp-tokens": ["--wrap", "ddp", "--sizes", "3,7,12", "--tokens", "--configs", "sgd,adamw_clip"],
    "flat-accumulate2": ["--wrap", "none", "--sizes", "4,1,6", "--passes", "2", "--change-at", "3", "--configs", "sgd,adamw_clip"],
}


# launched by mpirun instead (torch.distributed's rendezvous from the MPI world, dx.torch_env_from_mpi)
MPIRUN_CASES = {"mpirun-ddp-5.9.2": ["--wrap", "ddp", "--sizes", "5,9,2", "--configs", "sgd,adamw_clip"]}


def _run_cases(root: Path, launcher: str, cases: dict[str, list[str]], *extra: str) -> dict[str, list[dict]]:
    argv: list[str] = []
    for name, args in cases.items():
        (root / name).mkdir()
        argv += [*(["--then"] if argv else []), "--out", str(root / name), "--samples", str(SAMPLES),
                 "--epochs", str(EPOCHS), *args]
    launch(launcher, RANKS, "ddp_dataplane.py", *extra, *argv, timeout=400)
    return {name: [json.loads((root / name / f"rank{r}.json").read_text()) for r in range(RANKS)] for name in cases}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    out = _run_cases(tmp_path_factory.mktemp("ddp"), "torchrun", CASES, "--no-horovod")
    out.update(_run_cases(tmp_path_factory.mktemp("mpirun"), "mpirun", MPIRUN_CASES, "--no-horovod", "--mpi-env"))
    return out


def reference_params(config: str, steps: list[list[dict]], tokens: bool = False) -> dict[str, torch.Tensor]:
    """Single-process full-batch replay: each optimizer step's batch is the union of the samples of all
    ranks and all its micro-batches."""
    make_opt, kwargs = CONFIGS[config]
    data = IndexedData(SAMPLES)
    model = make_model()
    opt = make_opt(model.parameters())
    base_lr = [g["lr"] for g in opt.param_groups]
    coupling = LRCoupling()
    groups: dict[int, list[tuple[dict, ...]]] = {}
    for per_rank in zip(*steps):
        groups.setdefault(per_rank[0]["group"], []).append(per_rank)
    for micro in groups.values():
        idx = torch.tensor([i for per_rank in micro for s in per_rank for i in s["indices"]])
        opt.zero_grad()
        if tokens:  # the mean over every token of the step: sample i stands for 1 + i % 4 of them
            weights = (1 + idx % 4).to(torch.float64)
            per_sample = nn.functional.cross_entropy(model(data.x[idx]), data.y[idx], reduction="none")
            ((weights * per_sample).sum() / weights.sum()).backward()
        else:
            nn.functional.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
        if "max_grad_norm" in kwargs:
            nn.utils.clip_grad_norm_(model.parameters(), kwargs["max_grad_norm"])
        factor = 1.0
        if "lr_rule" in kwargs:
            B = sum(micro[0][0]["sizes"]) * len(micro)
            factor = coupling.plan(kwargs["lr_rule"], B, kwargs["base_batch_size"], None, math.ceil(SAMPLES / B))
            coupling.commit()
        for g, lr in zip(opt.param_groups, base_lr):
            g["lr"] = lr * factor
        opt.step()
    return {n: p.detach().flatten() for n, p in model.named_parameters()}


def _configs(name: str, per_rank: list[dict]) -> list[str]:
    return list(per_rank[0]["configs"])


@pytest.mark.parametrize("case", [*CASES, *MPIRUN_CASES])
def test_the_torch_engine_runs_without_horovod(results, case):
    for r, rank in enumerate(results[case]):
        assert rank["world"] == RANKS and rank["launcher_rank"] == r
        for config, got in rank["configs"].items():
            assert got["engine"] == "torch", (config, got["engine"])
            assert not got["horovod_imported"]


@pytest.mark.parametrize("case", [*CASES, *MPIRUN_CASES])
def test_every_sample_once_per_epoch(results, case):
    for config in _configs(case, results[case]):
        steps = [r["configs"][config]["steps"] for r in results[case]]
        assert len({len(s) for s in steps}) == 1, "ranks ran different numbers of steps"
        for epoch in range(EPOCHS):
            seen = [i for s in steps for rec in s if rec["epoch"] == epoch for i in rec["indices"]]
            assert sorted(seen) == list(range(SAMPLES)), f"{config}: epoch {epoch} lost or repeated samples"
        for per_rank in zip(*steps):
            for rank, s in enumerate(per_rank):
                assert len(s["indices"]) == s["counts"][rank] >= 1
        per_epoch: dict[int, set] = {}
        for s in steps[0]:
            per_epoch.setdefault(s["epoch"], set()).add(tuple(s["sizes"]))
        assert any(len(v) > 1 for v in per_epoch.values()), "the sizes never changed within an epoch"


@pytest.mark.parametrize("case", [*CASES, *MPIRUN_CASES])
def test_parameters_equal_single_process_full_batch(results, case):
    for config in _configs(case, results[case]):
        steps = [r["configs"][config]["steps"] for r in results[case]]
        if "accumulate" in case:
            groups = [s["group"] for s in steps[0]]
            assert max(groups.count(g) for g in set(groups)) > 1, "no optimizer step accumulated micro-batches"
        ref = reference_params(config, steps, tokens="tokens" in case)
        worst = max((torch.tensor(values, dtype=torch.float64) - ref[name]).abs().max().item()
                    for r in results[case] for name, values in r["configs"][config]["params"].items())
        print(f"{case} {config}: max |param - reference| = {worst:.3e}")
        assert worst < TOLERANCE, (case, config, worst)


def test_gradient_statistics_are_recorded(results):
    for r in results["ddp-3.7.12"]:
        records = r["configs"]["sgd"]["records"]
        assert len(records) == len(r["configs"]["sgd"]["steps"])
        assert all(rec["local_grad_sq"] > 0 and rec["global_grad_sq"] > 0 for rec in records)
