"""Per-rank step costs fitted online from per-step records. Pure NumPy: no MPI, no Horovod, no comm.

The model of one synchronous step (AdaptDL's form, with one cost line per rank):

    arrival_i(b) = a_i + c_i * max(b, k_i)                data wait + forward/backward of rank i at batch b
    T_sync       = (max_i arrival_i ** gamma + T_net ** gamma) ** (1 / gamma)
    T_step       = T_sync + overhead                      (optimizer update and the rest)

With gradient accumulation (p micro-batches per optimizer step) a step is p arrivals of the micro-batch,
the allreduce overlapping only the last: T_step = (p - 1) max_i arrival_i + T_sync + overhead; steps
are recorded as their mean micro-batch, so the lines stay per micro-batch.

`a_i` is a fixed cost per step, `c_i` a cost per sample; per-sample time t/b = a/b + c depends on b,
so only the pair is a speed. `k_i` is a small-batch knee (0: none): a GPU that a batch below k_i does
not fill takes as long as for k_i samples. The fit:

- per rank, a Huber-weighted least-squares line through the per-step (b, arrival) points (IRLS, the
  residual scale from their median absolute deviation), so a few slow steps (a GC pause, a page
  fault) do not move it;
- exponential forgetting: a point's weight halves every `half_life_steps` steps, so a line follows
  a slow drift;
- a change of speed: a rank whose arrivals, at sizes its line has seen, differ from the line's
  prediction by more than `shift_threshold` (log ratio, after a one-sided 99% bound of the steps'
  scatter taken as independent draws: :func:`~dynamix_hvd.control.speedgap.shrunk_mean` with
  ``serial=False``; a missed change leaves the line stale until forgetting catches up, a false one
  only restarts it, so this test keeps the plain bound's sensitivity) in two tested intervals, the same
  way, changed speed (a neighbour, a clock, a throttled link to its data; one such interval alone
  is a blip, common on shared hosts). A change that one interval's steps show decisively, from
  some step on far beyond the threshold at a strict serial bound (`decisive_factor`,
  :func:`~dynamix_hvd.control.speedgap.decisive_change`), is followed after that interval alone,
  the line restarting from the step where it began; a pause of a few steps is never decisive. Intervals at sizes the line has not seen (at most 2x from one
  it has, `max_extrapolation`) count only where their steps are off the line by more than the
  threshold beyond what the line can be off there without a change (a step's time between two
  sizes grows by a factor between 1 and their ratio): there they confirm a pending verdict the same
  way, and start one where the time went against the size, slower at a smaller size or faster at a
  larger one, which no step time that grows with its batch explains (a step that grows faster
  than its batch, memory pressure on a rank given more samples, or falls faster, a batch that fits
  a cache, is not taken for a change: the split check judges such a split);
  otherwise they leave a pending one as it is (they may lie between the two). The split moves a
  rank right after its speed changes, often within the interval that holds the change, so its next
  intervals are mostly at new sizes. A first verdict older than a half-life lapses. The first of
  the two (the change fell in it or just before it) and the points before it no longer count for
  the rank's line, which starts again from the intervals after it (the robust weights would
  otherwise take the new steps for outliers until they held half the weight, and forgetting needs
  several half-lives). Rescaling the old points instead would assume the change is one factor on
  the whole line; a change in the cost per sample alone would then bend the slope, and steps
  already at the new speed would be rescaled too. A line of one size is not identified until the
  next sizes are seen (see below). Not tested: intervals known only by their means, and token
  budgets (a step's time follows the lengths it drew);
- a change of speed at a new size (a start-up transient that ends as the split moves the rank): the
  test above cannot see it, but the line through both speeds needs a fixed cost far below zero
  (`impossible_fixed`), which no cost of a batch has; the line then starts again from that interval;
- identifiability: the slope needs at least two batch sizes. While a rank's (weighted) sizes spread
  less than `min_spread`, or its slope's standard error exceeds `max_rel_se` of it, its fit is
  `identified = False` and the two uses differ: the split takes the rank as a scaled copy of the
  identified ranks' lines through its own mean point, or, with none identified, assumes no fixed
  cost (sizes proportional to speed, which never pushes a rank below its equalising share),
  the throughput model pins a_i to `pinned_fixed_share` of the measured time (AdaptDL pins alpha_c to
  about half the compute, optimistic but bounded about larger batches). Policies that hold sizes
  still dither them a little to keep the fits identified (see :mod:`dynamix_hvd.control.proposal`);
- the knee, where it fits: after the line, each knee at one of the rank's recorded sizes is tried
  (the line through max(b, k), with the line's robust weights); one is kept only if it leaves
  `knee_residual` or less of the line's weighted squared residuals, with at least two sizes at or
  below it and one above (a flat stretch and a slope, both seen); then the line is refitted on
  max(b, k). No knee is ever assumed for sizes not seen;
- T_net and gamma by minimising the mean absolute log error of T_sync over a grid of gamma, T_net
  the weighted median that fits each gamma, with a short half-life of its own (`net_half_life_steps`); gamma = 1 (no overlap, pessimistic) unless another fits
  clearly better, which needs arrival times that vary (by more than 20% among the recent points).

With token budgets (variable-length data) `b` counts tokens, and attention adds a cost per token x
length: steps also carry s = the sum of their samples' squared lengths, and the lines become
arrival_i = a_i + c_i (b + eta s). eta, the job's attention cost per token and unit of length over
its linear cost per token, is shared by the ranks (a slow rank is slower at both); it is estimated
per rank by weighted least squares of the arrival on (1, b, s) and kept (the median of the ranks
where it is significant: t-statistic >= `attention_t`) only where the data show it; the lines are
then fitted on b + eta s and reported per token at the recent token-weighted mean length
L = sum s / sum b, c_i (1 + eta L), so the proposal still works in tokens. Knees are not searched
then.

Every step's points are kept (subsampled to `points_per_interval` per interval, each carrying the
weight of the steps it stands for), at most `capacity` of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import validate
from .speedgap import MIN_STEPS, change_start, decisive_change, shrunk_mean

GAMMAS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 10.0)
"""The overlap exponents the network fit tries (not a setting: the grid spans the model's domain, from
1, compute and allreduce adding up, to 10, close to full overlap, and the fit's choice among them is
what the cost model's tests pin down)."""
GAMMA_VARIED = 1.2
"""Gamma is fitted (not 1) only where the weighted points' arrival times vary by more than this
factor (not a setting: with arrivals this close, every gamma fits the synchronised times alike)."""
GAMMA_BETTER = 0.98
"""A gamma above 1 is kept only where its error is below this fraction of the best so far (not a
setting: the tie-break towards no overlap, the pessimistic model, among fits of equal error)."""


@dataclass(frozen=True)
class CostConfig:
    """Settings of the per-rank cost lines and the network fit (:class:`CostModel`), shared by the
    decision core's cost model and a policy's own."""

    half_life_steps: float = 200.0
    """Steps after which a point counts half in the per-rank lines (forgetting)."""
    net_half_life_steps: float = 24.0
    """The same for T_net, gamma and the overhead: one number each, which a decision interval's steps
    pin down, so they forget fast and follow a change of the link (a bandwidth drop) within a few
    decisions."""
    capacity: int = 512
    """Points kept (per rank); the oldest go first."""
    points_per_interval: int = 64
    """Steps of one interval kept as points (evenly spaced), each weighted by the steps it stands for."""
    huber_k: float = 1.345
    """Huber threshold in robust standard deviations of the residuals."""
    iterations: int = 6
    """IRLS iterations."""
    min_spread: float = 0.01
    """Weighted coefficient of variation of a rank's batch sizes below which its slope is not identified."""
    pinned_fixed_share: float = 0.5
    """Fixed share of the measured time assumed by the throughput model while a rank is not identified."""
    max_rel_se: float = 0.25
    """A slope whose standard error exceeds this fraction of it does not count as identified (two
    nearly equal sizes and timing noise give a line that would mislead the split)."""
    knee_residual: float = 0.5
    """A knee is kept only if its fit leaves at most this fraction of the line's squared residuals (0: no knees)."""
    attention_t: float = 3.0
    """t-statistic the per token x length term needs (in a rank's least squares of the arrival on
    tokens and squared lengths) to count; 0: never fitted."""
    shift_threshold: float = 0.1
    """A rank whose arrivals, at sizes its line has seen, differ from its line's prediction by more
    than this log ratio (after the steps' 99% one-sided bound) in two tested intervals (the second
    may be at a nearby new size, beyond the line's possible error there) changed speed:
    its line starts again after the first of them (module docstring). 0: never; lines then follow a
    change by forgetting alone."""

    decisive_factor: float = 2.0
    """A change of speed is followed after one interval, without waiting for a second, where that
    interval's steps after it are off the line by a median of more than this many times
    `shift_threshold`, most of them (`decisive_share`) beyond the threshold, at a strict serial bound
    (:func:`~dynamix_hvd.control.speedgap.decisive_change`); the line then starts again from the
    step where the change began. A pause of a few steps moves neither the median nor the share. 0:
    every change waits for a second interval."""
    decisive_share: float = 0.8
    """Share of the steps after a change that must be off the line by more than `shift_threshold`
    for the change to be followed after one interval (see `decisive_factor`)."""

    impossible_fixed: float = 0.5
    """A rank whose last interval, at sizes its line had not seen, ran faster than the line predicted
    there and whose least-squares line through all its points (without the a >= 0 bound) then has a
    fixed cost below minus this fraction of the line's time at the smallest size it saw (and below
    zero by more than two standard errors) mixes two speeds (a change of speed that coincided with a
    change of size, which the test at seen sizes cannot find): its line starts again from the last
    interval. A 2x transient that ended as the split moved the rank from 16 to 10 gives about -0.9; a
    convex cost (t = b ** 1.3) moved from 16 to 11 about -0.4 (moved up, it runs slower than the
    line predicted and is not tested). 0: never."""

    max_extrapolation: float = math.log(2.0)
    """Steps at a size where a rank's line can be off by more than this log ratio without any change of
    speed (the size's distance from the nearest one the line has seen plus the line's error there)
    are not compared with it (log 2: at most 2x from a seen size)."""
    seen_share: float = 0.05
    """A line has seen a size where at least this share of its rank's weight lies within
    `seen_within` of it; steps at sizes it has seen are tested against it as they come."""
    seen_within: float = 0.10
    """Relative distance from a size within which a line's points count as seeing it (a proportional
    line through one size is then off there by at most its fixed share of the time x 10%, within the
    10% a change of speed must exceed beyond the steps' scatter)."""
    latency_probes: int = 8
    """Latency probes kept (one per decision; their median is the collective's latency)."""

    def __post_init__(self) -> None:
        def number(name: str, **bounds: Any) -> None:
            validate.number(f"CostConfig.{name}", getattr(self, name), **bounds)

        for name in ("half_life_steps", "net_half_life_steps", "huber_k", "max_rel_se", "seen_within"):
            number(name, above=0)
        validate.integer("CostConfig.capacity", self.capacity, 2)
        for name in ("points_per_interval", "iterations", "latency_probes"):
            validate.integer(f"CostConfig.{name}", getattr(self, name), 1)
        for name in ("min_spread", "attention_t", "shift_threshold", "impossible_fixed", "max_extrapolation",
                     "decisive_factor"):
            number(name, minimum=0)
        number("decisive_share", above=0, maximum=1)
        for name in ("pinned_fixed_share", "knee_residual"):
            number(name, minimum=0, below=1)
        number("seen_share", above=0, maximum=1)


@dataclass
class CostFit:
    """Fitted arrival-time lines of every rank (arrays [R])."""

    fixed_s: np.ndarray
    """a_i (s); for an unidentified rank the throughput model's pinned value."""
    per_sample_s: np.ndarray
    """c_i (s per sample); for an unidentified rank the throughput model's value."""
    identified: np.ndarray
    """Whether two or more batch sizes pin the slope down."""
    fixed_se: np.ndarray
    per_sample_se: np.ndarray
    """Standard errors of a_i and c_i (inf where not identified): the confidence of the fit."""
    spread: np.ndarray
    """Weighted coefficient of variation of the rank's recorded batch sizes."""
    mean_batch: np.ndarray
    mean_time: np.ndarray
    knee: np.ndarray | None = None
    """k_i: sizes below it cost as much as it (0: no knee); None: no knees."""
    attention: float = 0.0
    """eta: the per token x length cost over the per-token cost (0: none fitted); `per_sample_s`
    already includes it at the recent mean length."""

    def __post_init__(self) -> None:
        if self.knee is None:
            self.knee = np.zeros_like(self.fixed_s)

    def arrival(self, sizes: np.ndarray, split: bool = False, borrowed: bool = True) -> np.ndarray:
        """Predicted arrival times of per-rank sizes ``[..., R]`` (`split`: the split's coefficients,
        `borrowed=False`: with unidentified ranks proportional to speed, guessing no fixed cost)."""
        a, c = self.split_coefficients(borrowed) if split else self.time_coefficients()
        return a + c * np.maximum(np.asarray(sizes, dtype=np.float64), self.knee)

    def split_coefficients(self, borrowed: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(a, c) for splitting a batch. A rank whose sizes do not pin its slope down (unidentified) is
        taken as a scaled copy of the identified ranks' lines through its own mean point: at its mean
        size, the fixed share of time their lines have there (the median over them). With no rank
        identified, or `borrowed=False`: proportional to speed (a = 0), which guesses no fixed cost
        and never pushes a rank below its equalising share. (Proportional next to identified lines
        with large fixed costs makes the rank at the smaller size look slower per sample because it
        is smaller, and keeps a split that no speed difference supports.)"""
        ident = self.identified
        b, t = self.mean_batch, self.mean_time
        share = np.zeros_like(b)
        if borrowed and ident.any() and not ident.all():
            a_i, c_i, k_i = self.fixed_s[ident], self.per_sample_s[ident], np.asarray(self.knee)[ident]
            for r in np.flatnonzero(~ident):
                share[r] = float(np.median(a_i / (a_i + c_i * np.maximum(b[r], k_i))))
        a = np.where(ident, self.fixed_s, share * t)
        c = np.where(ident, self.per_sample_s, (1.0 - share) * t / b)
        return a, c

    def time_coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, c) for predicting step times (unidentified ranks: AdaptDL's pinned fixed cost)."""
        return self.fixed_s, self.per_sample_s

    def relative_speed(self, batch: float) -> np.ndarray:
        """Samples per second of each rank at local batch `batch`, over the fastest rank's."""
        speed = batch / self.arrival(np.full(len(self.fixed_s), float(batch)), split=True)
        return speed / speed.max()

    def summary(self) -> dict[str, list[float]]:
        return {"fixed_s": self.fixed_s.tolist(), "per_sample_s": self.per_sample_s.tolist(),
                "identified": [bool(x) for x in self.identified], "per_sample_rel_se":
                (self.per_sample_se / self.per_sample_s).tolist(), "knee": np.asarray(self.knee).tolist(),
                "attention": self.attention}


@dataclass
class NetworkFit:
    net_s: float
    """T_net: the allreduce time not hidden behind compute."""
    gamma: float
    """Overlap exponent (1: compute and allreduce add up)."""
    overhead_s: float
    """Per-step time after synchronisation (optimizer update)."""
    bus_bytes: float = 0.0
    """Bytes each rank sends per step in a ring allreduce of the gradients: their bytes after
    compression x 2 (R - 1) / R (0: not reported)."""
    latency_s: float = math.nan
    """Median of the recent single-value allreduce probes: the collective's latency (NaN: none yet)."""
    bus_bandwidth_Bps: float = math.nan
    """Effective bus bandwidth of the gradient allreduce, bytes per second: `bus_bytes` over T_net less
    the latency (NaN: not measurable: no payload or probe, or T_net within 5% of the latency, i.e.
    the link's bandwidth is not what limits the allreduce)."""

    def with_link(self, bus_bytes: float, latency_s: float) -> "NetworkFit":
        """This fit with the link's measurements, and the bandwidth they imply."""
        moving = self.net_s - latency_s if math.isfinite(latency_s) else self.net_s
        bandwidth = bus_bytes / moving if bus_bytes > 0 and moving > 0.05 * self.net_s > 0 else math.nan
        return NetworkFit(self.net_s, self.gamma, self.overhead_s, bus_bytes, latency_s, bandwidth)

    def sync_time(self, arrival: np.ndarray | float) -> np.ndarray | float:
        g = self.gamma
        return (np.asarray(arrival, dtype=np.float64) ** g + self.net_s ** g) ** (1.0 / g)

    def step_time(self, arrival: np.ndarray | float, passes: np.ndarray | int = 1) -> np.ndarray | float:
        """One optimizer step of `passes` micro-batches whose slowest arrival is `arrival` each: the
        allreduce overlaps only the last one's backward."""
        a = np.asarray(arrival, dtype=np.float64)
        return (np.asarray(passes) - 1) * a + self.sync_time(a) + self.overhead_s


def kept_points(n: int, most: int) -> np.ndarray:
    """Positions of the points kept of an interval's `n` steps: at most `most`, evenly spaced."""
    return np.unique(np.linspace(0, n - 1, min(n, most)).round().astype(int))


def weighted_median(x: np.ndarray, w: np.ndarray) -> float:
    if len(x) == 0 or w.sum() <= 0:
        return 0.0
    order = np.argsort(x)
    cum = np.cumsum(w[order])
    return float(x[order][int(np.searchsorted(cum, 0.5 * cum[-1]))])


class CostModel:
    """Per-step points of all ranks and the fits through them (computed on demand, cached)."""

    def __init__(self, world_size: int, config: CostConfig | None = None) -> None:
        validate.integer("CostModel world_size", world_size, 1)
        self.world_size = world_size
        self.cfg = config or CostConfig()
        R = world_size
        self._b = np.zeros((0, R))
        self._s = np.zeros((0, R))  # sum of squared lengths per step (token budgets; 0: not kept)
        self._t = np.zeros((0, R))
        self._sync = np.zeros(0)
        self._arrival = np.zeros(0)
        self._overhead = np.zeros(0)
        self._at = np.zeros(0)      # step count of each point
        self._mult = np.zeros(0)    # steps each point stands for
        self._live = np.zeros((0, R))  # 1: the point counts for the rank's line; 0: from before a change of speed
        self.steps = 0.0
        self._latency = np.zeros(0)  # the latest single-value allreduce probes (s)
        self.payload_bytes = 0.0
        self._fit: CostFit | None = None
        self._net: NetworkFit | None = None
        self._latest_after = 0.0  # step count before the last recorded interval
        self._latest_steps_each = 1.0  # steps each row of the last recorded interval stands for
        self.shift = np.ones(world_size)
        """Per rank, the factor by which the last recorded interval found its speed changed (1: none)."""
        # per rank, the last tested interval's significant offset (0: none) and the step count at its end;
        # not checkpointed: a restored process's first interval carries its start-up costs
        self._pending = np.zeros(world_size)
        self._pending_end = np.zeros(world_size)
        self._restart_at: dict[int, float] = {}  # rank -> step count its line restarts after (this interval's)
        self._tested_at = np.zeros(0)  # step counts of the steps `_follow_speed` tests
        self.changed_from: float | None = None
        """The step count after which the last recorded interval's voted changes began (None: none)."""

    @property
    def points(self) -> int:
        return len(self._at)

    @property
    def change_pending(self) -> bool:
        """Some rank's last tested interval was off its line: a change of speed if the next one is too."""
        return bool((self._pending != 0).any())

    @property
    def lengths_known(self) -> bool:
        """The points carry squared lengths (token budgets): a step's cost depends on its samples'
        lengths, so intervals of one split differ by the lengths they drew."""
        return self.points > 0 and bool((self._s[-1] > 0).all())  # the latest interval's points

    def record(self, batches: np.ndarray, arrival: np.ndarray, sync_end: np.ndarray | None = None,
               overhead_s: float = 0.0, steps_each: float = 1.0, passes: np.ndarray | None = None,
               sq_tokens: np.ndarray | None = None, changed: Sequence[int] = ()) -> None:
        """Add one interval: `batches`, `arrival` [n, R] per step (arrival = data wait + compute),
        `sync_end` [n] the time from a step's start to the end of its allreduce (None: unknown, the
        network is then fitted from other intervals), `overhead_s` the time after it. `steps_each`: steps
        each row stands for (> 1 when only interval means are known). `passes` [n]: micro-batches
        accumulated into each step (None: 1); such a step is kept as its mean micro-batch (batch and
        arrival over p), and its allreduce as following the last one. `sq_tokens` [n, R]: with token
        budgets, the sum of each step's squared sample lengths (None: not kept). `changed`: ranks that
        measured a change of their own speed in this interval (a change vote, `changewatch`): their
        lines start again from where the change began, as after a decisive change. Non-finite or
        non-positive rows are dropped."""
        b = np.asarray(batches, dtype=np.float64)
        t = np.asarray(arrival, dtype=np.float64)
        R = self.world_size
        if b.ndim != 2 or b.shape[1] != R or t.shape != b.shape:
            raise ValueError(f"record needs batches and arrival of shape [n, {R}], got {b.shape} and {t.shape}")
        n = len(b)
        q = np.zeros_like(b) if sq_tokens is None else np.asarray(sq_tokens, dtype=np.float64)
        if q.shape != b.shape:
            raise ValueError(f"sq_tokens needs shape {b.shape}, got {q.shape}")
        s = np.full(n, np.nan) if sync_end is None else np.asarray(sync_end, dtype=np.float64)
        if s.shape != (n,):
            raise ValueError(f"sync_end needs shape ({n},), got {s.shape}")
        if passes is not None:
            p = np.asarray(passes, dtype=np.float64)
            if p.shape != (n,) or not (p >= 1).all():
                raise ValueError(f"passes needs shape ({n},) with values >= 1, got {p}")
            b, t, q = b / p[:, None], t / p[:, None], q / p[:, None]
            s = s - (p - 1) * t.max(1)  # the earlier micro-batches' time comes before the allreduce
        at = self.steps + steps_each * (np.arange(n) + 1.0)
        self._latest_after, self._latest_steps_each = self.steps, float(steps_each)
        self.steps += steps_each * n
        ok = np.isfinite(b).all(1) & np.isfinite(t).all(1) & (b > 0).all(1) & (t > 0).all(1)
        self.shift = np.ones(R)
        self.changed_from = None
        if not ok.any():
            return
        if self.cfg.shift_threshold > 0 and not (q[ok] > 0).any():  # token budgets: a step's time
            self._tested_at = at[ok]                                # follows the lengths it drew
            self._follow_speed(b[ok], t[ok])
        for r in changed:
            if r in self._restart_at:  # already followed as a decisive change
                after = self._restart_at[r]
                self.changed_from = after if self.changed_from is None else min(self.changed_from, after)
            elif 0 <= r < R and ok.sum() >= MIN_STEPS:
                self._voted_change(r, b[ok], t[ok], at[ok])
        idx = np.flatnonzero(ok)
        keep = idx[kept_points(len(idx), self.cfg.points_per_interval)]
        mult = steps_each * len(idx) / len(keep)
        over = overhead_s if math.isfinite(overhead_s) and overhead_s > 0 else 0.0
        cap = self.cfg.capacity
        self._b = np.concatenate([self._b, b[keep]])[-cap:]
        self._s = np.concatenate([self._s, np.where(np.isfinite(q[keep]), q[keep], 0.0)])[-cap:]
        self._t = np.concatenate([self._t, t[keep]])[-cap:]
        self._arrival = np.concatenate([self._arrival, t[keep].max(1)])[-cap:]
        self._sync = np.concatenate([self._sync, s[keep]])[-cap:]
        self._overhead = np.concatenate([self._overhead, np.full(len(keep), over)])[-cap:]
        self._at = np.concatenate([self._at, at[keep]])[-cap:]
        self._mult = np.concatenate([self._mult, np.full(len(keep), mult)])[-cap:]
        self._live = np.concatenate([self._live, np.ones((len(keep), R))])[-cap:]
        for r, after in self._restart_at.items():  # a change followed after one interval: its earlier steps go
            before = self._at <= after
            self._live[before if (~before).any() else slice(None, -1), r] = 0.0
        self._restart_at = {}
        self._fit = self._net = None
        if self.cfg.impossible_fixed > 0 and not (q[ok] > 0).any():
            self._restart_impossible_lines()

    def _follow_speed(self, b: np.ndarray, t: np.ndarray) -> None:
        """Each rank whose new steps (sizes `b`, arrivals `t` [n, R], the last `self.steps`) are off
        its line the same way as the last interval that could be tested: that interval and the points
        before it stop counting for its line (module docstring; the change fell somewhere in it, so
        it may hold both speeds). Sets `shift`: the new steps' factor over the line, which the earlier
        interval's steps already pulled towards them (so it understates the change). Verdicts come
        from steps at sizes the line has seen (`CostConfig.seen_share`, `seen_within`); at sizes it has not seen,
        the line's own error there, not the steps' scatter, would decide, so only a deviation beyond
        the most that error can be starts or confirms one (module docstring). Intervals known only by
        their means (fewer than `MIN_STEPS` steps) are not tested."""
        self._pending[self._latest_after - self._pending_end > self.cfg.half_life_steps] = 0.0  # lapsed
        fit = self.fit()
        if fit is None or len(b) < MIN_STEPS:
            return
        w = self.line_weights()
        predicted = fit.arrival(b, split=True, borrowed=False)  # an unidentified line: proportional, at the size it saw
        for r in range(self.world_size):
            sizes, which = np.unique(b[:, r], return_inverse=True)
            seen_size = _seen(sizes, self._b[:, r], w[:, r], self.cfg.seen_share, self.cfg.seen_within)
            if not fit.identified[r]:  # proportional through its mean size: near that size only
                seen_size &= np.abs(sizes / fit.mean_batch[r] - 1.0) <= self.cfg.seen_within
            seen = seen_size[which]
            if seen.sum() < MIN_STEPS:
                # At sizes the line has not seen, only steps off the line beyond what its error there
                # can be (`_extrapolation_allowance`) count: they confirm a pending verdict in its
                # direction, and start one where the time went against the size (never drop one).
                # The split moves a rank as soon as its speed changes, often within the interval that
                # holds the change, so the intervals after it are mostly at new sizes: a verdict that
                # waited for a seen size would lapse while the line followed the new speed by
                # forgetting alone, the robust weights taking the new steps for outliers for several
                # half-lives.
                allowance, smaller = self._extrapolation_allowance(r, sizes, w[:, r], fit)
                allowance, smaller = allowance[which], smaller[which]
                testable = allowance <= self.cfg.max_extrapolation
                if testable.sum() < MIN_STEPS:
                    continue
                d = np.log(t[testable, r] / predicted[testable, r])
                for way in (1.0, -1.0):  # slower, faster: beyond the allowance one way at most
                    off = float(shrunk_mean((d - way * allowance[testable])[:, None], serial=False)[0])
                    if off * way <= self.cfg.shift_threshold:
                        continue
                    if off * self._pending[r] > 0:
                        self._confirm_shift(r, float(d.mean()))
                    elif (smaller[testable] == (way > 0)).all():  # slower and smaller, or faster and larger
                        self._pending[r], self._pending_end[r] = off, self.steps
                continue  # otherwise an earlier interval's verdict waits for the next
            d = np.log(t[seen, r] / predicted[seen, r])
            if self._decisive(r, d, seen):  # a change large and clear enough to follow at once
                continue
            off = float(shrunk_mean(d[:, None], serial=False)[0])
            if abs(off) <= self.cfg.shift_threshold:
                self._pending[r] = 0.0
            elif off * self._pending[r] > 0:  # the second interval: a change, not a blip
                self._confirm_shift(r, float(d.mean()))
            else:
                self._pending[r], self._pending_end[r] = off, self.steps

    def _decisive(self, r: int, d: np.ndarray, seen: np.ndarray) -> bool:
        """Rank `r`'s interval (log ratios `d` of its steps at seen sizes, `seen` the mask of those
        steps among the interval's) holds a change decisive on its own (`CostConfig.decisive_factor`):
        its line starts again from the step where the change began, at once."""
        if not self.cfg.decisive_factor or not seen.all():  # with steps at unseen sizes between, the
            return False                                     # start of the change is not in `d`'s order
        start = decisive_change(d, self.cfg.shift_threshold, self.cfg.decisive_factor, self.cfg.decisive_share)
        if start is None:
            return False
        self.shift[r] = math.exp(float(np.median(d[start:])))
        self._live[:, r] = 0.0  # every earlier interval's points; this interval's before `start` in record()
        self._restart_at[r] = float(self._tested_at[start]) - 0.5 * self._latest_steps_each
        self._pending[r] = 0.0
        self._fit = None
        return True

    def _voted_change(self, r: int, b: np.ndarray, t: np.ndarray, at: np.ndarray) -> None:
        """Rank `r` measured its own speed change in this interval (its change vote): its line starts
        again from the step where its arrivals, against the line (or as they are, before any fit),
        moved most clearly, and `changed_from` is that step's count (the earliest over such ranks)."""
        fit = self.fit()
        if fit is not None:  # log ratios to the line: 0 where the rank runs as the line says
            d = np.log(t[:, r] / fit.arrival(b, split=True, borrowed=False)[:, r])
        else:  # no line yet (a new world): against the interval's first steps
            d = np.log(t[:, r])
            d = d - np.median(d[:MIN_STEPS])
        way = 1.0 if np.median(d[-MIN_STEPS:]) >= np.median(d) else -1.0
        start = change_start(d, way)
        if start == 0 and fit is None:
            return  # the whole interval at one speed and nothing to compare it with
        if self.shift[r] == 1.0:  # from the line (or the interval's start) to the steps after the change
            self.shift[r] = math.exp(float(np.median(d[start:]) - (np.median(d[:start]) if start else 0.0)))
        self._live[:, r] = 0.0
        self._restart_at[r] = float(at[start]) - 0.5 * self._latest_steps_each
        self._pending[r] = 0.0
        self._fit = None
        after = self._restart_at[r]
        self.changed_from = after if self.changed_from is None else min(self.changed_from, after)

    def _confirm_shift(self, r: int, log_factor: float) -> None:
        """Rank `r` changed speed: its pending interval and the points before it stop counting."""
        self.shift[r] = math.exp(log_factor)
        self._live[self._at <= self._pending_end[r], r] = 0.0
        self._pending[r] = 0.0
        self._fit = None

    def _extrapolation_allowance(self, r: int, sizes: np.ndarray, weights: np.ndarray,
                                 fit: CostFit) -> tuple[np.ndarray, np.ndarray]:
        """Per size in `sizes`: how far off (log ratio) rank `r`'s line can be there without any change
        of speed, least over the sizes the line has seen (an unidentified line: its mean size) of
        |log(size / seen size)| plus the line's own error near the seen size (the weighted mean log
        residual of its points within `CostConfig.seen_within` of it, plus their weighted mean |log| distance
        from it; inf where it has none); and whether the size is below the seen size that
        gives that least. Every line the fit gives (a, c >= 0, a knee max(b, k) included) and every
        step time t(b) = a + c b grows between two sizes by a factor between 1 and their ratio, so a
        line right at one is off at the other by at most the log of the ratio."""
        live = weights > 0
        b = self._b[live, r]
        residual = np.log(self._t[live, r] / fit.arrival(self._b[live], split=True, borrowed=False)[:, r])
        if fit.identified[r]:
            held = np.unique(b)
            anchors = held[_seen(held, b, weights[live], self.cfg.seen_share, self.cfg.seen_within)]
        else:
            anchors = np.array([fit.mean_batch[r]])
        allowance, smaller = np.full(len(sizes), np.inf), np.zeros(len(sizes), dtype=bool)
        for anchor in anchors:
            near = np.abs(b / anchor - 1.0) <= self.cfg.seen_within
            if not weights[live][near].sum() > 0:
                continue
            spread = np.abs(np.log(b[near] / anchor))  # the points' own distance from the anchor
            error = abs(float(np.average(residual[near], weights=weights[live][near]))) \
                + float(np.average(spread, weights=weights[live][near]))
            here = np.abs(np.log(sizes / anchor)) + error
            closer = here < allowance
            allowance, smaller = np.where(closer, here, allowance), np.where(closer, sizes < anchor, smaller)
        return allowance, smaller

    def _restart_impossible_lines(self) -> None:
        """Each rank whose last interval ran at sizes its line had not seen (which the shift test
        leaves alone), faster than its line through the earlier points predicted there, and whose
        line through all of them, fitted without the bound a >= 0, would cross zero time at a positive
        batch (a fixed cost below minus `impossible_fixed` of its time at the smallest size, and below
        zero by more than two standard errors): no cost of a batch looks like that, two speeds at two
        sizes do (a transient that ended when the split moved the rank to a new size). The bound would
        turn it into a line through the origin that keeps the old speed for as long as its points
        weigh (half-lives); instead the rank's line starts again from the last interval, as after a
        change of speed found by the test at seen sizes, and `shift` is its factor over the earlier
        line. A slower interval at a new size is left to the shift test (one slow interval is a
        blip: a warm-up after a change of size, a neighbour). Not for intervals known only by their
        means (fewer than `MIN_STEPS` points: no scatter to test against)."""
        w = self.line_weights()
        latest = self._at > self._latest_after
        if latest.sum() < MIN_STEPS:
            return
        for r in range(self.world_size):
            wr, b, t = w[:, r], self._b[:, r], self._t[:, r]
            old = ~latest & (wr > 0)
            if not old.any():
                continue
            new = np.unique(b[latest])  # sizes the line had seen are the shift test's (a blip is not a change)
            if _seen(new, b[old], wr[old], self.cfg.seen_share, self.cfg.seen_within).any():
                continue
            line = _least_squares(b, t, wr, self.cfg.min_spread)
            if line is None:
                continue
            a, c, se_a = line
            if not (a < -self.cfg.impossible_fixed * (a + c * b[wr > 0].min()) and a + 2 * se_a < 0):
                continue
            earlier = _least_squares(b[old], t[old], wr[old], self.cfg.min_spread)
            if earlier is None or earlier[0] < 0:  # one size, or no fixed cost: through the origin
                slope = float((wr[old] * b[old] * t[old]).sum() / (wr[old] * b[old] ** 2).sum())
                earlier = (0.0, slope, 0.0)
            offset = float(np.mean(np.log(t[latest] / (earlier[0] + earlier[1] * b[latest]))))
            if offset >= 0:
                continue
            self.shift[r] = math.exp(offset)
            self._live[~latest, r] = 0.0
            self._pending[r] = 0.0
            self._fit = None

    @property
    def latest_after(self) -> float:
        """The step count before the last recorded interval (where `latest_interval` begins)."""
        return self._latest_after

    @property
    def latest_per_step(self) -> bool:
        """The last recorded interval came with per-step times (not only its means)."""
        return self._latest_steps_each == 1.0

    def latest_interval(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kept points of the last recorded interval: batches and arrival times [n, R] and step
        times [n] (the allreduce's end plus the time after it; NaN where not known), one row per kept
        step (one row standing for the interval where only its means were known)."""
        return self.points_since(self._latest_after)

    def points_since(self, step: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As `latest_interval`, for every interval recorded after the job's first `step` steps (those
        still held: the oldest points leave at `CostConfig.capacity`)."""
        mine = self._at > step
        return self._b[mine], self._t[mine], self._sync[mine] + self._overhead[mine]

    def record_link(self, payload_bytes: float, latency_s: float) -> None:
        """What the link carries and how fast it answers: the gradient bytes of one step (after
        compression) and one latency probe (a single-value allreduce's seconds; NaN: none)."""
        if math.isfinite(payload_bytes) and payload_bytes > 0:
            self.payload_bytes = float(payload_bytes)
        if math.isfinite(latency_s) and latency_s > 0:
            self._latency = np.append(self._latency, latency_s)[-self.cfg.latency_probes:]
        self._net = None

    def _weights(self, half_life: float | None = None) -> np.ndarray:
        half_life = self.cfg.half_life_steps if half_life is None else half_life
        return self._mult * 0.5 ** ((self.steps - self._at) / half_life)

    def line_weights(self) -> np.ndarray:
        """Each point's weight [n, R] in each rank's line: forgetting, and none from before the
        rank's last change of speed."""
        return self._weights()[:, None] * self._live

    def fit(self) -> CostFit | None:
        """The per-rank lines (None before the first point)."""
        if self._fit is None and self.points:
            self._fit = self._fit_lines()
        return self._fit

    def _fit_lines(self) -> CostFit:
        b, w = self._b, self.line_weights()
        eta = self._attention(w) if self.cfg.attention_t > 0 and (self._s > 0).all() else 0.0
        if eta > 0:
            fit = self._irls(b + eta * self._s, w)[0]
            sw = w.sum(0)
            mean_tokens = (w * b).sum(0) / sw
            length = (w * self._s).sum(0) / (w * b).sum(0)  # token-weighted mean length
            per_token = 1.0 + eta * length
            fit.per_sample_s, fit.per_sample_se = fit.per_sample_s * per_token, fit.per_sample_se * per_token
            fit.mean_batch, fit.attention = mean_tokens, eta
            return fit
        line = self._irls(b, w)
        knee = self._knees(line[-1]) if self.cfg.knee_residual > 0 else np.zeros(self.world_size)
        if not knee.any():
            return line[0]
        fit = self._irls(np.maximum(b, knee), w)[0]
        fit.knee = knee
        return fit

    def _attention(self, w: np.ndarray) -> float:
        """eta of the per token x length term (see the module docstring), 0 where no rank shows one."""
        etas = []
        for r in range(self.world_size):
            X = np.stack([np.ones(len(self._b)), self._b[:, r], self._s[:, r]], 1)
            sw = np.sqrt(w[:, r])
            if (w[:, r] > 0).sum() < 6:
                continue
            # columns of 1, ~1e3 and ~1e6 tokens: scaled to unit size so the solve and its covariance
            # are not lost to conditioning (the SVD of the scaled design gives both)
            scale = np.sqrt((w[:, r, None] * X ** 2).sum(0) / w[:, r].sum())
            A = X / scale * sw[:, None]
            U, sv, Vt = np.linalg.svd(A, full_matrices=False)
            if sv[-1] <= 1e-8 * sv[0]:
                continue  # lengths do not vary apart from token counts: nothing to separate
            coef = (Vt.T @ ((U.T @ (self._t[:, r] * sw)) / sv)) / scale
            resid = (self._t[:, r] - X @ coef) * sw
            n_eff = w[:, r].sum() ** 2 / (w[:, r] ** 2).sum()
            sigma2 = float(resid @ resid) / w[:, r].sum() * n_eff / max(n_eff - 3, 1e-9)
            # (A^T A)^-1 in the scaled units, times the weights' effective-count normalisation
            inv = (Vt.T / sv ** 2) @ Vt * w[:, r].sum() / n_eff
            var_d = sigma2 * inv[2, 2] / scale[2] ** 2
            _, c, d = coef
            if d > 0 and d >= self.cfg.attention_t * math.sqrt(max(var_d, 0.0)):
                length = float((w[:, r] * self._s[:, r]).sum() / (w[:, r] * self._b[:, r]).sum())
                etas.append(d / max(c, 0.05 * d * length))  # attention at most 95% of a token's cost
        return float(np.median(etas)) if etas else 0.0

    def _knees(self, W: np.ndarray) -> np.ndarray:
        """Per rank, the knee (a recorded size) whose fit leaves at most `knee_residual` of the
        line's weighted squared residuals, if any (0: none). `W`: the line's robust weights."""
        out = np.zeros(self.world_size)
        for r in range(self.world_size):
            b, t, w = self._b[:, r], self._t[:, r], W[:, r]
            sizes = np.unique(b[w > 1e-6 * w.max()])
            if len(sizes) < 3:
                continue
            best = (self.cfg.knee_residual * _line_sse(b, t, w), 0.0)
            for k in sizes[1:-1]:  # at least two sizes at or below the knee, one above
                sse = _line_sse(np.maximum(b, k), t, w)
                if sse < best[0]:
                    best = (sse, float(k))
            out[r] = best[1]
        return out

    def _irls(self, b: np.ndarray, w: np.ndarray) -> tuple[CostFit, np.ndarray]:
        """Huber IRLS lines of the arrival times on `b` [n, R] (point weights `w`); the fit and the
        final robust weights."""
        cfg, t = self.cfg, self._t
        W = w
        for _ in range(cfg.iterations):
            sw = W.sum(0)
            mb, mt = (W * b).sum(0) / sw, (W * t).sum(0) / sw
            vb = (W * (b - mb) ** 2).sum(0) / sw
            spread = np.sqrt(vb) / mb
            ident = spread >= max(cfg.min_spread, 1e-9)
            cov = (W * (b - mb) * (t - mt)).sum(0) / sw
            c = np.where(ident, cov / np.where(ident, vb, 1.0), mt / mb)
            a = mt - c * mb
            through_origin = (W * b * t).sum(0) / (W * b * b).sum(0)
            c = np.where(a < 0, through_origin, c)       # a fixed cost is never negative
            a = np.maximum(a, 0.0)
            flat = c <= 0                                 # time falling with b: noise, keep a tiny slope
            c = np.where(flat, 1e-6 * mt / mb, c)
            a = np.where(flat, np.maximum(mt - c * mb, 0.0), a)
            resid = t - a - c * b
            # residual scale, floored at 0.1% of the time (timer resolution; exact points must not
            # down-weight each other over rounding errors)
            scale = np.maximum(1.4826 * np.median(np.abs(resid), axis=0), 1e-3 * mt)
            huber = np.minimum(1.0, cfg.huber_k * scale / np.maximum(np.abs(resid), 1e-300))
            W = w * huber
        sw = W.sum(0)
        n_eff = sw ** 2 / (W ** 2).sum(0)
        sigma2 = (W * resid ** 2).sum(0) / sw * n_eff / np.maximum(n_eff - 2, 1e-9)
        with np.errstate(divide="ignore", invalid="ignore"):
            se_c = np.where(ident, np.sqrt(sigma2 / (n_eff * vb)), np.inf)
            se_a = np.where(ident, np.sqrt(sigma2 * (1 / n_eff + mb ** 2 / (n_eff * vb))), np.inf)
        ident = ident & (se_c < cfg.max_rel_se * c)
        se_c, se_a = np.where(ident, se_c, np.inf), np.where(ident, se_a, np.inf)
        pin = cfg.pinned_fixed_share
        a = np.where(ident, a, pin * mt)
        c = np.where(ident, c, (1 - pin) * mt / mb)
        return CostFit(a, c, ident, se_a, se_c, spread, mb, mt), W

    def fit_network(self) -> NetworkFit:
        """T_net, gamma and the overhead (T_net = 0, gamma = 1 before any synchronisation was timed)."""
        if self._net is None:
            self._net = self._fit_network()
        return self._net

    def _fit_network(self) -> NetworkFit:
        w = self._weights(self.cfg.net_half_life_steps)
        overhead = weighted_median(self._overhead, w)
        ok = np.isfinite(self._sync) & (self._sync > 0)
        if not ok.any():
            return self._with_link(NetworkFit(0.0, 1.0, overhead))
        A, S, w = self._arrival[ok], np.maximum(self._sync[ok], self._arrival[ok]), w[ok]
        best: tuple[float, float, float] | None = None
        varied = A[w > 1e-3 * w.max()]
        for g in GAMMAS if varied.max() > GAMMA_VARIED * varied.min() else GAMMAS[:1]:
            net = weighted_median((S ** g - A ** g) ** (1.0 / g), w)
            err = float(np.sum(w * np.abs(np.log((A ** g + net ** g) ** (1.0 / g) / S))) / w.sum())
            if best is None or err < GAMMA_BETTER * best[0] - 1e-4:  # prefer no overlap unless clearly better
                best = (err, net, g)
        assert best is not None
        return self._with_link(NetworkFit(best[1], best[2], overhead))

    def _with_link(self, net: NetworkFit) -> NetworkFit:
        latency = float(np.median(self._latency)) if len(self._latency) else math.nan
        return net.with_link(self.payload_bytes * 2 * (self.world_size - 1) / self.world_size, latency)

    # --- plain state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "steps": self.steps, "payload_bytes": self.payload_bytes,
                "latest_after": self._latest_after,
                **{k: getattr(self, "_" + k).tolist() for k in _ARRAYS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["world_size"]) != self.world_size:
            raise ValueError(f"cost model state for {state['world_size']} ranks, this model has {self.world_size}")
        self.steps = float(state["steps"])
        self.payload_bytes = float(state.get("payload_bytes", 0.0))
        self._latest_after = float(state.get("latest_after", self.steps))
        self._pending = np.zeros(self.world_size)
        for k in _ARRAYS:
            arr = np.asarray(state.get(k, []), dtype=np.float64)
            if k == "s" and arr.size == 0:  # state from before squared lengths were kept
                arr = np.zeros(len(state.get("b", [])) * self.world_size)
            if k == "live" and arr.size == 0:  # state from before changes of speed were followed
                arr = np.ones(len(state.get("b", [])) * self.world_size)
            per_rank = k in ("b", "s", "t", "live")
            setattr(self, "_" + k, arr.reshape(-1, self.world_size) if per_rank else arr.reshape(-1))
        self._fit = self._net = None


_ARRAYS = ("b", "s", "t", "live", "sync", "arrival", "overhead", "at", "mult", "latency")


def _seen(sizes: np.ndarray, points: np.ndarray, weights: np.ndarray, share: float, within: float) -> np.ndarray:
    """Per size in `sizes`: whether a line through `points` (one rank's sizes) with `weights` has
    seen it (`share` of the weight within `within` of it: `CostConfig.seen_share`, `seen_within`)."""
    near = np.abs(points[None, :] / sizes[:, None] - 1.0) <= within  # [sizes, points]
    return (near * weights).sum(1) >= share * weights.sum()


def _least_squares(x: np.ndarray, y: np.ndarray, w: np.ndarray, min_spread: float) -> tuple[float, float, float] | None:
    """Weighted least-squares line y = a + c x without bounds: (a, c, standard error of a); None where
    the x spread less than `min_spread` (coefficient of variation) or the points are too few (an
    effective count of 3 or less) for a standard error."""
    sw = w.sum()
    if not sw > 0:
        return None
    mx, my = (w * x).sum() / sw, (w * y).sum() / sw
    vx = (w * (x - mx) ** 2).sum() / sw
    n_eff = sw ** 2 / (w ** 2).sum()
    if not (np.sqrt(vx) >= max(min_spread, 1e-9) * mx and n_eff > 3):
        return None
    c = (w * (x - mx) * (y - my)).sum() / sw / vx
    a = my - c * mx
    sigma2 = (w * (y - a - c * x) ** 2).sum() / sw * n_eff / (n_eff - 2)
    return float(a), float(c), math.sqrt(sigma2 * (1 / n_eff + mx ** 2 / (n_eff * vx)))


def _line_sse(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """Weighted squared residuals of the weighted least-squares line of y on x."""
    sw = w.sum()
    mx, my = (w * x).sum() / sw, (w * y).sum() / sw
    vx = (w * (x - mx) ** 2).sum()
    c = (w * (x - mx) * (y - my)).sum() / vx if vx > 0 else 0.0
    return float((w * (y - my - c * (x - mx)) ** 2).sum())


def record_reports(model: CostModel, batches: Sequence[int], arrival: Sequence[float], sync_end: float,
                   overhead_s: float, steps: float, passes: int = 1) -> None:
    """Feed one interval known only by its means (one point per rank, standing for `steps` steps);
    `batches` are micro-batch sizes, `arrival` and `sync_end` whole steps of `passes` micro-batches."""
    model.record(passes * np.asarray([batches], dtype=np.float64), np.asarray([arrival], dtype=np.float64),
                 np.asarray([sync_end]), overhead_s, steps_each=max(float(steps), 1.0),
                 passes=np.array([float(passes)]))
