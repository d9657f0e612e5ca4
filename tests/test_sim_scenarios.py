"""The simulator's small-batch knee, transient stalls, live decision cadence over finite epochs, and
the scenario distribution (synthetic families and the profiles calibrated from real runs)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dynamix_hvd.control.cadence import DecisionCadence
from dynamix_hvd.control.policy import StaticPolicy
from bench.lab.scenarios import (FAMILIES, MISSPECIFIED, PROFILE_DIR, ScenarioConfig, family_names, load_profile, misspecify,
                                      profile_names, sample_cluster)
from bench.lab.simulator import ClusterSimulator

from test_simulator import spec


def test_knee_makes_compute_flat_below_it_and_the_optimum_fills_it() -> None:
    sim = ClusterSimulator(spec(2, knee=[64.0, 64.0], jitter=0.0, contention=0.0), seed=0)
    t16, t64, t128 = (float(sim.expected_step_time(np.array([b, b]))) for b in (16, 64, 128))
    assert t16 == pytest.approx(t64, rel=1e-3)  # only per-sample data time differs
    assert t128 > t64 * 1.2
    # measured compute in an interval follows the same curve
    sim.step_sizes([16, 16])
    small = np.mean(sim.last_steps["compute"], axis=0)
    sim.step_sizes([64, 64])
    assert np.allclose(np.mean(sim.last_steps["compute"], axis=0), small, rtol=1e-6)
    # below the knee samples are free, so the goodput optimum never leaves a rank under it
    assert min(sim.optimum_sizes()) >= 64
    plain = ClusterSimulator(spec(2, jitter=0.0), seed=0)
    assert float(plain.expected_step_time(np.array([16, 16]))) < t16


def test_transient_stalls_are_rare_heavy_tailed_and_land_in_compute_time() -> None:
    calm = ClusterSimulator(spec(2, jitter=0.0, steps_per_decision=2000), seed=3)
    stormy = ClusterSimulator(spec(2, jitter=0.0, steps_per_decision=2000, stall_prob=0.02, stall_s=0.05,
                                   stall_shape=1.2), seed=3)
    extra = stormy.last_steps["compute"] - calm.last_steps["compute"]
    stalled = extra > 1e-9
    assert 0.01 < stalled.mean() < 0.03, stalled.mean()
    assert extra[stalled].min() >= 0.05 - 1e-12 and extra.max() <= 50 * 0.05 + 1e-9
    assert np.median(extra[stalled]) < 0.5 * extra.max()  # heavy tail: a few long pauses
    # the other ranks wait for a stalled one
    assert (stormy.last_steps["step_s"] > calm.last_steps["step_s"] + 0.04).mean() > 0.02
    with pytest.raises(ValueError, match="stall_prob=1.5"):
        spec(2, stall_prob=1.5)


def test_live_cadence_decides_where_the_controller_would_over_finite_epochs() -> None:
    # 2 x 16 = 32 per step; an epoch of 1,000 samples is 31 full steps and one of 8
    s = spec(2, initial_batch=[16, 16], cadence="live", dataset_size=1000, total_epochs=6, target_decisions=24,
             min_decision_steps=4, target_progress=6000.0 * 0.98, max_decisions=500)
    sim = ClusterSimulator(s, seed=1)
    lengths, batches = [], []
    policy = StaticPolicy()
    while not sim.done:
        lengths.append(len(sim.last_steps["step_s"]))
        batches.append(sim.last_steps["step_batches"].sum(axis=1))
        sim.step_sizes(policy.decide(sim.decision_input()).sizes)
    steps = np.concatenate(batches)
    # no sample lost or duplicated: every epoch holds exactly 1,000 samples, its last step the remainder
    epochs = np.cumsum(steps)
    ends = np.flatnonzero(np.isclose(epochs % 1000, 0))
    assert len(ends) >= 5 and steps[ends[0]] == 8 and (steps[:ends[0]] == 32).all()
    # replay the live cadence on the same loop: the same interval lengths
    cadence = DecisionCadence(None, 24, 4, 6)
    expect, since, pos, step, epoch = [], 0, 0, 0, 0
    for _ in range(len(steps)):
        take = min(32, 1000 - pos)
        pos, step, since = pos + take, step + 1, since + 1
        end = pos == 1000
        if cadence.due(epoch_end=end, steps_since=since, decisions=len(expect), epoch=epoch, step=step,
                       sizes=[16, 16], epoch_length=lambda: 32):
            expect.append(since)
            since = 0
        if end:
            pos, step, epoch = 0, 0, epoch + 1
    assert lengths == expect[:len(lengths)]
    assert lengths[:3] == [4, 4, 8]  # the ramp (4, 4, 8, ...) up to 32 steps / ceil(24 / 6) per epoch
    assert 24 <= len(lengths) <= 40
    with pytest.raises(ValueError, match="cadence='sometimes'"):
        spec(2, cadence="sometimes")


def test_scenarios_draw_every_family_and_the_new_events() -> None:
    rng = np.random.default_rng(5)
    names = family_names()
    assert set(FAMILIES) <= set(names) and {"real-cnn", "real-mlp", "real-charlm"} <= set(names)
    specs = [sample_cluster(rng, ScenarioConfig(families=tuple(names))) for _ in range(200)]
    assert {s.name for s in specs} == set(names)
    assert 0.15 < np.mean([s.stall_prob > 0 for s in specs]) < 0.35
    assert 0.35 < np.mean([s.cadence == "live" for s in specs]) < 0.65
    gpu = [s for s in specs if s.gpu]
    assert 0.3 < np.mean([max(s.knee) > 0 for s in gpu]) < 0.7
    assert all(max(s.knee) == 0 for s in specs if not s.gpu)
    for s in specs[:40]:  # every drawn job runs
        sim = ClusterSimulator(s, seed=0)
        sim.step_sizes(sim.sizes)
        assert math.isfinite(sim.wall_s) and sim.wall_s > 0
    with pytest.raises(ValueError, match="'resnet'"):
        sample_cluster(rng, family="resnet")
    with pytest.raises(ValueError, match="'nope'"):
        load_profile("nope")


@pytest.mark.parametrize("name", ["cnn", "charlm", "mlp"])
def test_a_real_profile_keeps_its_workload_on_a_drawn_cluster(name: str) -> None:
    assert name in profile_names()
    raw = json.loads((PROFILE_DIR / f"{name}.json").read_text())
    assert raw["source"]["example"] == f"{name}_train" and raw["fit"]["holdout_window_mape_pct"] < 25
    base = load_profile(name)
    rng = np.random.default_rng(0)
    cfg = ScenarioConfig(families=(f"real-{name}",), straggler_prob=0.0, speed_sigma=(0.0, 0.0))
    jobs = [sample_cluster(rng, cfg, world_size=8) for _ in range(20)]
    for job in jobs:
        assert job.world_size == 8 and job.name == f"real-{name}"
        assert job.ref_batch == sum(base.initial_batch)  # progress in the logged job's unit
        assert job.dataset_size == base.dataset_size and job.total_epochs == base.total_epochs
    beta = np.median([job.beta_s[0] for job in jobs])
    assert beta == pytest.approx(float(np.median(base.beta_s)), rel=0.25)
    phi = np.median([job.phi_start for job in jobs])
    assert phi == pytest.approx(base.phi_start, rel=0.3)


def _compute_per_interval(spec_, intervals: int, sizes=(32, 32), seed: int = 0, per_step: bool = False) -> np.ndarray:
    """Each rank's mean compute per step in each of `intervals` intervals at fixed sizes ([n, R]), or
    with `per_step` every step's ([steps, R])."""
    sim = ClusterSimulator(spec_, seed=seed)
    pick = (lambda c: c) if per_step else (lambda c: np.mean(c, axis=0, keepdims=True))
    out = [pick(sim.last_steps["compute"])]
    for _ in range(intervals - 1):
        sim.step_sizes(list(sizes))
        out.append(pick(sim.last_steps["compute"]))
    return np.concatenate(out)


