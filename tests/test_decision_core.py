"""The decision core (dynamix_hvd.control.core): one object decides for the live controller and the
simulator. Replays of reports from the simulator and from a real mpirun job give the same decisions;
reports and decisions survive their float64 array form exactly; the array collectives work under
mpirun and horovodrun --gloo; state is plain; a plain optimizer is refused."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dynamix_hvd.control import wire
from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.config import ControllerConfig, make_core
from dynamix_hvd.control.core import DecisionCore, LayerMeans, RankInput, StepSeries
from dynamix_hvd.control.refine import PPOPolicy
from dynamix_hvd.control.policy_store import DEFAULT_POLICY, load_policy
from dynamix_hvd.control.state import RankReport
from bench.lab.simulator import ClusterSimulator
from launching import launch
from test_simulator import spec


def same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def sample_input(rank: int, steps: int = 4, layers: int = 3) -> RankInput:
    report = RankReport(rank=rank, local_batch=16 + rank, steps=steps, compute_s=0.01 * (rank + 1), sync_wait_s=1e-3,
                        data_wait_s=2e-4, step_s=0.0123, samples_per_s=1300.5, peak_memory_bytes=2**40 + 7,
                        mem_used_bytes=10**9, mem_total_bytes=2**53, cpu_util=0.7, gpu_util=math.nan,
                        net_bytes_per_s=1e6, tcp_retrans_per_s=0.0, loss_mean=math.nan if rank else 1.25,
                        local_grad_sq=2.5, global_grad_sq=1.5, max_batch=512)
    series = StepSeries([16 + rank] * steps, [1.0 + k / 7 for k in range(steps)], [0.5 + k for k in range(steps)],
                        [math.nan if k == 1 else 2.0 - k / 3 for k in range(steps)], "cuda" if rank else "rss",
                        [0.01 * (rank + 1) + 1e-4 * k for k in range(steps)], [2e-4] * steps,
                        [math.nan if rank == 2 else 1e-3 / (k + 1) for k in range(steps)], [1 + rank % 2] * steps,
                        [(16 + rank) * 150 * (k + 1) for k in range(steps)])
    means = LayerMeans([0.1 * (i + 1) for i in range(layers)], [0.01 * (i + 1) for i in range(layers)]) if layers else None
    return RankInput(report, series, means)


def test_reports_and_decisions_survive_the_array_form_exactly() -> None:
    for layers in (3, 0):
        inputs = [sample_input(r, layers=layers) for r in range(3)]
        rows = np.stack([wire.encode_report(i) for i in inputs])
        assert rows.shape == (3, wire.report_length(4, layers)) == (3, 25 + 9 * 4 + 2 * layers)
        back = wire.decode_reports(rows)
        assert all(same(a.to_dict(), b.to_dict()) for a, b in zip(inputs, back))
        assert all(type(b.report.peak_memory_bytes) is int and type(b.steps.local_batch[0]) is int for b in back)
    assert back[1].layers is None and back[1].steps.memory_kind == "cuda"
    with pytest.raises(ValueError, match="does not match its 60 values"):
        wire.decode_report(rows[0][:-1])
    assert same(wire.padded_losses([1.0, 2.0], 4), [1.0, 2.0, math.nan, math.nan])
    assert wire.padded_losses([1.0, 2.0, 3.0], 2) == [1.0, 2.0]
    assert back[1].steps.micro_batches == [2] * 4 and back[0].steps.micro_batches == [1] * 4
    assert back[1].steps.sq_tokens == [17 * 150 * (k + 1) for k in range(4)]
    sent = wire.encode_decision(7, 2, 1.375, [10, 20, 30], [8, 16, 32], passes=3, spacing=41, recheck=True,
                                ceiling=250, vote_every=9, noise_every=5)
    assert len(sent) == wire.decision_length(3) == 15
    assert wire.decode_decision(sent, 3) == {"decision": 7, "epoch": 2, "sizes": [10, 20, 30],
                                             "previous_sizes": [8, 16, 32], "lr_gain": 1.375, "passes": 3,
                                             "spacing": 41, "recheck": True, "ceiling": 250, "vote_every": 9,
                                             "noise_every": 5}
    plain = wire.decode_decision(wire.encode_decision(7, 2, 1.0, [1, 2, 3], [1, 2, 3]), 3)
    assert plain["recheck"] is False and plain["ceiling"] == 0 and plain["vote_every"] == 0
    assert plain["noise_every"] == 1
    with pytest.raises(ValueError, match="for 2 ranks has 13 values"):
        wire.decode_decision(sent, 2)
    short = [sample_input(0, steps=4), sample_input(1, steps=2)]  # rank 1 rejoined after an elastic reset
    ragged = wire.decode_reports([wire.encode_report(i) for i in short])
    assert [len(i.steps.local_batch) for i in ragged] == [4, 2]
    core = DecisionCore(2, 33, min_batch=1, max_batch=64)
    core.observe(ragged, [16, 17], 0)
    assert core.stats.steps == 2, "the first min(n) steps of every rank"
    with pytest.raises(ValueError, match="StepSeries.losses has 1 steps"):
        StepSeries([1, 2], [0.0, 0.0], [0.0, 0.0], [0.0])


def test_the_interval_loss_is_each_steps_sample_weighted_mean_over_ranks_that_had_one() -> None:
    """Per step: the mean of the ranks' finite losses weighted by their samples (a rank without a
    loss, with an infinite one or with no samples adds nothing; a step where no rank has one records
    none); ranks that recorded more steps than the others count up to the common length."""
    from dataclasses import replace
    inputs = [sample_input(r, steps=5 if r < 2 else 6, layers=0) for r in range(3)]
    losses = [[1.0, math.nan, 2.0, math.inf, math.nan],
              [4.0, 3.0, math.nan, 5.0, math.nan],
              [7.0, 9.0, 6.0, 1.0, math.nan, 8.0]]
    batches = [[10, 10, 10, 10, 10], [30, 30, 30, 30, 30], [0, 20, 20, 20, 20, 20]]
    inputs = [replace(i, steps=replace(i.steps, losses=l, local_batch=b)) for i, l, b in zip(inputs, losses, batches)]
    core = DecisionCore(3, 60)
    core._record_steps(inputs)
    expected = [(10 * 1 + 30 * 4) / 40, (30 * 3 + 20 * 9) / 50, (10 * 2 + 20 * 6) / 30, (30 * 5 + 20 * 1) / 50]
    assert list(core.stats.loss.window) == pytest.approx(expected, rel=1e-15)
    # the same per-step losses reach the policy (the growth check's noise), a step without one as NaN
    again = DecisionCore(3, 60)
    step_losses = again.policy_input(again.observe(inputs, [10, 30, 20], 0)).step_losses
    assert list(step_losses[:4]) == pytest.approx(expected, rel=1e-15) and math.isnan(step_losses[4])


def test_the_budget_still_to_run_reaches_the_policy() -> None:
    """From the epochs done (fractional where given, else the epoch) and `total_epochs`; unknown
    (NaN) without a budget."""
    inputs = [sample_input(r, steps=5, layers=0) for r in range(3)]
    with_budget = DecisionCore(3, 60, total_epochs=8)
    assert with_budget.policy_input(with_budget.observe(inputs, [20, 20, 20], 2, done=2.5)).budget_left == 1 - 2.5 / 8
    assert with_budget.policy_input(with_budget.observe(inputs, [20, 20, 20], 2)).budget_left == 1 - 2 / 8
    assert with_budget.policy_input(with_budget.observe(inputs, [20, 20, 20], 9, done=9.0)).budget_left == 0.0
    without = DecisionCore(3, 60)
    assert math.isnan(without.policy_input(without.observe(inputs, [20, 20, 20], 2, done=2.5)).budget_left)


def test_core_replays_the_simulators_reports_to_the_same_decisions() -> None:
    """The simulator runs on a decision core; a fresh core handed the same typed reports (through their
    array form, as rank 0 receives them) with the same policy decides the same sizes, gains and rewards."""
    learner = load_policy(DEFAULT_POLICY, ActionSpace())[0]
    sim = ClusterSimulator(spec(3, drift=[(0.3, 1, 2.0)]), seed=11)
    sim.reset()
    policy = PPOPolicy(learner, learn=False)
    logged = []
    for _ in range(15):
        out = policy.decide(sim.decision_input())
        gain = float(sim.stats.gain_at(sum(out.sizes)))
        gain = gain if math.isfinite(gain) and gain > 0 else 1.0
        logged.append((sim.inputs, list(sim.sizes), sim.epoch, sim.budget_done, out.sizes, gain, sim.last_reward,
                       sim.stats.noise_scale, list(sim.bounds.learned_max)))
        sim.step_sizes(out.sizes)
    s = sim.spec
    replay = DecisionCore(3, sum(s.initial_batch), PPOPolicy(learner, learn=False), min_batch=s.min_batch,
                          max_batch=s.max_batch, total_epochs=sim.total_epochs, fit_warmup=True)
    for t, (inputs, sizes, epoch, done, chosen, gain, reward, noise, bounds) in enumerate(logged):
        rows = np.stack([wire.encode_report(i) for i in inputs])
        d = replay.decide(wire.decode_reports(rows), sizes, epoch, done=done)
        assert d.index == t and d.sizes == chosen and d.previous_sizes == sizes and d.lr_gain == gain
        assert (d.reward is None) == (reward is None) and (reward is None or d.reward == reward.tolist())
        assert d.noise_scale == noise and replay.bounds.learned_max == bounds
    assert any(entry[3] != logged[0][1] for entry in logged), "the policy changed the sizes"


def test_adascale_gain_counts_every_micro_batch_over_the_tuned_base() -> None:
    """The gain is r at the samples of one optimizer step (passes x the new global batch) over the
    batch the LR was tuned for: r = (phi/B0 + 1) / (phi/B + 1) with phi = tr/|G|^2."""
    sim = ClusterSimulator(spec(2), seed=5)
    sim.reset()
    cfg = ControllerConfig(policy="static")
    plain, tuned = make_core(cfg, 2, sum(sim.sizes)), make_core(cfg, 2, sum(sim.sizes), base_batch=256)
    for _ in range(4):
        a = plain.decide(sim.inputs, list(sim.sizes), sim.epoch)
        b = tuned.decide(sim.inputs, list(sim.sizes), sim.epoch, passes=3)
        sim.step_sizes(a.sizes)
    phi, B = tuned.stats.noise_scale, 3 * sum(b.sizes)
    assert 0 < phi < 1e6 and B != 256
    assert b.lr_gain == pytest.approx((phi / 256 + 1) / (phi / B + 1), rel=1e-9)
    assert a.lr_gain == pytest.approx((phi / sum(sim.spec.initial_batch) + 1) / (phi / sum(a.sizes) + 1), rel=1e-9)
    assert tuned.state_dict()["base_batch"] == 256
    again = make_core(cfg, 2, 1)
    again.load_state_dict(tuned.state_dict())
    assert again.base_batch == 256 and again.initial_batch == tuned.initial_batch
    keyed = {k: v for k, v in tuned.state_dict().items() if k not in ("initial_batch", "base_batch")}
    again.load_state_dict({**keyed, "base_batch": 40, "lr_base_batch": 128})  # the two-key layout
    assert (again.initial_batch, again.base_batch) == (40, 128)
    with pytest.raises(ValueError, match="passes=0"):
        tuned.decide(sim.inputs, list(sim.sizes), sim.epoch, passes=0)
    with pytest.raises(ValueError, match="base_batch=0"):
        make_core(cfg, 2, 8, base_batch=0)


def _plain(value: Any, path: str = "state") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, (str, int)), f"{path}: key {k!r}"
            _plain(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _plain(v, f"{path}[{i}]")
    else:
        assert value is None or isinstance(value, (bool, int, float, str, torch.Tensor)), \
            f"{path} holds a {type(value).__name__}"


def test_core_state_is_plain_and_continues_exactly_after_a_weights_only_load() -> None:
    sim = ClusterSimulator(spec(2), seed=4)
    sim.reset()
    cfg = ControllerConfig(policy="ppo", learn=True, total_epochs=sim.total_epochs)
    core = make_core(cfg, 2, sum(sim.sizes))
    for _ in range(6):
        d = core.decide(sim.inputs, list(sim.sizes), sim.epoch, done=sim.budget_done)
        core.policy.after_decision()
        sim.step_sizes(d.sizes)
    state = core.state_dict()
    _plain(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    again = make_core(cfg, 2, 1)
    again.load_state_dict(torch.load(buf, weights_only=True))
    a = core.decide(sim.inputs, list(sim.sizes), sim.epoch, done=sim.budget_done)
    b = again.decide(sim.inputs, list(sim.sizes), sim.epoch, done=sim.budget_done)
    assert same(a.record(), b.record()), (a, b)
    assert again.stats.snapshot() == pytest.approx(core.stats.snapshot(), nan_ok=True)


def test_plain_optimizer_is_refused_with_what_to_use() -> None:
    from dynamix_hvd.control.controller import DynamixController
    from dynamix_hvd.data.loader import AdaptiveLoader
    from dynamix_hvd.data.synthetic import teacher_classification

    loader = AdaptiveLoader(teacher_classification(64, seed=0)[0], [8, 8], 0)
    model = nn.Linear(32, 10)
    with pytest.raises(TypeError, match=r"missing on torch\.optim\.sgd\.SGD: lr_gain, base_batch_size, "
                                        r"backward_passes_per_step, oom_handler, param_names, accumulating, "
                                        r"allreduce_bytes, set_backward_passes_per_step, pop_layer_means, "
                                        r"noise_every_for, set_noise_every, time_small_allreduce.*wrap yours with dynamix_hvd\.WeightedDistributedOptimizer"):
        DynamixController(loader, torch.optim.SGD(model.parameters(), lr=0.1), ControllerConfig(policy="static"))


@pytest.mark.mpi
def test_decisions_of_a_real_mpirun_job_replay_exactly(tmp_path: Path) -> None:
    """Rank 0 of a 2-rank job keeps the typed reports it decided on; a fresh core configured as the job's
    controller, handed the same reports, decides the same sizes, gains, rewards and statistics."""
    launch("mpirun", 2, "controller.py", "--out", str(tmp_path), "--epochs", "2", "--every", "5",
           "--max-batch", "40", "--keep-inputs", "1000")
    dump = json.loads(Path(tmp_path, "inputs.json").read_text())
    decisions = dump["decisions"]
    assert len(dump["inputs"]) == len(decisions) >= 4
    cfg = ControllerConfig(policy="ppo", decide_every_steps=5, max_batch=40, min_batch=2, total_epochs=2)
    core = make_core(cfg, 2, dump["initial_batch"], dump["layer_names"])
    for inputs, logged in zip(dump["inputs"], decisions):
        d = core.decide([RankInput.from_dict(i) for i in inputs], logged["previous_sizes"], logged["epoch"],
                        done=logged["done"]).record()
        for key in ("decision", "sizes", "lr_gain", "reward", "loss", "noise_scale", "efficiency", "throughput",
                    "layer_variance", "info"):
            assert same(d[key], logged[key]), (key, d[key], logged[key])
    assert any(d["reward"] is not None for d in decisions) and decisions[-1]["layer_variance"]


@pytest.mark.mpi
@pytest.mark.parametrize("launcher, ranks", [("mpirun", 3), ("horovodrun-gloo", 2)])
def test_array_collectives_in_a_real_job(launcher: str, ranks: int) -> None:
    out = launch(launcher, ranks, "arrays.py").stdout
    for r in range(ranks):
        for check in ("GATHER-OK", "BCAST-OK", "AFTER-OK"):
            assert f"{check} rank {r}" in out, out
    assert "RAGGED-OK rank 0" in out, out
    message = f"rank(s) [{ranks - 1}] sent [9] values where the others sent 7"
    assert f"MISMATCH-OK rank 0: rank 0: gathering uneven rows" in out and message in out, out
    if launcher == "mpirun":  # only rank 0 sees the lengths; the senders are done once it received them
        assert all(f"MISMATCH-SENT rank {r}" in out for r in range(1, ranks)), out
    else:  # under Gloo every rank learns the lengths and fails alike
        assert all(f"MISMATCH-OK rank {r}: rank {r}: gathering uneven rows" in out for r in range(ranks)), out
