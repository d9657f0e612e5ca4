"""Cost model, proposal and the "model" policy (pure, one process)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dynamix_hvd.control.actions import ActionSpace, BatchBounds
from dynamix_hvd.control.config import POLICY_NAMES, ControllerConfig, make_policy
from dynamix_hvd.control.costmodel import CostConfig, CostModel, NetworkFit, record_reports
from dynamix_hvd.control.policy import DecisionInput
from dynamix_hvd.control.proposal import ModelPolicy, ProposalConfig, equalise, propose, round_split
from dynamix_hvd.control.refine import refine
from dynamix_hvd.control.state import GlobalContext
from dynamix_hvd.stats.noise_scale import GradientStatistics

A, C = np.array([0.004, 0.012]), np.array([2e-4, 6e-4])  # rank 1: 3x slower, fixed cost too
TWO_INTERVALS = CostConfig(decisive_factor=0.0)
"""Changes of speed confirmed by a second interval only (none followed after one), for the tests of
that verdict's paths."""


def interval(rng, sizes, a=A, c=C, steps=50, outliers=0, jitter=0.03, net=0.0, gamma=1.0):
    """One interval of per-step (batches, arrival, end of allreduce) of ranks with costs a + c*b."""
    b = np.tile(np.asarray(sizes, dtype=float), (steps, 1))
    t = (a + c * b) * np.exp(rng.normal(0, jitter, b.shape))
    if outliers:
        rows = rng.choice(steps, outliers, replace=False)
        t[rows, rng.integers(0, b.shape[1], outliers)] *= 5.0  # a GC pause, a page fault
    sync = (t.max(1) ** gamma + net ** gamma) ** (1 / gamma)
    return b, t, sync


def test_fit_recovers_costs_from_noisy_steps_with_outliers():
    rng, model = np.random.default_rng(0), CostModel(2)
    for sizes in ([32, 32], [40, 24], [36, 28], [44, 20]):
        model.record(*interval(rng, sizes, outliers=5), overhead_s=1e-3)
    fit = model.fit()
    assert fit.identified.all()
    assert fit.fixed_s == pytest.approx(A, rel=0.15) and fit.per_sample_s == pytest.approx(C, rel=0.08)
    assert (fit.per_sample_se / fit.per_sample_s < 0.1).all(), "confident after four sizes"
    # least squares without the Huber weights would be pulled far off by the 5x outliers
    plain = CostModel(2, CostConfig(iterations=1))
    rng = np.random.default_rng(0)
    for sizes in ([32, 32], [40, 24], [36, 28], [44, 20]):
        plain.record(*interval(rng, sizes, outliers=5))
    assert np.abs(plain.fit().fixed_s / A - 1).max() > 2 * np.abs(fit.fixed_s / A - 1).max()


def test_fit_forgets_after_a_speed_change():
    rng, model = np.random.default_rng(1), CostModel(2, CostConfig(half_life_steps=100))
    for sizes in ([32, 32], [40, 24]) * 3:
        model.record(*interval(rng, sizes))
    slower = C * np.array([1.0, 2.0])  # rank 1 becomes twice as slow per sample
    for sizes in ([48, 16], [40, 24], [32, 32]) * 3:
        model.record(*interval(rng, sizes, c=slower))
    assert model.fit().per_sample_s == pytest.approx(slower, rel=0.1)


def _relative_speed(model: CostModel, batch: float = 32.0) -> float:
    """Rank 1's time at `batch` over rank 0's, by the fitted lines."""
    t = model.fit().arrival(np.full(2, batch), split=True)
    return float(t[1] / t[0])


@pytest.mark.parametrize("threshold", [0.1, 0.0])
def test_a_rank_that_changes_speed_is_followed_within_two_intervals(threshold):
    """Without the one-interval test (`decisive_factor` 0): a neighbour slows rank 1 3x, later 1.5x (a
    factor on its whole step): two intervals of 8 steps at the new speed move the line there (the
    second alone: the change may fall within the first), and the next sizes identify it again. By
    forgetting alone (threshold 0) the robust weights take the new steps for outliers and the line
    lags for many intervals."""
    rng, model = np.random.default_rng(5), CostModel(2, CostConfig(shift_threshold=threshold, decisive_factor=0.0))
    a, c = A[[0, 0]], C[[0, 0]]

    def run(sizes, slow, intervals=1):
        for _ in range(intervals):
            model.record(*interval(rng, sizes, a=a * slow, c=c * slow, steps=8, jitter=0.05))

    for k in range(16):
        run([32 + (k % 2), 32 - (k % 2)], np.ones(2))
    assert _relative_speed(model) == pytest.approx(1.0, abs=0.05)
    slow = np.array([1.0, 3.0])
    run([32, 32], slow)
    assert (model.shift == 1).all(), "one interval is a blip until the next says otherwise"
    run([32, 32], slow)
    if threshold == 0:
        assert _relative_speed(model) < 1.5 and (model.shift == 1).all()
        return
    assert model.shift[0] == 1 and model.shift[1] == pytest.approx(3.0, rel=0.08)
    assert _relative_speed(model) == pytest.approx(3.0, rel=0.08)
    assert model._live[:, 0].all() and model._live[:, 1].sum() == 8, "rank 1: the interval after the change only"
    for sizes in ([46, 18], [47, 17], [48, 16]):  # the split follows; new sizes identify the line
        run(sizes, slow)
    assert model.fit().identified.all()
    assert model.fit().per_sample_s == pytest.approx(c * slow, rel=0.15)
    slow = np.array([1.0, 1.5])
    run([48, 16], slow, 2)
    assert 0.45 < model.shift[1] < 0.7  # against a line the first interval at 1.5x already pulled
    truth = a * slow + c * slow * np.array([48, 16])
    assert model.fit().arrival(np.array([48, 16]), split=True) == pytest.approx(truth, rel=0.08)


def test_a_pending_change_waits_across_untested_sizes_lapses_and_is_not_checkpointed():
    """Off once at 32, then an interval at sizes the line has not seen and too far from those it has
    (8: 4x from 32) to test, then off again at 32: a change, and the line keeps the two intervals
    after the first. A first verdict older than a half-life lapses; a restored model holds none (its
    first interval has start-up costs)."""
    rng, model = np.random.default_rng(7), CostModel(2, TWO_INTERVALS)
    a, c = A[[0, 0]], C[[0, 0]]
    for k in range(16):
        model.record(*interval(rng, [32 + (k % 2), 32 - (k % 2)], a=a, c=c, steps=8, jitter=0.05))
    slow = np.array([1.0, 2.0])
    model.record(*interval(rng, [32, 32], a=a * slow, c=c * slow, steps=8, jitter=0.05))
    assert model.change_pending and (model.shift == 1).all()
    restored = CostModel(2, TWO_INTERVALS)
    restored.load_state_dict(model.state_dict())
    assert not restored.change_pending
    model.record(*interval(rng, [56, 8], a=a * slow, c=c * slow, steps=8, jitter=0.05))
    assert model.change_pending and (model.shift == 1).all(), "8 was not seen: not tested, still pending"
    model.record(*interval(rng, [32, 32], a=a * slow, c=c * slow, steps=8, jitter=0.05))
    assert model.shift[1] > 1.4 and not model.change_pending
    assert model._live[:, 1].sum() == 16, "the line starts again after the first interval off it"
    model.record(*interval(rng, [32, 32], a=a, c=c, steps=8, jitter=0.05))  # back to 1x: off once
    assert model.change_pending
    for _ in range(51):  # 200 steps after it (intervals too short to test): still pending
        model.record(*interval(rng, [32, 32], a=a, c=c, steps=4, jitter=0.05))
    assert model.change_pending
    model.record(*interval(rng, [32, 32], a=a, c=c, steps=4, jitter=0.05))  # past a half-life: lapsed
    assert not model.change_pending


