"""The default does no harm: equal ranks keep the user's split undithered, B grows only on a measured gain,
and a growth that trains slower than the initial batch is undone and remembered (pure, one process)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dynamix_hvd.control.actions import ActionSpace, BatchBounds
from dynamix_hvd.control.costmodel import CostModel, NetworkFit
from dynamix_hvd.control.growth import GrowthCheck, GrowthConfig
from dynamix_hvd.control.policy import DecisionInput
from dynamix_hvd.control.policy_store import DEFAULT_POLICY, load_policy
from dynamix_hvd.control.proposal import ModelPolicy, Proposal, ProposalConfig, propose
from dynamix_hvd.control.refine import PPOPolicy
from dynamix_hvd.control.splitcheck import SplitCheck, SplitConfig
from dynamix_hvd.control.state import OBS_DIM, GlobalContext, RankReport


def steps(rng, sizes, a, c, n=40, jitter=0.04, net=0.0):
    b = np.tile(np.asarray(sizes, dtype=float), (n, 1))
    t = (np.asarray(a) + np.asarray(c) * b) * np.exp(rng.normal(0, jitter, b.shape))
    return b, t, t.max(1) + net


def report(rank, size, n, step_s, loss):
    return RankReport(rank=rank, local_batch=size, steps=n, compute_s=step_s, sync_wait_s=0.0, data_wait_s=0.0,
                      step_s=step_s, samples_per_s=size / step_s, peak_memory_bytes=0, mem_used_bytes=0,
                      mem_total_bytes=0, cpu_util=0.0, gpu_util=0.0, net_bytes_per_s=0.0, tcp_retrans_per_s=0.0,
                      loss_mean=loss, local_grad_sq=math.nan, global_grad_sq=math.nan, max_batch=4096)


def run(policy, a, c, decisions=30, base=(64, 64), net=0.0, noise=1e6, loss=lambda t, B: 2.0 / (1 + t) ** 0.3,
        seed=0, step=None, lengths=False, change=None, unrecorded=(), n=40, jitter=0.04, left=None, infos=None):
    """Decisions of `policy` on ranks with costs a + c b (jittered); the interval's loss is `loss(t, B)`
    at the training seconds t its end; `step(sizes)`, when given, is the measured wall time per step
    whatever the per-rank lines say (a split that cannot shorten it); `change=(k, a, c)`: the costs
    from interval k on; intervals in `unrecorded` reach the policy but not the cost model (no timed
    steps); `left(k)`: the budget still to run at decision k (None: no budget); `noise`: the noise
    scale, or a function of the decision's index giving it; `infos`: a list that collects each
    decision's info."""
    rng, model = np.random.default_rng(seed), CostModel(len(a))
    sizes, out_sizes, clock = list(base), [], 0.0
    for k in range(decisions):
        if change is not None and k == change[0]:
            a, c = change[1], change[2]
        b, t, sync = steps(rng, sizes, a, c, n=n, jitter=jitter, net=net)
        if k not in unrecorded:
            model.record(b, t, sync, overhead_s=1e-3, sq_tokens=b * 150.0 if lengths else None)
        step_s = float(sync.mean()) + 1e-3 if step is None else step(sizes) * float(np.exp(rng.normal(0, 0.02)))
        clock += step_s * len(b)
        phi = noise(k) if callable(noise) else noise
        ctx = GlobalContext(global_batch=sum(sizes), initial_batch=sum(base), noise_scale=phi, efficiency=1.0,
                            loss_trend=0.0, progress=k / decisions, world_size=len(a))
        reports = [report(r, s, len(b), step_s, loss(clock, sum(sizes))) for r, s in enumerate(sizes)]
        obs = torch.zeros(len(a) + 1, OBS_DIM)
        inp = DecisionInput(obs, reports, ctx, sizes, BatchBounds(len(a), 1, 4096), None, costs=model,
                            noise_lower=phi, noise_point=phi, budget_left=math.nan if left is None else left(k))
        out = policy.decide(inp)
        sizes = list(out.sizes)
        out_sizes.append(sizes)
        if infos is not None:
            infos.append(out.info)
    return out_sizes


EQUAL = dict(a=[0.002, 0.002], c=[1e-4, 1e-4])


def test_equal_ranks_keep_the_users_split_undithered():
    """Equal speeds with 4% timing noise: every decision keeps 64/64 (no split, no dither, no growth),
    for the proposal and for the shipped PPO policy deployed greedily."""
    shipped = load_policy(DEFAULT_POLICY, ActionSpace())[0]
    for name, make in (("model", ModelPolicy), ("ppo", lambda: PPOPolicy(shipped, learn=False))):
        for seed in range(3):
            hist = run(make(), **EQUAL, seed=seed)
            assert all(s == [64, 64] for s in hist), (name, seed, hist)


def test_a_real_straggler_is_split_after_two_intervals_of_evidence():
    """Two recorded intervals of per-step times, each with the paired test's bound past the margin
    and the same rank slower, are evidence enough for a 3x gap: the second decision splits."""
    policy = ModelPolicy()
    hist = run(policy, a=[0.002, 0.006], c=[1e-4, 3e-4], decisions=6)
    assert hist[0] == [64, 64], hist
    assert hist[1][0] > 1.5 * hist[1][1], hist
    assert all(s[0] > 1.8 * s[1] for s in hist[3:]), hist
    one = run(ModelPolicy(split_intervals=1), a=[0.002, 0.006], c=[1e-4, 3e-4], decisions=1)
    assert one[0][0] > 1.5 * one[0][1], "split_intervals=1 splits at the first decision"


def test_a_rank_that_becomes_slower_mid_job_is_split_within_an_interval_and_a_recheck():
    """Equal ranks for eight intervals, then rank 1 3x slower: the interval that shows it asks for a
    recheck (one busy interval on a shared host looks the same, so it alone does not split equal
    ranks), and the recheck's decision leaves the even split; a 1.3x slowdown (a gap below a
    recheck's) waits for the next regular interval."""
    slow = dict(a=[0.002, 0.006], c=[1e-4, 3e-4])
    for n in (40, 12):
        infos: list = []
        hist = run(ModelPolicy(), **EQUAL, change=(8, slow["a"], slow["c"]), decisions=10, n=n, infos=infos)
        assert all(s == [64, 64] for s in hist[:9]), hist
        assert infos[8]["recheck"] and hist[9][0] > 1.5 * hist[9][1], (n, hist)
    infos = []
    mild = dict(a=[0.002, 0.0026], c=[1e-4, 1.3e-4])
    hist = run(ModelPolicy(), **EQUAL, change=(8, mild["a"], mild["c"]), decisions=10, infos=infos)
    assert hist[8] == [64, 64] and not infos[8]["recheck"] and hist[9][0] > hist[9][1], hist


