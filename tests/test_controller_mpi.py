"""The controller in real multi-process jobs: decisions reach every rank, stay in bounds, time out.

The runs of tests/workers/controller.py of one launcher and world size share one job (--then between them,
each in its own folder), so that its ranks start, import torch and Horovod and join once; the first test
that needs a job starts it. The jobs whose runs depend on timing (sleeps, measured step times) run alone;
the ones that only wait for a silent rank, and the Gloo job beside them, run side by side.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynamix_hvd.control.config import ControllerConfig
from dynamix_hvd.control.controller import NO_MODEL_WARNING
from dynamix_hvd.control.proposal import ProposalConfig
from launching import WORKERS, launch_side_by_side

# job -> (launcher, ranks, {run: the worker's arguments}); tests/test_model_mpi.py adds a run of its own
JOBS: dict[str, tuple[str, int, dict[str, list[str]]]] = {
    "mpirun-3": ("mpirun", 3, {
        "decisions": ["--epochs", "2", "--every", "5", "--max-batch", "40"],
        **{f"fit-fp16-{fp16}": ["--epochs", "1", "--every", "8", "--policy", "static", *(["--fp16"] if fp16 else [])]
           for fp16 in (False, True)},
    }),
    "mpirun-2": ("mpirun", 2, {
        **{f"cadence-{policy}": ["--epochs", "4", "--every", "-1", "--policy", policy, "--max-batch", "40",
                                 "--decision-budget", "0", "--with-model",
                                 *(["--sleep-per-sample", "0.0005", "--slow-rank", "1", "--slow-factor", "3"]
                                   if policy == "model" else [])]
           for policy in ("static", "model")},
        "budget": ["--epochs", "4", "--every", "-1", "--policy", "static"],
        "ramp": ["--epochs", "2", "--every", "-1", "--policy", "static", "--target-decisions", "4",
                 "--decision-budget", "0"],
        "ceiling": ["--epochs", "2", "--every", "-1", "--policy", "static", "--target-decisions", "4",
                    "--decision-budget", "0", "--sleep-per-sample", "0.001", "--max-interval", "0.12"],
        **{run: ["--epochs", "3", "--every", "-1", "--policy", "model", "--target-decisions", "6",
                 "--sizes", "16,16", "--samples", "3200", "--max-batch", "64", "--sleep-per-sample", "0.001",
                 "--slow-rank", "1", "--slow-factor", "3", "--slow-from-step", "100", "--decision-budget", "0",
                 *(["--change-vote-s", "0"] if run == "recheck" else [])]
           for run in ("recheck", "vote")},
        "adam-noise": ["--epochs", "3", "--every", "-1", "--policy", "static", "--adam", "--decision-budget", "0"],
    }),
    "horovodrun-gloo-2": ("horovodrun-gloo", 2, {"decisions": ["--epochs", "2", "--every", "5", "--max-batch", "40"]}),
    "silent-mpirun-3": ("mpirun", 3, {"silent": ["--mode", "silent", "--silent", "2", "--timeout", "3"]}),
    "silent-gloo-2": ("horovodrun-gloo", 2, {"silent": ["--mode", "silent", "--silent", "1", "--timeout", "3"]}),
}
# jobs started together (side by side): only the last group's spend their time waiting
GROUPS = (("mpirun-3",), ("mpirun-2",), ("horovodrun-gloo-2", "silent-mpirun-3", "silent-gloo-2"))
_DONE: dict[str, tuple[subprocess.CompletedProcess, dict[str, Path]]] = {}


def controller_job(job: str, factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict[str, Path]]:
    """Job `job`'s CompletedProcess and each run's folder; the first call runs the job (and its group)."""
    if job not in _DONE:
        group = next(g for g in GROUPS if job in g)
        specs, folders = {}, {}
        for name in group:
            launcher, ranks, runs = JOBS[name]
            root = factory.mktemp(name)
            folders[name], argv = {}, []
            for run, args in runs.items():
                folders[name][run] = root / run
                folders[name][run].mkdir()
                argv += [*(["--then"] if argv else []), "--out", str(root / run), *args]
            specs[name] = (launcher, ranks, [sys.executable, str(WORKERS / "controller.py"), *argv])
        for name, done in launch_side_by_side(specs, timeout=300).items():
            _DONE[name] = (done.proc, folders[name])
    return _DONE[job]


def controller_run(job: str, run: str, factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    """Every rank's results of run `run` of job `job` (which must have succeeded), and the job's output."""
    proc, folders = controller_job(job, factory)
    assert proc.returncode == 0, f"{job}: exit {proc.returncode}\n{proc.stdout[-6000:]}"
    ranks = JOBS[job][1]
    return [json.loads(Path(folders[run], f"rank{r}.json").read_text()) for r in range(ranks)], proc.stdout


@pytest.mark.parametrize("launcher, ranks", [("mpirun", 3), ("horovodrun-gloo", 2)])
def test_every_rank_receives_every_decision_within_bounds(tmp_path_factory, launcher, ranks):
    results, out = controller_run(f"{launcher}-{ranks}", "decisions", tmp_path_factory)
    # no model= given: rank 0 alone says the BatchNorm floor cannot apply
    assert [[w[:60] for w in r["warnings"]] for r in results] == [[NO_MODEL_WARNING[:60]]] + [[]] * (ranks - 1)
    assert NO_MODEL_WARNING[:60] in out, out[-3000:]
    assert results[0]["backend"] == ("mpi4py" if launcher == "mpirun" else "horovod-objects")
    histories = [r["history"] for r in results]
    assert len(histories[0]) >= 4
    for h in histories[1:]:
        assert [d["sizes"] for d in h] == [d["sizes"] for d in histories[0]], "ranks disagree on decisions"
    for d in histories[0]:
        assert len(d["sizes"]) == ranks
        assert all(2 <= b <= 40 for b in d["sizes"]), d
        assert d["lr_gain"] > 0
    assert any(d["reward"] is not None for d in histories[0])
    assert results[0]["final_sizes"] == histories[0][-1]["sizes"]


@pytest.mark.parametrize("fp16", [False, True])
def test_the_network_fit_knows_the_gradient_bytes_and_the_allreduce_latency(tmp_path_factory, fp16):
    """Every decision's network fit carries the bytes each rank sends in the gradient allreduce (the
    model's 1,386 float32 parameters, halved by fp16 compression, times 2 (R - 1) / R) and, from the
    second decision on, the latency probed with a single-value allreduce after each decision."""
    result = controller_run("mpirun-3", f"fit-fp16-{fp16}", tmp_path_factory)[0][0]
    payload = 1386 * (2 if fp16 else 4)
    assert result["allreduce_bytes"] == payload
    fitted = [d["net"] for d in result["history"] if d["net"] is not None]
    assert len(fitted) >= 3, result["history"]
    assert all(n["bus_bytes"] == pytest.approx(payload * 2 * 2 / 3) for n in fitted)
    assert all(0 < n["latency_s"] < 1.0 for n in fitted[1:]), [n["latency_s"] for n in fitted]


@pytest.mark.parametrize("policy", ["static", "model"])
def test_automatic_cadence_decides_at_epoch_ends_and_inside_epochs(tmp_path_factory, policy):
    """decide_every_steps=None: every epoch end, and inside epochs so that the job gets about
    target_decisions (32) decisions, never closer than min_decision_steps (8) nor in an epoch's last
    half-interval; the same steps on every rank, also when decisions change the sizes (model: rank 1
    sleeps 3x longer per sample, so the model moves samples to rank 0 whatever the machine's noise)."""
    results, _ = controller_run("mpirun-2", f"cadence-{policy}", tmp_path_factory)
    assert not any(r["warnings"] for r in results), "model= given: nothing to warn about"
    when = results[0]["when"]
    assert results[1]["when"] == when, when
    assert [d["sizes"] for d in results[1]["history"]] == [d["sizes"] for d in results[0]["history"]]
    if policy == "static":  # 1200 samples, 8 + 12 per step: 60 steps an epoch, 32 / 4 epochs = 8 a epoch
        assert when == [[e, s, 60] for e in range(4) for s in (8, 16, 24, 32, 40, 48, 56, 60)], when
        return
    assert any(d["sizes"] != [8, 12] for d in results[0]["history"]), "the sizes did change (from 8 + 12)"
    assert ControllerConfig.from_dict(results[0]["config"]).policy_config == ProposalConfig(), "defaults spelled out"
    for epoch in range(4):
        steps = [s for e, s, _ in when if e == epoch]
        assert steps and steps[-1] == [n for e, _, n in when if e == epoch][-1], (epoch, when)  # its end
        gaps = [b - a for a, b in zip([0] + steps, steps)]
        assert min(gaps[:-1], default=8) >= 8, (epoch, when)


def test_decision_budget_spaces_later_decisions_alike_on_every_rank(tmp_path_factory):
    """With the default budget (1% of training time) on steps of about a millisecond, a decision costs
    many steps: after the first four, rank 0 sends a spacing with each decision and no rank decides
    sooner, epoch ends included; every rank decides at the same steps and records the same spacing."""
    results, _ = controller_run("mpirun-2", "budget", tmp_path_factory)
    when, history = results[0]["when"], results[0]["history"]
    assert results[1]["when"] == when
    assert [d["spacing"] for d in results[1]["history"]] == [d["spacing"] for d in history]
    # every decision sends a spacing (at least 1 step whenever deciding takes any time; how many depends on
    # the machine's speed and load): what is checked is that every rank records and keeps it
    assert all(d["spacing"] >= 1 for d in history), [d["spacing"] for d in history]
    steps = [e * 60 + s for e, s, _ in when]  # 60 steps an epoch at the static sizes
    assert steps[:4] == [8, 16, 24, 32]  # the ramp that finds the split is free
    for i in range(4, len(steps)):  # a change vote may bring one forward to a quarter of the spacing
        least = history[i - 1]["spacing"] // (4 if history[i].get("changed_by") else 1)
        assert steps[i] - steps[i - 1] >= least, (i, steps, [d["spacing"] for d in history])
    assert len(when) < 32  # without the budget: 32 (see above)


def test_adam_noise_statistics_are_taken_on_the_same_steps_on_every_rank(tmp_path_factory):
    """Adam's preconditioned norms cost several passes over the gradients: rank 0 sends with each decision
    how many steps apart they are taken (from their measured cost and the step time; on these 1-2 ms
    steps more than 1), every rank takes them on the same steps (the step after each decision, then
    every `noise_every`-th), and the noise scale is estimated from them."""
    results, _ = controller_run("mpirun-2", "adam-noise", tmp_path_factory)
    history, measured = results[0]["history"], results[0]["measured"]
    assert results[0]["noise_preconditioner"] == "adam"
    assert results[1]["measured"] == measured
    assert [d["noise_every"] for d in results[1]["history"]] == [d["noise_every"] for d in history]
    assert max(d["noise_every"] for d in history) > 1, [d["noise_every"] for d in history]
    assert 0 < sum(measured) < len(measured)
    # the schedule: every step until the first decision, then the step after each and every k-th
    at = results[0]["at_step"]
    assert all(measured[:at[0]])
    for i, start in enumerate(at):
        end = at[i + 1] if i + 1 < len(at) else len(measured)
        every = history[i]["noise_every"]
        assert measured[start:end] == [(k % every) == 0 for k in range(end - start)], (i, every)
    assert any(d["noise_point"] is not None and d["noise_point"] > 0 for d in history[2:])


def test_automatic_cadence_ramps_up_to_its_interval(tmp_path_factory):
    """The first two decisions come min_decision_steps (8) apart, then twice that, until the interval that
    spreads target_decisions over the job (4 over 2 epochs of 60 steps: every 30) is reached."""
    results, _ = controller_run("mpirun-2", "ramp", tmp_path_factory)
    assert results[1]["when"] == results[0]["when"]
    # epoch 0: 8, 16, 16 + 16; the next at 32 + 30 = 62 is past the epoch: the end decides
    assert results[0]["when"] == [[0, 8, 60], [0, 16, 60], [0, 32, 60], [0, 60, 60], [1, 30, 60], [1, 60, 60]]


def test_a_long_interval_is_capped_at_the_seconds_asked_for_alike_on_every_rank(tmp_path_factory):
    """4 decisions over 2 epochs of 60 steps would come every 30 steps once ramped up (above); steps
    of about 12 ms (rank 1 sleeps 12 x 1 ms) and at most 0.12 s an interval cap it near 10 steps:
    rank 0 sends the ceiling with every decision, every rank records the same and decides at the same
    steps, and no interval inside an epoch is longer than the ceiling the last decision sent."""
    results, _ = controller_run("mpirun-2", "ceiling", tmp_path_factory)
    when, history = results[0]["when"], results[0]["history"]
    assert results[1]["when"] == when
    ceilings = [d["ceiling"] for d in history]
    assert [d["ceiling"] for d in results[1]["history"]] == ceilings
    # 0.12 s at steps of 12-13 ms (a slower or busier machine: more ms, fewer steps)
    assert all(1 <= c <= 11 for c in ceilings), ceilings
    steps = [e * 60 + s for e, s, _ in when]
    assert steps[:2] == [8, 16]  # the ramp's first intervals are min_decision_steps (8), under any ceiling
    for i in range(2, len(steps)):
        if when[i][0] == when[i - 1][0] and when[i][1] != 60:  # inside an epoch (its end decides anyway)
            assert steps[i] - steps[i - 1] <= max(8, ceilings[i - 1]), (i, when, ceilings)
    assert len(when) >= 10, when  # without the ceiling: 6
    # every rank records the settings it ran with, the ones given on its command line included
    for result in results:
        config = ControllerConfig.from_dict(result["config"])
        assert result["checkpointed_config"] == result["config"]
        assert (config.policy, config.total_epochs, config.min_batch) == ("static", 2, 2)
        assert config.advanced.cadence.max_decision_interval_s == 0.12
        assert (config.advanced.cadence.decision_budget, config.advanced.cadence.target_decisions) == (0, 4)


def test_a_rank_that_becomes_slower_is_followed_at_its_change_vote_alike_on_every_rank(tmp_path_factory):
    """Rank 1 turns 3x slower at an epoch end (step 100 of 300; decisions every 50 steps once ramped
    up): its change vote says so once six steps at its size show it, and the decision comes at that
    vote, on every rank alike, and leaves the neutral split at once, long before the cadence's next."""
    results, _ = controller_run("mpirun-2", "vote", tmp_path_factory)
    history, at = results[0]["history"], results[0]["at_step"]
    assert results[1]["at_step"] == at and [d["sizes"] for d in results[1]["history"]] == [d["sizes"] for d in history]
    voted = [i for i, d in enumerate(history) if d.get("changed_by") and at[i] > 100]
    assert voted, (at, [d.get("changed_by") for d in history])
    first = voted[0]
    assert history[first]["changed_by"] == [1], history[first]
    # the reference's 6 steps came before the change (the size did not change at step 100), so the
    # vote needs the 5-6 steps of its window and comes at the next vote after them
    assert at[first] - 100 <= 6 + history[first - 1]["vote_every"] + 1, (at, first, history[first - 1]["vote_every"])
    b0, b1 = history[first]["sizes"]
    assert b0 > 1.5 * b1, history[first]["sizes"]  # split at once: no second interval, no recheck
    assert all(b - a >= 8 for a, b in zip(at, at[1:])), at


def test_a_rank_that_becomes_slower_is_rechecked_soon_and_split_alike_on_every_rank(tmp_path_factory):
    """Without change votes: rank 1 turns 3x slower at an epoch end (step 100 of 300; decisions every
    50 steps once ramped up, no decision budget, so the next interval is all slow): the decision whose
    interval shows the gap asks for a recheck, the next comes min_decision_steps (8) later on every
    rank and leaves the neutral split. (That a recheck comes ahead of the budget's spacing:
    tests/test_cadence.py.)"""
    results, _ = controller_run("mpirun-2", "recheck", tmp_path_factory)
    history, at = results[0]["history"], results[0]["at_step"]
    assert results[1]["at_step"] == at and [d["recheck"] for d in results[1]["history"]] == [d["recheck"] for d in history]
    asked = [i for i, d in enumerate(history) if d["recheck"] and at[i] > 100 and i + 1 < len(history)]
    assert asked, (at, [d["recheck"] for d in history])
    first = asked[0]
    # 8 steps later (where that falls in an epoch's last 4 steps, at its end), whatever the interval
    # (50) and the decision budget's spacing
    assert 8 <= at[first + 1] - at[first] < 12, (at, first)
    b0, b1 = history[first]["sizes"]
    assert b0 == b1, history[first]["sizes"]  # the evidence came from the neutral split
    assert history[first + 1]["sizes"][0] > 1.5 * history[first + 1]["sizes"][1], history[first + 1]["sizes"]
    assert all(b - a >= 8 for a, b in zip(at, at[1:])), at


def test_silent_rank_triggers_timeout_naming_it(tmp_path_factory):
    proc, _ = controller_job("silent-mpirun-3", tmp_path_factory)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    lines = {r: next((line for line in out.splitlines() if line.startswith(f"TIMEOUT-OK rank {r}")), "")
             for r in (0, 1)}
    assert "rank(s) [2] did not answer" in lines[0], out
    # rank 1 is stopped by the same silence: at the first decision, the collective that learns which
    # ranks share a memory budget names rank 2 on every rank; at a later one, rank 1 waits for rank 0's
    # decision, which never comes because rank 0 is stuck on rank 2
    assert "rank(s) [2] did not answer" in lines[1] or "receiving batch-size decision from rank 0" in lines[1], out


def test_silent_rank_under_gloo_exits_with_a_clear_message(tmp_path_factory):
    proc, _ = controller_job("silent-gloo-2", tmp_path_factory)
    assert proc.returncode != 0 and "killed: still running" not in proc.stdout, proc.stdout[-6000:]
    assert "did not complete within 3 s under Gloo" in proc.stdout, proc.stdout[-6000:]
