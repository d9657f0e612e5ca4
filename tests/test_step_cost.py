"""What a training step costs besides the model: caches that must recompute when sizes change, the
step records' columnar buffer, and the preemption vote's cadence by time (one process, no launcher)."""
from __future__ import annotations

import math
import random
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

import dynamix_hvd.data.loader as loader_module
from dynamix_hvd.data.loader import AdaptiveLoader
from dynamix_hvd.data.metrics import STEP_FIELDS, StepColumns, StepRecord, StepTracker
from dynamix_hvd.data.plan import plan_steps, plan_token_steps, token_cumsum, with_tokens
from dynamix_hvd.resilience import checkpoint
from dynamix_hvd.resilience.checkpoint import Checkpointer, next_vote_interval


def _counting(monkeypatch, name: str) -> list[int]:
    """Count the loader's calls of the planning function `name`."""
    calls = [0]
    original = getattr(loader_module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(loader_module, name, counted)
    return calls


def _fresh(loader: AdaptiveLoader) -> list:
    """The rest of the epoch planned from scratch, as the loader planned it before it cached."""
    order, cum = loader._epoch_order()
    if loader.budget == "tokens":
        return plan_token_steps(cum, loader._cursor, loader.batch_sizes, loader.last_step)
    steps = plan_steps(loader.num_samples, loader._cursor, loader.batch_sizes, loader.last_step)
    return steps if cum is None else with_tokens(steps, cum)


# --- the plan: a replan only when the epoch or the sizes change ------------------------------------------
@pytest.mark.parametrize("last_step", ["partial", "drop"])
@pytest.mark.parametrize("tokens", [False, True])
def test_a_plan_from_any_later_step_start_is_the_rest_of_the_plan(last_step, tokens):
    # What the loader's plan cache relies on: planning is greedy from the cursor, so the plan from a
    # planned step's start is the tail of the plan from the epoch's start (the folded last step too).
    rng = random.Random(1)
    for _ in range(40):
        world = rng.randint(1, 4)
        n = rng.randint(world, 90)
        sizes = [rng.randint(1, 9) * (5 if tokens else 1) for _ in range(world)]
        if tokens:
            cum = token_cumsum(torch.tensor([rng.randint(1, 12) for _ in range(n)]))
            plan = lambda c: plan_token_steps(cum, c, sizes, last_step)  # noqa: E731
        else:
            plan = lambda c: plan_steps(n, c, sizes, last_step)  # noqa: E731
        whole = plan(0)
        for i, step in enumerate(whole):
            assert plan(step.start) == whole[i:], (n, sizes, i)


@pytest.mark.parametrize("tokens", [False, True])
def test_should_step_and_len_read_the_plan_once_per_epoch_and_replan_when_sizes_change(monkeypatch, tokens):
    name = "plan_token_steps" if tokens else "plan_steps"
    n = 103
    lengths = [1 + (7 * i) % 13 for i in range(n)] if tokens else None
    loader = AdaptiveLoader(TensorDataset(torch.arange(n)), [30, 50] if tokens else [3, 5], 0, lengths=lengths,
                            budget="tokens" if tokens else "samples")
    calls = _counting(monkeypatch, name)
    loader.set_epoch(1)
    seen, lens = [], []
    for step, _ in enumerate(loader):
        # what the optimizer's should_step(), the cadence and the progress display read at every step
        assert loader.remaining_steps() == _fresh(loader)
        assert loader.steps_left == len(_fresh(loader))
        lens.append(len(loader))
        seen.append(step)
    assert calls[0] == 1, f"{calls[0]} plans for one epoch of {len(seen)} steps"
    assert len(set(lens)) == 1 and lens[0] == len(seen)
    # new sizes mid-epoch: one new plan from the cursor, then reads again
    loader.set_epoch(2)
    calls[0] = 0
    for step, _ in enumerate(loader):
        if step == 2:
            loader.set_batch_sizes([60, 20] if tokens else [6, 2])
        assert loader.remaining_steps() == _fresh(loader)
    assert calls[0] == 2
    # the same sizes again change nothing; a rewound step (redo_current_step) and a restored state replan
    loader.set_epoch(3)
    calls[0] = 0
    it = iter(loader)
    next(it)
    next(it)
    loader.set_batch_sizes(list(loader.batch_sizes))
    assert loader.steps_left == len(_fresh(loader)) and calls[0] == 1
    loader.redo_current_step([2, 7] if not tokens else [20, 70])
    assert loader.remaining_steps() == _fresh(loader) and calls[0] == 2
    state = loader.state_dict()
    loader.load_state_dict(dict(state, cursor=state["cursor"] + 1))  # a cursor no plan has a step at
    assert loader.remaining_steps() == _fresh(loader) and calls[0] == 3


def test_epoch_size_with_token_budgets_is_summed_once_until_the_lengths_change(monkeypatch):
    lengths = torch.tensor([3, 5, 2, 7, 1, 4])
    loader = AdaptiveLoader(TensorDataset(torch.arange(6)), [8, 8], 1, lengths=lengths, budget="tokens")
    sums = [0]
    original = torch.Tensor.sum

    def counted(self, *args, **kwargs):
        sums[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", counted)
    assert [loader.epoch_size for _ in range(50)] == [22] * 50 and sums[0] <= 1
    before = sums[0]
    loader.lengths[0] += 10  # changed in place
    assert loader.epoch_size == 32 and loader.epoch_size == 32 and sums[0] == before + 1
    loader.lengths = torch.tensor([1, 1, 1, 1, 1, 1])  # replaced
    assert loader.epoch_size == 6 and sums[0] == before + 2
    samples = AdaptiveLoader(TensorDataset(torch.arange(6)), [2, 2], 0, lengths=lengths)
    assert samples.epoch_size == 6  # a loader planning by samples counts samples


# --- step records as columns -----------------------------------------------------------------------------
def _close_step(tracker: StepTracker, epoch: int, step: int, **extra) -> None:
    tracker.batch_requested()
    tracker.batch_ready(epoch, step, 4 + step, 10 + step, tokens=(7, 9), sq_tokens=3)
    tracker.step_started()
    tracker.synchronized()
    tracker.step_finished(**extra)


def test_step_records_grow_as_columns_and_read_back_as_records():
    tracker = StepTracker(rank=1, max_records=1000)
    for step in range(600):  # past the buffer's first capacity several times
        _close_step(tracker, step // 100, step, lr=0.5 * step, local_grad_sq=step + 0.25,
                    status="oom" if step == 7 else "ok")
    records = tracker.records
    assert len(records) == 600 and tracker.finished == 600
    last = records[-1]
    assert isinstance(last, StepRecord) and (last.epoch, last.step, last.rank) == (5, 599, 1)
    assert (last.local_batch, last.global_batch, last.local_tokens, last.global_tokens) == (603, 609, 9, 16)
    assert last.lr == 299.5 and last.local_grad_sq == 599.25 and last.status == "ok" and last.memory_kind == "rss"
    assert last.peak_memory_bytes > 0 and last.step_s >= 0 and math.isnan(last.device_compute_s)
    assert records[7].status == "oom" and records.values("status").count("oom") == 1
    # every field with the type a StepRecord gives it, in the record's order
    row = tracker.to_dicts()[7]
    assert list(row) == list(STEP_FIELDS) and repr(row) == repr(asdict(records[7]))  # NaN where a field was not set
    assert all(type(row[k]) is int for k in ("epoch", "step", "local_batch", "peak_memory_bytes", "micro_batches"))
    assert records.values("step") == list(range(600)) and records.column("lr")[2] == 1.0
    assert list(tracker.to_dataframe().columns) == list(STEP_FIELDS)
    with pytest.raises(TypeError, match="bogus"):
        _close_step(tracker, 0, 0, bogus=1.0)


def test_history_and_undrained_records_stay_bounded():
    tracker = StepTracker(rank=0, max_records=5)
    for step in range(23):
        _close_step(tracker, 0, step)
    assert tracker.records.values("step") == list(range(18, 23))
    assert tracker.drain().values("step") == list(range(18, 23))  # never more than the history holds
    for step in range(23, 26):
        _close_step(tracker, 0, step)
    drained = tracker.drain()
    assert isinstance(drained, StepColumns) and drained.values("step") == [23, 24, 25]
    assert len(tracker.drain()) == 0 and len(tracker.records) == 5


def test_undrained_records_survive_a_checkpoint_and_come_first():
    tracker = StepTracker(rank=1)
    for step in range(4):
        _close_step(tracker, 0, step, status="nonfinite" if step == 2 else "ok")
        if step == 0:
            tracker.drain()
    state = tracker.state_dict()
    assert [r["step"] for r in state["undrained"]] == [1, 2, 3] and state["undrained"][1]["status"] == "nonfinite"
    again = StepTracker(rank=1)
    again.load_state_dict(state)
    _close_step(again, 0, 4)
    drained = again.drain()
    assert drained.values("step") == [1, 2, 3, 4] and drained[1].status == "nonfinite"
    assert drained[:3] == tracker.drain() and len(again.records) == 1


# --- the preemption vote by time ------------------------------------------------------------------------
def test_the_next_vote_comes_after_the_interval_of_the_slowest_rank_at_most_doubling():
    assert next_vote_interval(1, [0.01, 0.02], 1.0) == 2          # doubling from the first vote
    assert next_vote_interval(64, [0.01, 0.02], 1.0) == 50        # 1 s of the slower rank's steps
    assert next_vote_interval(64, [0.003], 1.0) == 128
    assert next_vote_interval(1000, [0.003], 1.0) == 334
    assert next_vote_interval(8, [2.0], 1.0) == 1                  # steps longer than the interval: every step
    assert next_vote_interval(8, [0.0], 1.0) == 1 and next_vote_interval(8, [math.nan], 1.0) == 1
    assert next_vote_interval(1 << 22, [1e-9], 1e6) == checkpoint.MAX_VOTE_INTERVAL


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Channel:
    """One rank's control channel that records the votes; `others` is the other ranks' step time."""

    backend, rank = "test", 0

    def __init__(self, others: float) -> None:
        self.others, self.votes = others, []

    def allgather_object(self, obj, op):
        self.votes.append(op.name)
        return [obj, (False, self.others)]

    def any_true(self, flag, op):
        self.votes.append(op.name)
        return bool(flag)


def _voting(tmp_path, monkeypatch, others: float, **kwargs):
    clock = _Clock()
    monkeypatch.setattr(checkpoint, "time", clock)
    loader = AdaptiveLoader(TensorDataset(torch.arange(100_000)), [5, 5], 0)
    optimizer = SimpleNamespace(backward_passes_per_step=1)
    channel = _Channel(others)
    ckpt = Checkpointer(tmp_path, torch.nn.Linear(1, 1), optimizer, loader, channel=channel, **kwargs)
    return clock, loader, optimizer, channel, ckpt


def test_votes_by_time_come_about_once_an_interval_counted_alike_on_every_rank(tmp_path, monkeypatch):
    clock, loader, optimizer, channel, ckpt = _voting(tmp_path, monkeypatch, others=0.02)

    def run(steps: range) -> list[int]:
        voted = []
        for k in steps:
            clock.now += 0.01  # this rank: 10 ms steps; the other rank: 20 ms, which sets the pace
            before = len(channel.votes)
            ckpt._on_step_end(loader, False)  # what the loader runs at every step's end, on every rank
            if len(channel.votes) > before:
                voted.append(k)
        return voted

    voted_at = run(range(1, 371))
    assert voted_at[:6] == [1, 3, 7, 15, 31, 63]   # the interval doubles up to...
    assert voted_at[6:] == [113, 163, 213, 263, 313, 363]   # ...1 s of the slower rank's steps
    assert channel.votes == ["dx.checkpoint.vote"] * len(voted_at) and ckpt.votes == len(voted_at)
    # a rank's batch doubles, so its steps will take up to twice as long: the interval halves at once
    loader.set_batch_sizes([10, 5])
    assert run(range(371, 395)) == [363 + 25]
    optimizer.backward_passes_per_step = 4  # four micro-batches per step from now on: a quarter
    assert run(range(395, 420)) == [388 + 50 // 4]
    loader.set_batch_sizes([5, 5])  # smaller batches keep the interval (which doubles again from 12)
    assert run(range(420, 460)) == [400 + 24]


def test_a_signal_is_acted_on_at_the_next_vote(tmp_path, monkeypatch):
    clock, loader, optimizer, channel, ckpt = _voting(tmp_path, monkeypatch, others=0.01, check_interval_s=0.05)
    saved = []
    monkeypatch.setattr(ckpt, "save", lambda: saved.append(ckpt.votes) or tmp_path / "step")
    for _ in range(20):
        clock.now += 0.01
        ckpt._on_step_end(loader, False)
    ckpt._on_signal(15, None)
    with pytest.raises(SystemExit) as stop:
        for k in range(1, 10):
            clock.now += 0.01
            ckpt._on_step_end(loader, False)
    assert stop.value.code == 143 and saved == [ckpt.votes] and k <= 5  # within 0.05 s of 10 ms steps


def test_every_k_steps_votes_exactly_then(tmp_path, monkeypatch):
    clock, loader, optimizer, channel, ckpt = _voting(tmp_path, monkeypatch, others=0.01, check_every=3)
    for _ in range(10):
        ckpt._on_step_end(loader, False)
    assert ckpt.votes == 3 and len(channel.votes) == 3


@pytest.mark.parametrize("kwargs, named", [
    ({"check_every": 0}, "check_every=0"), ({"check_every": 2.5}, "check_every=2.5"),
    ({"check_interval_s": 0}, "check_interval_s=0"), ({"check_interval_s": math.inf}, "check_interval_s=inf"),
    ({"keep": 0}, "keep=0"), ({"exit_code": 300}, "exit_code=300"),
])
def test_bad_checkpointer_settings_are_refused_by_name(tmp_path, kwargs, named):
    with pytest.raises(ValueError, match=named):
        Checkpointer(tmp_path, None, None, None, **kwargs)
