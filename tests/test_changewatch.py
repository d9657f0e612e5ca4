"""The change vote's own test (dynamix_hvd.control.changewatch): a rank's compute time per step at
its planned size against its reference, and the cadence bringing the decision forward on a yes."""
from __future__ import annotations

import numpy as np
import pytest

from dynamix_hvd.control.cadence import CadenceConfig, DecisionCadence
from dynamix_hvd.control.changewatch import (REFERENCE_STEPS, WINDOW_STEPS, OwnSpeed, own_change, reference_time,
                                             vote_every)


def steps(times, batch=16):
    t = np.asarray(times, dtype=np.float64)
    return t, np.full(len(t), batch)


def test_the_reference_is_the_median_of_the_first_steps_at_the_planned_size():
    c, b = steps([0.5, 0.010, 0.011, 0.012, 0.50, 0.010, 0.011, 0.9])
    b[0] = 8  # an epoch's short last step at another size does not count
    ref, scatter, after = reference_time(c, b, 16)
    assert ref == pytest.approx(0.011) and after == 7 and 0 < scatter < 0.2  # one paused step among six moves the median little
    assert reference_time(c[:5], b[:5], 16) is None  # fewer than REFERENCE_STEPS at the size


@pytest.mark.parametrize("factor, vote", [(3.0, 1), (1.5, 1), (1 / 1.5, -1), (1.1, 0), (0.9, 0)])
def test_a_vote_says_which_way_the_compute_time_moved_beyond_the_ratio(factor, vote):
    rng = np.random.default_rng(0)
    c, b = steps(0.02 * factor * np.exp(rng.normal(0, 0.03, WINDOW_STEPS + 3)))
    assert own_change(c, b, 16, 0.02, 1.25) == vote


@pytest.mark.parametrize("paused", [1, 2, 3])
def test_a_pause_of_up_to_three_steps_however_long_is_no_change(paused):
    c = np.full(WINDOW_STEPS, 0.02)
    c[-paused:] = 3.0  # one to three steps of a 3 s pause each
    assert own_change(c, np.full(WINDOW_STEPS, 16), 16, 0.02, 1.25) == 0
    c[:5] = 0.06  # five of six slow: a change
    assert own_change(c, np.full(WINDOW_STEPS, 16), 16, 0.02, 1.25) == 1


def test_steps_that_scatter_widely_need_a_change_beyond_their_scatter():
    c = np.full(WINDOW_STEPS, 0.03)  # 1.5x the reference
    b = np.full(WINDOW_STEPS, 16)
    assert own_change(c, b, 16, 0.02, 1.25, scatter=0.05) == 1
    assert own_change(c, b, 16, 0.02, 1.25, scatter=0.3) == 0   # 3 x 0.3 > log 1.5: noise could do that
    assert own_change(3 * c, b, 16, 0.02, 1.25, scatter=0.3) == 1  # 4.5x stands out of it


def test_too_few_steps_at_the_planned_size_give_no_vote():
    c, b = steps([0.06] * WINDOW_STEPS)
    b[0] = 12  # the window holds steps of another size: not enough at this one
    assert own_change(c, b, 16, 0.02, 1.25) == 0
    assert own_change(c, np.full(WINDOW_STEPS, 16), 16, 0.02, 1.25) == 1


def test_false_votes_on_noisy_equal_ranks_are_rare():
    """Autocorrelated noise (AR(1), rho 0.6, 8% per step) with 1% of steps paused 5x: how often a
    vote says yes, over 2,000 votes each against a fresh reference."""
    rng = np.random.default_rng(1)
    yes = 0
    for _ in range(2000):
        e = np.zeros(REFERENCE_STEPS + WINDOW_STEPS + 4)
        for k in range(1, len(e)):
            e[k] = 0.6 * e[k - 1] + rng.normal(0, 0.08 * np.sqrt(1 - 0.36))
        c = 0.02 * np.exp(e) * np.where(rng.random(len(e)) < 0.01, 5.0, 1.0)
        b = np.full(len(c), 16)
        ref, scatter, after = reference_time(c, b, 16)
        yes += own_change(c[after:], b[after:], 16, ref, 1.25, scatter) != 0
    print(f"false votes: {yes} of 2000")
    assert yes <= 20


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="ratio=1.0"):
        own_change(np.ones(6), np.ones(6), 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="reference_s=0"):
        own_change(np.ones(6), np.ones(6), 1, 0, 1.25)
    with pytest.raises(ValueError, match="change_ratio.*1"):
        CadenceConfig(change_ratio=1.0)
    with pytest.raises(ValueError, match="change_vote_s.*-1"):
        CadenceConfig(change_vote_s=-1)


def test_votes_every_quarter_second_of_steps():
    assert vote_every(0.25, [0.02, 0.03]) == 10  # median 25 ms
    assert vote_every(0.25, [1.0]) == 2          # never every step
    assert vote_every(0, [0.02]) == 0 and vote_every(0.25, []) == 0


def test_a_yes_brings_the_decision_forward_once_min_steps_ran():
    cadence = DecisionCadence(None, 32, 8, 4)
    common = dict(epoch_end=False, decisions=6, epoch=0, step=20, sizes=[8, 8], epoch_length=lambda: 1000,
                  spacing=200)
    assert not cadence.due(steps_since=60, **common)               # the budget's spacing holds it back
    assert cadence.due(steps_since=60, changed=True, **common)      # a change vote waits a quarter of it
    assert not cadence.due(steps_since=40, changed=True, **common)
    assert not cadence.due(steps_since=5, changed=True, **dict(common, spacing=0))  # and for min_steps
    assert cadence.due(steps_since=8, changed=True, **dict(common, spacing=0))
    assert not DecisionCadence(10, 32, 8, 4).due(steps_since=5, changed=True, **common)  # a fixed cadence: its own


def test_the_reference_is_kept_while_the_size_stays_and_taken_again_after_forget():
    """A rank that slowed just before a decision: its reference from before the decision still holds
    in the next interval (its size did not change), so its vote says yes there; after `forget` (its
    vote brought a decision) the slow steps become the reference."""
    watch = OwnSpeed()
    before = np.full(10, 0.02)
    assert watch.vote(before, np.full(10, 16), 0, 16, 1.25) == 0 and watch.reference[1] == pytest.approx(0.02)
    after = np.full(8, 0.06)  # the next interval, from step 10 on: 3x
    assert watch.vote(after, np.full(8, 16), 10, 16, 1.25) == 1
    watch.forget()
    assert watch.vote(after, np.full(8, 16), 10, 16, 1.25) == 0  # six steps for the reference, two after it
    assert watch.reference[1] == pytest.approx(0.06)
    assert watch.vote(after, np.full(8, 12), 10, 12, 1.25) == 0 and watch.reference[0] == 12  # a new size
