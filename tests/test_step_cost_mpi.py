"""No collective per step besides Horovod's own, in what a user runs (controller, checkpointer and run
log on), counted where the collectives are issued in a real 2-rank mpirun job."""
from __future__ import annotations

import json
import math
from pathlib import Path

from launching import launch


def test_a_training_step_issues_only_the_gradient_allreduces(tmp_path):
    launch("mpirun", 2, "step_cost.py", "--out", str(tmp_path), "--epochs", "3", "--step-sleep", "0.01")
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        steps, decisions, votes, train_s = got["steps"], got["decisions"], got["votes"], got["train_s"]
        print(f"rank {r}: {steps} steps in {train_s:.2f} s, {decisions} decisions, {votes} preemption votes; "
              f"control plane {got['control']}; Horovod by name {got['horovod']}")
        assert steps > 30 and decisions >= 3  # 50 steps an epoch at first; the default controller may grow B
        # Horovod's own: one allreduce per parameter and step, nothing else per step
        assert got["gradient_allreduces"] == steps * got["params"]
        assert got["horovod"] == {"dx.latency_probe (allreduce)": decisions}  # the latency probe: one per decision
        # the control plane: one report and one decision per decision, the run log's rows per epoch, and
        # the preemption votes: about one per second of training, plus the first ones while the
        # interval doubles from one step to a second's worth (about 11 ms steps here: 7 doublings)
        control = dict(got["control"])
        assert control.pop("dx.control.reports") == control.pop("dx.control.decision") == decisions
        assert control.pop("dx.runlog.epoch_rows") == 3
        assert control.pop("dx.checkpoint.vote") == votes
        assert control.pop("dx.control.memory") == 1  # which ranks share a memory budget: once per world
        # the change votes: every `vote_every` steps (about 0.25 s of training) of each interval a decision
        # opened; a vote on a decision's own step comes first, so an interval of n steps holds n // every
        ends = [start for start, _ in got["intervals"][1:]] + [steps]
        change_votes = sum((end - start) // every for (start, every), end in zip(got["intervals"], ends) if every)
        assert change_votes <= train_s / 0.25 + decisions
        assert control.pop("dx.control.change_vote", 0) == change_votes
        assert control == {}, f"collectives nobody expects: {control}"
        assert 3 <= votes <= math.ceil(train_s / 1.0) + 1 + 8, (votes, train_s)
    assert ranks[0]["control"] == ranks[1]["control"] and ranks[0]["horovod"] == ranks[1]["horovod"]
