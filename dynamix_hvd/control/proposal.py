"""The model-based proposal: split and global batch from the fitted costs. Pure: no MPI, no Horovod.

Each decision, from the cost model (:mod:`dynamix_hvd.control.costmodel`) and the noise scale:

- **split**: for a global batch B, the sizes that make every rank arrive at the allreduce together,
  b_i = (T - a_i) / c_i with T such that sum b_i = B, each clipped to the rank's bounds (fast ranks
  fill up to the slow rank's arrival) and never below a fitted small-batch knee; rounded to integers that keep B, the leftover samples going to
  the ranks that arrive earliest with them;
- **global batch**: the B in [initial batch, memory bounds x `BatchBounds.max_passes`
  micro-batches] that maximises predicted goodput B * E(B) / T_step(B) (with p micro-batches
  accumulated, T_step = p slowest arrivals + the allreduce after the last), E(B) = (phi + B0) / (phi + B) with phi a lower confidence bound on the noise
  scale (a noisy estimate errs towards smaller batches); within a trust region (B changes by at most
  `trust`x per decision, a rank's size grows by at most that, or, where B does not grow, back to
  its neutral share, and falls as far as the others' growth allows) and with hysteresis (B changes only when the predicted
  goodput improves by more than `hysteresis`, as AdaptDL); in the first `hold_unidentified` decisions
  B does not grow while some rank's cost line is not identified (its fixed cost, and with it the whole
  gain of a larger batch, is then a guess: the first decision after one size was seen raised the CNN's
  B by a third for one interval on the pinned guess alone); later, or with 0 (AdaptDL's optimistic
  exploration, the "goodput" rule), the guess is used, so a line the dither cannot identify (one
  rank, a fixed-cost-dominated rank) does not hold B for ever;
- **dither**: while some rank's cost line is not identified (its recent sizes hardly vary), sizes
  alternate by +-`dither` around the proposal (B kept), so the next fit sees two sizes.
- **no harm** (:class:`ModelPolicy`): the neutral split (the job's own) is kept unless the equalising
  one is predicted to pay `split_margin` and the ranks' speeds are measured to differ by that much
  (:mod:`dynamix_hvd.control.speedgap`), and a split taken is judged by the measured step
  (:mod:`dynamix_hvd.control.splitcheck`); B grows past the initial batch only on a confident
  predicted gain, then judged by the loss (:mod:`dynamix_hvd.control.growth`), and only where that
  judgement can end before the training budget does (a growth that could not be judged would run
  unchecked to the end); with a budget, B also stays where, held to the end, it would lose at most
  `budget_loss` of the budget's progress (a budget fixes the samples).

:class:`ModelPolicy` (policy "model") applies the proposal; the rules "goodput" and "speed-split"
(:mod:`dynamix_hvd.control.rules`) are the same code with other settings.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from .actions import BatchBounds
from .flipguard import FlipGuard
from .costmodel import CostConfig, CostFit, CostModel, NetworkFit, record_reports
from .growth import GrowthCheck, GrowthConfig
from .speedgap import speed_gap
from .splitcheck import SplitCheck, SplitConfig
from .jointfit import fit_joint
from .phases import Alternative, Plan, phase_of, transition
from .policy import DecisionInput, DecisionOutput
from .state import RankReport
from ..stats.noise_scale import batch_at_efficiency, statistical_efficiency
from .. import validate


@dataclass(frozen=True)
class ProposalConfig:
    """Settings of the cost-model proposal: how the split and the global batch follow the fitted costs
    and the noise scale, and the checks that undo a split or a growth that did not pay."""

    search_batch: bool = True
    """Choose the global batch (False: keep it and only split it)."""
    hysteresis: float = 0.05
    """Change B only for a predicted goodput gain above this fraction."""
    trust: float | None = 2.0
    """Largest factor by which B may change per decision, and a rank's size grow (in the split of a B
    that does not grow, a rank below its neutral share may also grow back to it); a rank's size may
    fall as far as the others' growth allows (None: no limit)."""
    noise: str = "lower"
    """Noise scale used in E(B): "lower" (a lower confidence bound) or "point" (the estimate)."""
    dither: float = 0.04
    """Relative size dither while a rank's cost line is not identified (0: none)."""
    dither_decisions: int | None = 4
    """Decisions at the start of a job during which unidentified lines are dithered (None: always).
    Later an unidentified rank is split by its measured speed and credited no fixed cost, so holding
    still costs nothing; a dither would only shake a settled split."""
    candidates: int = 64
    """Global batches scored per decision (a geometric grid over the allowed range)."""
    hold_unidentified: int = 2
    """Decisions at the start during which B may not grow while some rank's cost line is not identified
    (its throughput gain would rest on the pinned fixed share, not a measurement; the dither usually
    identifies the lines within one interval). 0: grow on the guess from the first decision (AdaptDL)."""
    joint_fit: bool = False
    """Refine the staged fits jointly (compute, network and overlap at once, as AdaptDL; see
    :mod:`dynamix_hvd.control.jointfit`) before proposing."""
    split_margin: float = 0.05
    """Leave the neutral split (the job's initial sizes, scaled to B) only when the arrival-equalising
    split is predicted to shorten the step by more than this fraction; ranks whose measured speeds do
    not differ by that much keep it, undithered (half the margin keeps a split once taken). 0: always
    equalise."""
    split_intervals: int = 2
    """Recorded intervals at the neutral split, running, in which the measured difference in speed
    (per-step times, a paired test) must pass `split_margin`, the same rank the slowest, before the
    neutral split is left: one noisy interval on a shared host must not split equal ranks. An
    interval too short for the test (under five kept steps) waits and is tested together with the
    neutral ones after it until they hold five, so a job whose epochs are a few steps long is judged
    on steps too (the count is then of tested groups). An interval known only by its means (from a
    peer that sends no per-step times) is no evidence; where no interval ever had per-step times (a
    hand-built DecisionInput without a cost model), the predicted gain must pass the margin in two
    intervals running, whatever this says."""
    recheck_gap: float = 0.15
    """A first interval that passes `split_margin` with a measured gain from equalising arrivals (the
    paired test's lower bound) of at least this asks for the next decision `min_decision_steps`
    later rather than a whole interval later (the decision cadence's recheck): a rank that became
    several times slower is balanced an interval sooner. A smaller gap waits for the regular
    interval. The default lies between the largest first gap on equal ranks (0.08) and the smallest
    first measurement of a slowdown that began mid-job (0.19) in the tuning half of the workload zoo;
    on a host whose cores differ in speed, equal ranks pass the regular interval about as often as the
    recheck (BENCHMARKS.md), so the threshold mainly spares decisions. 0: recheck after every passing
    first interval; 1 or more: never. The same gap lets a rank whose change vote brought the
    decision be split after that one interval (its own measurement being the second)."""
    grow_margin: float = 0.10
    """B grows past the current and the initial batch only when the predicted goodput gain exceeds
    this fraction (on top of `hysteresis`), predicted with the noise scale's lower bound and, with
    `confident_growth`, without crediting any unidentified fixed cost."""
    confident_growth: bool = True
    """Predict the time of a larger batch with no fixed cost on ranks whose cost line is not identified
    (only measured fixed costs: the allreduce, the update, identified lines), so B grows only where a
    gain is measured, not guessed. False: AdaptDL's optimistic pinned fixed share."""
    check_growth: bool = True
    """After B grew past the initial batch, compare the training loss with what the initial
    batch was making (its loss against log time over the latest half of the run, extrapolated); where
    the larger batch falls behind by more than the noise of the per-step losses and of the line allows,
    return to the initial batch and never grow again in this job (see :class:`GrowthCheck`). With a
    training budget (``total_epochs``), a growth starts only where the check's verdict can come
    before the budget ends."""

    budget_loss: float = 0.05
    """With a training budget (``total_epochs``), B stays at sizes that, held to the budget's end,
    lose at most this fraction of the budget's progress: (1 - E(B)) times the share of the budget
    still to run, E the statistical efficiency against the initial batch with the noise scale
    `noise` names. A budget fixes the samples, so what a larger batch loses per sample is lost from
    the job's end (its final metric), whatever it gains per second. Each decision asks this of the
    rest of the job, so the cap loosens as the budget is spent and a B that follows it loses more
    over the whole job (up to about four times this; the last twentieth of the budget is uncapped).
    Where B grew past the cap (by more than `hysteresis`), it comes back to it in one decision,
    whatever `trust` allows (the cap bounds B as memory does); not while a growth or a split is
    judged. 1: goodput alone decides, as without a budget; 0: no batch past the initial one under a
    budget."""

    check_split: bool = True
    """After the split left neutral, compare the measured step with the neutral split's; where it did
    not shorten by half the predicted gain, return to neutral and from then on split only for twice
    the gain that failed, at most 25%, until the measured gap has passed `split_margin` in
    `split_intervals` x 2^failures intervals running (see :class:`SplitCheck`). Off where
    `split_margin` is 0 and with token budgets."""
    growth: GrowthConfig = field(default_factory=GrowthConfig)
    """The growth check's settings (`check_growth`): how long a growth settles and is judged, and how
    far its loss may fall behind."""
    split: SplitConfig = field(default_factory=SplitConfig)
    """The split check's settings (`check_split`): how a split is judged, and how far a failed one
    raises the margin."""

    def __post_init__(self) -> None:
        if self.noise not in ("lower", "point"):
            raise ValueError(f"ProposalConfig.noise={self.noise!r}; choose 'lower' or 'point'")
        if self.trust is not None:
            validate.number("ProposalConfig.trust", self.trust, above=1, what="a finite number > 1 or None")
        validate.integer("ProposalConfig.hold_unidentified", self.hold_unidentified, 0)
        validate.integer("ProposalConfig.split_intervals", self.split_intervals, 1)
        validate.number("ProposalConfig.hysteresis", self.hysteresis, 0)
        validate.number("ProposalConfig.dither", self.dither, 0, below=0.5, what="a fraction in [0, 0.5)")
        validate.integer("ProposalConfig.candidates", self.candidates, 2)
        for name, kind in (("growth", GrowthConfig), ("split", SplitConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"ProposalConfig.{name}={getattr(self, name)!r}; it must be a {kind.__name__}")
        for name in ("confident_growth", "check_growth", "check_split", "search_batch", "joint_fit"):
            validate.boolean(f"ProposalConfig.{name}", getattr(self, name))
        if self.dither_decisions is not None:
            validate.integer("ProposalConfig.dither_decisions", self.dither_decisions, 0, what="an integer >= 0 or None")
        for name in ("split_margin", "grow_margin"):
            validate.number(f"ProposalConfig.{name}", getattr(self, name), 0, below=1, what="a fraction in [0, 1)")
        validate.number("ProposalConfig.budget_loss", self.budget_loss, 0, maximum=1, what="a fraction in [0, 1]")
        validate.number("ProposalConfig.recheck_gap", self.recheck_gap, 0, what="a number >= 0 (1 or more: never)")


def equalise(micro_batch: np.ndarray | float, fixed: np.ndarray, per_sample: np.ndarray, lo: np.ndarray,
             hi: np.ndarray) -> np.ndarray:
    """Real-valued arrival-equalising shares [K, R] for global micro-batches [K] (within sum(lo)..sum(hi)):
    b_i = clip((T - a_i) / c_i, lo_i, hi_i) with the common arrival T solved exactly.

    The total f(T) = sum_i clip((T - a_i) / c_i, lo_i, hi_i) is piecewise linear and non-decreasing:
    its slope gains 1/c_i where rank i leaves its lower bound (T = a_i + c_i lo_i) and loses it where
    the rank reaches its upper bound (T = a_i + c_i hi_i). Sorting the 2R kinks and summing the slope
    changes gives f at every kink in O(R log R); each B then lies on one segment (a binary search)
    and T follows by interpolation. (A bisection took ~60 array passes: most of a decision's time.)"""
    B = np.atleast_1d(np.asarray(micro_batch, dtype=np.float64))
    lo_f, hi_f = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    B = np.clip(B, lo_f.sum(), hi_f.sum())
    kinks = np.concatenate([fixed + per_sample * lo_f, fixed + per_sample * hi_f])
    slope_change = np.concatenate([1.0 / per_sample, -1.0 / per_sample])
    order = np.argsort(kinks, kind="stable")
    kinks, slope = kinks[order], np.cumsum(slope_change[order])[:-1]  # slope after each kink but the last
    at_kinks = lo_f.sum() + np.concatenate([[0.0], np.cumsum(np.maximum(slope, 0.0) * np.diff(kinks))])
    j = np.clip(np.searchsorted(at_kinks, B, side="left"), 1, len(kinks) - 1)
    rise = at_kinks[j] - at_kinks[j - 1]
    frac = np.clip(np.divide(B - at_kinks[j - 1], rise, out=np.zeros_like(B), where=rise > 0), 0.0, 1.0)
    T = kinks[j - 1] + frac * (kinks[j] - kinks[j - 1])
    return np.clip((T[:, None] - fixed) / per_sample, lo_f, hi_f)


def round_split(shares: np.ndarray, micro_batch: int, fixed: np.ndarray, per_sample: np.ndarray,
                lo: np.ndarray, hi: np.ndarray) -> list[int]:
    """Integer local batches summing to `micro_batch` (when the bounds allow): floors of the shares, then one
    more sample at a time to the rank that arrives earliest with it."""
    sizes = np.clip(np.floor(shares + 1e-9), lo, hi).astype(np.int64)
    _fill(sizes, int(micro_batch), fixed, per_sample, lo, hi)
    return sizes.tolist()


def _fill(sizes: np.ndarray, target: int, fixed: np.ndarray, per_sample: np.ndarray, lo: np.ndarray,
          hi: np.ndarray) -> None:
    """Move `sizes` (in place) to sum `target`: add where arrival after +1 is earliest, remove where
    the arrival is latest."""
    while sizes.sum() < target:
        after = np.where(sizes < hi, fixed + per_sample * (sizes + 1), np.inf)
        if not np.isfinite(after).any():
            return
        sizes[int(np.argmin(after))] += 1
    while sizes.sum() > target:
        now = np.where(sizes > lo, fixed + per_sample * sizes, -np.inf)
        if not np.isfinite(now).any():
            return
        sizes[int(np.argmax(now))] -= 1


@dataclass
class Proposal:
    sizes: list[int]
    """Per-rank sizes of one micro-batch."""
    global_batch: int
    """Samples per optimizer step: passes x sum(sizes)."""
    predicted_step_s: float
    predicted_goodput: float
    goodput_now: float
    """Predicted goodput of the current B with the equalised split."""
    batch_keep: int
    """The current B as `goodput_now` scores it (within the bounds)."""
    switched: bool
    dithered: bool
    noise_scale: float
    batch_min: int
    batch_max: int
    """The global batches this decision allows (initial batch or memory, trust region, no growth
    on unidentified lines): what a refinement of the proposal must stay within."""
    passes: int = 1
    """Micro-batches per optimizer step (gradient accumulation past the memory bounds)."""
    split_gain: float = 0.0
    """Predicted step-time gain of the equalising split over the neutral one (at this B)."""
    neutral: bool = False
    """The neutral split was kept (the ranks' speeds do not differ by `split_margin`)."""

    def info(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()
                if k != "sizes"}


def propose(cfg: ProposalConfig, fit: CostFit, net: NetworkFit, sizes: Sequence[int], bounds: BatchBounds,
            initial_batch: int, noise: float, index: int, passes: int = 1, neutral: Sequence[float] | None = None,
            may_grow: bool = True, split_confirmed: bool = True, split_margin: float | None = None,
            force_neutral: bool = False, cap: int | None = None) -> Proposal:
    """The proposal for the next interval (see the module docstring); `index` drives the dither;
    `sizes` are the current micro-batch sizes, `passes` the current micro-batches per step;
    `neutral`: each rank's share of the neutral split (default equal); `may_grow` False: B returns to
    at most `initial_batch` now and stays there (the growth check failed); `split_confirmed` False: the
    difference in speed is not measured to exceed the margin (see `ModelPolicy`), so a neutral split
    stays neutral;
    `split_margin` replaces `cfg.split_margin` (a margin raised by a failed split); `force_neutral`:
    the neutral split now, whatever the prediction (a split just failed its check); `cap`: B stays at
    most this, with the usual margins (a growth whose check could not end before the budget does).

    Global batches count samples per optimizer step. With ``bounds.max_passes`` > 1 every count of
    micro-batches p up to it is scored: B = p x micro-batch, the micro-batch split within the memory
    bounds, the step p slowest arrivals plus the allreduce after the last (see
    :meth:`NetworkFit.step_time`), so accumulation wins only where memory caps the one-pass batch and
    the larger B is worth its time. The trust region bounds B's change and each rank's growth in
    samples per step."""
    R = len(sizes)
    cur = np.asarray(sizes, dtype=np.int64)
    per_step = passes * cur                      # each rank's samples per optimizer step now
    B_cur = int(per_step.sum())
    upper = np.array([bounds.upper(r) for r in range(R)], dtype=np.int64)
    a_s, c_s = fit.split_coefficients()
    # The batch search splits each candidate B with unidentified ranks proportional to speed, the same
    # lines it times them with (confident growth credits no guessed fixed cost); only the split of
    # the chosen B borrows the identified lines' shape for them.
    a_g, c_g = fit.split_coefficients(borrowed=False)
    knee = np.floor(fit.knee)

    def micro_bounds(p: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = np.full(R, bounds.min_batch, dtype=np.int64), upper
        if cfg.trust is not None:
            # A rank's samples grow by at most `trust`x; they fall as far as the others' growth allows,
            # so a rank found slow is set to its equalising size in one decision.
            hi = np.maximum(np.minimum(hi, np.floor(per_step * cfg.trust / p + 1e-9)), lo).astype(np.int64)
        # below its knee a rank's samples are free: the split never leaves it there (within its bounds)
        return np.maximum(lo, np.minimum(knee, hi)).astype(np.int64), hi

    choices = list(range(1, bounds.max_passes + 1)) if bounds.max_passes > 1 else [passes]
    if passes not in choices:
        choices.append(passes)
    limits = {p: micro_bounds(p) for p in choices}
    B_lo = float(max(initial_batch, passes * limits[passes][0].sum()))
    if cfg.trust is not None and may_grow:
        B_lo = max(B_lo, B_cur / cfg.trust)
    B_hi = float(max(p * hi.sum() for p, (_, hi) in limits.items()))
    if not may_grow:
        B_hi = min(B_hi, float(initial_batch))
    if cap is not None:
        B_hi = min(B_hi, float(cap))
    B_lo = min(B_lo, B_hi)  # memory below the initial batch: as large as it allows

    def goodput(Bs: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi = limits[p]
        shares = equalise(np.asarray(Bs, dtype=np.float64) / p, a_g, c_g, lo, hi)
        # confident: an unidentified rank's time is all per-sample (no guessed fixed cost to amortise)
        step = np.asarray(net.step_time(fit.arrival(shares, split=cfg.confident_growth, borrowed=False).max(1), p))
        total = p * shares.sum(1)
        # phi unknown (nothing measured): no gain from a larger batch
        return total * statistical_efficiency(noise, total, initial_batch, unknown="no_gain") / step, step, shares

    keep_hi = passes * float(limits[passes][1].sum())
    B_keep = int(round(min(max(B_cur, B_lo), keep_hi, B_hi)))
    if index < cfg.hold_unidentified and not fit.identified.all():
        B_hi = min(B_hi, float(B_keep))
    keep_gp, _, _ = goodput(np.array([B_keep]), passes)
    B_new, p_new, switched = B_keep, passes, False
    if cfg.search_batch and (B_hi > B_lo or (not may_grow and passes > 1)):
        best = (-np.inf, B_keep, passes)
        for p in choices:
            lo_p, hi_p = max(B_lo, p * float(limits[p][0].sum())), min(B_hi, p * float(limits[p][1].sum()))
            if lo_p > hi_p:
                continue
            grid = np.unique(np.round(np.geomspace(lo_p, max(hi_p, lo_p), cfg.candidates) / p)) * p
            gp, _, _ = goodput(grid, p)
            k = int(np.argmax(gp))
            if gp[k] > best[0] * (1 + 1e-9):  # ties: fewer micro-batches
                best = (float(gp[k]), int(grid[k]), p)
        growing = best[1] > max(B_keep, initial_batch)
        margin = cfg.hysteresis + (cfg.grow_margin if growing else 0.0) if may_grow else 0.0  # banned: back at once
        if best[0] > (1 + margin) * keep_gp[0]:
            _, B_new, p_new = best
            switched = True
    gp_new = goodput(np.array([B_new]), p_new)[0] if switched else keep_gp  # unswitched: B_keep, as scored
    lo, hi = limits[p_new]
    micro = int(round(B_new / p_new))
    lo_eq, hi_eq = lo, hi
    if cfg.trust is not None and p_new * micro <= B_cur:
        # A rank relieved earlier may regain its neutral share of B in one decision (a slowdown that
        # lifted): the job's own split is no extrapolation, and 2x per decision took a rank cut to
        # one sample five decisions to get back. Only for the equalising split: not in the batch
        # search (with it a larger B looked cheap right after a split), nor where B grows (a line
        # fitted on a relieved rank's few samples extrapolates worst to a larger B's share: one
        # jumped from 14 to 62 samples), nor for the neutral split below (the fallback where a split
        # does not pay or failed its check, and the reference of its predicted gain): returning to it
        # at once, a slow rank bound by its fixed cost flapped between the two (each split held B
        # for its check, so B never grew). So that fallback is neutral only within the 2x bounds.
        back = np.floor(micro * neutral_shares(R, neutral) + 1e-9).astype(np.int64)
        hi_eq = np.maximum(hi, np.minimum(back, upper))
        wider = np.maximum(lo, np.minimum(knee, hi_eq)).astype(np.int64)  # the knee floor, where B fits
        lo_eq = wider if wider.sum() <= micro else lo
    shares = equalise(np.array([float(micro)]), a_s, c_s, lo_eq, hi_eq)
    out = np.array(round_split(shares[0], micro, a_s, c_s, lo_eq, hi_eq), dtype=np.int64)
    margin = cfg.split_margin if split_margin is None else split_margin
    even, split_gain = _neutral_split(margin, fit, out, cur, micro, neutral, a_s, c_s, lo, hi, split_confirmed,
                                      force_neutral)
    if even is not None:
        out = even
    dithered = False
    early = cfg.dither_decisions is None or index < cfg.dither_decisions
    if cfg.dither > 0 and early and not fit.identified.all() and R > 1 and even is None:
        out = _dither(out, cfg.dither, index, a_s, c_s, bounds)
        dithered = True
    step_new = np.atleast_1d(net.step_time(fit.arrival(out[None, :], split=cfg.confident_growth, borrowed=False).max(1), p_new))
    b_min = min(int(math.ceil(B_lo - 1e-9)), B_keep, B_new)
    b_max = max(int(math.floor(B_hi + 1e-9)), B_keep, B_new)
    if not cfg.search_batch:  # B is kept: a refinement of the proposal (PPO's batch row) keeps it too
        b_min = b_max = int(p_new * out.sum())
    return Proposal(out.tolist(), int(p_new * out.sum()), float(step_new[0]), float(gp_new[0]), float(keep_gp[0]),
                    B_keep, switched, dithered, float(noise), b_min, b_max, p_new, split_gain, even is not None)


def neutral_shares(ranks: int, neutral: Sequence[float] | None) -> np.ndarray:
    """Each rank's fraction of the neutral split (default equal)."""
    if neutral is None:
        return np.full(ranks, 1.0 / ranks)
    return np.asarray(neutral, dtype=np.float64) / float(np.sum(neutral))


def neutral_sizes(micro: int, neutral: Sequence[float] | None, fixed: np.ndarray, per_sample: np.ndarray,
                  lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """`micro` samples split by the neutral shares (default equal), within the bounds."""
    w = neutral_shares(len(fixed), neutral)
    return np.array(round_split(micro * w, micro, fixed, per_sample, lo, hi), dtype=np.int64)


def off_neutral(current: Sequence[int], neutral: Sequence[float] | None) -> bool:
    """The sizes differ from the neutral shares of their sum by more than rounding (1 sample, or 2% of
    the mean size)."""
    cur = np.asarray(current, dtype=np.float64)
    total = max(float(cur.sum()), 1.0)
    return bool(np.abs(cur - total * neutral_shares(len(cur), neutral)).max() > max(1.0, 0.02 * total / len(cur)))


def predicted_split_gain(fit: CostFit, net: NetworkFit, sizes: Sequence[int], neutral: Sequence[float] | None,
                         passes: int = 1) -> float:
    """The predicted step-time gain of `sizes` over the neutral split of their sum (the allreduce and
    per-step costs included: what a measured step can show)."""
    cur = np.asarray(sizes, dtype=np.float64)
    now = float(net.step_time(float(fit.arrival(cur, split=True).max()), passes))
    even = float(net.step_time(float(fit.arrival(cur.sum() * neutral_shares(len(cur), neutral), split=True).max()),
                               passes))
    return 1.0 - now / even if even > 0 else 0.0


def _neutral_split(split_margin: float, fit: CostFit, proposed: np.ndarray, current: np.ndarray, micro: int,
                   neutral: Sequence[float] | None, a_s: np.ndarray, c_s: np.ndarray, lo: np.ndarray,
                   hi: np.ndarray, confirmed: bool = True, force: bool = False) -> tuple[np.ndarray | None, float]:
    """The neutral split when the equalising one does not pay (None: keep `proposed`), and the
    predicted step-time gain of `proposed` over it. The margin is halved while the current sizes are
    already off the neutral split, so a split once taken does not flap on timing noise."""
    if len(proposed) < 2 or (split_margin == 0 and not force):
        return None, 0.0
    even = neutral_sizes(micro, neutral, a_s, c_s, lo, hi)
    slow_even = float(fit.arrival(even, split=True).max())
    gain = 1.0 - float(fit.arrival(proposed, split=True).max()) / slow_even if slow_even > 0 else 0.0
    away = off_neutral(current, neutral)
    margin = split_margin * (0.5 if away else 1.0)
    keep_neutral = force or gain <= margin or (not away and not confirmed)
    return (even if keep_neutral else None), gain


def _dither(sizes: np.ndarray, amount: float, index: int, fixed: np.ndarray, per_sample: np.ndarray,
            bounds: BatchBounds) -> np.ndarray:
    """Alternate each rank's size by +-amount (sign by rank and decision parity), keeping the sum."""
    R = len(sizes)
    lo = np.full(R, bounds.min_batch)
    hi = np.array([bounds.upper(r) for r in range(R)])
    sign = np.where((np.arange(R) + index) % 2 == 0, 1, -1)
    step = np.maximum(1, np.round(amount * sizes)).astype(np.int64)
    out = np.clip(sizes + sign * step, lo, hi).astype(np.int64)
    _fill(out, int(sizes.sum()), fixed, per_sample, lo, hi)
    return out


@dataclass
class Evidence:
    """What one interval told the default policy (see `ModelPolicy._evidence`)."""

    costs: CostModel
    fit: CostFit
    net: NetworkFit
    may_grow: bool
    """The growth check has its reference and has not banned growth."""
    ran_neutral: bool
    """The interval ran at the job's own split."""
    checking: bool
    """Splits are judged (a split check, and step times that do not follow the data's lengths)."""
    split_failed: bool
    """The split under judgement failed its check in this interval."""
    gap: float
    """The measured speed gap's lower bound (the paired test's)."""
    slowest: int
    intervals: int
    """Intervals running whose measured gap passed the margin, the same rank the slowest."""
    lifted: bool
    """The gap, measured long enough, outweighs an earlier failed split: the configured margin applies."""
    margin: float
    confirmed: bool
    """The speed difference is measured to exceed the margin: the split may leave the job's own."""
    recheck: bool
    budget_cap: int | None = None
    late: bool = False


class ModelPolicy:
    """Policy "model": the proposal, applied as is, except that with ``hold_flips`` a decision that
    would return to the sizes of two decisions ago is held (:class:`FlipGuard`). Fits come from the
    decision core's per-step cost model (`DecisionInput.costs`); handed none (a DecisionInput built by
    hand), it fits its own from the reports' interval means."""

    name = "model"

    def __init__(self, config: ProposalConfig | None = None, costs: CostConfig | None = None, *,
                 hold_flips: bool = False, **kwargs: Any) -> None:
        self.cfg = config or ProposalConfig(**kwargs)
        self.guard = FlipGuard() if hold_flips else None
        self.costs_cfg = costs or CostConfig()
        self.decisions = 0
        self._own: CostModel | None = None
        self.last: Proposal | None = None
        self.neutral: list[float] | None = None
        """Each rank's share of the job's initial sizes: the split kept while speeds do not differ."""
        self.check = GrowthCheck(self.cfg.growth) if self.cfg.check_growth else None
        self.split_check = SplitCheck(self.cfg.split) if self.cfg.check_split and self.cfg.split_margin > 0 else None
        self._costs_seen = -1.0  # the cost model's step count at the last decision
        self._gap_run = 0
        """Recorded neutral intervals running whose measured gap passed the margin, `_gap_slowest` the
        slowest rank in each."""
        self._gap_slowest = -1
        self._unit_from: float | None = None
        """The step count where neutral steps too few to test on their own began (None: none wait)."""
        self._stepwise = False
        """Per-step times were seen: the measured gap, not the predicted one, confirms a split."""
        self._restored = False
        """Restored into a fresh process: its next interval holds the start-up costs (a restored
        rank's first report keeps them, as the uninterrupted run's), so the split check skips it."""
        self._rechecked = False
        """The last decision asked for a recheck (never two running: a gap whose slowest rank swaps
        between intervals would otherwise recheck at every decision)."""
        self.phase: str | None = None
        """The phase the next interval runs in (:data:`~dynamix_hvd.control.phases.PHASES`; None before
        the first decision)."""

    @property
    def split_margin(self) -> float:
        """The proposal's split margin, raised by failed splits."""
        return max(self.cfg.split_margin, self.split_check.margin if self.split_check is not None else 0.0)

    def _costs(self, inp: DecisionInput) -> CostModel:
        if inp.costs is not None:
            return inp.costs
        R = len(inp.reports)
        if self._own is None or self._own.world_size != R:
            self._own = CostModel(R, self.costs_cfg)
        feed_means(self._own, inp.reports, inp.passes)
        return self._own

    def noise(self, inp: DecisionInput) -> float:
        value = inp.noise_lower if self.cfg.noise == "lower" else inp.noise_point
        return value if math.isfinite(value) else inp.ctx.noise_scale

    def decide(self, inp: DecisionInput) -> DecisionOutput:
        out = self.propose(inp)
        if self.guard is None:
            return out
        # a held proposal stays in self.last (and a split trial it started ends at the next neutral interval)
        passes = out.passes if out.passes is not None else inp.passes
        sizes, passes, held = self.guard.hold(out.sizes, passes, inp.sizes, inp.passes,
                                              bool(out.info.get("dithered")))
        return DecisionOutput(sizes, {**out.info, "held": held}, passes if held else out.passes)

    def propose(self, inp: DecisionInput) -> DecisionOutput:
        """This decision's proposal (what policy "ppo" refines): the interval's verdicts move the phase
        (:mod:`dynamix_hvd.control.phases`), the phase's function says what may change, the proposal
        changes that, and the record says why and what else was weighed."""
        if self.neutral is None or len(self.neutral) != len(inp.sizes):
            self.neutral = [float(b) for b in inp.sizes]
        B_now, initial = inp.ctx.global_batch, inp.ctx.initial_batch
        measured = self.phase or phase_of(False, False, off_neutral(inp.sizes, self.neutral), B_now > initial)
        ev = self._evidence(inp)
        if ev is None:  # no timed step yet: keep the sizes
            self.last, self._rechecked = None, False
            return DecisionOutput([inp.bounds.clip(r, b) for r, b in enumerate(inp.sizes)],
                                  {"proposal": None, "phase": measured})
        if ev.split_failed:
            now = "even"
            plan = Plan(hold_batch=True, back_to_even=True,
                        why="the split's measured step was not shorter by half its predicted gain: the sizes head "
                            "back to the job's own split (as far as the trust region allows in one decision); a "
                            f"new split needs a predicted gain of {self.split_margin:.0%}")
        else:
            now = phase_of(ev.checking and self.split_check.judging, self.check is not None and self.check.judging,
                           not ev.ran_neutral, B_now > initial)
            plan = getattr(self, "_" + now.replace(" ", "_"))(ev, inp)
        self.last = self._carry_out(plan, ev, inp)
        self.decisions += 1
        after = self._next_phase(inp)
        self.phase = after
        info = {**self.last.info(), "target_global_batch": self.last.global_batch, **ev.fit.summary(),
                "net_s": ev.net.net_s, "gamma": ev.net.gamma, "fit": "joint" if self.cfg.joint_fit else "staged",
                "may_grow": ev.may_grow, "growth_late": ev.late, "budget_cap": ev.budget_cap, "gap_bound": ev.gap,
                "gap_intervals": ev.intervals, "margin_lifted": ev.lifted, "speed_shift": ev.costs.shift.tolist(),
                "recheck": ev.recheck, "phase": now}
        if self.split_check is not None and (self.split_check.last or ev.split_failed):
            info["split_check"] = {**self.split_check.last, "failed_now": ev.split_failed,
                                   "margin": self.split_margin, "failures": self.split_check.failures}
        if self.check is not None and self.check.last:
            info["growth_check"] = {**self.check.last, "banned": self.check.banned, "accepted": self.check.accepted}
        info["transition"] = transition(measured, now, after, self._verdict(measured, now, ev),
                                        [plan.why, self._outcome(now, after, inp)],
                                        self._evidence_record(ev), self._alternatives(ev, inp))
        return DecisionOutput(self.last.sizes, info, self.last.passes)

    # --- the evidence an interval brings ------------------------------------------------------------
    def _evidence(self, inp: DecisionInput) -> Evidence | None:
        """Advance the checks on the interval just measured and test the ranks' speeds; None before
        any step was timed."""
        if self.check is not None:
            self.check.observe(inp.reports, inp.ctx.global_batch, inp.ctx.initial_batch, inp.step_losses,
                               inp.budget_left)
        may_grow = self.check is None or (self.check.ready and not self.check.banned)
        costs = self._costs(inp)
        fit = costs.fit()
        if fit is None:
            return None
        net = costs.fit_network()
        if self.cfg.joint_fit:
            fit, net = fit_joint(costs) or (fit, net)
        ran_neutral = not off_neutral(inp.sizes, self.neutral)
        # with token budgets and length bucketing an interval's step time follows the lengths it drew,
        # so the steps of two intervals say nothing of the split
        checking = self.split_check is not None and not costs.lengths_known
        fresh, self._costs_seen = costs.steps != self._costs_seen, costs.steps  # an interval was recorded
        split_failed = checking and self.split_check.observe(
            inp.reports, ran_neutral, inp.ctx.global_batch, first_interval=self._restored,
            speed_changed=fresh and bool((costs.shift != 1).any()), speed_pending=fresh and costs.change_pending,
            predicted_gain=0.0 if ran_neutral else predicted_split_gain(fit, net, inp.sizes, self.neutral, inp.passes))
        # the ranks' speeds differ by more than the margin, measured: with per-step times, the lower
        # confidence bound of a paired test on each interval's steps, a gain in the measured step
        # (:mod:`speedgap`), passes the configured margin in `split_intervals` recorded intervals
        # running at the neutral split, the same rank the slowest each time (a margin raised by a
        # failed split applies to the predicted gain, in the slowest arrival, as it was raised); with
        # interval means only, the predicted gain passes the margin in two intervals running. An
        # interval too short to test waits to be tested with the ones after it. A restored process's
        # first interval holds its start-up and is not evidence.
        # the sizes that ran were neutral (a neutral proposal clipped by the bounds counts as one; a
        # refinement or a held flip that ran other sizes does not)
        neutral_ran = ran_neutral or (self.last is not None and self.last.neutral
                                      and list(inp.sizes) == list(self.last.sizes))
        if fresh and not self._restored and inp.costs is not None:
            gap, slowest, passed = self._test_interval(costs, neutral_ran)
        else:  # not evidence; the latest interval's bound is still reported
            (gap, slowest), passed = speed_gap(*costs.latest_interval()), False
        self._restored = False
        intervals = self._gap_run
        # a gap measured in enough intervals running outweighs an earlier failed split: the configured
        # margin applies while the run lasts, and the raised one is dropped when a split is taken on it
        lifted = self.split_check is not None and self.split_check.outweighed(intervals, self.cfg.split_intervals)
        margin = self.cfg.split_margin if lifted else self.split_margin
        confirmed = (intervals >= self.cfg.split_intervals if self._stepwise
                     else self.last is not None and self.last.split_gain > margin)
        # a rank that measured its own compute time rise (its change vote) and is the slowest in the
        # paired test on the steps since, by a large gap: two independent measurements, as good as two
        # intervals (a small gap still waits for the second: a busy host slows a rank for a while)
        voted = (intervals > 0 and slowest in inp.changed_by and costs.shift[slowest] > 1.0
                 and gap >= self.cfg.recheck_gap)
        confirmed = confirmed or voted
        # this interval added evidence that the next must confirm: where the gap is large, decide again
        # after the fewest steps rather than a whole interval later (a rank that became slower waits one
        # interval less); a gap near the margin waits for the regular interval
        recheck = passed and gap >= self.cfg.recheck_gap and not confirmed and not self._rechecked
        self._rechecked = recheck
        return Evidence(costs, fit, net, may_grow, ran_neutral, checking, split_failed, gap, slowest, intervals,
                        lifted, margin, confirmed, recheck)

    # --- one function per phase: what a decision made in it may change ------------------------------
    def _even(self, ev: Evidence, inp: DecisionInput) -> Plan:
        return Plan(False, False, "the split may leave the job's own where the ranks' speeds are measured to "
                                  "differ; the global batch may grow where a larger one is predicted to pay")

    def _split(self, ev: Evidence, inp: DecisionInput) -> Plan:
        return Plan(False, False, "the split follows the fitted speeds (back to the job's own where it no longer "
                                  "pays half the margin); the global batch may grow")

    def _grown(self, ev: Evidence, inp: DecisionInput) -> Plan:
        return Plan(False, False, "the grown global batch follows the predicted goodput and the budget's cap; the "
                                  "split may leave the job's own as from even")

    def _split_and_grown(self, ev: Evidence, inp: DecisionInput) -> Plan:
        return Plan(False, False, "split and global batch both follow the fitted costs")

    def _judging_split(self, ev: Evidence, inp: DecisionInput) -> Plan:
        return Plan(True, False, "a split is being judged: the global batch holds until its verdict")

    def _judging_growth(self, ev: Evidence, inp: DecisionInput) -> Plan:
        return Plan(True, False, "a growth is being judged: the global batch holds until its verdict")

    # --- carrying the plan out ----------------------------------------------------------------------
    def _carry_out(self, plan: Plan, ev: Evidence, inp: DecisionInput) -> Proposal:
        """The proposal within what `plan` allows: one change at a time, a budget's cap, no growth too
        late to be judged, and the split left alone in the decision that leaves the job's own."""
        held = replace(self.cfg, search_batch=False)
        # A budget caps B where a larger batch would cost the job's end more than `budget_loss`; not
        # while a change is judged (its sizes must hold until the verdict).
        cap = None if plan.hold_batch else self._budget_cap(inp)

        def proposal(cfg: ProposalConfig, neutral: bool = False) -> Proposal:
            return propose(cfg, ev.fit, ev.net, inp.sizes, inp.bounds, inp.ctx.initial_batch, self.noise(inp),
                           self.decisions, inp.passes, self.neutral, ev.may_grow, split_confirmed=ev.confirmed,
                           split_margin=ev.margin, force_neutral=plan.back_to_even or neutral, cap=cap)

        ev.budget_cap = cap  # recorded as the budget set it (the late rule below may lower `cap`)
        last = self.last = proposal(held if plan.hold_batch else self.cfg)
        ev.late = not plan.hold_batch and self._growth_too_late(inp)
        if ev.late:  # no growth whose check could not give its verdict before the budget ends
            cap = min(max(inp.ctx.global_batch, inp.ctx.initial_batch), cap if cap is not None else math.inf)
            last = proposal(self.cfg)
        B_now = inp.ctx.global_batch
        leaving = ev.checking and ev.ran_neutral and not last.neutral and off_neutral(last.sizes, self.neutral)
        if leaving and self.cfg.search_batch and last.global_batch != B_now:
            last = proposal(held)
            if last.global_batch != B_now:  # the budget's cap moves B: that change alone, the split waits
                last = proposal(held, neutral=True)
            leaving = not last.neutral and off_neutral(last.sizes, self.neutral)
        if leaving:
            self.split_check.start(last.split_gain)
            if ev.lifted:
                self.split_check.lift()
        if ev.split_failed:
            self._end_gap_run()  # a later split needs fresh evidence
        return last

    def _next_phase(self, inp: DecisionInput) -> str:
        """The phase the next interval runs in, with the sizes just proposed."""
        grown = self.last.global_batch > inp.ctx.initial_batch
        growth_judged = (self.check is not None and not (self.check.accepted or self.check.banned) and grown)
        return phase_of(self.split_check is not None and self.split_check.judging, growth_judged,
                        off_neutral(self.last.sizes, self.neutral), grown)

    # --- the record ---------------------------------------------------------------------------------
    def _verdict(self, measured: str, now: str, ev: Evidence) -> str:
        """What the interval just measured decided, where it decided anything."""
        if ev.split_failed:
            c = self.split_check.last
            return (f"split failed: measured step {c.get('split_step_s', math.nan):.4g} s against the even "
                    f"split's {c.get('reference_step_s', math.nan):.4g} s")
        if measured == "judging split" and now != "judging split":
            c = self.split_check.last if self.split_check is not None else {}
            return (f"split kept: measured step {c.get('split_step_s', math.nan):.4g} s against the even "
                    f"split's {c.get('reference_step_s', math.nan):.4g} s")
        if measured == "judging growth" and now != "judging growth" and self.check is not None:
            c = self.check.last
            verdict = "fell behind" if self.check.banned else "kept up"
            return (f"growth {'banned' if self.check.banned else 'kept'}: the loss {verdict} with the initial "
                    f"batch's line (excess {c.get('excess', math.nan):.4g}, tolerance {c.get('tolerance', math.nan):.4g})")
        if ev.recheck:
            return f"speed gap {ev.gap:.3f} in one interval: decide again soon to confirm it"
        return ""

    def _outcome(self, now: str, after: str, inp: DecisionInput) -> str:
        last, B_now = self.last, inp.ctx.global_batch
        if after == now:
            return "" if list(last.sizes) == list(inp.sizes) and last.passes == inp.passes else "sizes follow the fit"
        if after == "judging split":
            return (f"leave the job's own split: the ranks' speeds were measured to differ in {self._gap_run} "
                    f"intervals running; equalising their arrivals is predicted to shorten the step by "
                    f"{last.split_gain:.1%}")
        if after == "judging growth":
            gain = last.predicted_goodput / last.goodput_now - 1 if last.goodput_now > 0 else math.nan
            return (f"grow the global batch {B_now} -> {last.global_batch}: predicted goodput {gain:+.1%} "
                    f"(noise scale {last.noise_scale:.4g})")
        if after in ("even", "grown") and now in ("split", "split and grown"):
            return "back to the job's own split: equalising no longer pays half the margin"
        if after in ("even", "split") and now in ("grown", "split and grown", "judging growth"):
            return f"the global batch returns to {last.global_batch}"
        if now == "even" and after in ("split", "split and grown"):
            return ("the trust region let the sizes move only part of the way back: the next interval runs off "
                    "the job's own split, and the split follows the fit from there, unjudged")
        return f"{now} -> {after}"

    def _evidence_record(self, ev: Evidence) -> dict[str, Any]:
        last = self.last
        return {"gap_bound": ev.gap, "slowest_rank": ev.slowest, "gap_intervals": ev.intervals,
                "split_margin": ev.margin, "split_confirmed": ev.confirmed, "predicted_split_gain": last.split_gain,
                "noise_scale": last.noise_scale, "goodput_now": last.goodput_now,
                "predicted_goodput": last.predicted_goodput, "may_grow": ev.may_grow, "budget_cap": ev.budget_cap,
                "growth_too_late": ev.late, "recheck": ev.recheck}

    def _alternatives(self, ev: Evidence, inp: DecisionInput) -> list[Alternative]:
        """The sizes kept, the job's own split and the arrival-equalising split of the current micro-batch,
        and the proposal, each with its predicted step and goodput."""
        R, passes = len(inp.sizes), inp.passes
        a_s, c_s = ev.fit.split_coefficients()
        lo = np.full(R, inp.bounds.min_batch, dtype=np.int64)
        hi = np.array([inp.bounds.upper(r) for r in range(R)], dtype=np.int64)
        micro = int(np.clip(sum(inp.sizes), lo.sum(), hi.sum()))
        even = neutral_sizes(micro, self.neutral, a_s, c_s, lo, hi).tolist()
        equal = round_split(equalise(np.array([float(micro)]), a_s, c_s, lo, hi)[0], micro, a_s, c_s, lo, hi)
        noise, initial = self.noise(inp), inp.ctx.initial_batch

        def scored(name: str, sizes: Sequence[int], p: int) -> Alternative:
            b = np.asarray(sizes, dtype=np.float64)
            step = float(np.atleast_1d(ev.net.step_time(ev.fit.arrival(b[None, :], split=True).max(1), p))[0])
            B = int(p * b.sum())
            gp = B * float(statistical_efficiency(noise, B, initial, unknown="no_gain")) / step if step > 0 else math.nan
            return Alternative(name, [int(x) for x in sizes], p, B, step, gp)

        return [scored("keep", inp.sizes, passes), scored("even split", even, passes),
                scored("equalised split", equal, passes), scored("chosen", self.last.sizes, self.last.passes)]

    def _budget_cap(self, inp: DecisionInput) -> int | None:
        """The largest global batch that, held to the budget's end, loses at most `budget_loss` of
        the budget's progress (see `ProposalConfig.budget_loss`), at least the initial batch; the
        current batch where it lies above that by no more than `hysteresis` (the noise scale's bound
        moves between decisions: a cap just below B must not move B every time). None without a
        budget, with `budget_loss` 1, or where every batch qualifies."""
        left = inp.budget_left
        if not (math.isfinite(left) and left > 0) or self.cfg.budget_loss >= 1:
            return None
        limit = batch_at_efficiency(self.noise(inp), 1.0 - self.cfg.budget_loss / left, inp.ctx.initial_batch)
        if not math.isfinite(limit):
            return None
        cap = max(int(math.floor(limit + 1e-9)), inp.ctx.initial_batch)
        B_now = inp.ctx.global_batch
        return B_now if cap < B_now <= cap * (1 + self.cfg.hysteresis) else cap

    def _growth_too_late(self, inp: DecisionInput) -> bool:
        """The proposal (`self.last`) starts a growth past the initial batch whose check could not
        give its verdict before the training budget ends: the verdict's earliest time (settling and
        judging, :meth:`GrowthCheck.verdict_seconds`, at the reference's typical interval, longer by
        the predicted step's growth) exceeds the training seconds the budget still holds
        (:meth:`GrowthCheck.seconds_left`, the rate so far) shortened by the predicted throughput
        gain. Such a growth would run unjudged to the end of the job. False where nothing is judged
        (no growth check, or its growth already accepted or banned), where the budget or the rate it
        is spent at is unknown, and for anything but a growth past the initial batch."""
        check = self.check
        if check is None or check.accepted or check.banned or self.last is None:
            return False
        B_now, B_new, initial = inp.ctx.global_batch, self.last.global_batch, inp.ctx.initial_batch
        if not B_new > max(B_now, initial) or B_now > initial:
            return False
        left_s = check.seconds_left(inp.budget_left)
        if not math.isfinite(left_s):
            return False
        noise = self.noise(inp)
        eff_keep = statistical_efficiency(noise, self.last.batch_keep, initial, unknown="no_gain")
        eff_new = statistical_efficiency(noise, B_new, initial, unknown="no_gain")
        speedup = 1.0  # samples per second at the new B over the current one
        if self.last.goodput_now > 0 and eff_new > 0 and math.isfinite(eff_keep / eff_new):
            speedup = max(self.last.predicted_goodput / self.last.goodput_now * eff_keep / eff_new, 1.0)
        steps = [r.step_s for r in inp.reports if math.isfinite(r.step_s) and r.step_s > 0]
        longer = max(self.last.predicted_step_s / float(np.median(steps)), 1.0) if steps else 1.0
        return check.verdict_seconds(check.typical_interval_s() * longer) > left_s / speedup

    def _test_interval(self, costs: CostModel, neutral_ran: bool) -> tuple[float, int, bool]:
        """The paired test on the interval just recorded, with any neutral steps before it too few to
        test on their own: its bound, the slowest rank, and whether it passed the margin (the run of
        passing intervals is extended, restarted or ended)."""
        if not neutral_ran or not costs.latest_per_step:  # not evidence; its bound is still reported
            if neutral_ran:
                self._unit_from = None  # steps waiting for more do not mix with an interval's means
            else:
                self._end_gap_run()
            return (*speed_gap(*costs.latest_interval()), False)
        start = costs.latest_after
        if self._unit_from is not None and self._unit_from <= start and not (costs.shift != 1).any():
            start = self._unit_from  # not across a change of speed, nor from another cost model
        if costs.changed_from is not None:  # a rank voted that its speed changed: the steps since
            start = max(start, costs.changed_from)
        gap, slowest = speed_gap(*costs.points_since(start))
        if not math.isfinite(gap):  # too few steps: the next interval adds its own to them
            self._unit_from = start
            return gap, slowest, False
        self._unit_from = None
        self._stepwise = True
        passed = gap > self.cfg.split_margin
        if not passed:
            self._end_gap_run()
        else:
            same = self._gap_run > 0 and slowest == self._gap_slowest
            self._gap_run, self._gap_slowest = (self._gap_run + 1 if same else 1), slowest
        return gap, slowest, passed

    def _end_gap_run(self) -> None:
        self._gap_run, self._gap_slowest, self._unit_from = 0, -1, None

    def after_decision(self) -> dict[str, float]:
        return {}

    def reset_world(self, world_size: int) -> None:
        self._own = None
        self._costs_seen = -1.0
        self._end_gap_run()
        self._rechecked = False
        self.neutral = None
        self.last = None
        self.phase = None
        if self.check is not None:  # a reference from another world says nothing about this one
            self.check = GrowthCheck(self.cfg.growth)
        if self.split_check is not None:
            self.split_check = SplitCheck(self.cfg.split)
        if self.guard is not None:
            self.guard = FlipGuard()

    def state_dict(self) -> dict[str, Any]:
        return {"decisions": self.decisions, "neutral": self.neutral,
                "growth": None if self.check is None else self.check.state_dict(),
                "split": None if self.split_check is None else self.split_check.state_dict(),
                "guard": None if self.guard is None else [list(h) for h in self.guard.history],
                "gap_run": self._gap_run, "gap_slowest": self._gap_slowest, "stepwise": self._stepwise,
                "rechecked": self._rechecked, "phase": self.phase}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "learner" in state:  # a deployed PPO policy's state: its proposal's and its guard's are this state
            state = {**state["model"], "guard": state.get("guard") if self.guard is not None else None}
        self.decisions = int(state["decisions"])
        neutral = state.get("neutral")  # absent in checkpoints from before the neutral split
        self.neutral = None if neutral is None else [float(x) for x in neutral]
        if self.check is not None and state.get("growth") is not None:
            self.check.load_state_dict(state["growth"])
        if self.split_check is not None and state.get("split") is not None:
            self.split_check.load_state_dict(state["split"])
        if self.guard is not None and state.get("guard") is not None:
            self.guard.history = [[int(b) for b in h] for h in state["guard"]]
        self._gap_run = int(state.get("gap_run", 0))
        self._gap_slowest = int(state.get("gap_slowest", -1))
        # neutral steps waiting for more were the previous process's: its start-up interval is not evidence
        self._unit_from = None
        self._stepwise = bool(state.get("stepwise", False))
        self._rechecked = bool(state.get("rechecked", False))
        self.phase = state.get("phase")
        self._restored = True


def feed_means(model: CostModel, reports: Sequence[RankReport], passes: int = 1) -> None:
    """One interval known only by its reports' means (what a hand-built DecisionInput carries; its
    sizes are micro-batches, `passes` of them per step)."""
    arrival = [r.compute_s + max(r.data_wait_s, 0.0) for r in reports]
    if not all(t > 0 and math.isfinite(t) for t in arrival):
        return
    sync = float(np.median([t + max(r.sync_wait_s, 0.0) for t, r in zip(arrival, reports)]))
    overhead = float(np.median([r.step_s - t - max(r.sync_wait_s, 0.0) for t, r in zip(arrival, reports)]))
    record_reports(model, [r.local_batch for r in reports], arrival, sync, overhead,
                   max(min(r.steps for r in reports), 1), passes)
