"""Tokens, not samples: padding, useful tokens per second and time to a validation-loss target of a
small transformer LM on variable-length text (`bench.token_lm`), 2 ranks, with and without a 3x
straggler, for plain Horovod (padded fixed-size batches), dynamix_hvd planning by samples, and
dynamix_hvd planning by token budgets. Arms interleaved; medians and ranges over seeds.

    python -m bench.bench_tokens --seeds 0,1,2 --out bench/results/tokens

The target is measured in the same run: the validation loss plain Horovod reaches at two thirds of
its samples without a straggler (per seed); time to target is the training time (evaluation excluded)
at the first evaluation at or below it. Every job holds /tmp/machine.lock while it runs, so nothing
else launched under that lock shares the cores (or run the whole benchmark under it with --no-lock).
Records already in --out are reused, so an interrupted run continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("plain", "samples", "tokens")
CONDITIONS = {"no straggler": 1.0, "3x straggler": 3.0}


def run(arm: str, seed: int, factor: float, epochs: float, out: Path, lock: bool = True) -> dict:
    cmd = ["flock", "/tmp/machine.lock"] * lock + ["mpirun", "--allow-run-as-root", "-np", "2", "-x", "OMP_NUM_THREADS",
           "-x", "PYTHONPATH", "--mca", "mpi_yield_when_idle", "1", sys.executable, "-m", "bench.token_lm",
           "--arm", arm, "--seed", str(seed), "--epochs", str(epochs), "--out", str(out)]
    if factor != 1.0:
        cmd += ["--slow-rank", "1", "--slow-factor", str(factor)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    record = json.loads(out.read_text())
    record["wall_s"] = time.perf_counter() - t0
    return record


def target_of(plain: dict) -> float:
    """The validation loss plain Horovod reached at two thirds of its samples."""
    evals = plain["evals"]
    goal = 2 * evals[-1]["samples"] / 3
    return next(e["val_loss"] for e in evals if e["samples"] >= goal)


def time_to(record: dict, target: float) -> float:
    return next((e["train_s"] for e in record["evals"] if e["val_loss"] <= target), float("nan"))


def spread(values: list[float]) -> str:
    finite = [v for v in values if v == v]
    if not finite:
        return "not reached"
    return f"{statistics.median(finite):.2f} ({min(finite):.2f}-{max(finite):.2f})" + (
        f", {len(values) - len(finite)} not reached" if len(finite) < len(values) else "")


def report(results: list[dict]) -> str:
    targets = {r["seed"]: target_of(r) for r in results if r["arm"] == "plain" and r["slow_factor"] == 1.0}
    lines = ["| condition | arm | padding | useful tokens/s | vs plain | time to target (s) | vs plain | final val loss |",
             "|---|---|---|---|---|---|---|---|"]
    for name, factor in CONDITIONS.items():
        rows = {arm: [r for r in results if r["arm"] == arm and r["slow_factor"] == factor] for arm in ARMS}
        plain = {r["seed"]: r for r in rows["plain"]}
        for arm in ARMS:
            rs = [r for r in rows[arm] if r["seed"] in plain and r["seed"] in targets]
            if not rs:
                continue
            tps = [r["useful_tokens_per_s"] / plain[r["seed"]]["useful_tokens_per_s"] for r in rs]
            tt = [time_to(r, targets[r["seed"]]) for r in rs]
            tt_ratio = [t / time_to(plain[r["seed"]], targets[r["seed"]]) for t, r in zip(tt, rs)]
            lines.append(f"| {name} | {arm} | {statistics.median(r['padding'] for r in rs):.1%} | "
                         f"{statistics.median(r['useful_tokens_per_s'] for r in rs):,.0f} | {spread(tps)} | "
                         f"{spread(tt)} | {spread(tt_ratio)} | "
                         f"{spread([r['evals'][-1]['val_loss'] for r in rs])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=float, default=1.5)
    ap.add_argument("--out", default="bench/results/tokens")
    ap.add_argument("--no-lock", action="store_true",
                    help="do not take /tmp/machine.lock per job (when the whole run already holds it)")
    ap.add_argument("--rerun", action="store_true", help="run jobs whose record is already in --out again")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, factor in CONDITIONS.items():
            for arm in ARMS:  # interleaved: every seed and condition runs all arms back to back
                path = out / f"{arm}-seed{seed}-slow{factor:g}.json"
                if path.exists() and not args.rerun and "wall_s" in json.loads(path.read_text()):
                    record = json.loads(path.read_text())  # kept from an earlier, interrupted run
                else:
                    record = run(arm, seed, factor, args.epochs, path, lock=not args.no_lock)
                    path.write_text(json.dumps(record))
                results.append(record)
                print(f"seed {seed} {name} {arm}: {record['train_s']:.1f} s training, "
                      f"{record['useful_tokens_per_s']:,.0f} useful tokens/s, padding {record['padding']:.1%}",
                      flush=True)
    table = report(results)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