@pytest.mark.parametrize("after", [0.5, 2.0])
def test_a_change_is_confirmed_at_a_nearby_new_size_beyond_the_lines_possible_error(after):
    """Rank 1, 3x slower and cut to 5-6 samples, speeds up to 1.5x (or slows to 6x); the split moves it
    at once, so its next interval is at 8, a size its line has not seen. Off the line there by more
    than any line through 5-6 can be at 8 (a factor up to 8/6), the same way as the interval before:
    the change is confirmed there, and the line starts again. A blip at 6 followed by an interval at
    8 at the old speed confirms nothing (off by less than 8/6 can explain)."""
    a, c = A[[0, 0]], C[[0, 0]]
    slow = np.array([1.0, 3.0])

    def split_at_3x(seed):
        rng, model = np.random.default_rng(seed), CostModel(2, TWO_INTERVALS)
        for k in range(12):
            model.record(*interval(rng, [58 + (k % 2), 6 - (k % 2)], a=a * slow, c=c * slow, steps=16, jitter=0.05))
        assert model.fit().identified[1] and (model.shift == 1).all()  # 5-6: rank 1's line is identified
        return rng, model

    rng, model = split_at_3x(11)
    now = slow * np.array([1.0, after])
    model.record(*interval(rng, [58, 6], a=a * now, c=c * now, steps=16, jitter=0.05))
    assert model.change_pending and (model.shift == 1).all()
    model.record(*interval(rng, [56, 8], a=a * now, c=c * now, steps=16, jitter=0.05))
    assert not model.change_pending and model.shift[0] == 1
    assert model.shift[1] == pytest.approx(after, rel=0.25), "the new steps' factor over the old line"
    assert model._live[:, 1].sum() == 16, "rank 1's line: the interval at 8 only"
    rng, model = split_at_3x(12)
    blip = slow * np.array([1.0, after])
    model.record(*interval(rng, [58, 6], a=a * blip, c=c * blip, steps=16, jitter=0.05))
    assert model.change_pending
    model.record(*interval(rng, [56, 8], a=a * slow, c=c * slow, steps=16, jitter=0.05))
    assert (model.shift == 1).all() and model._live.all()
    assert model.change_pending, "an interval at a new size confirms a verdict or leaves it pending"


def test_a_change_within_an_interval_is_found_at_the_new_sizes_the_split_moves_to():
    """Equal ranks dithered around 38/26 (an earlier split); rank 1 turns 3x slower in the last quarter
    of an interval, too few steps to start a verdict there. The split then moves it to 19, 16 and 13,
    sizes its line has not seen: steps off the line there beyond what any line through 24-27 can be
    off start a verdict at the first and confirm it at the second, and the line starts again. A
    rank whose new sizes its line can explain (rank 0, growing) starts nothing."""
    a, c = A[[0, 0]], C[[0, 0]]
    slow = np.array([1.0, 3.0])

    def before_and_the_change(config: CostConfig) -> tuple[CostModel, np.random.Generator]:
        rng, model = np.random.default_rng(21), CostModel(2, config)
        for k in range(12):
            model.record(*interval(rng, [38 + (k % 2), 26 - (k % 2) - (k % 3)], a=a, c=c, steps=32, jitter=0.05))
        assert model.fit().identified.all() and not model.change_pending
        b, t, sync = interval(rng, [38, 26], a=a, c=c, steps=32, jitter=0.05)
        t[24:, 1] *= 3.0  # the change falls in the interval's last quarter
        model.record(b, t, np.maximum(sync, t.max(1)))
        return model, rng

    # by default, eight clear steps at 3x are enough: followed at once, the line restarts with them
    model, _ = before_and_the_change(CostConfig())
    assert model.shift[1] == pytest.approx(3.0, rel=0.1) and not model.change_pending
    truth = 3.0 * (a[1] + c[1] * 26)
    assert model.fit().arrival(np.array([38.0, 26.0]), split=True)[1] == pytest.approx(truth, rel=0.1)
    # with the two-interval test alone, the new sizes the split moves to carry the verdict
    model, rng = before_and_the_change(TWO_INTERVALS)
    assert not model.change_pending, "a quarter of an interval off its line is not yet a verdict"
    model.record(*interval(rng, [45, 19], a=a * slow, c=c * slow, steps=32, jitter=0.05))
    assert model.change_pending and (model.shift == 1).all(), "19 is new: a first verdict, not a change"
    assert model._pending[0] == 0, "rank 0 at 45: within what its line can be off there"
    model.record(*interval(rng, [48, 16], a=a * slow, c=c * slow, steps=32, jitter=0.05))
    assert model.shift[0] == 1 and model.shift[1] > 2.0 and not model.change_pending
    assert model._live[:, 1].sum() < model._live[:, 0].sum(), "rank 1's line starts again"
    model.record(*interval(rng, [51, 13], a=a * slow, c=c * slow, steps=32, jitter=0.05))
    model.record(*interval(rng, [50, 14], a=a * slow, c=c * slow, steps=32, jitter=0.05))
    assert model.fit().per_sample_s[1] == pytest.approx(3 * c[1], rel=0.2)


def test_a_new_size_starts_no_verdict_that_the_line_or_the_batch_explains():
    """Nothing pending. (1) A rank whose step is almost all fixed cost, its line through one size (32,
    proportional there), runs at 48 and at 21 at its usual speed: 1.5x faster and slower than the
    line says, the time against the size, but no further off than a line through 32 can be there:
    no verdict. (2) A rank given more samples whose step grows faster than its batch (memory
    pressure): slower beyond anything the line can be off at the new size, but with the size, so
    not a change of speed; the split check judges such a split."""
    rng, model = np.random.default_rng(13), CostModel(2)
    a, c = np.array([0.010, 0.010]), np.array([1e-5, 1e-5])
    for _ in range(12):
        model.record(*interval(rng, [32, 32], a=a, c=c, steps=16, jitter=0.03))
    assert not model.fit().identified.any()
    b, t, sync = interval(rng, [48, 21], a=a, c=c, steps=16, jitter=0.03)
    off = np.log(t / model.fit().arrival(b, split=True, borrowed=False)).mean(0)
    assert off[0] < -0.3 and off[1] > 0.3, "off the line, the time against the size"
    model.record(b, t, sync)
    assert not model.change_pending and (model.shift == 1).all()

    rng, model = np.random.default_rng(14), CostModel(2)
    a, c = A[[0, 0]], C[[0, 0]]
    for k in range(12):
        model.record(*interval(rng, [36 + 2 * (k % 3), 28 - 2 * (k % 3)], a=a, c=c, steps=32, jitter=0.05))
    assert model.fit().identified.all()
    b, t, sync = interval(rng, [50, 14], a=a, c=c, steps=32, jitter=0.05)
    t[:, 0] *= 1.8  # rank 0's step at 50 samples takes 1.8x its line's time
    assert np.log(t[:, 0] / model.fit().arrival(b, split=True, borrowed=False)[:, 0]).mean() > 0.5
    model.record(b, t, np.maximum(sync, t.max(1)))
    assert not model.change_pending and (model.shift == 1).all()