def _decide_on(policy, model, times, sizes=(64, 64), steps_each=1):
    b, t, sync = times
    model.record(b, t, sync, overhead_s=1e-3, steps_each=steps_each)
    ctx = GlobalContext(global_batch=sum(sizes), initial_batch=128, noise_scale=1e6, efficiency=1.0,
                        loss_trend=0.0, progress=0.0, world_size=2)
    reports = [report(r, s, len(b), float(sync.mean()) + 1e-3, 1.0) for r, s in enumerate(sizes)]
    inp = DecisionInput(torch.zeros(3, OBS_DIM), reports, ctx, list(sizes), BatchBounds(2, 1, 4096), None,
                        costs=model, noise_lower=1e6, noise_point=1e6)
    return policy.decide(inp)


def test_one_noisy_interval_does_not_split_equal_ranks():
    """Equal ranks whose one interval looks 3x apart (a busy host for a few seconds), then equal again:
    the neutral split stays; a gap whose slowest rank swaps between intervals does not add up either;
    an interval too short to test is tested with the next one."""
    rng = np.random.default_rng(0)
    slow1, slow0, equal = ([0.002, 0.006], [1e-4, 3e-4]), ([0.006, 0.002], [3e-4, 1e-4]), EQUAL.values()
    for order, runs in (((slow1, equal, slow1, equal), [1, 0, 1, 0]), ((slow1, slow0, slow1, slow0), [1, 1, 1, 1])):
        policy, model = ModelPolicy(search_batch=False), CostModel(2)
        outs = [_decide_on(policy, model, steps(rng, [64, 64], *costs)) for costs in order]
        assert all(o.sizes == [64, 64] for o in outs), [o.sizes for o in outs]
        assert [o.info["gap_intervals"] for o in outs] == runs
        # never two rechecks running (the swapping gap would otherwise recheck at every decision)
        assert [o.recheck for o in outs] == [True, False, True, False], [o.recheck for o in outs]
    policy, model = ModelPolicy(search_batch=False), CostModel(2)
    first = _decide_on(policy, model, steps(rng, [64, 64], *slow1))
    short = _decide_on(policy, model, steps(rng, [64, 64], *slow1, n=3))
    second = _decide_on(policy, model, steps(rng, [64, 64], *slow1))
    assert first.sizes == short.sizes == [64, 64] and first.info["gap_intervals"] == short.info["gap_intervals"] == 1
    assert second.info["gap_intervals"] == 2 and second.sizes[0] > 1.5 * second.sizes[1], second.sizes
    # the first passing interval asks for the next decision soon; one too short to test, or a confirmed
    # gap, does not
    assert (first.recheck, short.recheck, second.recheck) == (True, False, False)
    # a gap past the margin but under recheck_gap (1.3x slower: a bound of about 0.11) waits for the
    # regular interval, as does any gap with recheck_gap=1; 1.5x slower (about 0.18) rechecks
    for fresh, costs, expected in ((ModelPolicy(search_batch=False), ([0.002, 0.0026], [1e-4, 1.3e-4]), False),
                                   (ModelPolicy(search_batch=False), ([0.002, 0.003], [1e-4, 1.5e-4]), True),
                                   (ModelPolicy(search_batch=False, recheck_gap=1.0), slow1, False)):
        out = _decide_on(fresh, CostModel(2), steps(np.random.default_rng(0), [64, 64], *costs))
        assert out.info["gap_intervals"] == 1 and out.recheck is expected, (out.info["gap_bound"], out.recheck)
    after = _decide_on(policy, model, steps(rng, second.sizes, *slow1), sizes=second.sizes)
    assert after.info["gap_intervals"] == 0, "an interval off the neutral split is not evidence for leaving it"


def test_intervals_too_short_to_test_are_tested_together():
    """Epochs of four steps (a decision at each end): each interval alone is too short for the paired
    test, so two are tested together. A 3x straggler is split at the fourth decision (two such pairs
    running), not before; a gap in the first pair only (a busy host) is no evidence, nor are steps
    off the neutral split."""
    slow1 = ([0.002, 0.006], [1e-4, 3e-4])
    for seed in range(3):
        rng, policy, model = np.random.default_rng(seed), ModelPolicy(search_batch=False), CostModel(2)
        outs = [_decide_on(policy, model, steps(rng, [64, 64], *slow1, n=4)) for _ in range(4)]
        assert [o.info["gap_intervals"] for o in outs] == [0, 1, 1, 2], [o.info["gap_intervals"] for o in outs]
        assert [math.isfinite(o.info["gap_bound"]) for o in outs] == [False, True, False, True]
        assert all(o.sizes == [64, 64] for o in outs[:3]) and outs[3].sizes[0] > 1.5 * outs[3].sizes[1], outs[3].sizes
        policy, model = ModelPolicy(search_batch=False), CostModel(2)
        costs = [slow1, slow1] + [tuple(EQUAL.values())] * 6
        outs = [_decide_on(policy, model, steps(rng, [64, 64], *c, n=4)) for c in costs]
        assert all(o.sizes == [64, 64] for o in outs), [o.sizes for o in outs]
        assert [o.info["gap_intervals"] for o in outs] == [0, 1, 1, 0, 0, 0, 0, 0]
    policy, model = ModelPolicy(search_batch=False), CostModel(2)
    _decide_on(policy, model, steps(rng, [64, 64], *slow1, n=4))
    uneven = _decide_on(policy, model, steps(rng, [80, 48], *slow1, n=4), sizes=(80, 48))
    assert uneven.info["gap_intervals"] == 0 and policy._unit_from is None, "steps off the neutral split end the wait"
    # an interval known only by its means (a peer without per-step times) is no evidence and is not
    # mixed with the steps that wait
    policy, model = ModelPolicy(search_batch=False), CostModel(2)
    _decide_on(policy, model, steps(rng, [64, 64], *slow1, n=4))
    assert policy._unit_from is not None
    b, t, sync = steps(rng, [64, 64], *slow1, n=6)
    means = _decide_on(policy, model, (b[:1], t.mean(0, keepdims=True), sync.mean(keepdims=True)), steps_each=6)
    assert not model.latest_per_step and policy._unit_from is None and means.info["gap_intervals"] == 0


