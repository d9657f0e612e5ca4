"""Token-weighted exactness under mpirun: every update equals the single-process mean over all valid
tokens of all ranks' batches of that step (padding masked), for unequal per-rank sizes that change
mid-epoch, with token counts from the loader's lengths, from token budgets (set by hand or by the
controller), or given per step (one small allreduce), with and without accumulation; SGD with
momentum and AdamW, float64."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launching import launch
from workers.tokens import MODES, Sequences, collate, make_model, token_loss

RANKS = 3
SAMPLES = 90
EPOCHS = 2
TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens")
    launch("mpirun", RANKS, "tokens.py", "--out", str(out), "--samples", str(SAMPLES), "--epochs", str(EPOCHS))
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(RANKS)]


def replay(mode: str, steps: list[list[dict]]) -> dict[str, torch.Tensor]:
    """One process: each optimizer step's gradient is the mean over the valid tokens of every
    micro-batch of every rank."""
    make_opt = MODES[mode][0]
    data = Sequences(SAMPLES)
    model = make_model()
    opt = make_opt(model.parameters())
    for per_rank in zip(*steps):
        idx = [i for s in per_rank for m in s["micro"] for i in m["indices"]]
        _, x, y, mask = collate([data[i] for i in idx])
        opt.zero_grad()
        (token_loss(model, x, y, mask) / mask.sum()).backward()
        opt.step()
    return {n: p.detach().flatten() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", list(MODES))
def test_update_is_the_mean_over_all_valid_tokens(results, mode):
    steps = [r["modes"][mode]["steps"] for r in results]
    ref = replay(mode, steps)
    worst = max((torch.tensor(v, dtype=torch.float64) - ref[n]).abs().max().item()
                for r in results for n, v in r["modes"][mode]["params"].items())
    moved = max((torch.tensor(v, dtype=torch.float64) - p.detach().flatten()).abs().max().item()
                for n, v in results[0]["modes"][mode]["params"].items()
                for m, p in make_model().named_parameters() if m == n)
    print(f"{mode}: max |param - single-process token mean| = {worst:.2e} (parameters moved {moved:.2f})")
    assert moved > 0.05 and worst < TOLERANCE


@pytest.mark.parametrize("mode", list(MODES))
def test_every_sample_once_and_sizes_changed(results, mode):
    data = Sequences(SAMPLES)
    steps = [r["modes"][mode]["steps"] for r in results]
    assert len({len(s) for s in steps}) == 1
    for epoch in range(EPOCHS):
        seen = [i for s in steps for rec in s if rec["epoch"] == epoch for m in rec["micro"] for i in m["indices"]]
        assert sorted(seen) == list(range(SAMPLES)), f"{mode}: epoch {epoch} lost or repeated samples"
    sizes = {tuple(m["sizes"]) for rec in steps[0] for m in rec["micro"]}
    assert len(sizes) == 2 if MODES[mode][4] else len(sizes) > 2, sizes
    for per_rank in zip(*steps):
        for k in range(len(per_rank[0]["micro"])):
            for rank, s in enumerate(per_rank):
                m = s["micro"][k]
                assert len(m["indices"]) == m["counts"][rank] >= 1
                if m["tokens"] is not None:  # the plan's counts are the true valid tokens
                    assert m["tokens"][rank] == sum(data.lengths[i] for i in m["indices"])


def steps_of(result: dict, mode: str) -> list[dict]:
    return result["modes"][mode]["steps"]


def test_token_budgets_give_ranks_their_tokens(results):
    """With budgets, a rank's tokens stay within its budget in every step but the epoch's last (a
    single sample longer than the budget goes alone), and the records count tokens."""
    steps = [r["modes"]["budget-adamw"]["steps"] for r in results]
    checked = 0
    for epoch in range(EPOCHS):
        in_epoch = [[rec for rec in s if rec["epoch"] == epoch] for s in steps]
        for per_rank in list(zip(*in_epoch))[:-1]:
            for rank, s in enumerate(per_rank):
                m = s["micro"][0]
                if m["counts"][rank] > 1:
                    assert m["tokens"][rank] <= m["sizes"][rank], (epoch, rank, m)
                    checked += 1
    assert checked > 10
    records = results[1]["modes"]["budget-adamw"]["records"]
    assert all(r["local_batch"] == r["local_tokens"] > 0 for r in records)
    assert all(r["global_batch"] == r["global_tokens"] for r in records)
    controlled = [rec["micro"][0]["sizes"] for rec in steps_of(results[0], "budget-controller")]
    assert controlled[-1][1] < min(controlled[-1][0], controlled[-1][2]), "the slow rank should get fewer tokens"
    given = results[2]["modes"]["given-accum-sgd"]["records"]
    assert all(r["global_tokens"] > r["local_tokens"] > 0 for r in given)


@pytest.mark.parametrize("mode", ["budget-adamw", "budget-accum-adamw"])
def test_step_records_carry_the_squared_lengths_of_the_ranks_samples(results, mode):
    """With token budgets every step record carries the sum of its samples' squared lengths (over all
    micro-batches of the step), which the cost model's per token x length term is fitted on."""
    data = Sequences(SAMPLES)
    for rank, r in enumerate(results):
        steps, records = r["modes"][mode]["steps"], r["modes"][mode]["records"]
        assert len(steps) == len(records)
        for step, rec in zip(steps, records):
            expected = sum(data.lengths[i] ** 2 for m in step["micro"] for i in m["indices"])
            assert rec["local_sq_tokens"] == expected > 0, (rank, step, rec)