def test_a_nearby_new_size_does_not_confirm_what_the_lines_error_there_explains():
    """A rank whose step is almost all fixed cost, timed at one size only (its line: proportional
    through that point), runs one fast interval (a blip), then 1.5x its size at its usual speed: the
    steps there are 1.5x below the line (a fixed cost does not grow with the batch) but no further
    off than a line through 32 can be at 48, so no change is confirmed, and the blip stays pending."""
    rng, model = np.random.default_rng(13), CostModel(2, TWO_INTERVALS)
    a, c = np.array([0.010, 0.010]), np.array([1e-5, 1e-5])
    for _ in range(12):
        model.record(*interval(rng, [32, 32], a=a, c=c, steps=16, jitter=0.03))
    assert not model.fit().identified.any()
    fast = np.array([1.0, 0.6])
    model.record(*interval(rng, [32, 32], a=a * fast, c=c * fast, steps=16, jitter=0.03))
    assert model.change_pending
    b, t, sync = interval(rng, [16, 48], a=a, c=c, steps=16, jitter=0.03)
    off = np.log(t[:, 1] / model.fit().arrival(b, split=True, borrowed=False)[:, 1]).mean()
    assert off < -0.3, "the steps are far below the line: only its possible error there explains them"
    model.record(b, t, sync)
    assert (model.shift == 1).all() and model.change_pending and model._live.all()


def test_a_size_farther_than_2x_from_any_seen_one_confirms_nothing():
    """A pending 3x slowdown at 32, then an interval at 12 (2.7x from 32) at the new speed: far past
    anything a line through 32 can be off there by, but too far to compare with it at all; the
    verdict waits for a size the line can speak for."""
    rng, model = np.random.default_rng(9), CostModel(2, TWO_INTERVALS)
    a, c = A[[0, 0]], C[[0, 0]]
    for _ in range(12):
        model.record(*interval(rng, [32, 32], a=a, c=c, steps=16, jitter=0.03))
    slow = np.array([1.0, 3.0])
    model.record(*interval(rng, [32, 32], a=a * slow, c=c * slow, steps=16, jitter=0.03))
    assert model.change_pending
    b, t, sync = interval(rng, [52, 12], a=a * slow, c=c * slow, steps=16, jitter=0.03)
    off = np.log(t[:, 1] / model.fit().arrival(b, split=True, borrowed=False)[:, 1]).mean()
    assert off - math.log(32 / 12) > 0.5, "beyond the allowance by far: only the 2x cut keeps it out"
    model.record(b, t, sync)
    assert (model.shift == 1).all() and model.change_pending


def test_no_speed_change_is_read_into_noise_blips_or_sizes_a_line_has_not_seen():
    """Equal ranks timed with 10% jitter and a pause now and then: no interval of 8 steps in 300 moves
    a line. One interval of a rank 1.5x slower between normal ones (a blip) is followed there and
    back, each after one interval, by the one-interval test; without it the blip moves nothing. A
    size far from those seen (a proportional line's guess at it is no measurement) is not tested."""
    a, c = A[[0, 0]], C[[0, 0]]
    for config, blips in ((CostConfig(), True), (CostConfig(), False), (TWO_INTERVALS, True)):
        rng, model = np.random.default_rng(6), CostModel(2, config)
        shifted = []
        for k in range(300):
            blip = np.array([1.0, 1.5 if blips and k % 50 == 25 else 1.0])
            model.record(*interval(rng, [32 + (k % 2), 32 - (k % 2)], a=a * blip, c=c * blip, steps=8,
                                   jitter=0.10, outliers=int(k % 7 == 0)))
            if (model.shift != 1).any():
                shifted.append(k)
        if blips and config.decisive_factor:  # each blip followed, and its end: rank 1 only
            assert shifted == [k for b in range(25, 300, 50) for k in (b, b + 1)], shifted
        else:
            assert shifted == []
        assert _relative_speed(model) == pytest.approx(1.0, abs=0.05)
    one = CostModel(2)
    one.record(*interval(rng, [32, 32], a=a, c=c, steps=8))
    assert not one.fit().identified.any()
    # 56 and 8 are far from the 32 the lines saw: their proportional guesses (18% and 3x off) are not
    # compared with the steps
    one.record(*interval(rng, [56, 8], a=a, c=c, steps=8))
    assert (one.shift == 1).all() and (one._pending == 0).all()


def test_one_size_is_not_identified_until_dithered():
    rng, model = np.random.default_rng(2), CostModel(2)
    model.record(*interval(rng, [32, 32]))
    fit = model.fit()
    assert not fit.identified.any() and np.isinf(fit.per_sample_se).all()
    t = A + C * 32
    a_t, c_t = fit.time_coefficients()
    assert a_t == pytest.approx(0.5 * t, rel=0.05), "throughput model: alpha pinned to half the time (AdaptDL)"
    a_s, c_s = fit.split_coefficients()
    assert (a_s == 0).all() and c_s == pytest.approx(t / 32, rel=0.05), "split: proportional to speed"
    # the policy dithers: +-4% alternating, B kept; the next fit sees two sizes per rank
    policy, sizes = ModelPolicy(ProposalConfig(search_batch=False)), [32, 32]
    seen = []
    for k in range(4):
        out = policy.decide(decision_input(sizes, costs=model))
        seen.append(out.info["dithered"])
        sizes = out.sizes
        assert sum(sizes) == 64
        model.record(*interval(rng, sizes))
    # (equal lines: no split, but the unidentified lines are dithered in the first decisions)
    assert any(seen[:2]) and not seen[-1], "dither only while a rank is not identified"
    assert model.fit().identified.all()


def test_a_line_through_two_speeds_at_two_sizes_starts_again_and_a_convex_one_does_not():
    """Rank 0 runs 2x slower at 16 for two intervals (a start-up transient), then at its new size 10 at
    full speed: the shift test cannot see it (10 was never seen), but the line through both would need
    a fixed cost far below zero. The line starts again from the interval at 10, and `shift` is its
    factor over the earlier line's prediction there (proportional through 16: 0.70). Left alone: a
    convex cost (t = c b ** 1.3) moved 16 -> 11 (its line dips to about -0.4 of its time at 11) or
    doubled, rank 1's ordinary line, a slower interval at a new size (a blip for the shift test), and
    intervals known only by their means."""
    rng, model = np.random.default_rng(11), CostModel(2)
    a, c = np.array([0.012, 0.012]), np.array([4e-4, 4e-4])
    for _ in range(2):
        model.record(*interval(rng, [16, 16], a=a * [2.0, 1.0], c=c * [2.0, 1.0], steps=12, jitter=0.05))
    assert (model.shift == 1).all()
    model.record(*interval(rng, [10, 22], a=a, c=c, steps=12, jitter=0.05))
    assert model.shift[0] == pytest.approx(16 / (2 * 18.4 * 10 / 16), rel=0.05) and model.shift[1] == 1
    assert model._live[:, 0].sum() == 12 and model._live[:, 1].all()
    assert not model.fit().identified[0], "one size left: not identified until the next"
    for moves in (([16, 16], [16, 16], [11, 21]), ([16, 16], [16, 16], [32, 32])):
        rng, convex = np.random.default_rng(12), CostModel(2)
        for sizes in moves:
            b = np.tile(np.asarray(sizes, dtype=float), (12, 1))
            t = 1e-3 * b ** 1.3 * np.exp(rng.normal(0, 0.03, b.shape))
            convex.record(b, t, t.max(1))
        assert (convex.shift == 1).all() and convex._live.all(), moves
    slow = CostModel(2)  # 2x slower after moving up to 22: one such interval is the shift test's blip
    rng = np.random.default_rng(14)
    for _ in range(2):
        slow.record(*interval(rng, [16, 16], a=a, c=c, steps=12, jitter=0.05))
    slow.record(*interval(rng, [10, 22], a=a * [1.0, 2.0], c=c * [1.0, 2.0], steps=12, jitter=0.05))
    assert (slow.shift == 1).all() and slow._live.all()
    means = CostModel(2)  # the transient, known only by interval means: no scatter to test against
    for sizes, k in (([16, 16], 2.0), ([16, 16], 2.0), ([10, 22], 1.0)):
        record_reports(means, sizes, list((a + c * np.array(sizes)) * [k, 1.0]), 0.04, 0.001, 12)
    assert (means.shift == 1).all() and means._live.all()
    with pytest.raises(ValueError, match="impossible_fixed"):
        CostConfig(impossible_fixed=-0.5)


