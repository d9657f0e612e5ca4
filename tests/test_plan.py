"""Epoch plans and the adaptive loader in one process (the multi-process checks are in *_mpi.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from dynamix_hvd.data.loader import AdaptiveLoader
from dynamix_hvd.data.plan import epoch_permutation, plan_steps, split_proportional, validate_batch_sizes

sizes_st = st.lists(st.integers(1, 40), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, extra=st.integers(0, 500), policy=st.sampled_from(["partial", "drop"]))
def test_plan_covers_epoch_exactly(sizes, extra, policy):
    n = len(sizes) + extra
    steps = plan_steps(n, 0, sizes, policy)
    covered = sum(s.global_count for s in steps)
    if policy == "partial":
        assert covered == n
    else:
        assert covered == n - n % sum(sizes)
        assert all(s.counts == tuple(sizes) for s in steps)
    pos = 0
    for s in steps:
        assert s.start == pos and min(s.counts) >= 1
        pos = s.end


@settings(max_examples=200, deadline=None)
@given(a=sizes_st, b_seed=st.integers(0, 10**6), extra=st.integers(0, 300), cut=st.integers(0, 50))
def test_mid_epoch_change_loses_nothing(a, b_seed, extra, cut):
    n = len(a) + extra
    g = torch.Generator().manual_seed(b_seed)
    b = torch.randint(1, 30, (len(a),), generator=g).tolist()
    first = plan_steps(n, 0, a)
    cut = min(cut, len(first))
    cursor = first[cut - 1].end if cut else 0
    rest = plan_steps(n, cursor, b)
    assert sum(s.global_count for s in first[:cut]) + sum(s.global_count for s in rest) == n


def test_split_proportional_is_proportional_and_exact():
    assert split_proportional(22, [3, 7, 12]) == (3, 7, 12)
    assert split_proportional(11, [3, 7, 12]) == (2, 3, 6)
    assert sum(split_proportional(5, [1, 1, 100])) == 5
    with pytest.raises(ValueError, match="cannot split 2 samples over 3 ranks"):
        split_proportional(2, [1, 2, 3])


def test_last_partial_step_folds_when_fewer_samples_than_ranks():
    steps = plan_steps(24, 0, [3, 7, 12])  # 24 = 22 + 2 left over, fewer than 3 ranks
    assert [s.global_count for s in steps] == [24]
    assert min(steps[0].counts) >= 3


def test_permutation_is_deterministic_and_changes_per_epoch():
    assert torch.equal(epoch_permutation(50, 1, 2), epoch_permutation(50, 1, 2))
    assert not torch.equal(epoch_permutation(50, 1, 2), epoch_permutation(50, 1, 3))
    assert torch.equal(epoch_permutation(50, 1, 2, shuffle=False), torch.arange(50))


@pytest.mark.parametrize("bad, message", [
    ([3, 0, 2], "batch size of rank 1 is 0"),
    ([3, 2.5], "batch size of rank 1 is 2.5"),
    ([True], "batch size of rank 0 is True"),
    ([], "batch_sizes is empty"),
])
def test_bad_batch_sizes_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        validate_batch_sizes(bad)


def test_wrong_world_size_is_named():
    with pytest.raises(ValueError, match=r"got 2 batch sizes \[1, 2\] for a world of 3 ranks"):
        validate_batch_sizes([1, 2], world_size=3)


def _loaders(n, sizes, **kw):
    data = TensorDataset(torch.arange(n))
    return [AdaptiveLoader(data, sizes, r, seed=9, **kw) for r in range(len(sizes))]


def _run_epoch(loaders, change_at=None, new_sizes=None):
    """Drive all ranks' loaders in lockstep, as synchronous training would."""
    seen = []
    iters = [iter(ld) for ld in loaders]
    step = 0
    while True:
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            return seen, step
        assert all(b is not None for b in batches), "ranks ran different numbers of steps"
        seen += [i for (x,) in batches for i in x.tolist()]
        if step == change_at:
            for ld in loaders:
                ld.set_batch_sizes(new_sizes)
        step += 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_mid_epoch_change_with_workers(num_workers):
    loaders = _loaders(203, [3, 7, 12], num_workers=num_workers)
    seen, steps = _run_epoch(loaders, change_at=3, new_sizes=[20, 1, 5])
    assert sorted(seen) == list(range(203))
    assert steps == 4 + len(range(4 * 22, 203, 26))


