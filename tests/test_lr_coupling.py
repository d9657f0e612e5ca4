"""The LR rules, the warm-up ramp after B grows, progress (tau) and ProgressScheduler. Pure maths."""
from __future__ import annotations

import io
import math
from types import SimpleNamespace

import pytest
import torch

from dynamix_hvd.optim.lr_scaling import LRCoupling, default_warmup_steps, lr_factor
from dynamix_hvd.optim.progress import ProgressAccounting, ProgressScheduler


def run(coupling: LRCoupling, plan: list[tuple[str, int, float]], base: int = 8, per_epoch: int = 100) -> list[float]:
    out = []
    for rule, batch, gain in plan:
        out.append(coupling.plan(rule, batch, base, gain, per_epoch))
        coupling.commit()
    return out


def test_rules_hand_values():
    assert lr_factor("none", 64, 8) == 1.0
    assert lr_factor("linear", 64, 8) == 8.0
    assert lr_factor("sqrt", 32, 8) == 2.0
    assert lr_factor("adascale", 64, 8, gain=3.5) == 3.5
    for gain in (None, math.nan, 0.0, -1.0, math.inf):
        assert lr_factor("adascale", 64, 8, gain=gain) == 1.0  # no statistics: no scaling
    with pytest.raises(ValueError, match="'cubic'"):
        lr_factor("cubic", 8, 8)


def test_the_square_root_rule_takes_the_square_root_of_the_gain_and_progress_counts_the_gain():
    assert lr_factor("adascale", 64, 8, gain=4.0, adaptive=True) == 2.0
    assert lr_factor("adascale", 64, 8, gain=4.0, adaptive=False) == 4.0
    assert lr_factor("linear", 64, 8, adaptive=True) == 8.0  # an explicit rule is what runs
    # progress: each step is worth the gain (Adam at sqrt(r), SGD at r), and B/B0 under the sqrt rule
    sgd, adam, sqrt = LRCoupling(0), LRCoupling(0, adaptive=True), LRCoupling(0)
    assert run(sgd, [("adascale", 32, 4.0)] * 3) == [4.0] * 3
    assert run(adam, [("adascale", 32, 4.0)] * 3) == [2.0] * 3
    assert run(sqrt, [("sqrt", 32, 1.0)] * 3) == [2.0] * 3
    assert sgd.scale_invariant_steps == adam.scale_invariant_steps == sqrt.scale_invariant_steps == 12.0
    # the warm-up ramps the applied (square-root) factor: 1 -> 2 over 2 steps, progress its square
    ramp = LRCoupling(2, adaptive=True)
    assert run(ramp, [("adascale", 8, 1.0), ("adascale", 32, 4.0), ("adascale", 32, 4.0)]) == [1.0, 1.5, 2.0]
    assert ramp.scale_invariant_steps == pytest.approx(1 + 2.25 + 4)
    with pytest.raises(ValueError, match="adaptive='yes'"):
        LRCoupling(adaptive="yes")


def test_ramp_after_an_increase_then_tau_is_the_sum_of_the_factors():
    c = LRCoupling(warmup_steps=4)
    factors = run(c, [("linear", 8, 1.0)] * 2 + [("linear", 16, 1.0)] * 6)
    assert factors == pytest.approx([1, 1, 1.25, 1.5, 1.75, 2, 2, 2], rel=1e-15)
    assert c.scale_invariant_steps == pytest.approx(sum(factors), rel=1e-15)
    assert c.ramp_length == 0  # over


def test_a_decrease_applies_at_once_and_ends_a_ramp():
    c = LRCoupling(warmup_steps=4)
    factors = run(c, [("linear", 8, 1.0), ("linear", 32, 1.0), ("linear", 8, 1.0), ("linear", 8, 1.0)])
    assert factors == [1.0, 1.75, 1.0, 1.0]
    assert c.ramp_length == 0


def test_the_ramp_follows_a_gain_that_changes_and_restarts_when_B_grows_again():
    c = LRCoupling(warmup_steps=2)
    f = run(c, [("adascale", 8, 1.0), ("adascale", 16, 3.0), ("adascale", 16, 2.0)])
    assert f == [1.0, 2.0, 2.0]  # halfway to 3, then the (new) target 2 at the ramp's end
    f = run(c, [("adascale", 32, 4.0), ("adascale", 64, 6.0), ("adascale", 64, 6.0), ("adascale", 64, 6.0)])
    assert f == [3.0, 4.5, 6.0, 6.0]  # B grew again mid-ramp: from the last applied factor (3)


