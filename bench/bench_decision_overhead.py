"""Decision overhead of the controller (gather + decide + broadcast) at 2, 4, 8 and 16 ranks, with the
shipped PPO policy deployed (the proposal plus the policy network's forward pass: an upper bound for
the default proposal).

    python -m bench.bench_decision_overhead [--ranks 2,4,8,16] [--decisions 40] [--quick]

Runs real mpirun jobs on this machine (oversubscribed when ranks > cores). A decision is timed on
every rank; the figure per decision is the slowest rank's time (the job moves on only when the last
rank has the decision). The epoch share uses
the example MLP epoch (8192 samples, local batch 16) at the measured step time of the same job.

Bytes per decision (`decision_bytes`): every rank sends rank 0 one float64 report of F + 7k + 2L
values (F fixed fields, k steps since the last decision, L parameter tensors for the layer means) and
rank 0 sends every rank 3 + 2R float64 back. A cost model, t(R) = c + alpha * hops(R) + bytes(R) / beta
with hops = log2(R) (tree) or R - 1 (rank 0 handles each message, as comm's point-to-point gather
does), is fitted to the measured rows (non-negative least squares) and extrapolated to --predict ranks.
On one oversubscribed machine the fit mostly measures process scheduling: fit it on a cluster.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from dynamix_hvd.control.wire import decision_length, report_length
from dynamix_hvd.tools.launchcheck import command, local_env, local_plan

REPO = Path(__file__).resolve().parents[1]
FLOAT_BYTES = 8
REPORT_FIXED_FIELDS = report_length(0, 0)  # F: fixed values of one rank's report
PER_STEP = report_length(1, 0) - REPORT_FIXED_FIELDS  # values per step since the last decision


def report_values(fields: int, steps: int, tensors: int) -> int:
    """Float64 values in one rank's report (`dynamix_hvd.control.wire` layout, F overridable)."""
    return report_length(steps, tensors) - REPORT_FIXED_FIELDS + fields


def broadcast_values(ranks: int) -> int:
    """Float64 values in the decision rank 0 sends back (`wire.decision_length`)."""
    return decision_length(ranks)


def decision_bytes(ranks: int, fields: int, steps: int, tensors: int) -> dict[str, int]:
    """Bytes that travel per decision: reports into rank 0 and the decision out of it (R - 1 peers each)."""
    gathered = (ranks - 1) * report_values(fields, steps, tensors) * FLOAT_BYTES
    broadcast = (ranks - 1) * broadcast_values(ranks) * FLOAT_BYTES
    return {"gathered": gathered, "broadcast": broadcast, "total": gathered + broadcast}


HOPS = {"tree": lambda r: math.log2(r), "linear": lambda r: r - 1.0}


def fit(rows: list[dict], hops: str) -> dict[str, float] | None:
    """Non-negative least squares of median_s = c + alpha * hops(R) + bytes(R) / beta over the rows."""
    from scipy.optimize import nnls

    if len(rows) < 2:
        return None
    a = np.array([[1.0, HOPS[hops](r["ranks"]), r["bytes"]["total"]] for r in rows])
    (c, alpha, per_byte), _ = nnls(a, np.array([r["median_s"] for r in rows]))
    return {"c_s": c, "alpha_s": alpha, "beta_bytes_per_s": 1.0 / per_byte if per_byte > 0 else math.inf}


def predict(model: dict[str, float], hops: str, ranks: int, total_bytes: int) -> float:
    return model["c_s"] + model["alpha_s"] * HOPS[hops](ranks) + total_bytes / model["beta_bytes_per_s"]


def run(ranks: int, decisions: int, steps_between: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = command(local_plan("mpirun", ranks), [sys.executable, "-m", "bench.decision_worker", "--decisions",
                                                    str(decisions), "--steps-between", str(steps_between),
                                                    "--out", str(out)], forward=())
        proc = subprocess.run(cmd, cwd=REPO, env=local_env(REPO), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4,8,16", help="comma-separated rank counts to measure")
    ap.add_argument("--decisions", type=int, default=40, help="decisions timed per rank count")
    ap.add_argument("--steps-between", type=int, default=2, help="training steps between decisions (k)")
    ap.add_argument("--fields", type=int, default=REPORT_FIXED_FIELDS, help="fixed report fields per rank (F)")
    ap.add_argument("--predict", type=int, default=1024, help="rank count the cost model extrapolates to")
    ap.add_argument("--quick", action="store_true", help="smoke test: ranks 2,3 and 3 decisions (no figures)")
    ap.add_argument("--json", type=Path, help="also write the rows and the fitted models to this file")
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.decisions = "2,3", 3
    print(f"{'ranks':>5} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'mean ms':>8} "
          f"{'epoch s':>8} {'% of epoch':>10} {'vs 2 ranks':>10} {'bytes/dec':>10}")
    base, rows = None, []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        r = run(ranks, args.decisions, args.steps_between)
        r["bytes"] = decision_bytes(ranks, args.fields, r["steps_between"], r["param_tensors"])
        rows.append(r)
        epoch_s = 8192 / (16 * ranks) * r["step_s"]
        base = base or r["median_s"]
        print(f"{ranks:>5} {r['median_s'] * 1e3:>10.2f} {r['p90_s'] * 1e3:>8.2f} {r['max_s'] * 1e3:>8.2f} "
              f"{r['mean_s'] * 1e3:>8.2f} {epoch_s:>8.2f} {100 * r['median_s'] / epoch_s:>9.2f}% "
              f"{r['median_s'] / base:>9.2f}x {r['bytes']['total']:>10d}", flush=True)
    k, tensors = rows[0]["steps_between"], rows[0]["param_tensors"]
    print(f"\nbytes per decision B(R) = (R-1)*8*(F + {PER_STEP}k + 2L) + (R-1)*8*(3 + 2R), here F={args.fields}, k={k}, "
          f"L={tensors}: B({args.predict}) = {decision_bytes(args.predict, args.fields, k, tensors)['total']:,} bytes")
    models = {}
    for hops in HOPS:
        model = fit(rows, hops)
        if model is None:
            print(f"model ({hops}): needs at least two rank counts")
            continue
        at = predict(model, hops, args.predict, decision_bytes(args.predict, args.fields, k, tensors)["total"])
        models[hops] = {**model, f"predicted_s_at_{args.predict}": at}
        print(f"model ({hops}): t(R) = {model['c_s'] * 1e3:.3f} ms + {model['alpha_s'] * 1e3:.3f} ms * "
              f"{'log2(R)' if hops == 'tree' else '(R-1)'} + B(R) / {model['beta_bytes_per_s'] / 1e6:.3g} MB/s "
              f"-> {at * 1e3:.1f} ms at {args.predict} ranks")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "models": models, "fields": args.fields}, indent=2))


if __name__ == "__main__":
    main()