def test_misspecified_conditions_do_what_they_say() -> None:
    """Interference slows one rank 3x for 2 intervals in 6; the moving straggler's 3x moves on every 4
    decisions; bursts cut the bandwidth 10x for 2 intervals in 5; the biased noise estimate starts
    4x too large and fades; "none" changes nothing."""
    base = spec(2, beta_s=[1e-4, 1e-4], jitter=0.0, contention=0.0)
    assert misspecify(base, "none").to_dict() == {**base.to_dict(), "name": "cluster/none"}
    calm = _compute_per_interval(base, 24, per_step=True)
    hit = _compute_per_interval(misspecify(base, "interference"), 24, per_step=True) / calm
    slowed = hit.max(1) > 1.5
    assert 0.2 < slowed.mean() < 0.5, slowed.mean()
    assert np.allclose(np.sort(hit[slowed], axis=1), [1.0, 3.0]), "one rank, 3x"
    assert len(set(hit[slowed].argmax(1))) == 2, "the rank is drawn afresh for each slow-down"
    assert not slowed[:5 * 20].any(), "the first slow-down starts after one period"
    calm = _compute_per_interval(base, 12)
    moving = _compute_per_interval(misspecify(base, "moving"), 12) / calm
    slow_rank = moving.argmax(1)
    assert (moving.max(1) > 2.9).all() and list(slow_rank) == [0] * 4 + [1] * 4 + [0] * 4, moving

    def steps(spec_, n=15):
        sim = ClusterSimulator(spec_, seed=0)
        out = [sim.last_steps["step_s"]]
        for _ in range(n - 1):
            sim.step_sizes([32, 32])
            out.append(sim.last_steps["step_s"])
        return np.concatenate(out)

    ratio = steps(misspecify(base, "bursts")) / steps(base)
    burst = ratio > 2.0
    assert 0.02 < burst.mean() < 0.4 and np.allclose(ratio[~burst], 1.0), ratio
    assert not burst[:5 * 20].any(), "the first burst starts after one period"

    def noise(spec_):
        sim = ClusterSimulator(spec_, seed=1)
        for _ in range(6):
            sim.step_sizes([32, 32])
        return sim.core.stats.noise_scale

    assert noise(misspecify(base, "biased-noise")) > 2.0 * noise(base)
    with pytest.raises(ValueError, match="unknown condition 'storm'"):
        misspecify(base, "storm")
    with pytest.raises(ValueError, match="interfere_rank=5"):
        spec(2, interfere_rank=5)
    assert set(MISSPECIFIED) >= {"stalls", "interference", "moving", "bursts", "biased-noise"}


