"""When the controller decides (dynamix_hvd.control.cadence): the schedules, and that the answer
depends only on what every rank shares, so a rank that joins or restores decides where the others do."""
from __future__ import annotations

import math

import pytest

from dynamix_hvd.control.cadence import FREE_DECISIONS, DecisionCadence, interval_ceiling


def walk(cadence, epochs, length, start_decisions=0, start_epoch=0, since=0, spacing=0, recheck_after=(),
         ceiling=0):
    """Feed `epochs` epochs of `length` steps; returns the (epoch, step) of every decision. The
    decisions numbered in `recheck_after` ask for a recheck."""
    decisions, when, recheck = start_decisions, [], 0
    for epoch in range(start_epoch, start_epoch + epochs):
        for step in range(1, length + 1):
            since += 1
            if cadence.due(epoch_end=step == length, steps_since=since, decisions=decisions, epoch=epoch,
                           step=step, sizes=[8, 12], epoch_length=lambda: length, spacing=spacing,
                           recheck=recheck, ceiling=ceiling):
                recheck = cadence.min_steps if decisions in recheck_after else 0
                decisions, since = decisions + 1, 0
                when.append((epoch, step))
    return when


def test_automatic_cadence_ramps_up_then_spreads_target_decisions():
    # 4 decisions over 2 epochs of 60 steps: every 30; the first two after 8 each (a split needs two
    # intervals of evidence), then 16 more
    assert walk(DecisionCadence(None, 4, 8, 2), 2, 60) == [(0, 8), (0, 16), (0, 32), (0, 60), (1, 30), (1, 60)]
    # 32 over 4 epochs of 60: the interval (8) is the ramp's start: every 8 steps, every epoch end
    assert walk(DecisionCadence(None, 32, 8, 4), 1, 60) == [(0, s) for s in (8, 16, 24, 32, 40, 48, 56, 60)]
    # no total_epochs: the ramp, then 4 a epoch (every 50 of 200 steps; none in the last half-interval)
    assert walk(DecisionCadence(None, 32, 8, None), 2, 200) == [(0, 8), (0, 16), (0, 32), (0, 64), (0, 114),
                                                                 (0, 164), (0, 200), (1, 50), (1, 100), (1, 150),
                                                                 (1, 200)]


def test_budget_spacing_holds_back_later_decisions_epoch_ends_included():
    """The first FREE_DECISIONS (the ramp that finds the split) ignore the spacing; after them no
    decision comes sooner than `spacing` steps after the last, not even at an epoch end."""
    assert FREE_DECISIONS == 4
    # unlimited: the ramp (8, 8, 16, ...; capped at the interval, 8), then every 8 steps (see above)
    free = walk(DecisionCadence(None, 32, 8, 4), 3, 60)
    spaced = walk(DecisionCadence(None, 32, 8, 4), 3, 60, spacing=70)
    assert spaced[:4] == free[:4] == [(0, 8), (0, 16), (0, 24), (0, 32)]
    assert spaced[4:] == [(1, 42), (2, 52)]  # 70 steps apart; the epoch ends at (0, 60), (1, 60) waited
    assert len(free) > 3 * len(spaced)
    # a spacing shorter than the interval changes nothing; a fixed cadence the user chose ignores it
    assert walk(DecisionCadence(None, 32, 8, 4), 3, 60, spacing=4) == free
    assert walk(DecisionCadence(10, 32, 8, 2), 2, 25, spacing=100) == walk(DecisionCadence(10, 32, 8, 2), 2, 25)


def test_a_recheck_comes_min_steps_after_its_decision_ahead_of_interval_and_spacing():
    """A decision that saw a first interval of evidence asks for the next one after min_steps (8),
    whatever the interval (30) and the budget's spacing (70); the cadence then goes on as before.
    Where the recheck would fall in an epoch's last half-recheck, its end decides; an epoch end
    before the recheck waits for it. A fixed cadence the user chose keeps its steps."""
    plain = walk(DecisionCadence(None, 4, 8, 2), 2, 60)
    assert plain == [(0, 8), (0, 16), (0, 32), (0, 60), (1, 30), (1, 60)]
    assert walk(DecisionCadence(None, 4, 8, 2), 2, 60, recheck_after={3}) == [
        (0, 8), (0, 16), (0, 32), (0, 60), (1, 8), (1, 38), (1, 60)]
    spaced = walk(DecisionCadence(None, 4, 8, 2), 3, 60, spacing=70)
    assert spaced == [(0, 8), (0, 16), (0, 32), (0, 60), (2, 10)]  # 70 steps after (0, 60)
    assert walk(DecisionCadence(None, 4, 8, 2), 3, 60, spacing=70, recheck_after={4}) == spaced + [(2, 18)]
    assert walk(DecisionCadence(10, 32, 8, 2), 2, 25, recheck_after={0, 1, 2}) == walk(DecisionCadence(10, 32, 8, 2), 2, 25)
    # epochs of 41 steps: a recheck asked at 32 would land at 40, one step before the epoch's end, so
    # the end decides (on 9 steps, not 8 and then 1)
    assert walk(DecisionCadence(None, 4, 8, 2), 1, 41, recheck_after={2}) == [(0, 8), (0, 16), (0, 32), (0, 41)]
    # epochs of 20: a recheck asked at 16 lets the epoch end at 20 pass (4 steps) and comes at (1, 4)
    assert walk(DecisionCadence(None, 4, 8, 2), 2, 20) == [(0, 8), (0, 16), (0, 20), (1, 10), (1, 20)]
    assert walk(DecisionCadence(None, 4, 8, 2), 2, 20, recheck_after={1}) == [(0, 8), (0, 16), (1, 4), (1, 14), (1, 20)]