def test_loader_resumes_mid_epoch_from_state_dict_on_a_new_world():
    loaders = _loaders(100, [4, 6])
    iters = [iter(ld) for ld in loaders]
    seen = []
    for _ in range(3):
        seen += [i for it in iters for i in next(it)[0].tolist()]
    state = loaders[0].state_dict()
    data = TensorDataset(torch.arange(100))
    resumed = [AdaptiveLoader(data, [1, 1, 1], r, seed=0) for r in range(3)]
    for ld in resumed:
        ld.load_state_dict(state, batch_sizes=[5, 5, 5])
    rest, _ = _run_epoch(resumed)
    assert sorted(seen + rest) == list(range(100))


def _logged(calls: list, names: str = "ab", sizes=(2, 3)) -> AdaptiveLoader:
    ld = AdaptiveLoader(TensorDataset(torch.arange(10.0)), list(sizes), 0, seed=1)
    for name in names:
        ld.step_end_callbacks.append(lambda loader, end, name=name: calls.append((name, loader.step, end)))
    return ld


def test_a_step_saved_before_it_ended_ends_after_the_restore():
    """A state taken in the loop body (before the step-end callbacks ran) resumes with the rest of
    them, epoch end included; one taken inside a callback resumes after that callback."""
    calls, states = [], []
    for _ in (ld := _logged(calls)):
        states.append(ld.state_dict())
    assert calls == [("a", 1, False), ("b", 1, False), ("a", 2, True), ("b", 2, True)]
    assert [s["step_ends_started"] for s in states] == [0, 0] and ld.state_dict()["step_ends_started"] is None
    older = {k: v for k, v in states[1].items() if k != "step_ends_started"}  # nothing to run: as before
    for state, want in ((states[0], calls), (states[1], calls[2:]), ({**states[1], "step_ends_started": 1}, calls[3:]),
                        (older, [])):
        got = []
        again = _logged(got)
        again.load_state_dict(state)
        again.set_epoch(0)
        for _ in again:
            pass
        assert got == want, (state, got)
    got = []
    moved = _logged(got)
    moved.load_state_dict(states[1])
    moved.set_epoch(1)  # leaving the restored epoch ends its step first
    assert got == calls[2:] and moved.epoch == 1 and moved.step == 0


def test_step_tracker_state_holds_the_undrained_records():
    from dynamix_hvd.data.metrics import StepTracker

    tracker = StepTracker(rank=1)
    for step in range(3):
        tracker.batch_ready(0, step, 4, 10)
        tracker.step_started()
        tracker.synchronized()
        tracker.step_finished(local_grad_sq=0.5 + step, status="oom" if step == 1 else "ok")
        if step == 0:
            tracker.drain()
    again = StepTracker(rank=1)
    again.load_state_dict(tracker.state_dict())
    assert again.drain() == tracker.drain() and len(again.records) == 0


def test_loader_refuses_its_own_sampler_arguments():
    with pytest.raises(ValueError, match="do not pass batch_size=32"):
        AdaptiveLoader(TensorDataset(torch.arange(10)), [2, 2], 0, batch_size=32)
    with pytest.raises(ValueError, match="rank 2 outside a world of 2 ranks"):
        AdaptiveLoader(TensorDataset(torch.arange(10)), [2, 2], 2)


# --- variable-length samples ----------------------------------------------------------------------

from dynamix_hvd.data.plan import plan_token_steps, sortish_order, token_cumsum, validate_lengths  # noqa: E402