def test_no_ramp_without_a_previous_step_or_with_warmup_0_or_1_or_for_the_gain_alone():
    assert run(LRCoupling(4), [("linear", 32, 1.0)]) == [4.0]
    for k in (0, 1):
        assert run(LRCoupling(k), [("linear", 8, 1.0), ("linear", 32, 1.0)]) == [1.0, 4.0]
    # the gain rising at a fixed B (a new estimate) is no increase of B: applied at once
    assert run(LRCoupling(4), [("adascale", 16, 1.0), ("adascale", 16, 1.8)]) == [1.0, 1.8]
    # rule none never ramps and counts raw steps
    c = LRCoupling(4)
    assert run(c, [("none", 8, 1.0), ("none", 64, 5.0)]) == [1.0, 1.0] and c.scale_invariant_steps == 2.0


def test_default_warmup_is_a_small_fraction_of_an_epoch():
    assert default_warmup_steps(1000) == 30
    assert default_warmup_steps(100) == 3
    assert default_warmup_steps(5) == 2 and default_warmup_steps(0) == 2
    c = LRCoupling()  # None: from the epoch length at the new B
    f = run(c, [("linear", 8, 1.0), ("linear", 16, 1.0), ("linear", 16, 1.0), ("linear", 16, 1.0),
                ("linear", 16, 1.0)], per_epoch=100)
    assert f == pytest.approx([1.0, 1 + 1 / 3, 1 + 2 / 3, 2.0, 2.0], rel=1e-15)


def test_plan_changes_nothing_until_commit():
    c = LRCoupling(4)
    run(c, [("linear", 8, 1.0)])
    before = c.state_dict()
    assert c.plan("linear", 32, 8, 1.0, 10) == 1.75
    assert c.state_dict() == before  # a skipped step (no commit) makes no progress
    assert c.plan("linear", 32, 8, 1.0, 10) == 1.75
    c.commit()
    with pytest.raises(RuntimeError, match="without a plan"):
        c.commit()


def test_state_dict_is_plain_and_resumes_mid_ramp():
    plan = [("linear", 8, 1.0), ("linear", 8, 1.0), ("linear", 24, 1.0)] + [("linear", 24, 1.0)] * 5
    whole = run(LRCoupling(4), plan)
    first = LRCoupling(4)
    head = run(first, plan[:4])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    again = LRCoupling(4)
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert head + run(again, plan[4:]) == whole
    assert again.scale_invariant_steps == pytest.approx(sum(whole), rel=1e-15)


# --- ProgressScheduler ----------------------------------------------------------------------------------
class Counted(torch.optim.SGD, ProgressAccounting):
    """A plain optimizer with the weighted optimizer's progress surface (for pure tests)."""

    def __init__(self, num_samples: int = 80, base: int = 8) -> None:
        super().__init__([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        self.lr_coupling, self.base_batch_size = LRCoupling(0), base
        self.loader = SimpleNamespace(num_samples=num_samples, epoch_size=num_samples)

    def advance(self, batch: int) -> None:
        self.step()
        self.lr_coupling.plan("linear", batch, self.base_batch_size, None, 10)
        self.lr_coupling.commit()


def test_steplr_follows_tau_whether_or_not_B_doubled():
    lrs = {}
    for batches in ([8] * 20, [8] * 4 + [16] * 8):
        opt = Counted()
        sched = ProgressScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5), opt)
        seen = []
        for b in batches:
            seen.append((opt.scale_invariant_steps, sched.get_last_lr()[0]))
            opt.advance(b)
            sched.step()
        assert opt.progress_done(20) and sched.done == 20
        lrs[len(batches)] = seen
    for tau, lr in lrs[12]:
        assert lr == 0.1 * 0.5 ** (int(tau) // 3) == dict(lrs[20])[tau]


def test_per_epoch_schedules_count_base_equivalent_epochs():
    opt = Counted(num_samples=80, base=8)  # 10 base steps per epoch
    sched = ProgressScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), opt, per="epoch")
    stepped = []
    for b in [8] * 9 + [32] * 5:  # factor 4 per step after 9 base steps
        opt.advance(b)
        stepped.append(sched.step())
    assert opt.scale_invariant_epochs == pytest.approx(2.9)
    assert stepped == [0] * 9 + [1, 0, 1, 0, 0] and sched.done == 2
    assert sched.get_last_lr() == [0.025]
    assert opt.progress_done(epochs=2.9) and not opt.progress_done(epochs=3)


