"""A run's decisions in words: ``dynamix-hvd explain RUN``.

The default policy records, with every decision, the phase of the interval it measured, the verdict
that interval brought, the phase it decided in and the one the next interval runs in, why, the
evidence and the alternatives it weighed with their predicted step times
(:func:`dynamix_hvd.control.phases.transition`). This module turns a run's decision history into
lines a person reads top to bottom: one block per decision that changed something, and one line for
each run of decisions that changed nothing. Policies that record no phases (static, the classic
rules) get one line per change of sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..control.phases import PHASES


@dataclass(frozen=True)
class Step:
    """One decision as explain reads it."""

    index: int
    epoch: float
    before: list[int]
    after: list[int]
    passes_before: int
    passes_after: int
    phase: str | None
    """The phase the decision was made in (None: the policy records none)."""
    next_phase: str | None
    verdict: str
    """What the interval the decision measured concluded ("" where nothing)."""
    why: list[str]
    evidence: dict[str, Any]
    alternatives: list[dict[str, Any]]
    held: bool
    """A flip guard held the proposal back (the sizes stayed)."""
    proposed: list[int] | None
    """Policy "ppo": the proposal the learned policy corrected (None where it is the decision)."""

    @property
    def quiet(self) -> bool:
        """Nothing changed and nothing was concluded: the phase, the sizes and the micro-batches stayed."""
        return (self.phase == self.next_phase and self.before == self.after
                and self.passes_before == self.passes_after and not self.verdict)


def steps_of(history: Iterable[dict[str, Any]]) -> list[Step]:
    """The decisions of a controller's history (``RunData.history``, ``DynamixController.history``)."""
    out = []
    for i, d in enumerate(history):
        info = d.get("info") or {}
        t = info.get("transition") or {}
        before = [int(b) for b in d.get("previous_sizes") or d.get("sizes") or []]
        after = [int(b) for b in d.get("sizes") or []]
        done = d.get("done")
        epoch = float(done) if done is not None else float(d.get("epoch", 0))
        proposed = info.get("proposed_sizes")
        out.append(Step(int(d.get("decision", i)), epoch, before, after, int(d.get("previous_passes", 1) or 1),
                        int(d.get("passes", 1) or 1), t.get("phase", info.get("phase")), t.get("next"),
                        str(t.get("verdict", "")), list(t.get("why", [])), dict(t.get("evidence", {})), list(t.get("alternatives", [])),
                        bool(info.get("held")), None if proposed is None or proposed == after else list(proposed)))
    return out


def _sizes(sizes: Sequence[int], passes: int = 1) -> str:
    text = "/".join(str(b) for b in sizes)
    return f"{text} x{passes}" if passes > 1 else text


def _seconds(value: Any) -> str:
    return f"{value * 1e3:.3g} ms" if isinstance(value, (int, float)) and math.isfinite(value) else "?"


def _evidence_line(ev: dict[str, Any]) -> str:
    parts = []
    gap = ev.get("gap_bound")
    if isinstance(gap, (int, float)) and math.isfinite(gap):
        parts.append(f"speed gap >= {gap:.1%} (rank {ev.get('slowest_rank')} slowest, "
                     f"{ev.get('gap_intervals', 0)} interval(s) in a row; margin {ev.get('split_margin', math.nan):.0%})")
    gain = ev.get("predicted_split_gain")
    if isinstance(gain, (int, float)) and math.isfinite(gain) and gain:
        parts.append(f"predicted split gain {gain:.1%}")
    noise = ev.get("noise_scale")
    if isinstance(noise, (int, float)) and math.isfinite(noise):
        parts.append(f"noise scale {noise:.4g}")
    if ev.get("budget_cap") is not None:
        parts.append(f"budget caps the global batch at {ev['budget_cap']}")
    if ev.get("growth_too_late"):
        parts.append("too late in the budget to judge a growth")
    if ev.get("may_grow") is False:
        parts.append("growth not allowed yet (or banned)")
    return "; ".join(parts)


def _alternatives_line(alternatives: Sequence[dict[str, Any]]) -> str:
    return " | ".join(f"{a.get('name')} {_sizes(a.get('sizes', []), a.get('passes', 1))}: "
                      f"{_seconds(a.get('predicted_step_s'))}" for a in alternatives)