def test_an_unidentified_rank_borrows_the_shape_of_the_identified_lines_for_the_split():
    """Rank 1's line is identified with a large fixed cost (12 ms + 0.4 ms per sample); rank 0 has run
    one size (10) at the same line. Split as proportional, rank 0 would look 1.6x slower per sample for
    being smaller; as a scaled copy of rank 1's line through its own point it is as fast, and the
    equalising split of 32 is 16/16."""
    rng, model = np.random.default_rng(13), CostModel(2)
    a, c = np.array([0.012, 0.012]), np.array([4e-4, 4e-4])
    for sizes in ([10, 16], [10, 22], [10, 19]):
        model.record(*interval(rng, sizes, a=a, c=c, steps=24, jitter=0.02))
    fit = model.fit()
    assert list(fit.identified) == [False, True]
    a_s, c_s = fit.split_coefficients()
    assert a_s[0] / (a_s[0] + c_s[0] * 10) == pytest.approx(12 / 16, abs=0.05), "rank 1's fixed share at 10"
    assert fit.arrival(np.array([16, 16]), split=True) == pytest.approx([0.0184, 0.0184], rel=0.04)
    lo, hi = np.ones(2), np.full(2, 32.0)
    assert round_split(equalise(32.0, a_s, c_s, lo, hi)[0], 32, a_s, c_s, lo, hi) == [16, 16]
    a_p, c_p = fit.split_coefficients(borrowed=False)  # what confident growth and the policy features use
    assert a_p[0] == 0 and c_p[0] == pytest.approx(0.016 / 10, rel=0.04) and a_p[1] == a_s[1]


def test_network_and_overlap_fit():
    rng, model = np.random.default_rng(3), CostModel(2)
    for sizes in ([8, 8], [16, 16], [32, 32], [64, 64], [128, 128]):
        model.record(*interval(rng, sizes, jitter=0.01, net=0.02, gamma=3.0), overhead_s=2e-3)
    net = model.fit_network()
    assert net.gamma == pytest.approx(3.0, abs=0.6) and net.net_s == pytest.approx(0.02, rel=0.15)
    assert net.overhead_s == pytest.approx(2e-3)
    one = CostModel(2)
    one.record(*interval(rng, [32, 32], jitter=0.01, net=0.02, gamma=3.0))
    assert one.fit_network().gamma == 1.0, "one arrival time cannot tell overlap: assume none"


def test_the_network_fit_follows_a_bandwidth_drop_within_three_decisions_and_measures_the_link():
    """A 2-rank job whose link drops from 100 to 10 Mbit/s (84 kB of gradients, 0.3 ms latency)
    between two decisions of 16 steps: T_net and the bus bandwidth follow within three decisions,
    while the per-rank lines (compute) keep their long memory."""
    payload, latency = 84_000, 3e-4
    bus = payload * 2 * (2 - 1) / 2

    def link(mbit):
        return latency + bus / (mbit * 1e6 / 8)

    rng, model = np.random.default_rng(5), CostModel(2)
    for k in range(12):
        model.record(*interval(rng, [32, 32], steps=16, jitter=0.02, net=link(100)), overhead_s=1e-3)
        model.record_link(payload, latency * rng.uniform(1.0, 1.3))
    fast = model.fit_network()
    assert fast.net_s == pytest.approx(link(100), rel=0.1)
    assert fast.bus_bytes == bus and fast.latency_s == pytest.approx(latency, rel=0.3)
    assert fast.bus_bandwidth_Bps == pytest.approx(100e6 / 8, rel=0.2)
    per_sample = model.fit().per_sample_s.copy()
    for k in range(3):
        model.record(*interval(rng, [32, 32], steps=16, jitter=0.02, net=link(10)), overhead_s=1e-3)
        model.record_link(payload, latency * rng.uniform(1.0, 1.3))
    slow = model.fit_network()
    assert slow.net_s == pytest.approx(link(10), rel=0.1), "T_net follows within three decisions"
    assert slow.bus_bandwidth_Bps == pytest.approx(10e6 / 8, rel=0.15)
    assert np.allclose(model.fit().per_sample_s, per_sample, rtol=0.2)
    restored = CostModel(2)
    restored.load_state_dict(model.state_dict())
    assert restored.fit_network() == slow
    assert math.isnan(CostModel(2).fit_network().latency_s)  # no probe yet: no latency, no bandwidth


def test_equalising_split_matches_the_closed_form():
    # two ranks, one 3x slower per sample, both 5 ms fixed: T = (B + sum a/c) / sum 1/c
    a, c = np.array([0.005, 0.005]), np.array([1e-4, 3e-4])
    lo, hi = np.array([1, 1]), np.array([1024, 1024])
    for B in (64, 100, 1000):
        T = (B + (a / c).sum()) / (1 / c).sum()
        shares = equalise(B, a, c, lo, hi)[0]
        assert shares == pytest.approx((T - a) / c, rel=1e-9)
        sizes = round_split(shares, B, a, c, lo, hi)
        assert sum(sizes) == B and abs(sizes[0] - (T - a[0]) / c[0]) <= 1
    # a rank whose fixed cost exceeds what the others need keeps its minimum; bounds hold
    sizes = round_split(equalise(20, np.array([0.001, 0.01]), c, lo, hi)[0], 20, np.array([0.001, 0.01]), c, lo, hi)
    assert sizes == [19, 1]
    capped = round_split(equalise(100, a, c, lo, np.array([60, 1024]))[0], 100, a, c, lo, np.array([60, 1024]))
    assert capped == [60, 40]


