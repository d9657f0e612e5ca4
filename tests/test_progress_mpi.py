"""LR schedules follow scale-invariant progress when B changes, on 2 real Horovod ranks (`mpirun -np 2`).

tests/workers/progress.py trains with a StepLR driven by `ProgressScheduler` while B stays, doubles,
is doubled by a real controller (default rule: AdaScale with the controller's gain) or is doubled
under an explicit linear rule; this checks that the schedule is the same function of tau in every
case, that tau is the sum of the factors applied, and the warm-up ramp after each increase.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dynamix_hvd.optim.lr_scaling import LRCoupling, default_warmup_steps
from launching import launch
from workers.progress import B0, DOUBLE_AT, RESUME_AT, SAMPLES, STEP_SIZE, TOTAL, TUNED_BATCH, WARMUP

RANKS = 2
SCENARIOS = ("fixed", "doubled", "resumed", "controller", "explicit")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("progress")
    launch("mpirun", RANKS, "progress.py", "--out", str(out), timeout=600)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(RANKS)]


def scheduled_lr(tau: float) -> float:
    """StepLR(0.1, step_size, gamma=0.5) at floor(tau) base iterations."""
    return 0.1 * 0.5 ** (math.floor(tau + 1e-9) // STEP_SIZE)


def replay_factors(steps, rule: str, warmup: int | None) -> list[float]:
    coupling = LRCoupling(warmup)
    out = []
    for s in steps:
        out.append(coupling.plan(rule, s["batch"], B0, s["gain"], math.ceil(SAMPLES / s["batch"])))
        coupling.commit()
    return out


@pytest.mark.parametrize("name", SCENARIOS)
def test_schedule_is_a_function_of_tau_and_tau_sums_the_factors(results, name):
    runs = [r[name] for r in results]
    assert runs[0]["steps"] == runs[1]["steps"], "ranks disagree on progress or LR"
    steps = runs[0]["steps"]
    for prev, s in zip([None, *steps], steps):
        assert s["base_lr"] == scheduled_lr(s["tau"]), s
        assert s["done"] == math.floor(s["tau"] + 1e-9), s
        assert s["tau_after"] - s["tau"] == pytest.approx(s["effective_lr"] / s["base_lr"], rel=1e-12)
        assert s["epochs_after"] == pytest.approx(s["tau_after"] * B0 / SAMPLES, rel=1e-12)
        if prev is not None:
            assert s["tau"] == prev["tau_after"]
    # the budget ends training the step tau reaches it
    assert steps[-1]["tau_after"] >= TOTAL > steps[-2]["tau_after"]
    assert runs[0]["final_lr"] == scheduled_lr(steps[-1]["tau_after"])


@pytest.mark.parametrize("name,rule,warmup", [("fixed", "linear", WARMUP), ("doubled", "linear", WARMUP),
                                              ("controller", "adascale", None), ("explicit", "linear", None)])
def test_effective_lr_is_base_times_ramped_factor(results, name, rule, warmup):
    run = results[0][name]
    assert run["rule"] == rule
    steps = run["steps"]
    factors = replay_factors(steps, rule, warmup)
    assert [s["effective_lr"] for s in steps] == [s["base_lr"] * f for s, f in zip(steps, factors)]
    assert (len({s["batch"] for s in steps}) == 1) == (name == "fixed")
    for i, s in enumerate(steps[1:], 1):
        if s["batch"] > steps[i - 1]["batch"]:  # an increase: eased in, from the last factor applied
            assert factors[i - 1] < factors[i] < (factors[i + 1] if i + 1 < len(factors) else math.inf), (i, factors)


def test_doubling_B_keeps_the_schedule_at_the_same_base_progress(results):
    fixed, doubled = results[0]["fixed"]["steps"], results[0]["doubled"]["steps"]
    assert len(fixed) == TOTAL and all(s["batch"] == B0 for s in fixed)
    assert doubled[DOUBLE_AT]["batch"] == 2 * B0 and len(doubled) < 0.7 * len(fixed)
    # the warm-up: 2 steps from factor 1 to 2
    ramp = [s["effective_lr"] / s["base_lr"] for s in doubled[DOUBLE_AT - 1:DOUBLE_AT + 3]]
    assert ramp == pytest.approx([1.0, 1.5, 2.0, 2.0], rel=1e-12)
    by_progress = {round(s["tau"]): s["base_lr"] for s in fixed}  # fixed: tau = the step index
    for s in doubled:
        assert s["base_lr"] == by_progress[math.floor(s["tau"])], s
    # the same base LR at every base iteration, whichever way it was reached; the same final LR
    assert results[0]["fixed"]["final_lr"] == results[0]["doubled"]["final_lr"] == scheduled_lr(TOTAL)
    samples = [sum(s["samples"] for s in run) for run in (fixed, doubled)]
    assert samples[1] >= samples[0], "the doubled run did less than the base budget of samples"


def test_saved_coupling_and_scheduler_resume_exactly(results):
    doubled, resumed = results[0]["doubled"], results[0]["resumed"]
    assert len(resumed["steps"]) > RESUME_AT + 2
    assert resumed["steps"] == doubled["steps"]  # includes the gain reset by load_state_dict in `doubled`
    assert resumed["tau"] == doubled["tau"] and resumed["done"] == doubled["done"]


def test_controller_default_is_adascale_and_an_explicit_rule_wins(results):
    ctrl, explicit = results[0]["controller"], results[0]["explicit"]
    for run in (ctrl, explicit):
        gains = [d["lr_gain"] for d in run["history"]]
        assert len(gains) >= 2 and all(1.0 < g for g in gains), gains
        assert len({s["batch"] for s in run["steps"]}) >= 3, "the controller never changed B twice"
        seen = {s["gain"] for s in run["steps"]}
        assert set(gains[:-1]) <= seen  # every gain but the last decision's was used by a step
    steps = ctrl["steps"]
    settled = [s for i, s in enumerate(steps) if i >= 2 and s["batch"] == steps[i - 2]["batch"] > B0]
    assert settled, "no step after a ramp"
    for s in settled:  # adascale: the gain, strictly between no scaling and linear scaling
        factor = s["effective_lr"] / s["base_lr"]
        assert factor == pytest.approx(s["gain"], rel=1e-12) and 1.0 < factor < s["batch"] / B0
    k = default_warmup_steps(math.ceil(SAMPLES / (2 * B0)))
    assert k == 2
    # linear despite the controller's gain: B/B0 once the ramp is over
    explicit_settled = [s for i, s in enumerate(explicit["steps"])
                        if i >= k and all(t["batch"] == s["batch"] for t in explicit["steps"][i - k:i])]
    assert explicit_settled
    for s in explicit_settled:
        assert s["effective_lr"] / s["base_lr"] == pytest.approx(s["batch"] / B0, rel=1e-12)


def test_adascale_gain_is_over_the_batch_the_lr_was_tuned_for(results):
    """base_batch_size=32 with 8 samples a step to start: the controller's gain is r(B) over 32 (below 1
    while B < 32, exactly 1 at 32), not over the loader's first global batch."""
    run = results[0]["tuned"]
    by_batch = {}
    for d in run["history"]:
        by_batch.setdefault(sum(d["sizes"]), []).append(d["lr_gain"])
    assert any(b < TUNED_BATCH for b in by_batch) and TUNED_BATCH in by_batch, by_batch
    for b, gains in by_batch.items():
        if b < TUNED_BATCH:  # r < 1 (r = 1 only if the trace estimate clipped to 0)
            assert all(0 < g <= 1 for g in gains), (b, gains)
        elif b == TUNED_BATCH:
            assert all(g == 1.0 for g in gains), (b, gains)
    assert min(g for b, gains in by_batch.items() if b < TUNED_BATCH for g in gains) < 1, by_batch
    steps = run["steps"]
    assert all(s["effective_lr"] / s["base_lr"] <= 1.0 + 1e-12 for s in steps if s["batch"] <= TUNED_BATCH)