def test_live_cadence_caps_long_intervals_at_the_seconds_asked_for() -> None:
    """Epochs of 313 steps and 2 decisions over 2 epochs: once ramped up, one decision an epoch; a
    ceiling of about 20 steps' time (the controller's `interval_ceiling` at the last interval's step
    time) brings an interval inside an epoch down to about 20 steps, as the live controller does."""
    base = dict(initial_batch=[16, 16], cadence="live", dataset_size=10_000, total_epochs=2, target_decisions=2,
                min_decision_steps=4, target_progress=20_000 * 0.98, max_decisions=500)
    step = float(ClusterSimulator(spec(2, **base), seed=1).expected_step_time(np.array([16.0, 16.0])))

    def intervals(ceiling_s: float) -> list[int]:
        sim = ClusterSimulator(spec(2, **base, max_decision_interval_s=ceiling_s), seed=1)
        lengths, policy = [], StaticPolicy()
        while not sim.done:
            lengths.append(len(sim.last_steps["step_s"]))
            sim.step_sizes(policy.decide(sim.decision_input()).sizes)
        return lengths

    uncapped, capped = intervals(0.0), intervals(20 * step)
    assert max(uncapped) > 150 and len(uncapped) < 12  # the ramp, then the rest of the epoch
    assert uncapped[:3] == capped[:3] == [4, 4, 8]  # the ramp comes first
    assert max(capped) <= 24 and len(capped) > 25, capped  # about 20 (the step time varies with the jitter)


