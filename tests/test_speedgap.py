"""The paired test that tells a measured speed gap from timing noise (pure)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dynamix_hvd.control.speedgap import MIN_STEPS, SERIAL_STEPS, effective_steps, speed_gap, t_quantile


def split_gain_lower_bound(*args, **kwargs):
    return speed_gap(*args, **kwargs)[0]


@pytest.mark.parametrize("df, exact", [(1, 31.821), (2, 6.965), (3, 4.541), (MIN_STEPS - 1, 3.747), (5, 3.365),
                                       (10, 2.764), (30, 2.457)])
def test_t_quantile_is_within_one_percent(df, exact):
    assert t_quantile(0.99, df) == pytest.approx(exact, rel=0.01)
    assert t_quantile(0.99, df + 0.7) == t_quantile(0.99, df), "a fractional df rounds down"


def test_t_quantile_at_infinite_degrees_of_freedom_is_the_normal_one():
    assert t_quantile(0.99, math.inf) == pytest.approx(2.3263, abs=1e-4)


def test_t_quantile_refuses_a_two_sided_level():
    with pytest.raises(ValueError, match="0.3"):
        t_quantile(0.3, 5)


def times(rng, n, factor, sizes=(32, 32), jitter=0.1, common=0.2):
    """Per-rank noise `jitter` and a step-wide factor `common` (a busy host slows every rank at once)."""
    b = np.tile(np.asarray(sizes, dtype=float), (n, 1))
    t = b * 1e-3 * np.array([1.0, factor]) * np.exp(rng.normal(0, jitter, b.shape) + rng.normal(0, common, (n, 1)))
    return b, t


def test_equal_ranks_bound_at_zero_and_a_straggler_near_its_gain():
    rng = np.random.default_rng(0)
    equal = [split_gain_lower_bound(*times(rng, 8, 1.0)) for _ in range(200)]
    assert max(equal) < 0.05, "equal ranks never pass the 5% margin"
    twice = [split_gain_lower_bound(*times(rng, 6, 2.0)) for _ in range(200)]
    assert min(twice) > 0.1 and np.median(twice) < 1 / 3, "2x: gain 1/3, bounded below it but well above the margin"
    longer = [split_gain_lower_bound(*times(rng, 20, 2.0)) for _ in range(200)]  # effective steps counted
    assert min(longer) > 0.15 and np.median(longer) < 1 / 3


def test_the_step_wide_noise_cancels_in_the_pairs():
    """A 1.3x gap under a step-wide factor 10x the per-rank noise is still measured from 8 steps."""
    rng = np.random.default_rng(1)
    bounds = [split_gain_lower_bound(*times(rng, 8, 1.3, jitter=0.03, common=0.3)) for _ in range(50)]
    assert min(bounds) > 0.08


def serial_times(rng, n, factor, rho, jitter=0.15, common=0.2):
    """As `times`, with each rank's own noise an AR(1) series of lag-1 correlation `rho` (a core slowed
    by its neighbours stays slow for several steps)."""
    e = rng.normal(0, jitter * math.sqrt(1 - rho ** 2), (n + 50, 2))
    x = np.zeros_like(e)
    for k in range(1, len(e)):
        x[k] = rho * x[k - 1] + e[k]
    b = np.full((n, 2), 32.0)
    return b, b * 1e-3 * np.array([1.0, factor]) * np.exp(x[50:] + rng.normal(0, common, (n, 1)))


def test_serially_correlated_noise_is_not_taken_for_a_gap():
    """Equal ranks whose noise persists from step to step (lag-1 correlation 0.8, as on a shared VM):
    the plain t-test, which takes the steps as independent, finds a gap in about one 20-step interval
    in eight; counting effective steps cuts that by about two-fifths, and a 2x straggler is still found."""
    rng = np.random.default_rng(5)
    draws = [serial_times(rng, 20, 1.0, 0.8) for _ in range(600)]
    serial = np.mean([split_gain_lower_bound(b, t) > 0.05 for b, t in draws])
    independent = np.mean([split_gain_lower_bound(b, t, serial=False) > 0.05 for b, t in draws])
    assert independent > 0.1 and serial < 0.65 * independent and serial < 0.09
    twice = [split_gain_lower_bound(*serial_times(rng, 20, 2.0, 0.8)) for _ in range(200)]
    assert np.mean(np.array(twice) > 0.05) >= 0.98
    # below SERIAL_STEPS the steps are taken as independent: both tests agree
    b, t = serial_times(rng, SERIAL_STEPS - 1, 1.2, 0.8)
    assert split_gain_lower_bound(b, t) == split_gain_lower_bound(b, t, serial=False)


def test_effective_steps_count_independent_steps_as_themselves():
    rng = np.random.default_rng(6)
    independent = np.array([effective_steps(rng.normal(size=(200, 1)))[0] for _ in range(50)])
    assert np.median(independent) > 170 and independent.max() <= 200
    _, t = serial_times(rng, 200, 1.0, 0.8, common=0.0)
    # AR(1) at 0.8: the mean's variance is about (1 + 0.8) / (1 - 0.8) = 9 times the independent one's;
    # a bandwidth of n^(1/3) lags sees part of it
    assert 200 / 9 < effective_steps(np.log(t))[0] < 200 / 2.5


def test_sizes_that_already_balance_unequal_speeds_gain_nothing():
    """Rank 1 at half the samples and half the speed arrives with rank 0: the equalising split gains
    nothing, and the noise of six steps must not make it look as if it did."""
    rng = np.random.default_rng(2)
    b = np.tile([64.0, 32.0], (6, 1))
    bounds = [split_gain_lower_bound(b, 0.064 * np.exp(rng.normal(0, 0.2, (6, 2)))) for _ in range(200)]
    assert max(bounds) < 0.05 and np.median(bounds) == 0.0


def test_a_gap_in_a_small_share_of_the_step_saves_that_share():
    """Rank 1 1.5x slower to arrive (a 20% gain on the arrival), but arrivals are a fifth of the step: the
    bound is on the step, below the 5% margin."""
    rng = np.random.default_rng(4)
    b, t = times(rng, 32, 1.5, jitter=0.02, common=0.0)
    alone = split_gain_lower_bound(b, t)
    on_step = split_gain_lower_bound(b, t, step_s=5 * t.max(1))
    assert alone > 0.15 and on_step == pytest.approx(alone * t.mean(0).max() / (5 * t.max(1)).mean())
    assert on_step < 0.05 and split_gain_lower_bound(b, t, step_s=np.full(32, np.nan)) == alone
    partly = 5 * t.max(1)
    partly[:3] = np.nan  # steps whose end was not timed: the others give the step
    assert split_gain_lower_bound(b, t, step_s=partly) == pytest.approx(alone * t.mean(0).max() / partly[3:].mean())


def test_too_few_steps_or_one_rank_give_no_bound():
    rng = np.random.default_rng(3)
    assert math.isnan(split_gain_lower_bound(*times(rng, MIN_STEPS - 1, 3.0)))
    assert math.isnan(split_gain_lower_bound(np.ones((8, 1)), np.ones((8, 1))))
    b, t = times(rng, MIN_STEPS, 3.0)
    t[0, 1] = math.nan  # a step without a time is left out: too few remain
    assert math.isnan(split_gain_lower_bound(b, t))
