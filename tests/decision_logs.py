"""Stored decision logs: what the default policy decided on recorded inputs, for the replay test.

Two kinds, in tests/data/decision_logs/:

* ``live-NAME.json.gz``: a 2-rank mpirun job of ``tests/workers/controller.py`` under the default
  policy with ``keep_inputs``: the typed reports rank 0 decided on, and its decisions;
* ``simulated.json.gz``: simulated jobs drawn from the scenario distribution (``bench.lab``), the
  default policy driving each, and every decision it took.

Regenerate (only where a decision is meant to change; the replay test names each such change):
``python tests/decision_logs.py``. The live jobs take about two minutes on 2 cores.
"""
from __future__ import annotations

import gzip
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
LOGS = HERE / "data" / "decision_logs"

# name -> controller.py arguments (2 ranks, sleeping stragglers, the automatic cadence)
LIVE = {
    "straggler": ["--sizes", "16,16", "--slow-rank", "1", "--slow-factor", "3"],
    "changing": ["--sizes", "16,16", "--slow-rank", "1", "--slow-factor", "3", "--slow-from-step", "150"],
    "equal": ["--sizes", "32,32", "--samples", "4800", "--max-batch", "512", "--sleep-per-sample", "0.0001",
              "--sleep-fixed", "0.01"],
}
COMMON = ["--policy", "model", "--every", "-1", "--epochs", "6", "--samples", "2400", "--max-batch", "256",
          "--sleep-per-sample", "0.0005", "--sleep-fixed", "0.003", "--keep-inputs", "1000", "--with-model",
          "--decision-budget", "0"]
SIMULATED_SEEDS = range(12)
SIMULATED_MAX_DECISIONS = 40
DECIDED = ("sizes", "passes", "recheck", "lr_gain")
"""What a replay must reproduce of each decision."""


def args_of(argv: list[str]) -> dict[str, str]:
    """The last value of each ``--flag value`` pair."""
    return {argv[i]: argv[i + 1] for i in range(0, len(argv) - 1) if argv[i].startswith("--")}


def live_config(name: str) -> dict[str, Any]:
    """The ControllerConfig fields of the stored job that decide (the worker's, for `name`)."""
    a = args_of(COMMON + LIVE[name])
    return {"policy": a["--policy"], "max_batch": int(a["--max-batch"]), "min_batch": 2,
            "total_epochs": int(a["--epochs"])}


def replay_live(name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The stored live job `name`'s decisions, and the decision records (``Decision.record()``) a fresh
    decision core of its config takes on the same inputs, as the live controller decides."""
    from dynamix_hvd.control.config import ControllerConfig, make_core
    from dynamix_hvd.control.core import RankInput

    log = read(LOGS / f"live-{name}.json.gz")
    core = make_core(ControllerConfig(**log["config"]), 2, log["initial_batch"], log["layer_names"])
    replayed = [core.decide([RankInput.from_dict(i) for i in inputs], stored["previous_sizes"], stored["epoch"],
                            passes=stored["previous_passes"], done=stored["done"]).record()
                for inputs, stored in zip(log["inputs"], log["decisions"])]
    return log["decisions"], replayed


def simulated_decisions(seed: int, policy: Any) -> tuple[list[dict[str, Any]], str]:
    """The decisions `policy` takes in the simulated job of `seed` (at most SIMULATED_MAX_DECISIONS)."""
    from bench.lab.scenarios import sample_cluster
    from bench.lab.simulator import ClusterSimulator

    spec = sample_cluster(np.random.default_rng(seed))
    sim = ClusterSimulator(spec, seed=seed)
    sim.reset()
    out = []
    while not sim.done and len(out) < SIMULATED_MAX_DECISIONS:
        d = policy.decide(sim.decision_input())
        policy.after_decision()
        out.append({"sizes": list(d.sizes), "passes": d.passes, "recheck": bool(d.recheck),
                    "phase": d.info.get("phase")})
        sim.step_sizes(d.sizes, d.passes, d.recheck)
    return out, spec.name


def write(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(data, f, allow_nan=True)


def read(path: Path) -> Any:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def main() -> None:
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    from dynamix_hvd.control.proposal import ModelPolicy
    from launching import launch

    sims = []
    for seed in SIMULATED_SEEDS:
        decisions, family = simulated_decisions(seed, ModelPolicy())
        sims.append({"seed": seed, "family": family, "decisions": decisions})
    write(LOGS / "simulated.json.gz", sims)
    for name, extra in LIVE.items():
        with tempfile.TemporaryDirectory() as tmp:
            launch("mpirun", 2, "controller.py", "--out", tmp, *COMMON, *extra, timeout=600)
            dump = json.loads(Path(tmp, "inputs.json").read_text())
        keep = ("decision", "epoch", "sizes", "previous_sizes", "passes", "previous_passes", "recheck", "lr_gain",
                "done", "info")
        write(LOGS / f"live-{name}.json.gz", {
            "config": live_config(name), "initial_batch": sum(int(b) for b in args_of(extra)["--sizes"].split(",")),
            "layer_names": dump["layer_names"], "inputs": dump["inputs"],
            "decisions": [{k: d.get(k) for k in keep} for d in dump["decisions"]]})
        print(name, len(dump["decisions"]), "decisions", flush=True)


if __name__ == "__main__":
    main()