def test_a_ceiling_caps_the_interval_in_long_epochs_below_the_spacing():
    """4 decisions over 2 epochs of 60 steps come every 30 once ramped up; a ceiling of 20 steps (the
    seconds asked for at the step time) caps that, not the ramp's first intervals nor min_steps; the
    budget's spacing still comes first; a fixed cadence the user chose keeps its steps."""
    assert walk(DecisionCadence(None, 4, 8, 2), 2, 60, ceiling=20) == [
        (0, 8), (0, 16), (0, 32), (0, 60), (1, 20), (1, 40), (1, 60)]  # none in (0, 60)'s last 10 steps
    # epochs of 600 steps and 4 decisions over 2 epochs: every 300 steps, or every 50 under the ceiling
    # (after the ramp's 8, 8, 16, 32; the ramp alone doubles on to the interval)
    capped = walk(DecisionCadence(None, 4, 8, 2), 2, 600, ceiling=50)
    assert capped == ([(0, s) for s in (8, 16, 32, *range(64, 565, 50), 600)]
                      + [(1, s) for s in (*range(50, 551, 50), 600)])
    assert walk(DecisionCadence(None, 4, 8, 2), 2, 600) == [(0, 8), (0, 16), (0, 32), (0, 64), (0, 128), (0, 256),
                                                            (0, 600), (1, 300), (1, 600)]
    # a ceiling under min_steps gives min_steps; one above the interval changes nothing
    assert walk(DecisionCadence(None, 4, 8, 2), 1, 60, ceiling=3) == [(0, s) for s in (8, 16, 24, 32, 40, 48, 56, 60)]
    assert walk(DecisionCadence(None, 4, 8, 2), 2, 60, ceiling=45) == walk(DecisionCadence(None, 4, 8, 2), 2, 60)
    spaced = walk(DecisionCadence(None, 4, 8, 2), 3, 60, spacing=70)
    assert walk(DecisionCadence(None, 4, 8, 2), 3, 60, spacing=70, ceiling=20) == spaced
    assert walk(DecisionCadence(10, 32, 8, 2), 2, 25, ceiling=4) == walk(DecisionCadence(10, 32, 8, 2), 2, 25)
    # a fresh cadence (a rank that joined, a restored job) answers alike under the same ceiling
    lived = DecisionCadence(None, 4, 8, 2)
    assert walk(lived, 1, 600, ceiling=50)[-3:] == [(0, 514), (0, 564), (0, 600)]
    assert walk(lived, 1, 600, 15, 1, ceiling=50) == walk(DecisionCadence(None, 4, 8, 2), 1, 600, 15, 1, ceiling=50)


def test_interval_ceiling_is_the_seconds_asked_for_at_the_median_step_time():
    assert interval_ceiling(5.0, [0.1, 0.2, 0.3]) == 25
    assert interval_ceiling(5.0, [0.3, math.nan, 0.1, 0.2, -1.0, math.inf]) == 25  # only finite times > 0 count
    assert interval_ceiling(0.01, [0.5]) == 1       # at least one step
    assert interval_ceiling(5.0, [1e-12]) == 1 << 20 and interval_ceiling(1e308, [0.1]) == 1 << 20  # bounded
    assert interval_ceiling(0.0, [0.1]) == 0 and interval_ceiling(5.0, []) == 0 and interval_ceiling(5.0, [0.0]) == 0


@pytest.mark.parametrize("every, expected", [(10, [(0, 10), (0, 20), (0, 25), (1, 10), (1, 20), (1, 25)]),
                                             (20, [(0, 20), (1, 15), (1, 25)]), (0, [(0, 25), (1, 25)])])
def test_fixed_cadence_every_k_steps_and_epoch_ends_with_enough_records(every, expected):
    assert walk(DecisionCadence(every, 32, 8, 2), 2, 25) == expected


def test_a_fresh_cadence_answers_as_one_that_lived_through_the_job():
    """A rank that joins after an elastic reset, or a job restored from a checkpoint, builds a fresh
    cadence while the others keep theirs: from the same shared state they must decide at the same
    steps, also when the shared history was rolled back to fewer decisions than a survivor saw."""
    lived = DecisionCadence(None, 6, 8, 3)  # every 50 steps of 100 once ramped up (8, 8, 16, 32, 50)
    assert walk(lived, 1, 100) == [(0, 8), (0, 16), (0, 32), (0, 64), (0, 100)]
    for decisions in (1, 2, 3, 0):  # rolled back to the start of epoch 0 after `decisions` decisions
        fresh = DecisionCadence(None, 6, 8, 3)
        assert walk(lived, 2, 100, decisions, 0) == walk(fresh, 2, 100, decisions, 0), decisions