def explain_lines(history: Iterable[dict[str, Any]], *, verbose: bool = False) -> list[str]:
    """The lines ``dynamix-hvd explain`` prints for a decision history (`verbose`: every decision, the
    evidence and the alternatives of each)."""
    steps = steps_of(history)
    if not steps:
        return ["no decisions recorded"]
    lines: list[str] = []
    phased = any(s.phase is not None for s in steps)
    quiet: list[Step] = []

    def flush() -> None:
        if not quiet:
            return
        first, last = quiet[0], quiet[-1]
        where = f" in {first.phase}" if first.phase else ""
        stay = f"sizes stay {_sizes(last.after, last.passes_after)}"
        if first is last:
            lines.append(f"{'#' + str(first.index):>9}  epoch {first.epoch:.2f}{where}: {stay}")
        else:
            lines.append(f"{f'#{first.index}-#{last.index}':>9}  epoch {first.epoch:.2f}-{last.epoch:.2f}{where}: "
                         f"{stay} ({len(quiet)} decisions)")
        quiet.clear()

    for s in steps:
        if not verbose and (s.quiet or (not phased and s.before == s.after and s.passes_before == s.passes_after)):
            quiet.append(s)
            continue
        flush()
        moved = (f"{_sizes(s.before, s.passes_before)} -> {_sizes(s.after, s.passes_after)}"
                 if (s.before, s.passes_before) != (s.after, s.passes_after) else f"stay {_sizes(s.after, s.passes_after)}")
        if not verbose and s.phase is not None and s.phase == s.next_phase and not s.verdict and not s.held:
            # a move within a phase: the phase's rule, applied again
            lines.append(f"{'#' + str(s.index):>9}  epoch {s.epoch:.2f} in {s.phase}: sizes {moved} "
                         f"({(s.why[-1] if s.why else 'no reason recorded')})")
            continue
        phases = f"  [{s.phase} -> {s.next_phase}]" if s.phase and s.next_phase else (f"  [{s.phase}]" if s.phase else "")
        lines.append(f"{'#' + str(s.index):>9}  epoch {s.epoch:.2f}{phases}  sizes {moved}")
        for why in ([s.verdict] if s.verdict else []) + s.why:
            lines.append(f"{'':11}- {why}")
        if s.held:
            lines.append(f"{'':11}- held: the proposal would have returned to the sizes of two decisions ago")
        if s.proposed is not None:
            lines.append(f"{'':11}- the learned policy corrected the proposal {_sizes(s.proposed)}")
        if verbose or s.next_phase != s.phase:
            ev = _evidence_line(s.evidence)
            if ev:
                lines.append(f"{'':11}  evidence: {ev}")
            if s.alternatives:
                lines.append(f"{'':11}  weighed (predicted step): {_alternatives_line(s.alternatives)}")
    flush()
    if phased:
        lines.append("")
        lines.append("decisions per phase: " + ", ".join(
            f"{p} {n}" for p, n in phase_counts(steps).items() if n))
    return lines


def phase_counts(steps: Sequence[Step]) -> dict[str, int]:
    """How many decisions were made in each phase (every phase named, in order)."""
    counts = dict.fromkeys(PHASES, 0)
    for s in steps:
        if s.phase in counts:
            counts[s.phase] += 1
    return counts


def phase_spans(history: Sequence[dict[str, Any]], times: Sequence[float]) -> list[tuple[float, float, str]]:
    """(start, end, phase) of each stretch of training that ran in one phase, from decision times
    (`times[i]`: when decision i took effect, NaN where unknown); the report shades them."""
    spans: list[tuple[float, float, str]] = []
    steps = steps_of(history)
    for i, s in enumerate(steps):
        if s.next_phase is None or i >= len(times) or not math.isfinite(times[i]):
            continue
        end = next((times[j] for j in range(i + 1, len(times)) if math.isfinite(times[j])), math.inf)
        if spans and spans[-1][2] == s.next_phase and spans[-1][1] == times[i]:
            spans[-1] = (spans[-1][0], end, s.next_phase)
        else:
            spans.append((float(times[i]), end, s.next_phase))
    return spans


def legend_lines() -> list[str]:
    """Every phase with what it means."""
    return [f"  {name}: {meaning}" for name, meaning in PHASES.items()]