def test_the_evidence_round_trips_and_a_restored_first_interval_is_skipped():
    rng = np.random.default_rng(1)
    slow1 = ([0.002, 0.006], [1e-4, 3e-4])
    policy, model = ModelPolicy(search_batch=False), CostModel(2)
    assert _decide_on(policy, model, steps(rng, [64, 64], *slow1)).info["gap_intervals"] == 1
    restored = ModelPolicy(search_batch=False)
    restored.load_state_dict(policy.state_dict())
    assert (restored._gap_run, restored._gap_slowest, restored._stepwise, restored._rechecked) == (1, 1, True, True)
    skipped = _decide_on(restored, model, steps(rng, [64, 64], *slow1))
    assert skipped.sizes == [64, 64] and skipped.info["gap_intervals"] == 1, "start-up is not evidence"
    split = _decide_on(restored, model, steps(rng, [64, 64], *slow1))
    assert split.info["gap_intervals"] == 2 and split.sizes[0] > 1.5 * split.sizes[1], split.sizes
    policy.reset_world(3)
    assert (policy._gap_run, policy._gap_slowest) == (0, -1), "evidence from another world says nothing here"


def test_a_gap_within_the_noise_of_a_short_interval_waits_for_more_steps():
    """40% slower with 20% per-step noise on each rank (a split gain of ~16%): six steps show a gap beyond
    the margin in a minority of jobs; two intervals of sixty-four more steps nearly always do, and the
    split follows by the third decision (the second where the six steps passed too)."""
    a, c = [0.002, 0.0028], [1e-4, 1.4e-4]
    passed, split = [], []
    for seed in range(20):
        policy, rng, model = ModelPolicy(search_batch=False), np.random.default_rng(seed), CostModel(2)
        outs = [_decide_on(policy, model, steps(rng, [64, 64], a, c, n=n, jitter=0.2)) for n in (6, 64, 64)]
        assert outs[0].sizes == [64, 64], "one interval is not evidence enough"
        passed.append(outs[0].info["gap_intervals"] == 1)
        split.append(any(o.sizes != [64, 64] for o in outs[1:]))
    assert sum(passed) <= 8 and sum(split) >= 19, (passed, split)


def test_a_transient_that_ends_as_the_split_moves_a_rank_is_undone_at_the_next_decision():
    """Equal ranks whose steps are mostly fixed cost (a GRU's: 12 ms + 0.4 ms per sample); rank 0
    runs 2x slower for the first two intervals of 12 steps (start-up), then as fast as rank 1. Two
    intervals of measured gap split it (the evidence rule cannot tell a transient that lasts them),
    but the first interval at its new size, fast, makes its line through both sizes impossible (a
    fixed cost far below zero): the line starts again there, the identified rank 1 lends it the shape
    of its line, and the next decision is back at 16/16 for good. Without the restart the line
    through the origin, and next to rank 1's line a proportional guess, kept an uneven split for
    many decisions."""
    even = dict(a=[0.012, 0.012], c=[4e-4, 4e-4])
    for seed in range(4):
        hist = run(ModelPolicy(), a=[0.026, 0.012], c=[8e-4, 4e-4], base=(16, 16), decisions=12, seed=seed,
                   noise=1.0, change=(2, even["a"], even["c"]), n=12, jitter=0.08)
        assert hist[0] == [16, 16] and hist[1][0] < 12, (seed, hist)
        assert all(s == [16, 16] for s in hist[2:]), (seed, hist)
    # a real 2x straggler (rank 0 slower at both costs) on such short intervals: split, and kept
    for seed in range(4):
        hist = run(ModelPolicy(), a=[0.012, 0.006], c=[8e-4, 4e-4], base=(16, 16), decisions=12, seed=seed,
                   noise=1.0, n=12, jitter=0.08)
        assert all(s[0] <= 10 for s in hist[1:]), (seed, hist)


def test_a_straggler_whose_fixed_cost_dominates_is_relieved_at_once():
    """Rank 1 3x slower at both costs, fixed costs 3/4 of a step (the GRU's shape): once the first
    split has shown its line, the next decision puts it at its equalising size, 1 sample; the trust
    region bounds the fast rank's growth, not the slow rank's relief (halving it took 9, 5, 3, 2, 1)."""
    for seed in range(3):
        hist = run(ModelPolicy(), a=[0.012, 0.036], c=[4e-4, 12e-4], base=(16, 16), decisions=8, seed=seed,
                   noise=1.0, n=18)
        first = next(k for k, s in enumerate(hist) if s != [16, 16])
        assert hist[first][1] > 4 and all(s == [31, 1] for s in hist[first + 1:]), (seed, hist)


def test_a_real_straggler_split_passes_its_check_and_stays():
    """B is held in the decision that leaves the neutral split and while the split is judged."""
    policy = ModelPolicy()
    hist = run(policy, a=[0.002, 0.006], c=[1e-4, 3e-4], decisions=20)
    assert all(s[0] > 1.8 * s[1] for s in hist[2:]), hist
    first = next(k for k, s in enumerate(hist) if s != [64, 64])
    assert all(sum(s) == 128 for s in hist[first:first + 3]), hist
    assert policy.split_check.failures == 0 and policy.split_check.last["measured_gain"] > 0.3, policy.split_check.last


def test_a_straggler_that_appears_later_is_split_and_judged_at_its_new_speed():
    """Equal ranks for 10 intervals, then rank 1 3x slower: its line restarts at the change, the split
    follows within two intervals and is judged against a neutral step at the new speed (not the
    faster steps before the change, which would fail it), passes and stays."""
    policy = ModelPolicy()
    hist = run(policy, a=[0.002, 0.002], c=[1e-4, 1e-4], decisions=20,
               change=(10, [0.002, 0.006], [1e-4, 3e-4]))
    assert all(s == [64, 64] for s in hist[:10]), hist
    assert all(s[0] > 1.8 * s[1] for s in hist[12:]), hist
    check = policy.split_check
    assert check.failures == 0 and check.last["measured_gain"] > 0.3, check.last


def test_a_change_found_once_is_not_read_again_from_an_interval_the_cost_model_did_not_record():
    """The split taken where the change was confirmed is judged even when the next interval carried
    no timed steps (the cost model's change of speed belongs to the interval it recorded)."""
    policy = ModelPolicy()
    hist = run(policy, a=[0.002, 0.002], c=[1e-4, 1e-4], decisions=20,
               change=(10, [0.002, 0.006], [1e-4, 3e-4]), unrecorded={12})
    assert all(s[0] > 1.8 * s[1] for s in hist[12:]), hist
    check = policy.split_check
    assert check.failures == 0 and check.last["measured_gain"] > 0.3, check.last


