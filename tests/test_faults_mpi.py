"""Injected failures in a real job: a NaN step is skipped everywhere, an OOM is redone smaller."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launching import launch


# Every case is a run of tests/workers/faults.py; all of them run in one job under mpirun (--then between
# them, each in its own folder), so that the ranks start, import torch and Horovod and join once.
RUNS = {
    "nan": ["--nan-step", "5"],
    "oom": ["--oom-above", "20"],
    **{f"oom-{where}-{passes}": ["--oom-above", "20", "--oom-in", where, "--passes", str(passes)]
       for where, passes in (("backward", 1), ("forward", 2), ("backward", 2))},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults")
    argv = []
    for name, args in RUNS.items():
        (root / name).mkdir()
        argv += [*(["--then"] if argv else []), "--out", str(root / name), *args]
    launch("mpirun", 2, "faults.py", *argv)
    return {name: root / name for name in RUNS}


def _results(tmp_path, ranks=2):
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(ranks)]


def _epoch_coverage(results, epoch):
    """Samples consumed in `epoch` by steps that were not redone (ok or skipped as non-finite)."""
    return sorted(i for r in results for s in r["served"]
                  if s["epoch"] == epoch and s["status"] != "oom" for i in s["indices"])


def test_nan_loss_on_one_rank_skips_the_step_on_all_ranks(runs):
    results = _results(runs["nan"])
    for r in results:
        assert r["statuses"][5] == "nonfinite" and r["skipped"]["nonfinite"] == 1
        assert r["statuses"].count("ok") == len(r["statuses"]) - 1
        assert r["params_finite"]
    assert results[0]["decision_losses"] and all(math.isfinite(loss) for loss in results[0]["decision_losses"]), \
        "NaN leaked into the loss statistics"
    assert math.isfinite(results[0]["noise_scale"])
    for epoch in (0, 1):
        assert _epoch_coverage(results, epoch) == list(range(600))


def test_oom_shrinks_the_rank_redoes_the_step_and_remembers_the_bound(runs):
    results = _results(runs["oom"])
    r0 = results[0]
    assert r0["skipped"]["oom"] == 1, "exactly one failure: the bound is remembered afterwards"
    assert r0["statuses"][0] == "oom" and r0["statuses"][1] == "ok"
    assert r0["bound_rank1"] == int(24 * 0.8) == r0["final_sizes"][1]
    assert len(results[1]["served"][0]["indices"]) == 24 and len(results[1]["served"][1]["indices"]) == 19
    for epoch in (0, 1):
        assert _epoch_coverage(results, epoch) == list(range(600)), "samples lost or repeated"


@pytest.mark.parametrize("where,passes", [("backward", 1), ("forward", 2), ("backward", 2)])
def test_oom_mid_backward_or_in_a_micro_batch_is_redone_without_losing_samples(runs, where, passes):
    """In backward: the last layer's gradients are already in Horovod's hands when the first layer's
    fails (only the rest is poisoned). With accumulation: the whole optimizer step, every micro-batch,
    is served again."""
    results = _results(runs[f"oom-{where}-{passes}"])
    for r in results:
        assert r["skipped"] == {"nonfinite": 0, "oom": 1}, r["skipped"]
        assert r["statuses"][0] == "oom" and set(r["statuses"][1:]) == {"ok"}
        assert r["params_finite"]
    assert results[0]["bound_rank1"] == int(24 * 0.8) == results[0]["final_sizes"][1]
    first_redone = [s for s in results[1]["served"] if s["status"] != "oom"][0]
    assert len(first_redone["indices"]) == 19
    for epoch in (0, 1):
        assert _epoch_coverage(results, epoch) == list(range(600)), "samples lost or repeated"