def test_cadence_study_runs_every_ceiling_and_tables_them(tmp_path) -> None:
    """The ceiling study (bench.lab.cadence_study) on one short job: every ceiling reaches the target
    under every condition and policy, and the table has a row for each."""
    from bench.lab import cadence_study

    rows = cadence_study.evaluate(1, 0, 120.0, (2,), epochs=4, ceilings=(0.0, 5.0))
    conditions, policies = len(cadence_study.CONDITIONS), len(cadence_study.POLICIES)
    assert len(rows) == conditions * policies
    assert all(math.isfinite(r[k]) and r[k] > 0 for r in rows for k in ("t_0", "t_5"))
    assert all(r["decisions_5"] >= r["decisions_0"] for r in rows)
    assert len(cadence_study.table(rows, (0.0, 5.0))) >= 2 + conditions * policies
    job = sample_cluster(np.random.default_rng(0), ScenarioConfig(families=cadence_study.FAMILIES, world_sizes=(4,)))
    assert cadence_study.long_job(job, 100.0, "drift").drift == [(0.3, 3, 3.0), (0.6, 3, 0.5)]
    assert cadence_study.long_job(job, 100.0, "interference").interfere_rank == 3
    with pytest.raises(ValueError, match="storm"):
        cadence_study.long_job(job, 100.0, "storm")
    with pytest.raises(SystemExit):
        cadence_study.main(["--world-sizes", "1", "--out", str(tmp_path)])
    only = cadence_study.evaluate(1, 0, 120.0, (2,), epochs=4, ceilings=(0.0,), policies=("default",))
    assert {r["policy"] for r in only} == {"default"} and len(only) == conditions
    assert [r["t_0"] for r in only] == [r["t_0"] for r in rows if r["policy"] == "default"], "deterministic"
    with pytest.raises(SystemExit):
        cadence_study.main(["--policies", "fastest", "--out", str(tmp_path)])


def test_misspecified_benchmark_runs_every_contender_and_tables_them(tmp_path) -> None:
    """The per-condition comparison (bench.lab.misspecified) on one small job per half: every
    contender reaches the target, the table has a row per condition and half (and per world size)."""
    from bench.lab import misspecified

    rows = misspecified.evaluate(["none", "moving"], jobs=1, seed=0, world_sizes=(2,))
    assert len(rows) == 4 and all(math.isfinite(r[c]) and r[c] > 0 for r in rows for c in misspecified.CONTENDERS)
    lines = misspecified.table(rows)
    assert len(lines) == 2 + 4 and lines[2].startswith("| none | tuning (1) |")
    assert misspecified.table(rows, by_world_size=True)[2].startswith("| none | 2 | tuning (1) |")
    with pytest.raises(SystemExit):
        misspecified.main(["--conditions", "storm", "--out", str(tmp_path)])


def test_the_follow_speed_study_runs_every_variant_on_the_same_jobs(tmp_path):
    """bench.lab.follow_speed: every job under each condition as shipped, without change votes, without
    votes or the one-interval test, and the oracle; a table row per condition and half."""
    from bench.lab import follow_speed

    assert follow_speed.main(["--jobs", "1", "--conditions", "moving", "--out", str(tmp_path)]) == 0
    rows = (tmp_path / "runs.csv").read_text().splitlines()
    assert rows[0].split(",")[-4:] == ["default", "no votes", "two intervals", "oracle"] and len(rows) == 3
    summary = (tmp_path / "summary.md").read_text().splitlines()
    assert [line.split(" | ")[0:2] for line in summary if line.startswith("| moving")] == \
        [["| moving", "tuning (1)"], ["| moving", "held-out (1)"]]