def test_split_check_starts_again_where_a_rank_changed_speed():
    check = SplitCheck()
    for k in range(2):
        check.observe([report(0, 64, 10, 0.010, 1.0)], True, 128)
    check.observe([report(0, 64, 10, 0.030, 1.0)], True, 128, speed_pending=True)
    assert check.reference == [0.010, 0.010], "an interval that may hold a change is not a reference"
    check.observe([report(0, 80, 10, 0.020, 1.0)], True, 160, speed_changed=True)
    assert check.reference == [0.020] and check.reference_batch == 160, "the confirming interval is the reference"
    check.start(0.3)
    check.observe([report(0, 80, 10, 0.014, 1.0)], False, 160, predicted_gain=0.3)
    assert not check.observe([report(0, 80, 10, 0.030, 1.0)], False, 160, predicted_gain=0.3, speed_pending=True)
    assert check.judging and len(check.trial) == 1, "a trial skips an interval that may hold a change"
    assert not check.observe([report(0, 80, 10, 0.009, 1.0)], False, 160, predicted_gain=0.3, speed_changed=True)
    assert not check.judging and check.failures == 0 and check.reference == [], "a trial across a change: no verdict"


def test_a_split_that_does_not_shorten_the_measured_step_is_undone_and_remembered():
    """Rank 1's lines say 20% slower (a predicted split gain of ~7%), but the measured step does not
    change with the split (the difference is in what each rank's timer sees, e.g. two ranks sharing
    cores): the split is judged and undone, and retried only after the measured gap has lasted 4
    neutral intervals, then 8, then 16 (each failure doubles the evidence the next trial needs), so
    thirty decisions hold at most three trials of two intervals; a real 3x straggler later is split at
    once. The check reads steps with 2% noise per interval against a predicted gain of ~3.5%, so now
    and then noise passes it: of eight jobs, at least six undo the split."""
    undone = 0
    for seed in range(8):
        policy = ModelPolicy()
        hist = run(policy, a=[0.002, 0.002], c=[1e-4, 1.2e-4], step=lambda sizes: 0.0105, seed=seed)
        undone += policy.split_check.failures >= 1
        if policy.split_check.failures:
            assert policy.split_check.failures <= 3 and sum(abs(s[0] - s[1]) > 1 for s in hist) <= 7, hist
    assert undone >= 6, undone
    policy = ModelPolicy()
    hist = run(policy, a=[0.002, 0.002], c=[1e-4, 1.2e-4], step=lambda sizes: 0.0105, seed=1, decisions=12)
    split_at = next(k for k, s in enumerate(hist) if s != [64, 64])
    back = next(k for k in range(split_at, len(hist)) if hist[k] == [64, 64])
    assert back <= split_at + 3, hist
    neutral = [abs(s[0] - s[1]) <= 1 for s in hist[back:]]  # B may grow: the lines pay it
    assert neutral[:4] == [True] * 4, hist  # four neutral intervals of measured gap before the retry
    check = policy.split_check
    assert check.failures == 2 and check.last["measured_gain"] < 0.5 * check.last["predicted_gain"], check.last
    assert 0.1 < policy.split_margin < 0.2, policy.split_margin
    later = run(policy, a=[0.002, 0.006], c=[1e-4, 3e-4], decisions=8, seed=1)
    assert later[-1][0] > 1.8 * later[-1][1], later


@pytest.mark.parametrize("failures, split_at", [(1, 3), (2, 7)])
def test_a_lasting_gap_below_a_raised_margin_is_split_after_more_evidence(failures, split_at):
    """After failed splits have raised the margin to 25%, rank 1 runs 1.5x slower (a predicted gain of
    about 20%, under the raised margin): the measured gap passing in 2 x 2^failures neutral intervals
    running outweighs it and that decision splits, 4 intervals in after one failure, 8 after two
    (without that the job would stay at the neutral split); the raised margin is dropped with the
    split; a run that reaches that length without a split taken on it leaves it in place."""
    for seed in range(3):
        policy = ModelPolicy()
        policy.split_check.load_state_dict({"margin": 0.25, "failures": failures})
        hist = run(policy, a=[0.002, 0.003], c=[1e-4, 1.5e-4], decisions=split_at + 3, seed=seed)
        uneven = [abs(s[0] - s[1]) > 1 for s in hist]
        assert uneven == [False] * split_at + [True] * 3, hist
        assert hist[-1][0] > 1.3 * hist[-1][1] and policy.split_check.margin == 0.0, hist
    check = SplitCheck()
    check.load_state_dict({"margin": 0.25, "failures": failures})
    assert not check.outweighed(split_at, 2) and check.outweighed(split_at + 1, 2)
    assert check.margin == 0.25, "outweighing alone (no split taken on it) keeps the raised margin"
    check.lift()
    assert check.margin == 0.0 and not check.outweighed(100, 2)


def test_no_split_check_with_token_budgets():
    """With squared lengths in the cost model (token budgets, length bucketing) intervals' steps do not
    compare, so a split is not judged by them (the same job as above keeps its split)."""
    policy = ModelPolicy()
    hist = run(policy, a=[0.002, 0.002], c=[1e-4, 1.2e-4], step=lambda sizes: 0.0105, lengths=True)
    assert policy.split_check.failures == 0 and not policy.split_check.last
    assert sum(s != [64, 64] for s in hist) > len(hist) // 2, hist


def test_a_restored_policy_skips_its_first_interval_and_a_kept_batch_binds_refinements():
    policy = ModelPolicy()
    run(policy, a=[0.002, 0.006], c=[1e-4, 3e-4], decisions=4)
    assert not policy._restored, "a fresh start's first report leaves its warm-up out: its interval counts"
    restored = ModelPolicy()
    restored.load_state_dict(policy.state_dict())
    assert restored._restored and restored.split_check.state_dict() == policy.split_check.state_dict()
    run(restored, a=[0.002, 0.006], c=[1e-4, 3e-4], decisions=1)
    assert not restored._restored
    assert "window" not in policy.split_check.state_dict(), "settings are not state"
    rng, model = np.random.default_rng(2), CostModel(2)
    model.record(*steps(rng, [64, 64], [0.002, 0.006], [1e-4, 3e-4]), overhead_s=1e-3)
    kept = propose(ProposalConfig(search_batch=False), model.fit(), model.fit_network(), [64, 64],
                   BatchBounds(2, 1, 4096), 128, 1e6, 5)
    assert kept.batch_min == kept.batch_max == kept.global_batch == 128


def test_split_check_needs_the_same_batch_and_round_trips():
    check = SplitCheck()
    for k in range(3):
        check.observe([report(0, 64, 10, 0.010, 1.0)], True, 128, first_interval=k == 0)
    assert check.reference == [0.010, 0.010]
    check.start(0.2)
    assert not check.observe([report(0, 80, 10, 0.010, 1.0)], False, 160), "another B: no verdict"
    assert check.trial_gain == 0 and check.failures == 0
    check.observe([report(0, 64, 10, 0.010, 1.0)], True, 128)
    check.start(0.2)
    assert not check.observe([report(0, 80, 10, 0.0101, 1.0)], False, 128, predicted_gain=0.1)
    assert check.observe([report(0, 80, 10, 0.0099, 1.0)], False, 128, predicted_gain=0.1), "no measured gain"
    check.observe([report(0, 64, 10, 0.010, 1.0)], True, 128)
    check.start(0.2)
    check.observe([report(0, 80, 10, 0.0096, 1.0)], False, 128, predicted_gain=0.05)
    assert not check.observe([report(0, 80, 10, 0.0096, 1.0)], False, 128, predicted_gain=0.07), \
        "4% measured against 6% predicted passes"
    assert check.failures == 1
    again = SplitCheck()
    again.load_state_dict(check.state_dict())
    assert again.state_dict() == check.state_dict() and again.margin == pytest.approx(0.25)  # at most max_margin