def test_equalise_solves_the_arrival_exactly_as_a_full_bisection_would():
    """The piecewise-linear solution equals what 100 halvings of the arrival time converge to (float
    resolution), sums to B and keeps every bound, at random costs, bounds and world sizes."""
    def bisection(B, a, c, lo, hi):
        B = np.clip(np.atleast_1d(np.asarray(B, dtype=np.float64)), lo.sum(), hi.sum())
        t_lo, t_hi = np.full(len(B), float((a + c * lo).min())), np.full(len(B), float((a + c * hi).max()))
        for _ in range(100):
            mid = 0.5 * (t_lo + t_hi)
            below = np.clip((mid[:, None] - a) / c, lo, hi).sum(1) < B
            t_lo, t_hi = np.where(below, mid, t_lo), np.where(below, t_hi, mid)
        return np.clip((t_hi[:, None] - a) / c, lo, hi)

    rng = np.random.default_rng(3)
    for trial in range(300):
        R = int(rng.integers(1, 17))
        a, c = rng.uniform(0, 0.05, R), rng.uniform(1e-4, 1e-2, R)
        lo = rng.integers(1, 8, R)
        hi = lo + rng.integers(0, 500, R) * (rng.uniform(size=R) > 0.1)  # some ranks pinned (lo == hi)
        B = np.concatenate([rng.uniform(lo.sum(), hi.sum(), 7), [lo.sum(), hi.sum()]])
        shares = equalise(B, a, c, lo, hi)
        assert np.allclose(shares, bisection(B, a, c, lo, hi), rtol=1e-9, atol=1e-9), trial
        assert np.allclose(shares.sum(1), B, rtol=1e-12, atol=1e-9), trial
        assert (shares >= lo - 1e-12).all() and (shares <= hi + 1e-12).all(), trial


def decision_input(sizes, base=None, noise=math.nan, max_batch=4096, costs=None):
    ctx = GlobalContext(global_batch=sum(sizes), initial_batch=base or sum(sizes), noise_scale=math.nan,
                        efficiency=1.0, loss_trend=0.0, progress=0.0, world_size=len(sizes))
    return DecisionInput(torch.zeros(len(sizes), 1), [], ctx, list(sizes), BatchBounds(len(sizes), 1, max_batch),
                         None, costs=costs, noise_lower=noise, noise_point=noise)


def known_costs(sizes_seen=([32, 32], [40, 24])):
    model = CostModel(2)
    rng = np.random.default_rng(4)
    for sizes in sizes_seen:
        model.record(*interval(rng, sizes, jitter=0.0), overhead_s=1e-3)
    return model


def test_proposal_trust_region_initial_batch_memory_and_hysteresis():
    fit, net = known_costs().fit(), NetworkFit(0.005, 1.0, 1e-3)
    cfg = ProposalConfig()
    bounds = BatchBounds(2, 1, 4096)
    big = propose(cfg, fit, net, [32, 32], bounds, 64, 1e6, 0)  # huge noise scale: larger is better
    assert 64 <= sum(big.sizes) <= 128, "B at most 2x per decision"
    assert big.sizes[0] <= 64, "a rank's size at most 2x per decision"
    assert big.sizes[1] < 16 and big.sizes[0] > 2 * big.sizes[1], \
        "the 3x slower rank gets less, below half its size: relieved as far as the other's growth allows"
    equal = CostModel(2)
    for sizes in ([30, 34], [34, 30], [28, 36]):
        b = np.tile(np.asarray(sizes, dtype=float), (40, 1))
        t = 0.002 + 1e-4 * b
        equal.record(b, t, t.max(1), overhead_s=1e-3)
    grown = propose(cfg, equal.fit(), net, [32, 32], bounds, 64, 1e6, 0)
    assert grown.switched and 64 < sum(grown.sizes) <= 128 and max(grown.sizes) <= 64, "at most 2x per decision"
    back = propose(cfg, equal.fit(), net, [60, 4], bounds, 64, 1.0, 0)
    assert back.sizes == [32, 32], "a relieved rank back to its neutral share in one decision"
    faster = CostModel(2)  # rank 1 now 2x faster than rank 0: back to its neutral share, not past it
    for sizes in ([60, 4], [58, 6], [62, 2]):
        b = np.tile(np.asarray(sizes, dtype=float), (40, 1))
        t = 0.002 + np.array([1e-4, 5e-5]) * b
        faster.record(b, t, t.max(1), overhead_s=1e-3)
    ahead = propose(cfg, faster.fit(), net, [60, 4], bounds, 64, 1.0, 0)
    assert ahead.sizes == [32, 32], ahead.sizes
    failed = propose(cfg, faster.fit(), net, [60, 4], bounds, 64, 1.0, 0, force_neutral=True)
    assert failed.sizes == [56, 8] and failed.neutral, "a failed split goes back towards neutral at 2x"
    grows = propose(cfg, faster.fit(), net, [60, 4], bounds, 64, 1e6, 0)  # B grows: no way back at once
    assert grows.switched and sum(grows.sizes) > 64 and grows.sizes[1] <= 8, grows.sizes
    quicker = CostModel(2)  # rank 1 4x faster: past its neutral share by at most 2x
    for sizes in ([40, 24], [42, 22], [38, 26]):
        b = np.tile(np.asarray(sizes, dtype=float), (40, 1))
        t = 0.002 + np.array([1e-4, 2.5e-5]) * b
        quicker.record(b, t, t.max(1), overhead_s=1e-3)
    assert propose(cfg, quicker.fit(), net, [40, 24], bounds, 64, 1.0, 0).sizes == [16, 48]
    free = propose(ProposalConfig(trust=None), fit, net, [32, 32], bounds, 64, 1e6, 0)
    assert sum(free.sizes) > 4 * 128
    small = propose(cfg, fit, net, [32, 32], bounds, 64, 1.0, 0)  # nothing gained by a larger batch
    assert sum(small.sizes) == 64, "never below the initial global batch"
    down = propose(cfg, fit, net, [300, 100], bounds, 64, 1.0, 0)
    assert 200 <= sum(down.sizes) < 400, "B at most /2 per decision"
    capped = propose(cfg, fit, net, [32, 32], BatchBounds(2, 1, 40), 64, 1e6, 0)
    assert max(capped.sizes) <= 40
    # hysteresis: at the model's optimum, a 5% band holds B still
    sizes = [32, 32]
    for k in range(8):
        p = propose(cfg, fit, net, sizes, bounds, 64, 500.0, k)
        sizes = p.sizes
    held = propose(cfg, fit, net, sizes, bounds, 64, 500.0, 9)
    assert not held.switched and sum(held.sizes) == sum(sizes)
    loose = propose(ProposalConfig(hysteresis=0.0), fit, net, sizes, bounds, 64, 550.0, 9)
    assert sum(loose.sizes) >= sum(sizes), "without hysteresis it follows a slightly larger noise scale"


