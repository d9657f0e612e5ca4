"""Straggler diagnosis (dynamix_hvd.runs.diagnosis) on constructed per-step records whose answer is
known: the slow rank, its phase, the time it cost and what the sizes recovered against the equal split."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dynamix_hvd.runs.diagnosis import diagnose, fit_line, format_diagnosis

ALLREDUCE, UPDATE = 0.004, 0.001


def records(sizes: list[list[int]], fixed: list[float], per_sample: list[float],
            data_wait: list[float] | None = None, rng: np.random.Generator | None = None) -> pd.DataFrame:
    """Steps of ranks whose arrival is data wait + fixed + per_sample x b, each waiting in the allreduce
    for the last arrival, as `RunLog` writes them (one row per rank and step)."""
    ranks = len(fixed)
    data_wait = data_wait or [0.0005] * ranks
    rows = []
    for s, split in enumerate(sizes):
        compute = [fixed[i] + per_sample[i] * split[i] for i in range(ranks)]
        if rng is not None:
            compute = [c * (1 + 0.02 * rng.standard_normal()) for c in compute]
        arrival = [data_wait[i] + compute[i] for i in range(ranks)]
        last = max(arrival)
        for i in range(ranks):
            rows.append({"epoch": s // 50, "step": s % 50, "rank": i, "local_batch": split[i],
                         "global_batch": sum(split), "data_wait_s": data_wait[i], "compute_s": compute[i],
                         "sync_wait_s": last - arrival[i] + ALLREDUCE, "optimizer_s": UPDATE,
                         "step_s": last + ALLREDUCE + UPDATE, "status": "ok"})
    return pd.DataFrame(rows)


def test_a_rank_slow_in_compute_is_named_with_the_time_it_cost():
    # rank 1 computes 3x slower per sample at equal sizes: 2 ms + 0.3 ms x 32 against 2 ms + 0.1 ms x 32
    steps = records([[32, 32]] * 40, fixed=[0.002, 0.002], per_sample=[0.0001, 0.0003])
    diag = diagnose(steps)
    assert diag is not None and diag.steps == 40
    assert diag.slow_rank == 1 and diag.phase == "compute" and diag.straggler
    assert diag.phase_excess_s == pytest.approx(0.0002 * 32)
    assert diag.cost_s == pytest.approx(40 * 0.0002 * 32)            # the job waited 6.4 ms per step on it
    assert diag.others_wait_s == pytest.approx(diag.cost_s)          # one other rank
    assert [rc.slowest_steps for rc in diag.ranks] == [0, 40]
    assert diag.ranks[0].sync_wait_s == pytest.approx(0.0064 + ALLREDUCE)
    assert diag.ranks[1].allreduce_s == pytest.approx(ALLREDUCE)
    assert diag.recovered_s == pytest.approx(0.0)                   # equal sizes ran: nothing recovered
    text = format_diagnosis(diag)
    assert "slowest rank: 1, in compute" in text and "recovered 0.00 s" in text


def test_a_rank_slow_in_its_data_wait_and_the_cost_is_over_the_next_to_last_arrival():
    # three ranks; rank 2 waits 10 ms for data, rank 0 computes 1 ms more than rank 1
    steps = records([[16, 16, 16]] * 30, fixed=[0.003, 0.002, 0.002], per_sample=[0.0001] * 3,
                    data_wait=[0.0005, 0.0005, 0.0105])
    diag = diagnose(steps)
    assert diag.slow_rank == 2 and diag.phase == "data wait"
    assert diag.phase_excess_s == pytest.approx(0.010)
    assert diag.cost_s == pytest.approx(30 * (0.0105 - 0.0005 - 0.001))  # over rank 0, the next to arrive
    assert diag.others_wait_s == pytest.approx(30 * (0.009 + 0.010))


def test_recovered_against_the_equal_split_from_each_ranks_cost_line():
    # rank 1 is 2x slower per sample; the run tried three splits of B = 60 (a controller balancing)
    fixed, per = [0.002, 0.003], [0.0002, 0.0004]
    sizes = [[30, 30]] * 10 + [[36, 24]] * 10 + [[40, 20]] * 30
    steps = records(sizes, fixed=fixed, per_sample=per)
    diag = diagnose(steps)
    lines = [(rc.fixed_s, rc.per_sample_s) for rc in diag.ranks]     # arrival: data wait 0.5 ms + compute
    assert lines == [pytest.approx((f + 0.0005, p)) for f, p in zip(fixed, per)]
    equal_step = max(f + p * 30 for f, p in zip(fixed, per)) + 0.0005 + ALLREDUCE + UPDATE
    measured = sum(max(f + p * b for f, p, b in zip(fixed, per, split)) + 0.0005 + ALLREDUCE + UPDATE
                   for split in sizes)
    assert diag.measured_s == pytest.approx(measured)
    assert diag.equal_split_s == pytest.approx(50 * equal_step)   # the 30/30 steps count as measured
    assert diag.recovered_s == pytest.approx(50 * equal_step - measured) and diag.recovered_s > 0.1
    assert diag.model_measured_s == pytest.approx(measured)
    assert "recovered" in format_diagnosis(diag)
    # a split worse than equal is reported as lost time
    worse = diagnose(records([[30, 30]] * 10 + [[20, 40]] * 20, fixed=fixed, per_sample=per))
    assert worse.recovered_s < 0 and " lost " in format_diagnosis(worse)


def test_equal_ranks_have_no_straggler():
    steps = records([[32, 32, 32, 32]] * 60, fixed=[0.002] * 4, per_sample=[0.0001] * 4,
                    rng=np.random.default_rng(0))
    diag = diagnose(steps)
    assert not diag.straggler and diag.cost_s < 0.05 * diag.measured_s
    assert format_diagnosis(diag).splitlines()[-2].startswith("no straggler")


def test_skipped_steps_and_steps_of_a_missing_rank_are_left_out():
    steps = records([[32, 32]] * 20, fixed=[0.002, 0.002], per_sample=[0.0001, 0.0003])
    oom = steps.iloc[[0, 1]].assign(compute_s=5.0, status="oom")          # redone: a second row per rank
    partial = steps[(steps.step == 19) & (steps["rank"] == 0)].index      # only one rank has this step
    diag = diagnose(pd.concat([oom, steps.drop(partial)], ignore_index=True))
    assert diag.steps == 19 and diag.cost_s == pytest.approx(19 * 0.0064)
    assert diagnose(steps[steps["rank"] == 0]) is None
    assert "at least two ranks" in format_diagnosis(None)


def test_fit_line_is_robust_to_stalls_and_goes_through_the_origin_with_one_size():
    b = np.array([16] * 10 + [32] * 10 + [48] * 10, dtype=float)
    t = 0.002 + 0.0001 * b
    t[3] = t[15] = 1.0                                                   # two stalls
    assert fit_line(b, t) == pytest.approx((0.002, 0.0001))
    assert fit_line(np.full(5, 20.0), np.full(5, 0.01)) == pytest.approx((0.0, 0.0005))
    # a size seen once (an epoch's leftover step) does not steer the line
    assert fit_line(np.array([32.0] * 8 + [5.0]), np.array([0.01] * 8 + [0.5])) == pytest.approx((0.0, 0.01 / 32))
    # a falling line (noise) keeps no negative per-sample cost
    assert fit_line(np.array([10.0] * 3 + [20.0] * 3), np.array([0.02] * 3 + [0.01] * 3)) == pytest.approx((0.015, 0.0))
