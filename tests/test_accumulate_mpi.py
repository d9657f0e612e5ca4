"""Gradient accumulation chosen by the controller, in a real 2-rank job (`mpirun`).

tests/workers/accumulate.py ramps the global batch past the memory bounds; the decisions switch the
optimizer to several micro-batches per step. This process checks that every rank applied the same
decisions at step boundaries, that no sample was lost or duplicated, that each step's record covers
all its micro-batches, and, by replaying the steps as single-process full-batch training, that every
update is the exact mean gradient over all samples of its micro-batches.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launching import launch
from test_dropin_mpi import assert_params, replay
from workers.accumulate import EPOCHS, SAMPLES

RANKS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accumulate")
    launch("mpirun", RANKS, "accumulate.py", "--out", str(out), timeout=600)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(RANKS)]


def test_decisions_switch_to_accumulation_past_the_memory_bounds(runs):
    history = runs[0]["history"]
    assert all(r["history"] == history for r in runs[1:]), "ranks disagree on decisions"
    passes = [d["passes"] for d in history]
    # the ramp's targets 13, 18, 24 with one pass holding at most 2 x 4: 2, then 3 micro-batches
    assert passes[0] == 2 and max(passes) == 3, passes
    assert all(max(d["sizes"]) <= 4 for d in history), "a micro-batch past the memory bound"
    assert max(d["passes"] * sum(d["sizes"]) for d in history) >= 12 * RANKS, "B stayed within one pass"
    for r in runs:
        assert not any(r["decided_mid_step"]), "a decision between the micro-batches of a step"
        assert r["restored"] == {"passes": passes[-1], "optimizer": passes[-1], "controller": passes[-1]}


def test_every_step_is_its_micro_batches(runs):
    for rank, run in enumerate(runs):
        for g in run["groups"]:
            assert g["micro_batches"] == len(g["micro"])
            assert g["local_batch"] == sum(m["counts"][rank] for m in g["micro"])
            assert g["global_batch"] == sum(sum(m["counts"]) for m in g["micro"])
            assert len(g["micro"]) <= g["micro"][0]["passes"]
            # the record's compute covers every micro-batch (each slept 2 ms per sample)
            assert g["compute_s"] >= 0.9 * run["sleep_per_sample"] * g["local_batch"], g
            assert g["data_wait_s"] >= 0
    groups = runs[0]["groups"]
    assert any(g["micro_batches"] == 3 for g in groups)
    full = [g for g in groups if len(g["micro"]) < g["micro"][0]["passes"]]
    # a short step only at an epoch's end (the loader ran out of micro-batches)
    ends = {max(j for j, h in enumerate(groups) if h["epoch"] == e) for e in range(EPOCHS)}
    assert all(groups.index(g) in ends for g in full), "a short step inside an epoch"


def test_no_sample_lost_or_duplicated(runs):
    for epoch in range(EPOCHS):
        seen = sorted(i for run in runs for g in run["groups"] if g["epoch"] == epoch
                      for m in g["micro"] for i in m["indices"])
        assert seen == list(range(SAMPLES)), f"epoch {epoch}"


def test_updates_are_the_exact_mean_over_all_micro_batches(runs):
    groups = [r["groups"] for r in runs]
    batches = [[i for per_rank in step for m in per_rank["micro"] for i in m["indices"]] for step in zip(*groups)]
    lrs = [g["lr"] for g in groups[0]]
    assert all([g["lr"] for g in other] == lrs for other in groups[1:])
    model = replay(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), batches, lrs=lrs, samples=SAMPLES)
    for run in runs:
        assert_params(model, run["params"])