def test_batch_grows_only_on_identified_fits_unless_exploring():
    """One size seen: the gain of a larger B rests on the pinned fixed share; in its first decisions the
    proposal holds B (and still re-splits it by speed), AdaptDL's exploration (hold_unidentified=0) grows it."""
    rng, model = np.random.default_rng(3), CostModel(2)
    model.record(*interval(rng, [32, 32], a=A * 0, c=C), overhead_s=1e-3)  # truly no fixed cost
    fit, net, bounds = model.fit(), NetworkFit(0.0, 1.0, 1e-3), BatchBounds(2, 1, 4096)
    assert not fit.identified.any()
    held = propose(ProposalConfig(), fit, net, [32, 32], bounds, 64, 1e6, 0)
    assert sum(held.sizes) == 64 and not held.switched
    assert held.sizes[0] >= 2.5 * held.sizes[1], "re-split by speed (3x) while B is held"
    assert (held.batch_min, held.batch_max) == (64, 64)
    adaptdl = dict(confident_growth=False, grow_margin=0.0)  # the pinned fixed share counts as a gain
    explore = propose(ProposalConfig(hold_unidentified=0, **adaptdl), fit, net, [32, 32], bounds, 64, 1e6, 0)
    late = propose(ProposalConfig(**adaptdl), fit, net, [32, 32], bounds, 64, 1e6, 2)
    assert late.switched and sum(late.sizes) > 64, "an unidentifiable line holds B only in the first decisions"
    assert explore.switched and sum(explore.sizes) > 64 and explore.batch_max == 128
    # the default credits no guessed fixed cost: with none measured, B never grows on a guess
    confident = propose(ProposalConfig(), fit, net, [32, 32], bounds, 64, 1e6, 2)
    assert not confident.switched and sum(confident.sizes) == 64
    # PPO's batch row cannot leave that range either: x1.25 or x0.8 on B keeps 64 here
    space = ActionSpace()
    for m in (1.25, 0.8):
        acts = [space.keep, space.keep, space.multipliers.index(m)]
        sizes, _ = refine(ModelPolicy(), space, decision_input([32, 32], costs=model), acts)
        assert sum(sizes) == 64, (m, sizes)
    # once a second size identifies the lines (fixed cost ~0: no throughput gain), B still may move
    model.record(*interval(rng, held.sizes, a=A * 0, c=C), overhead_s=1e-3)
    fit2 = model.fit()
    assert fit2.identified.all()
    later = propose(ProposalConfig(), fit2, NetworkFit(0.02, 1.0, 1e-3), held.sizes, bounds, 64, 1e6, 1)
    assert later.switched and sum(later.sizes) > 64, "a measured fixed cost (the allreduce) pays for a larger B"


def test_model_policy_is_selectable_and_keeps_sizes_without_timings():
    assert "model" in POLICY_NAMES
    policy = make_policy(ControllerConfig(policy="model", policy_config=ProposalConfig(trust=4.0)))
    assert isinstance(policy, ModelPolicy) and policy.cfg.trust == 4.0
    out = policy.decide(decision_input([16, 8], costs=CostModel(2)))
    assert out.sizes == [16, 8]
    with pytest.raises(ValueError, match="noise='upper'"):
        ProposalConfig(noise="upper")
    with pytest.raises(ValueError, match="hold_unidentified=-1"):
        ProposalConfig(hold_unidentified=-1)


def test_noise_scale_interval_is_continuous_where_the_old_estimate_jumps():
    """|G|^2 average near 0: `noise_scale` jumps between ~tr/|G|^2 and 1e12; the interval moves smoothly."""
    rng = np.random.default_rng(5)
    lowers, points, legacy = [], [], []
    for shift in np.linspace(0.02, -0.02, 9):
        stats = GradientStatistics()
        for _ in range(200):
            # two ranks of 16: |G|^2 estimate = (32 G - 16 g_i ...) noisy around `shift`
            g = rng.normal(0, 1, (2, 8)) / 4 + shift
            local = (g ** 2).sum(1)
            glob = float((g.mean(0) ** 2).sum())
            stats.update([16, 16], local, glob)
        lo, pt, hi = stats.noise_scale_interval(1.0)
        assert 0 <= lo <= pt <= hi
        lowers.append(lo), points.append(pt), legacy.append(stats.noise_scale)
    assert max(legacy) == 1e12, "the legacy estimate hits its cap"
    assert max(points) < 1e6 and max(lowers) < 1e6, "the interval's lower end and point stay finite and modest"
    assert np.isnan(GradientStatistics().noise_scale_interval()[0])
    first = GradientStatistics()
    first.update([16, 16], np.array([0.5, 0.7]), 0.01)  # one estimate, |G|^2 estimate <= 0
    lo, pt, hi = first.noise_scale_interval(1.0)
    assert lo == 0.0 and hi == first.config.max_noise_scale, "one estimate: no bound, not the cap as a bound"


def knee_interval(rng, sizes, knee, steps=50, jitter=0.03):
    """Ranks with costs a + c * max(b, knee) (a GPU that small batches do not fill)."""
    b = np.tile(np.asarray(sizes, dtype=float), (steps, 1))
    t = (A + C * np.maximum(b, knee)) * np.exp(rng.normal(0, jitter, b.shape))
    return b, t, t.max(1)


def test_knee_is_fitted_where_seen_and_never_on_a_straight_line():
    knee = np.array([48.0, 48.0])
    rng, model = np.random.default_rng(3), CostModel(2)
    for sizes in ([16, 16], [32, 32], [24, 40], [48, 48], [64, 64], [96, 80]):
        model.record(*knee_interval(rng, sizes, knee))
    fit = model.fit()
    assert fit.knee == pytest.approx(knee, abs=9), fit.knee   # a recorded size near the true knee
    assert fit.per_sample_s == pytest.approx(C, rel=0.15) and fit.identified.all()
    # predictions follow the flat stretch and the slope
    assert fit.arrival(np.array([16.0, 16.0])) == pytest.approx(A + C * 48, rel=0.1)
    assert fit.arrival(np.array([96.0, 96.0])) == pytest.approx(A + C * 96, rel=0.1)
    # the same sizes on straight lines: no knee
    rng, straight = np.random.default_rng(3), CostModel(2)
    for sizes in ([16, 16], [32, 32], [24, 40], [48, 48], [64, 64], [96, 80]):
        straight.record(*interval(rng, sizes))
    assert (straight.fit().knee == 0).all()
    # knees off: the line through the points
    rng, off = np.random.default_rng(3), CostModel(2, CostConfig(knee_residual=0.0))
    for sizes in ([16, 16], [32, 32], [24, 40], [48, 48], [64, 64], [96, 80]):
        off.record(*knee_interval(rng, sizes, knee))
    assert (off.fit().knee == 0).all()
    with pytest.raises(ValueError, match="knee_residual"):
        CostConfig(knee_residual=1.5)


def test_proposal_never_splits_below_a_fitted_knee():
    knee = np.array([48.0, 48.0])
    rng, model = np.random.default_rng(4), CostModel(2)
    for sizes in ([16, 16], [32, 32], [24, 40], [48, 48], [64, 64], [96, 80]):
        model.record(*knee_interval(rng, sizes, knee))
    fit, net = model.fit(), model.fit_network()
    assert fit.knee.min() > 30
    bounds = BatchBounds(2, 1, 1024)
    # without the knee the 3x slower rank would get ~1/4 of 64; with it both get at least the knee
    p = propose(ProposalConfig(search_batch=False, dither=0.0), fit, net, [32, 32], bounds, 64, 1e6, 5)
    assert min(p.sizes) >= min(int(fit.knee.min()), 64) and sum(p.sizes) >= 64
    plain = CostModel(2)
    rng = np.random.default_rng(4)
    for sizes in ([16, 16], [32, 32], [24, 40], [48, 48], [64, 64], [96, 80]):
        plain.record(*interval(rng, sizes))
    q = propose(ProposalConfig(search_batch=False, dither=0.0), plain.fit(), plain.fit_network(), [32, 32], bounds,
                64, 1e6, 5)
    assert q.sizes[1] < 24 and sum(q.sizes) == 64


