"""The default policy replayed on stored decision logs (tests/decision_logs.py): the same decisions.

Every stored decision must come out again (sizes, micro-batches per step, recheck, the AdaScale gain)
except those named in INTENDED_CHANGES, each with why it changed. A change to the decision logic that
moves any other decision fails here first, naming the log, the decision and both answers.
"""
from __future__ import annotations

from typing import Any

import pytest

from decision_logs import LIVE, LOGS, SIMULATED_MAX_DECISIONS, read, replay_live, simulated_decisions
from dynamix_hvd.control.phases import PHASES
from dynamix_hvd.control.proposal import ModelPolicy

ONE_INTERVAL = ("a change of speed that one interval's steps show clearly (CostConfig.decisive_factor) restarts "
                "the rank's line at once instead of after a second interval, so the fits from there on, and the "
                "sizes they give, differ (in a simulated job, every decision after the first that differs)")
CHANGE_VOTE = ("the simulator takes the live controller's change votes: a vote that a rank's speed moved ends the "
               "interval at that step and the decision follows it, so every decision after the first such vote "
               "that changes the sizes differs")
CHANGED: dict[str, dict[str, list[int]]] = {
    CHANGE_VOTE: {"simulated seed 0 (cnn)": [15, 16, 17, 18, *range(20, 30), 31, 32, 34, 35, 36, 38, 39],
                  "simulated seed 11 (mlp)": [28, 29, 30, 31, 32, 34]},
    ONE_INTERVAL: {"live-changing": [15, 19, 20, 25, 30, 31], "live-straggler": [21, 22],
                   "simulated seed 0 (cnn)": [19, 30, 33, 37],
                   "simulated seed 5 (cnn)": list(range(13, 34)), "simulated seed 10 (cnn)": list(range(31, 40))},
}
"""Why decisions differ from the stored ones: reason -> {log -> decision indices}."""
INTENDED_CHANGES: dict[tuple[str, int], str] = {
    (log, i): why for why, logs in CHANGED.items() for log, indices in logs.items() for i in indices}
"""(log, decision index) -> why the decision differs from the stored one."""


def differences(log: str, stored: list[dict[str, Any]], replayed: list[dict[str, Any]]) -> list[str]:
    out = []
    for i, (a, b) in enumerate(zip(stored, replayed)):
        keys = [k for k in ("sizes", "passes", "recheck", "lr_gain") if k in a and a[k] != b[k]]
        if keys and (log, i) not in INTENDED_CHANGES:
            out.append(f"{log} decision {i}: " + ", ".join(f"{k} {a[k]} -> {b[k]}" for k in keys))
    if len(stored) != len(replayed):
        out.append(f"{log}: {len(stored)} decisions stored, {len(replayed)} replayed")
    same = [i for i, (a, b) in enumerate(zip(stored, replayed))
            if all(a[k] == b[k] for k in ("sizes", "passes", "recheck", "lr_gain") if k in a)]
    out += [f"{log} decision {i}: named in INTENDED_CHANGES but unchanged" for i in same
            if (log, i) in INTENDED_CHANGES]
    return out


@pytest.mark.parametrize("name", sorted(LIVE))
def test_a_real_jobs_decisions_replay_unchanged(name: str) -> None:
    stored, replayed = replay_live(name)
    assert not differences(f"live-{name}", stored, replayed)
    phases = [d["info"].get("phase") for d in replayed]
    assert set(phases) <= set(PHASES), phases
    if name == "equal":
        assert set(phases) == {"even"}, phases
    else:  # the slow rank is found, its split judged and kept
        assert {"even", "judging split", "split"} <= set(phases), phases


def test_simulated_jobs_replay_unchanged() -> None:
    stored = read(LOGS / "simulated.json.gz")
    problems, seen = [], set()
    for job in stored:
        replayed, _ = simulated_decisions(job["seed"], ModelPolicy())
        problems += differences(f"simulated seed {job['seed']} ({job['family']})", job["decisions"], replayed)
        seen |= {d["phase"] for d in replayed}
    assert not problems, "\n".join(problems)
    assert seen <= set(PHASES) and len(seen) >= 3, seen
    assert max(len(job["decisions"]) for job in stored) == SIMULATED_MAX_DECISIONS