def test_a_small_speed_difference_is_not_split():
    """3% slower: inside the 5% margin, so the split stays neutral (timing noise alone is as large)."""
    hist = run(ModelPolicy(), a=[0.002, 0.00206], c=[1e-4, 1.03e-4])
    assert all(s == [64, 64] for s in hist), hist


def test_growth_needs_a_measured_gain():
    """No fixed cost measured (one size seen, no allreduce time): B is not grown on the pinned guess; a
    measured allreduce that dominates the step makes a larger batch pay, and B grows."""
    rng = np.random.default_rng(1)
    model = CostModel(2)
    model.record(*steps(rng, [64, 64], [0.0, 0.0], [1e-4, 1e-4]), overhead_s=1e-4)
    fit, bounds = model.fit(), BatchBounds(2, 1, 4096)
    quiet = propose(ProposalConfig(), fit, NetworkFit(0.0, 1.0, 1e-4), [64, 64], bounds, 128, 1e6, 5)
    assert sum(quiet.sizes) == 128 and not quiet.switched
    slow_net = propose(ProposalConfig(), fit, NetworkFit(0.05, 1.0, 1e-4), [64, 64], bounds, 128, 1e6, 5)
    assert sum(slow_net.sizes) > 128 and slow_net.switched


def test_growth_waits_for_the_reference_and_needs_losses():
    check = GrowthCheck()
    assert not check.ready
    for k in range(3):
        check.observe([report(0, 64, 10, 0.01, 2.0 - 0.1 * k)], 64, 64)
    assert check.ready
    no_loss = GrowthCheck()
    for k in range(5):
        no_loss.observe([report(0, 64, 10, 0.01, math.nan)], 64, 64)
    assert not no_loss.ready, "without losses the check has no reference: B never grows"


@pytest.mark.parametrize("worse", [True, False])
def test_growth_that_trains_slower_is_undone_and_remembered(worse):
    """Communication-bound ranks (B pays by the model); the loss after growing is either clearly above
    the initial batch's extrapolated curve (undone, never again) or below it (accepted)."""
    def loss(t, B):
        static = 2.0 - 0.3 * math.log(1 + t)
        return static + (0.3 if worse and B > 128 else -0.05 if B > 128 else 0.0)

    policy = ModelPolicy()
    hist = run(policy, a=[0.0, 0.0], c=[1e-4, 1e-4], net=0.05, loss=loss, decisions=20)
    totals = [sum(s) for s in hist]
    assert max(totals) > 128, "the measured allreduce makes growth pay"
    if worse:
        assert policy.check.banned and totals[-1] == 128, totals
        first_back = totals.index(128, totals.index(max(totals)))
        assert all(t == 128 for t in totals[first_back:]), "remembered: no second growth"
    else:
        assert policy.check.accepted and not policy.check.banned and totals[-1] > 128, totals


def test_growth_check_state_round_trips():
    check = GrowthCheck()
    for k in range(4):
        check.observe([report(0, 64, 10, 0.01, 2.0 - 0.1 * k)], 64, 64)
    check.observe([report(0, 96, 10, 0.01, 1.9)], 128, 64)
    again = GrowthCheck()
    again.load_state_dict(check.state_dict())
    assert again.state_dict() == check.state_dict() and again.ready


@pytest.mark.parametrize("kwargs", [dict(split_margin=1.5), dict(grow_margin=-0.1), dict(check_growth=1),
                                    dict(confident_growth="yes"), dict(dither_decisions=-1), dict(split_margin=True),
                                    dict(check_split="no"), dict(split_intervals=0), dict(recheck_gap=-0.1),
                                    dict(recheck_gap=math.nan), dict(budget_loss=1.5), dict(budget_loss=-0.01),
                                    dict(budget_loss=math.nan), dict(budget_loss=True)])
def test_bad_no_harm_settings_are_refused_naming_the_value(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"ProposalConfig.{name}={value!r}"):
        ProposalConfig(**kwargs)


def test_batchnorm_models_keep_every_rank_at_the_floor():
    """A model with per-rank BatchNorm raises min_batch to advanced.batchnorm_min_batch (never above the smallest
    initial size); SyncBatchNorm, LayerNorm-only models and no model leave it alone."""
    from dynamix_hvd.control.config import AdvancedConfig, ControllerConfig
    from dynamix_hvd.control.controller import batchnorm_floor, per_rank_batchnorm

    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    ln = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    sync = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
    cfg = ControllerConfig(policy="static")
    assert per_rank_batchnorm(bn) == ["1"] and per_rank_batchnorm(ln) == per_rank_batchnorm(sync) == []
    assert batchnorm_floor(cfg, bn, [32, 32]).min_batch == 16
    assert batchnorm_floor(cfg, bn, [8, 32]).min_batch == 8, "never above the smallest initial size"
    assert batchnorm_floor(ControllerConfig(policy="static", advanced=AdvancedConfig(batchnorm_min_batch=4)), bn,
                           [32, 32]).min_batch == 4
    for model in (ln, sync, None):
        assert batchnorm_floor(cfg, model, [32, 32]).min_batch == 1


def test_growth_check_bans_divergence_and_never_accepts_without_a_reference():
    check = GrowthCheck()
    for k in range(4):
        check.observe([report(0, 64, 10, 0.01, 2.0 - 0.1 * k)], 64, 64)
    for _ in range(2):
        check.observe([report(0, 96, 10, 0.01, math.inf)], 128, 64)
    assert check.banned, "a diverged interval after growing bans growth"
    blind = GrowthCheck()
    for _ in range(8):  # grown without any reference (e.g. restored from an older checkpoint)
        blind.observe([report(0, 96, 10, 0.01, 1.5)], 128, 64)
    assert not blind.accepted and not blind.banned and not blind.ready
    flat = GrowthCheck()  # a reference that did not improve: judged against its mean and spread
    for k, value in enumerate((1.98, 2.0, 2.0, 2.02)):
        flat.observe([report(0, 64, 10, 0.01, value)], 64, 64)
    coef, cov, scale, measured = flat._line()
    assert coef[1] == 0.0 and coef[0] == pytest.approx(2.0) and not measured
    assert 0 < math.sqrt(scale) < 0.05, "without per-step losses the noise is the reference's scatter"