# --- gradient accumulation -------------------------------------------------------------------------------
def test_accumulated_steps_fit_the_micro_batch_line_and_the_network():
    """A step of p micro-batches is p arrivals then the allreduce: recorded with its micro-batch count it
    gives the same per-micro-batch line and T_net as steps without accumulation."""
    rng = np.random.default_rng(7)
    plain, mixed = CostModel(2), CostModel(2)
    for sizes, p in (([32, 32], 1), ([40, 24], 2), ([36, 28], 3), ([44, 20], 1)):
        b, t, _ = interval(rng, sizes, jitter=0.01)
        net = 0.02
        plain.record(b, t, t.max(1) + net)
        # p micro-batches of `sizes` per step: p times the samples and the arrival, one allreduce
        mixed.record(p * b, p * t, p * t.max(1) + net, passes=np.full(len(b), p))
    for model in (plain, mixed):
        fit = model.fit()
        assert fit.identified.all()
        assert fit.per_sample_s == pytest.approx(C, rel=0.1) and fit.fixed_s == pytest.approx(A, rel=0.25)
        assert model.fit_network().net_s == pytest.approx(0.02, rel=0.05)
    net = NetworkFit(0.02, 1.0, 1e-3)
    assert float(net.step_time(0.1, 3)) == pytest.approx(3 * 0.1 + 0.02 + 1e-3)
    with pytest.raises(ValueError, match="passes needs shape"):
        mixed.record(b, t, t.max(1), passes=np.zeros(len(b)))


def test_proposal_accumulates_only_where_memory_caps_a_batch_worth_growing():
    fit = known_costs().fit()
    heavy = NetworkFit(0.05, 1.0, 1e-3)  # a slow allreduce: a larger B amortises it
    capped = BatchBounds(2, 1, 40, max_passes=8)
    grown = propose(ProposalConfig(trust=None), fit, heavy, [32, 32], capped, 64, 1e6, 5)
    assert grown.passes > 1 and max(grown.sizes) <= 40, grown
    assert grown.global_batch == grown.passes * sum(grown.sizes) > 80, "B past what one pass holds"
    assert grown.batch_max >= grown.global_batch
    one_pass = propose(ProposalConfig(trust=None), fit, heavy, [32, 32], BatchBounds(2, 1, 40), 64, 1e6, 5)
    assert one_pass.passes == 1 and sum(one_pass.sizes) <= 80, "max_passes=1: memory is the limit"
    assert grown.predicted_goodput > one_pass.predicted_goodput
    roomy = propose(ProposalConfig(trust=None), fit, heavy, [32, 32], BatchBounds(2, 1, 4096, max_passes=8),
                    64, 3000.0, 5)
    assert roomy.passes == 1 and 80 < roomy.global_batch < 4096, \
        "memory allows the best batch in one pass: accumulating would only add fixed costs"
    small = propose(ProposalConfig(trust=None), fit, heavy, [32, 32], capped, 64, 1.0, 5)
    assert small.passes == 1 and small.global_batch == 64, "nothing gained by a larger batch"
    # the trust region bounds the samples per step, with accumulation too
    step = propose(ProposalConfig(), fit, heavy, [32, 32], capped, 64, 1e6, 5)
    assert step.global_batch <= 2 * 64 and step.passes * max(step.sizes) <= 2 * 32
    # from an accumulating state: the current B is p x the micro-batches
    back = propose(ProposalConfig(), fit, heavy, [40, 40], capped, 64, 1.0, 5, passes=4)
    assert back.global_batch >= 320 / 2, "B at most /2 per decision"


def test_rules_accumulate_to_a_target_past_the_memory_bounds():
    from dynamix_hvd.control.rules import make_baseline

    rule = make_baseline("linear-ramp", end=96, ramp=1)
    inp = decision_input([8, 8])
    inp.bounds = BatchBounds(2, 1, 16, max_passes=4)
    out = rule.decide(inp)
    assert out.passes == 3 and max(out.sizes) <= 16 and out.passes * sum(out.sizes) >= 96, out
    fixed = make_baseline("linear-ramp", end=96, ramp=1)
    inp.bounds = BatchBounds(2, 1, 16)
    assert fixed.decide(inp).passes == 1 and sum(fixed.decide(inp).sizes) == 32, "no accumulation: clipped"


def test_joint_fit_recovers_overlap_between_the_staged_grid_points():
    """AdaptDL fits compute, network and overlap at once; the staged fit's gamma is a grid point. With a
    true gamma of 1.8 (between the grid's 1.5 and 2.0) and a few stalls, the joint fit finds gamma and
    T_net, keeps the lines, and the goodput rule proposes from it."""
    from dynamix_hvd.control.jointfit import fit_joint

    rng, model = np.random.default_rng(0), CostModel(2)
    for sizes in ([8, 8], [16, 16], [32, 32], [64, 64], [128, 128]):
        model.record(*interval(rng, sizes, jitter=0.03, net=0.02, gamma=1.8, outliers=3), overhead_s=2e-3)
    staged = model.fit_network()
    fit, net = fit_joint(model)
    assert staged.gamma in (1.5, 2.0) and abs(staged.net_s - 0.02) > 0.002
    assert net.gamma == pytest.approx(1.8, abs=0.1) and net.net_s == pytest.approx(0.02, rel=0.05)
    assert fit.per_sample_s == pytest.approx(C, rel=0.03) and fit.fixed_s == pytest.approx(A, rel=0.05)
    assert net.overhead_s == staged.overhead_s
    one = CostModel(2)  # one arrival time: gamma is not identifiable, it stays 1 as in the staged fit
    one.record(*interval(rng, [32, 32], jitter=0.01, net=0.02, gamma=3.0))
    assert fit_joint(one)[1].gamma == 1.0
    assert fit_joint(CostModel(2)) is None
    rule = make_policy(ControllerConfig(policy="goodput"))
    out = rule.decide(decision_input([32, 32], costs=model, noise=1e4))
    assert out.info["fit"] == "joint" and out.info["gamma"] == pytest.approx(net.gamma)


def token_steps(rng, budgets, a, c, d, steps=50, jitter=0.03, lengths=(16, 320)):
    """One interval of token-budget steps: each step's samples come from one length bucket (`lengths`
    tokens), so a rank's tokens b and squared lengths s = sum of len^2 vary apart; arrival a + c b + d s."""
    b = np.tile(np.asarray(budgets, dtype=float), (steps, 1)) * rng.uniform(0.93, 1.0, (steps, len(budgets)))
    length = rng.uniform(*lengths, (steps, 1))
    s = b * length * rng.uniform(0.97, 1.03, b.shape)
    t = (a + c * b + d * s) * np.exp(rng.normal(0, jitter, b.shape))
    return b, t, t.max(1), s


@pytest.mark.parametrize("lengths,budget", [((16, 320), 2732), ((256, 4096), 65536)])
def test_token_budgets_fit_a_per_token_times_length_term_where_attention_costs(lengths, budget):
    """Attention about half of a token's cost at the mean length: with the squared lengths the lines
    are identified and recover the fixed costs and eta = d / c; the token-only line, whose residuals
    carry every bucket's length, does not identify them. Long contexts too (squared lengths ~1e9 per
    step beside ~1e5 tokens: the least squares must survive the scales)."""
    mean_length = sum(lengths) / 2
    a, c = np.array([0.004, 0.008]), np.array([2e-6, 4e-6]) * 2732 / budget
    d = c / mean_length
    fits = {}
    for attention_t in (3.0, 0.0):
        rng, model = np.random.default_rng(4), CostModel(2, CostConfig(attention_t=attention_t))
        for shares in ([2, 1], [2.3, 1], [1.8, 1], [2.15, 1]):
            budgets = [budget * 2 * x / sum(shares) for x in shares]
            b, t, sync, s = token_steps(rng, budgets, a, c, d, lengths=lengths)
            model.record(b, t, sync, overhead_s=1e-3, sq_tokens=s if attention_t else None)
        fits[attention_t] = model.fit()
    fit, tokens_only = fits[3.0], fits[0.0]
    print(f"eta {fit.attention:.4g} (true {d[0] / c[0]:.4g}); fixed {fit.fixed_s} vs token-only "
          f"{tokens_only.fixed_s} (true {a}); per-token rel se {fit.per_sample_se / fit.per_sample_s} vs "
          f"{tokens_only.per_sample_se / tokens_only.per_sample_s}")
    assert fit.attention == pytest.approx(d[0] / c[0], rel=0.2)
    assert fit.identified.all() and fit.fixed_s == pytest.approx(a, rel=0.25)
    assert fit.per_sample_s == pytest.approx(c + d * mean_length, rel=0.1)
    assert fit.relative_speed(budget)[1] == pytest.approx(0.5, rel=0.1)
    assert tokens_only.attention == 0.0
    assert (tokens_only.per_sample_se / tokens_only.per_sample_s > 3 * fit.per_sample_se / fit.per_sample_s).all()


