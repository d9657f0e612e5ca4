"""The default policy's phases: where a job stands, and what a decision may change from there.

Pure: no MPI, no Horovod. The default policy (:class:`~dynamix_hvd.control.proposal.ModelPolicy`)
changes one thing at a time and keeps a change only once a measurement says it helped::

                 speeds measured to differ             the step got shorter
        even ──────────────────────────► judging split ─────────────────────► split
         ▲  ▲          the step did not get shorter │                           │
         │  └───────────────────────────────────────┘◄──── the gap closed ──────┘
         │
         │     a larger global batch predicted to pay         the loss kept up
   even, split ───────────────────────────────────► judging growth ─────────────► grown,
         ▲                                                 │                     split and grown
         └──── the loss fell behind: back to the initial batch, no growth again ─┘

While a change is judged the global batch holds (`Plan.hold_batch`), so what is measured is that
change alone. Each decision records the phase of the interval it measured, the verdicts that interval
brought, the phase it decided in, the phase the next interval runs in, why, and the alternatives it
weighed with their predicted step times (`transition`); ``dynamix-hvd explain RUN`` prints them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

PHASES: dict[str, str] = {
    "even": "every rank at its share of the job's own split and the global batch at the initial one (or "
            "below, where memory holds it): nothing is being judged",
    "judging split": "the split left the job's own to make the ranks arrive together; its measured step is "
                     "compared with the even split's, the global batch held meanwhile",
    "split": "an arrival-equalising split whose measured step was shorter: kept while the speeds differ",
    "judging growth": "the global batch grew past the initial one; the loss is compared with what the "
                      "initial batch was making, the sizes held meanwhile",
    "grown": "a global batch past the initial one that kept up with the initial batch's loss, evenly split",
    "split and grown": "a grown global batch, split to equalise the ranks' arrivals",
}
"""Every phase, with what it means."""


def phase_of(judging_split: bool, judging_growth: bool, split: bool, grown: bool) -> str:
    """The phase of a job whose split check is (not) judging, whose growth check is (not) judging,
    whose sizes are (not) off its own split and whose global batch is (not) past the initial one."""
    if judging_split:
        return "judging split"
    if judging_growth:
        return "judging growth"
    if split:
        return "split and grown" if grown else "split"
    return "grown" if grown else "even"


@dataclass(frozen=True)
class Plan:
    """What a decision may change, as its phase allows."""

    hold_batch: bool
    """The global batch stays as it is (a change is being judged, or a failed split is undone)."""
    back_to_even: bool
    """The sizes return to the job's own split now (a split failed its check)."""
    why: str
    """The reason, for the decision's record."""


@dataclass(frozen=True)
class Alternative:
    """One set of sizes a decision weighed, with what the cost model predicted for it."""

    name: str
    sizes: list[int]
    passes: int
    global_batch: int
    predicted_step_s: float
    predicted_goodput: float
    """Samples per second times the statistical efficiency at this global batch (relative units)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("predicted_step_s", "predicted_goodput"):
            out[key] = round(out[key], 6) if math.isfinite(out[key]) else None
        return out


def transition(measured: str, now: str, after: str, verdict: str, why: Sequence[str], evidence: dict[str, Any],
               alternatives: Sequence[Alternative]) -> dict[str, Any]:
    """The record of one decision's step through the phases (plain values): `verdict` what the
    interval measured concluded ("" where nothing), `why` the phase's rule and the outcome."""
    return {"measured": measured, "phase": now, "next": after, "verdict": verdict, "why": [w for w in why if w],
            "evidence": {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
                         for k, v in evidence.items()},
            "alternatives": [a.to_dict() for a in alternatives]}