def judge_growth(interval_s, excess, steps_per_s=50, static_s=60.0, grown_s=120.0, noise=0.05, seed=0):
    """A GrowthCheck fed `static_s` seconds at the initial batch, then up to `grown_s` seconds grown,
    in intervals of `interval_s` seconds of per-step losses: the static curve 2 - 0.3 log(1 + t) plus
    `excess(seconds grown)` after the growth, each step with noise of sd `noise`. Returns the check and
    the training seconds of its verdict (NaN: none)."""
    rng = np.random.default_rng(seed)
    check, t, verdict_at = GrowthCheck(), 0.0, math.nan
    n = max(int(round(interval_s * steps_per_s)), 1)
    while t < static_s + grown_s and math.isnan(verdict_at):
        grown = t >= static_s
        ts = t + (np.arange(n) + 0.5) / steps_per_s
        losses = 2.0 - 0.3 * np.log1p(ts) + rng.normal(0.0, noise, n)
        if grown:
            losses += excess(ts - static_s)
        check.observe([report(0, 96 if grown else 64, n, interval_s / n, float(losses.mean()))],
                      128 if grown else 64, 64, losses.tolist())
        t += interval_s
        if check.banned or check.accepted:
            verdict_at = t
    return check, verdict_at


@pytest.mark.parametrize("interval_s", [0.25, 1.0, 4.0, 15.0])
def test_a_growth_that_falls_behind_slowly_is_returned_whatever_the_interval_length(interval_s):
    """A larger batch that keeps pace at first and falls behind by 0.002 a second (half a per-step noise
    sd after 12 s): returned within the judged span at every cadence, not accepted after a few short
    intervals; one that is a little ahead throughout is accepted at every cadence, after about the same
    training time."""
    behind, at = judge_growth(interval_s, lambda s: 0.002 * s)
    assert behind.banned and not behind.accepted, (interval_s, behind.last)
    ahead, accepted_at = judge_growth(interval_s, lambda s: -0.01 + 0 * s)
    assert ahead.accepted and not ahead.banned, (interval_s, ahead.last)
    # judged for half the reference's span (the last half of 60 s), and at least 1 + 3 intervals
    assert 60.0 + 15.0 <= accepted_at <= 60.0 + max(15.0 + 3 * interval_s, 4 * interval_s) + 4, accepted_at


@pytest.mark.parametrize("interval_s", [0.25, 1.0, 4.0])
def test_a_growth_level_with_the_static_batch_is_kept_in_most_seeds(interval_s):
    """No difference at all after the growth: few false returns (the looks are spaced in judged time,
    so short intervals do not buy more chances to fail on noise)."""
    banned = sum(judge_growth(interval_s, lambda s: 0 * s, seed=seed)[0].banned for seed in range(40))
    assert banned <= 3, banned


def test_the_variance_of_an_interval_mean_comes_from_its_steps():
    from dynamix_hvd.control.growth import mean_variance

    rng = np.random.default_rng(3)
    x = 1.0 - 0.001 * np.arange(400) + rng.normal(0.0, 0.1, 400)  # a trend under noise of sd 0.1
    assert mean_variance(x) == pytest.approx(0.01 / 400, rel=0.2)
    assert math.isnan(mean_variance([1.0, math.nan, 2.0])) and math.isnan(mean_variance(None))


def test_the_checks_settings_come_from_the_proposal_config_and_survive_a_reset():
    cfg = ProposalConfig(growth=GrowthConfig(z=3.5, settle=2), split=SplitConfig(keep=0.25, max_margin=0.5))
    policy = ModelPolicy(cfg)
    for _ in range(2):
        assert (policy.check.z, policy.check.settle) == (3.5, 2)
        assert (policy.split_check.keep, policy.split_check.max_margin) == (0.25, 0.5)
        assert "config" not in policy.check.state_dict() and "keep" not in policy.split_check.state_dict()
        policy.reset_world(3)
    assert ModelPolicy().check.config == GrowthConfig() and ModelPolicy().split_check.config == SplitConfig()


def test_an_older_growth_check_state_loads_with_unknown_noise_and_is_judged_mid_growth():
    old = {"window": 4, "settle": 1, "judged": 3, "z": 2.0, "min_rel": 0.005, "elapsed_s": 3.5,
           "reference": [[1.0, 2.0], [2.0, 1.9], [3.0, 1.85]], "grown_for": 1, "verdicts": 0,
           "banned": False, "accepted": False, "last": {}}  # a checkpoint of the interval-counting check
    check = GrowthCheck()
    check.load_state_dict(old)
    assert check.ready and check.judging and all(math.isnan(p[2]) for p in check.reference)
    assert check.z == GrowthCheck().z, "settings are the job's: an older checkpoint's z is not restored"
    for k in range(6):  # far above the reference's line: judged, and returned
        check.observe([report(0, 96, 10, 0.1, 2.5)], 128, 64)
    assert check.banned


def feed(check, t_s, losses, grown, n_steps=None):
    """One interval of `t_s` seconds with these per-step losses (at 128 when grown, else 64)."""
    losses = np.asarray(losses, dtype=float)
    n = n_steps or len(losses)
    check.observe([report(0, 96 if grown else 64, n, t_s / n, float(losses.mean()))], 128 if grown else 64, 64,
                  losses.tolist())


def test_a_judged_interval_with_too_few_steps_borrows_the_measured_noise():
    """A grown interval of two steps has no noise of its own: it is given the measured intervals' noise
    per second (not the weights' scale), so a clear excess still returns B."""
    rng = np.random.default_rng(0)
    check = GrowthCheck()
    for k in range(8):
        feed(check, 1.0, 2.0 - 0.05 * k + rng.normal(0, 0.05, 50), False)
    for _ in range(6):
        feed(check, 1.0, [2.0, 2.0], True, n_steps=2)
    assert check.banned and check.last["tolerance"] < 0.2, check.last


def test_an_episode_ends_when_b_returns_and_a_new_one_is_judged_afresh():
    rng = np.random.default_rng(1)
    check = GrowthCheck()
    for k in range(8):
        feed(check, 1.0, 2.0 - 0.02 * k + rng.normal(0, 0.05, 50), False)
    feed(check, 1.0, 1.8 + rng.normal(0, 0.05, 50), True)
    assert check.judging and check.grown_for == 1
    feed(check, 1.0, 1.8 + rng.normal(0, 0.05, 50), False)  # the proposal took B back itself
    assert not check.judging and check.trial == [] and check.next_look == 0.0 and math.isnan(check.grown_at_s)
    feed(check, 1.0, 1.8 + rng.normal(0, 0.05, 50), True)
    assert check.judging and check.grown_at_s == pytest.approx(10.0)


