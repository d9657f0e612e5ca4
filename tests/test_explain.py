"""``dynamix-hvd explain``: a run's decisions phase by phase, from the default policy's own records.

The histories come from replaying stored decision logs of real 2-rank jobs (tests/decision_logs.py)
through the decision core, as the live controller decides."""
from __future__ import annotations

import math
import re
from typing import Any

import pytest

from decision_logs import replay_live
from dynamix_hvd.control.phases import PHASES
from dynamix_hvd.runs.explain import explain_lines, phase_counts, phase_spans, steps_of


def replayed_history(name: str) -> list[dict[str, Any]]:
    return replay_live(name)[1]


@pytest.fixture(scope="module")
def changing() -> list[dict[str, Any]]:
    return replayed_history("changing")


def indices_shown(lines: list[str]) -> list[int]:
    """Every decision index a line names, folded spans expanded."""
    shown = []
    for line in lines:
        m = re.match(r"\s*#(\d+)(?:-#(\d+))?\s", line)
        if m:
            first, last = int(m.group(1)), int(m.group(2) or m.group(1))
            shown += range(first, last + 1)
    return shown


def test_each_decision_records_the_phase_it_measured_decided_in_and_leads_to(changing):
    for before, after in zip(changing, changing[1:]):
        a, b = before["info"]["transition"], after["info"]["transition"]
        assert a["phase"] in PHASES and a["next"] in PHASES and a["measured"] in PHASES
        assert b["measured"] == a["next"], (before["decision"], a, b)  # the interval ran in the phase announced
    for d in changing:
        t = d["info"]["transition"]
        chosen = next(x for x in t["alternatives"] if x["name"] == "chosen")
        assert {x["name"] for x in t["alternatives"]} == {"keep", "even split", "equalised split", "chosen"}
        assert all(x["predicted_step_s"] is None or x["predicted_step_s"] > 0 for x in t["alternatives"])
        assert chosen["global_batch"] == chosen["passes"] * sum(chosen["sizes"])
        # the policy's proposal is what was decided (the flip guard may hold it: then the sizes stayed)
        assert chosen["sizes"] == d["sizes"] or (d["info"].get("held") and d["sizes"] == d["previous_sizes"])


def test_explain_names_every_decision_once_and_why_the_split_moved(changing):
    lines = explain_lines(changing)
    assert sorted(indices_shown(lines)) == [d["decision"] for d in changing], "\n".join(lines)
    assert len(lines) < len(changing) + 6 * sum(1 for s in steps_of(changing) if not s.quiet) + 3
    # the slow rank is found: the split leaves the job's own with the evidence and the alternatives beside it
    start = next(i for i, line in enumerate(lines) if "[even -> judging split]" in line)
    block = lines[start:start + 6]
    assert any("leave the job's own split" in line for line in block), "\n".join(block)
    assert any(line.strip().startswith("evidence: speed gap >=") for line in block), "\n".join(block)
    assert any(line.strip().startswith("weighed (predicted step): keep 16/16") for line in block), "\n".join(block)
    # and the split is judged: kept (or failed) with both measured step times
    assert any(re.search(r"split (kept|failed): measured step [\d.]+ s against the even split's [\d.]+ s", line)
               for line in lines), "\n".join(lines)
    counts = phase_counts(steps_of(changing))
    assert sum(counts.values()) == len(changing) and counts["even"] and counts["split"]
    assert lines[-1] == "decisions per phase: " + ", ".join(f"{p} {n}" for p, n in counts.items() if n)


def test_verbose_shows_every_decision_with_its_alternatives(changing):
    lines = explain_lines(changing, verbose=True)
    heads = [line for line in lines if re.match(r"\s*#\d+\s", line)]
    assert len(heads) == len(changing)
    assert sum("weighed (predicted step)" in line for line in lines) == len(changing)


def test_equal_ranks_fold_into_few_lines():
    history = replayed_history("equal")
    lines = explain_lines(history)
    assert sorted(indices_shown(lines)) == [d["decision"] for d in history]
    assert "judging split" not in "\n".join(lines[:-1])
    assert len(lines) <= len(history) // 2, "\n".join(lines)


def test_a_policy_without_phases_gets_a_line_per_change():
    history = [{"decision": i, "epoch": i, "sizes": s, "previous_sizes": p, "info": {}}
               for i, (p, s) in enumerate([([32, 32], [32, 32]), ([32, 32], [64, 64]), ([64, 64], [64, 64]),
                                           ([64, 64], [64, 64]), ([64, 64], [128, 128])])]
    lines = explain_lines(history)
    assert lines == ["       #0  epoch 0.00: sizes stay 32/32",
                     "       #1  epoch 1.00  sizes 32/32 -> 64/64",
                     "    #2-#3  epoch 2.00-3.00: sizes stay 64/64 (2 decisions)",
                     "       #4  epoch 4.00  sizes 64/64 -> 128/128"]
    assert explain_lines([]) == ["no decisions recorded"]


def test_phase_spans_tile_the_run(changing):
    times = [float(i) for i in range(len(changing))]
    spans = phase_spans(changing, times)
    assert spans[0][0] == 0.0 and math.isinf(spans[-1][1])
    for (s0, e0, p0), (s1, e1, p1) in zip(spans, spans[1:]):
        assert e0 == s1 and p0 != p1 and s0 < e0
    assert {p for _, _, p in spans} <= set(PHASES)
    assert phase_spans(changing, [math.nan] * len(changing)) == []


def test_leaving_the_even_split_warns_once_naming_the_slow_rank(changing, caplog):
    from dynamix_hvd.control.controller import warn_if_split

    with caplog.at_level("WARNING", logger="dynamix_hvd"):
        for record in changing:
            warn_if_split(record)
    leaving = [d for d in changing if d["info"]["transition"]["next"] == "judging split"
               and d["info"]["transition"]["phase"] != "judging split"]
    assert len(leaving) >= 1 and len(caplog.records) == len(leaving)
    first = caplog.records[0].getMessage()
    assert first.startswith("rank 1 was measured slower than the others") and "16/16 -> 22/10" in first, first
    caplog.clear()
    with caplog.at_level("WARNING", logger="dynamix_hvd"):
        for record in replayed_history("equal"):
            warn_if_split(record)
    assert not caplog.records