def test_onecycle_is_never_stepped_past_its_total_and_state_round_trips():
    opt = Counted()
    sched = ProgressScheduler(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10), opt)
    for _ in range(4):
        opt.advance(24)  # 3 base steps each: 12 > 10
        sched.step()
    assert sched.done == 9 and opt.scale_invariant_steps == 12  # 9: OneCycleLR's floor
    state = sched.state_dict()
    opt2 = Counted()
    again = ProgressScheduler(torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=1.0, total_steps=10), opt2)
    again.load_state_dict(state)
    assert again.done == 9 and again.get_last_lr() == sched.get_last_lr()


def test_onecycle_follows_progress_when_B_grows_and_shrinks_and_ends_on_its_floor():
    # OneCycleLR built for 12 steps at the base batch 8; B then doubles, halves, and returns
    reference = Counted()
    plain = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=1.0, total_steps=12)
    expected = [plain.get_last_lr()[0]]
    for _ in range(11):  # to its floor
        reference.step()
        plain.step()
        expected.append(plain.get_last_lr()[0])
    opt = Counted()
    sched = ProgressScheduler(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=12), opt)
    lrs = []
    for b in [16] * 3 + [4] * 6 + [8] * 2 + [16] * 2:  # 6 + 3 + 2 base steps, then 4: 3 more than it has
        opt.advance(b)
        sched.step()
        lrs.append((opt.scale_invariant_steps, sched.get_last_lr()[0]))
    # at every point the LR is the one plain OneCycleLR has after as many base-batch steps
    for tau, lr in lrs:
        assert lr == pytest.approx(expected[min(int(tau + 1e-9), 11)]), (tau, lr)
    # B halved: two optimizer steps per schedule step, the LR held in between
    assert [lr for _, lr in lrs[3:9]] == pytest.approx([expected[6], expected[7], expected[7], expected[8],
                                                        expected[8], expected[9]])
    # never stepped past its floor (one more step leaves it, the next raises): the LR stays there
    assert sched.done == 11 and lrs[-1][1] == pytest.approx(expected[-1]) and expected[-1] < 1e-4


def test_sequential_warmup_and_lambda_schedulers_are_driven_by_tau():
    opt = Counted()
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
    sched = ProgressScheduler(torch.optim.lr_scheduler.SequentialLR(
        opt, [warm, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))], milestones=[4]), opt)
    opt.advance(32)  # 4 base steps in one: the warm-up is over
    assert sched.step() == 4 and sched.get_last_lr() == pytest.approx([0.1])


def test_bad_schedulers_and_budgets_are_refused():
    opt = Counted()
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        ProgressScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt), opt)
    with pytest.raises(ValueError, match="different optimizer"):
        ProgressScheduler(torch.optim.lr_scheduler.StepLR(Counted(), 2), opt)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match="counts no progress"):
        ProgressScheduler(torch.optim.lr_scheduler.StepLR(plain, 2), plain)
    with pytest.raises(ValueError, match="give total_base_steps or epochs"):
        opt.progress_done()
    with pytest.raises(ValueError, match="give total_base_steps or epochs"):
        opt.progress_done(3, epochs=1)


def test_a_scheduler_built_before_wrapping_drives_the_shared_groups():
    """Users often build the scheduler on their own optimizer, then wrap it: the wrapper shares its
    parameter groups, so the scheduler is accepted and its LR is the one the wrapper steps with."""
    opt = Counted()
    inner = torch.optim.SGD(opt.param_groups, lr=0.1)  # the same group dicts, as the wrapper keeps them
    assert all(a is b for a, b in zip(inner.param_groups, opt.param_groups))
    sched = ProgressScheduler(torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5), opt)
    opt.advance(8)
    assert sched.step() == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