def test_a_reference_of_many_short_intervals_keeps_its_span_by_merging():
    rng = np.random.default_rng(2)
    check = GrowthCheck(GrowthConfig(max_reference=16))
    for k in range(400):
        feed(check, 0.25, 2.0 - 0.001 * k + rng.normal(0, 0.05, 10), False)
    assert len(check.reference) == 16
    assert check.reference_span() == pytest.approx(50.0, abs=3.5), "the latest half of 100 s (to a bin of ~3 s)"
    assert sum(p[3] for p in check.reference) == pytest.approx(check.reference_span(), abs=0.3)


def test_many_short_judged_intervals_are_merged_and_still_judged():
    rng = np.random.default_rng(4)
    check = GrowthCheck(GrowthConfig(max_reference=8, judged=0))  # judged=0: the span alone decides
    for k in range(40):
        feed(check, 1.0, 2.0 - 0.01 * k + rng.normal(0, 0.05, 50), False)
    for _ in range(400):
        if check.accepted or check.banned:
            break
        feed(check, 0.05, 1.5 + rng.normal(0, 0.05, 3), True)
    assert len(check.trial) <= 8 and check.accepted, (len(check.trial), check.last)
    assert check.verdict_intervals > 8


def test_b_holds_while_a_growth_is_judged():
    """Communication-bound ranks make a larger B pay by the model; the proposal grows B once and then
    holds it until the check has accepted the growth (one change at a time)."""
    def loss(t, B):
        return 2.0 - 0.3 * math.log(1 + t) - (0.05 if B > 128 else 0.0)

    policy = ModelPolicy()
    hist = run(policy, a=[0.0, 0.0], c=[1e-4, 1e-4], net=0.05, loss=loss, decisions=20)
    totals = [sum(s) for s in hist]
    first = next(k for k, t in enumerate(totals) if t > 128)
    assert totals[first + 1] == totals[first], totals  # judged at the first grown B
    assert policy.check.accepted and max(totals) > totals[first], totals  # then free to grow


def _paying_growth(left=None, decisions=20, noise=1e6, **config):
    """Communication-bound ranks (a larger B pays by the model) whose loss is level with the initial
    batch's curve; the global batches chosen and each decision's info."""
    def loss(t, B):
        return 2.0 - 0.3 * math.log(1 + t)

    infos: list = []
    policy = ModelPolicy(ProposalConfig(**config))
    hist = run(policy, a=[0.0, 0.0], c=[1e-4, 1e-4], net=0.05, loss=loss, decisions=decisions, left=left,
               infos=infos, noise=noise)
    return [sum(s) for s in hist], infos, policy


def test_a_growth_whose_verdict_cannot_come_before_the_budget_ends_does_not_start():
    """The same job grows B with a long budget (or none) and keeps the initial batch where the budget
    ends before the growth check could judge a growth (the check needs the settling time and half the
    reference's span, at least three intervals); a growth started in time is judged and, accepted,
    grows on as without a budget."""
    free, _, _ = _paying_growth()
    long, _, _ = _paying_growth(left=lambda k: 1 - (k + 1) / 400)
    assert max(free) > 128 and long == free, (free, long)
    # the reference exists from the fourth decision; with six in the budget two are left: too few
    short, infos, policy = _paying_growth(left=lambda k: max(0.0, 1 - (k + 1) / 6), decisions=8)
    assert short == [128] * 8, short
    assert any(i.get("growth_late") for i in infos) and not policy.check.banned, infos
    in_time, _, policy = _paying_growth(left=lambda k: 1 - (k + 1) / 24)
    assert in_time == free and policy.check.accepted, (free, in_time)


def _late_case(predicted_gain: float, budget_intervals: int, noise: float = math.inf) -> bool:
    """A growth check fed 20 intervals of 1 s at the initial batch of 128 while the budget of
    `budget_intervals` such intervals is spent (8 left after them at 28), asked whether a growth to 256
    predicted to raise goodput by `predicted_gain`x starts too late (the step of 256 predicted as long
    as the measured one, so intervals stay 1 s: the verdict needs 1 + 5 s)."""
    policy = ModelPolicy()
    for k in range(20):
        reports = [report(0, 64, 100, 0.01, 2.0 - 0.01 * k), report(1, 64, 100, 0.01, 2.0 - 0.01 * k)]
        policy.check.observe(reports, 128, 128, None, 1 - (k + 1) / budget_intervals)
    policy.last = Proposal([128, 128], 256, 0.01, 1000.0 * predicted_gain, 1000.0, 128, True, False, noise, 64,
                           256)
    ctx = GlobalContext(global_batch=128, initial_batch=128, noise_scale=noise, efficiency=1.0, loss_trend=0.0,
                        progress=0.5, world_size=2)
    inp = DecisionInput(torch.zeros(3, OBS_DIM), reports, ctx, [64, 64], BatchBounds(2, 1, 4096), None,
                        noise_lower=noise, noise_point=noise, budget_left=1 - 20 / budget_intervals)
    return policy._growth_too_late(inp)


def test_the_time_left_is_shortened_by_the_predicted_throughput_gain():
    """8 s left at the rate so far against a verdict that needs 6 s: in time at the same throughput,
    too late where the larger batch is predicted to run 2x the samples per second (4 s left), in time
    again with 5 more intervals in the budget (6.5 s). The throughput gain is the goodput gain over
    the efficiency lost: with 11 s left, a 1.5x goodput gain at E(256) / E(128) = 0.75 (noise scale
    256) is 2x the samples (5.5 s left: too late), at E = 1 1.5x (7.3 s: in time)."""
    assert not _late_case(1.0, 28)
    assert _late_case(2.0, 28)
    assert not _late_case(2.0, 33)
    assert _late_case(1.5, 31, noise=256.0) and not _late_case(1.5, 31)


def test_the_verdict_time_is_the_settling_and_the_judged_time_and_the_budget_counts_from_the_checks_start():
    check = GrowthCheck()
    for k in range(20):  # 20 intervals of 1 s at the initial batch: the reference spans the latest 10 s
        check.observe([report(0, 64, 3, 1.0 / 3, 2.0 - 0.01 * k)], 64, 64, None, 1 - (k + 11) / 40)
    assert check.reference_span() == pytest.approx(10.0) and check.typical_interval_s() == pytest.approx(1.0)
    # settle: max(1 interval, 5% of 20 s) = 1 s; judged: max(half the span, 3 intervals) = 5 s
    assert check.verdict_seconds() == pytest.approx(1.0 + 5.0)
    assert check.verdict_seconds(4.0) == pytest.approx(4.0 + 12.0)  # long intervals: 1 + 3 of them
    assert check.verdict_seconds(math.nan) == pytest.approx(1.0 + 5.0)
    # a check that started with a quarter of the budget spent: 19 s spent 19 of the 40 intervals'
    # budget since, so the 10 left hold 10 s (not 20 s x 10 / 30)
    assert check.seconds_left(10 / 40) == pytest.approx(10.0)
    assert math.isnan(check.seconds_left(math.nan)) and check.seconds_left(0.0) == 0.0
    again = GrowthCheck()
    again.load_state_dict(check.state_dict())
    assert again.budget_origin == check.budget_origin and again.seconds_left(10 / 40) == pytest.approx(10.0)