def _lengths(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("budgets", [(300, 700), (1, 1, 1), (5000, 200, 900), (10**6,)])
@pytest.mark.parametrize("cursor", [0, 37])
def test_token_plan_covers_the_rest_of_the_epoch_once_within_budgets(budgets, cursor):
    lengths = _lengths(500)
    cum = token_cumsum(lengths)
    steps = plan_token_steps(cum, cursor, budgets)
    pos = cursor
    for k, s in enumerate(steps):
        assert s.start == pos and min(s.counts) >= 1
        assert list(s.tokens) == [cum[a + b] - cum[a] for a, b in
                                  zip([s.start + sum(s.counts[:r]) for r in range(len(budgets))], s.counts)]
        if k < len(steps) - 1:  # greedy: within budget unless one sample alone exceeds it
            assert all(t <= b or c == 1 for t, b, c in zip(s.tokens, budgets, s.counts))
        pos = s.end
    assert pos == 500
    dropped = plan_token_steps(cum, cursor, budgets, "drop")
    # the same steps up to the end, where "partial" may have folded a remainder into its last one
    assert dropped[:-1] == steps[:len(dropped) - 1] and len(dropped) >= len(steps) - 1
    assert all(sum(s.tokens) <= sum(budgets) or max(s.counts) == 1 for s in dropped)


def test_sortish_order_is_a_permutation_that_cuts_padding():
    lengths = _lengths(4096, seed=3)
    order = torch.randperm(4096, generator=torch.Generator().manual_seed(1))
    sorted_order = sortish_order(order, lengths, 512, seed=0, epoch=0)
    assert sorted(sorted_order.tolist()) == list(range(4096))
    assert torch.equal(sorted_order, sortish_order(order, lengths, 512, seed=0, epoch=0))

    def padding(o: torch.Tensor) -> float:
        batches = lengths[o].view(-1, 16)
        return 1 - batches.sum().item() / (batches.max(1).values.sum().item() * 16)
    assert padding(sorted_order) < 0.1 < 0.3 < padding(order)


@pytest.mark.parametrize("bad, match", [([3, 0, 2], "sample 1 has length 0"), ([1.5, 2, 2], "dtype"),
                                        ([1, 2], "one token count per sample"), ("abc", "lengths")])
def test_bad_lengths_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        validate_lengths(bad, 3)


def test_loader_budget_arguments_are_checked():
    data = list(range(10))
    with pytest.raises(ValueError, match="budget='tokens' needs lengths"):
        AdaptiveLoader(data, [5, 5], 0, budget="tokens")
    with pytest.raises(ValueError, match="budget='bytes'"):
        AdaptiveLoader(data, [5, 5], 0, budget="bytes")
    with pytest.raises(ValueError, match="sort_window=-1"):
        AdaptiveLoader(data, [5, 5], 0, lengths=[1] * 10, sort_window=-1)
    with pytest.raises(ValueError, match="sort_window=8 sorts by length"):
        AdaptiveLoader(data, [5, 5], 0, sort_window=8)
    loader = AdaptiveLoader(data, [7, 9], 1, lengths=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], budget="tokens")
    assert loader.epoch_size == 55 and loader.global_micro_batch == 16
    seen = [i for batch in loader for i in batch.tolist()]
    assert len(seen) == len(loader.tracker.records) or seen  # iterates


def test_epochs_done_counts_the_samples_handed_out_as_the_step_end_callbacks_see_them():
    """What the controller's decisions read for the budget still to run: the epoch plus the share of
    its samples handed out, at every step's end (the epoch's end counts as the next epoch's start)."""
    ld = AdaptiveLoader(TensorDataset(torch.arange(10.0)), [2, 3], 0, seed=1)
    seen = []
    ld.step_end_callbacks.append(lambda loader, end: seen.append(loader.epochs_done))
    assert ld.epochs_done == 0.0
    for epoch in range(2):
        ld.set_epoch(epoch)
        for _ in ld:
            pass
    assert seen == pytest.approx([0.5, 1.0, 1.5, 2.0]) and ld.epochs_done == 2.0