def test_no_attention_term_where_the_cost_is_per_token():
    rng, model = np.random.default_rng(5), CostModel(2)
    for budgets in ([2732, 1366], [2900, 1250], [2600, 1450], [2800, 1300]):
        b, t, sync, s = token_steps(rng, budgets, np.array([0.004, 0.008]), np.array([4e-6, 8e-6]), 0.0)
        model.record(b, t, sync, sq_tokens=s)
    fit = model.fit()
    assert fit.attention == 0.0 and fit.identified.all()
    assert fit.per_sample_s == pytest.approx([4e-6, 8e-6], rel=0.1)
    again = CostModel(2)
    again.load_state_dict(model.state_dict())
    assert np.array_equal(again._s, model._s)


def test_a_change_of_speed_is_followed_after_one_interval_wherever_it_falls_in_it():
    """Rank 1 becomes 3x slower (or 2x faster) part-way through an interval of 16 steps: that interval
    already moves its line, which restarts from the step where the change began (the earlier steps
    of the interval no longer count), so the split follows at the next decision. A change of 15%
    (below twice the threshold) waits for a second interval."""
    a, c = A[[0, 0]], C[[0, 0]]
    for factor, at in ((3.0, 0), (3.0, 6), (0.5, 4), (3.0, 10)):
        rng, model = np.random.default_rng(17), CostModel(2)
        for k in range(12):
            model.record(*interval(rng, [32 + (k % 2), 32 - (k % 2)], a=a, c=c, steps=16, jitter=0.05))
        b, t, sync = interval(rng, [32, 32], a=a, c=c, steps=16, jitter=0.05)
        t[at:, 1] *= factor
        model.record(b, t, np.maximum(sync, t.max(1)))
        if 16 - at < 5:  # too few steps after the change to tell it from a pause: the usual two intervals
            assert (model.shift == 1).all() and model.change_pending
            continue
        assert model.shift[0] == 1 and model.shift[1] == pytest.approx(factor, rel=0.1), (factor, at)
        live = model._live[:, 1] > 0
        assert model._at[live].min() >= model.steps - 16 + at - 1, "only the steps from the change on"
        assert _relative_speed(model) == pytest.approx(factor, rel=0.1)
    rng, model = np.random.default_rng(17), CostModel(2)
    for k in range(12):
        model.record(*interval(rng, [32 + (k % 2), 32 - (k % 2)], a=a, c=c, steps=16, jitter=0.02))
    small = np.array([1.0, 1.15])
    model.record(*interval(rng, [32, 32], a=a * small, c=c * small, steps=16, jitter=0.02))
    assert (model.shift == 1).all() and model.change_pending
    model.record(*interval(rng, [32, 32], a=a * small, c=c * small, steps=16, jitter=0.02))
    assert model.shift[1] == pytest.approx(1.15, rel=0.05)


def test_a_pause_of_a_few_steps_is_not_a_change_of_speed():
    """A rank paused 1-3 s (a checkpoint of another job, a page-cache flush) in one, two or three
    steps of an interval of 16 steps of ~20 ms: no change is followed, the pause does not even leave a
    verdict for the next interval to confirm where it is one step, and the line stays where it was."""
    a, c = A[[0, 0]], C[[0, 0]]
    for pause_steps in (1, 2, 3):
        for pause_s in (1.0, 3.0):
            rng, model = np.random.default_rng(19), CostModel(2)
            for k in range(12):
                model.record(*interval(rng, [32 + (k % 2), 32 - (k % 2)], a=a, c=c, steps=16, jitter=0.05))
            b, t, sync = interval(rng, [32, 32], a=a, c=c, steps=16, jitter=0.05)
            t[5:5 + pause_steps, 1] += pause_s
            model.record(b, t, np.maximum(sync, t.max(1)))
            assert (model.shift == 1).all(), (pause_steps, pause_s)
            model.record(*interval(rng, [32, 32], a=a, c=c, steps=16, jitter=0.05))
            assert (model.shift == 1).all() and not model.change_pending, (pause_steps, pause_s)
            assert _relative_speed(model) == pytest.approx(1.0, abs=0.05)


def test_one_interval_false_alarms_on_equal_ranks_with_correlated_noise():
    """Equal ranks whose step times wander as on a shared host (log time an AR(1) process, lag-1
    autocorrelation 0.6, 8% scatter, an occasional 5x pause): in 2,000 intervals of 8 to 32 steps the
    one-interval test follows at most 1 change in 100 intervals (none is there)."""
    a, c = A[[0, 0]], C[[0, 0]]
    rng = np.random.default_rng(23)
    alarms = intervals = 0
    for job in range(20):
        model = CostModel(2)
        x = np.zeros(2)
        for k in range(100):
            steps = int(rng.choice([8, 16, 32]))
            b = np.tile(np.array([32.0 + (k % 2), 32.0 - (k % 2)]), (steps, 1))
            noise = np.empty((steps, 2))
            for i in range(steps):
                x = 0.6 * x + rng.normal(0, 0.08 * math.sqrt(1 - 0.36), 2)
                noise[i] = x
            t = (a + c * b) * np.exp(noise)
            t[rng.random((steps, 2)) < 0.01] *= 5.0
            model.record(b, t, t.max(1))
            if k >= 10:
                intervals += 1
                alarms += int((model.shift != 1).any())
    print(f"one-interval false alarms: {alarms} in {intervals} intervals")
    assert alarms <= intervals / 100


def test_a_voted_change_restarts_the_line_also_when_the_whole_interval_ran_at_the_new_speed():
    """A rank's change vote whose reference came from an earlier interval: every step of the voted
    interval is at the new speed (the change began before it). Its line still restarts there, with
    the shift measured against the line; without the vote one such interval is not enough."""
    from dynamix_hvd.control.costmodel import CostModel

    rng = np.random.default_rng(3)

    def interval(model, slow, changed=()):
        b = np.tile([16.0, 16.0], (12, 1))
        t = np.column_stack([0.01 + 0.001 * b[:, 0], slow * (0.01 + 0.001 * b[:, 1])]) * np.exp(rng.normal(0, 0.02, (12, 2)))
        model.record(b, t, t.max(1) + 0.001, changed=changed)

    voted, plain = CostModel(2), CostModel(2)
    for model in (voted, plain):
        for _ in range(3):
            interval(model, 1.0)
    interval(voted, 1.4, changed=(1,))
    interval(plain, 1.4)
    assert voted.changed_from is not None and voted.shift[1] == pytest.approx(1.4, rel=0.1)
    assert plain.changed_from is None