def test_a_budget_keeps_b_where_a_larger_batch_would_cost_the_jobs_end():
    """At a noise scale of 512 a larger batch pays per second (the job is communication-bound) but
    loses progress per sample: without a budget B grows to 512 (E = 0.62); with one, B stays where
    (1 - E(B)) x the budget still to run is at most 5% (E >= 0.95 at the start: B <= 161), and the
    cap loosens as the budget is spent (E >= 0.9 with half left: B <= 199). The growth to the cap is
    judged and accepted like any other."""
    free, _, _ = _paying_growth(noise=512.0)
    assert max(free) == 512, free
    left = lambda k: 1 - k / 20  # noqa: E731
    capped, infos, policy = _paying_growth(left=left, noise=512.0)
    for k in range(16):  # (later the cap is loose: the budget left nears 5%)
        cap = math.floor((512 + 128) / (1 - 0.05 / left(k)) - 512)
        assert infos[k]["budget_cap"] in (cap, None) and capped[k] <= cap, (k, capped[k], infos[k]["budget_cap"], cap)
    assert infos[0]["budget_cap"] == 161 and infos[10]["budget_cap"] == 199
    assert max(capped[:12]) == 165 and all(c <= f for c, f in zip(capped, free)), (capped, free)
    assert policy.check.accepted and not policy.check.banned


def test_budget_loss_one_is_goodput_alone_and_zero_keeps_the_initial_batch():
    left = lambda k: 1 - k / 20  # noqa: E731
    free, _, _ = _paying_growth(noise=512.0)
    assert _paying_growth(left=left, noise=512.0, budget_loss=1.0)[0] == free
    kept, infos, _ = _paying_growth(left=left, noise=512.0, budget_loss=0.0)
    assert kept == [128] * 20 and all(i["budget_cap"] in (128, None) for i in infos), kept


def test_a_grown_batch_comes_back_to_the_cap_when_the_noise_scale_falls():
    """B grew while the noise scale was large (no cap binds) and the growth was accepted; when the
    estimate falls to 512 with most of the budget left, B returns to the largest batch that costs the
    budget's end at most 5%, in one decision (a growth is not being judged then)."""
    noise = lambda k: 1e6 if k < 14 else 512.0  # noqa: E731
    left = lambda k: 1 - k / 400  # noqa: E731
    hist, infos, policy = _paying_growth(left=left, noise=noise)
    assert policy.check.accepted and hist[13] > 300, hist
    cap = math.floor((512 + 128) / (1 - 0.05 / left(14)) - 512)
    assert hist[14] == cap and all(B <= cap + 1 for B in hist[14:]), (hist, cap)


def test_the_budget_cap_waits_while_a_growth_is_judged():
    """A growth that started before the noise estimate fell is judged at its own batch: the cap does
    not cut it mid-check (its verdict would compare two batches)."""
    _, infos, policy = _paying_growth(noise=1e6)
    grown = next(k for k, i in enumerate(infos) if i.get("target_global_batch", 128) > 128)
    noise = lambda k: 1e6 if k <= grown else 512.0  # noqa: E731
    hist, infos, policy = _paying_growth(left=lambda k: 1 - k / 400, noise=noise)
    assert hist[grown + 1] == hist[grown] > 161 and infos[grown + 1]["budget_cap"] is None, (grown, hist)


def test_a_cap_just_below_the_batch_does_not_move_it():
    """The noise scale's bound moves between decisions: a cap that falls below B by less than the
    hysteresis keeps B; one that falls further brings B down to it."""
    noise = lambda k: 512.0 if k < 10 else 490.0 if k < 15 else 300.0  # noqa: E731
    left = lambda k: 1 - k / 400  # noqa: E731
    hist, infos, _ = _paying_growth(left=left, noise=noise)
    assert hist[9] > 128 and hist[10:15] == [hist[9]] * 5, hist
    assert all(i["budget_cap"] == hist[9] for i in infos[10:15]), [i["budget_cap"] for i in infos[10:15]]
    cap = math.floor((300 + 128) / (1 - 0.05 / left(15)) - 300)
    assert hist[15] == cap < hist[9] / 1.05, (hist, cap)


def test_the_late_rule_and_the_cap_are_recorded_apart():
    """Where the late-growth rule holds B, the decision still records the budget's own cap."""
    short, infos, _ = _paying_growth(left=lambda k: max(0.0, 1 - (k + 1) / 6), decisions=8)
    late = [i for i in infos if i.get("growth_late")]
    assert late and all(i["budget_cap"] is None or i["budget_cap"] > 128 for i in late), late


@pytest.mark.parametrize("falls_at", range(12, 18))
def test_a_split_leaves_neutral_only_at_a_batch_the_cap_does_not_move(falls_at):
    """B grew on a paying job; rank 1 turns 3x slower at decision 12 and the noise scale falls (the
    budget's cap drops below B) at `falls_at`. Wherever the split leaves the neutral split, B holds
    in that decision (one change at a time: the split check compares steps at one batch); where the
    cap falls in the decision the split would leave (13), B comes down first and the split follows."""
    def loss(t, B):
        return 2.0 - 0.3 * math.log(1 + t)

    noise = lambda k: 1e6 if k < falls_at else 512.0  # noqa: E731
    hist = run(ModelPolicy(), a=[0.0, 0.0], c=[1e-4, 1e-4], net=0.05, loss=loss, decisions=22,
               left=lambda k: 1 - k / 400, noise=noise, change=(12, [0.0, 0.0], [1e-4, 3e-4]))
    leaves = [k for k in range(1, len(hist)) if hist[k - 1][0] == hist[k - 1][1] and hist[k][0] != hist[k][1]]
    assert leaves and all(sum(hist[k]) == sum(hist[k - 1]) for k in leaves), (leaves, hist)
    assert sum(hist[-1]) < 200, hist  # the cap holds B near 162 in the end
    if falls_at == 13:
        assert sum(hist[13]) < sum(hist[12]) and hist[13][0] == hist[13][1] and leaves == [14], hist
