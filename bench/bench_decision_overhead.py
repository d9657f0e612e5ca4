"""Decision overhead of the controller (gather + PPO decide + broadcast) at 2, 4, 8 and 16 ranks.

    python -m bench.bench_decision_overhead [--ranks 2,4,8,16] [--decisions 40]

Runs real mpirun jobs on this machine (oversubscribed when ranks > cores). A decision is timed on
every rank; the figure per decision is the slowest rank's time (the job moves on only when the last
rank has the decision). Includes online PPO updates (one every 16 decisions). The epoch share uses
the example MLP epoch (8192 samples, local batch 16) at the measured step time of the same job.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dynamix_hvd.tools.launchcheck import command, local_env, local_plan

REPO = Path(__file__).resolve().parents[1]


def run(ranks: int, decisions: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = command(local_plan("mpirun", ranks), [sys.executable, "-m", "bench.decision_worker", "--decisions",
                                                    str(decisions), "--out", str(out)], forward=())
        proc = subprocess.run(cmd, cwd=REPO, env=local_env(REPO), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4,8,16")
    ap.add_argument("--decisions", type=int, default=40)
    args = ap.parse_args()
    print(f"{'ranks':>5} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'mean ms':>8} "
          f"{'epoch s':>8} {'% of epoch':>10} {'vs 2 ranks':>10}")
    base = None
    for ranks in [int(r) for r in args.ranks.split(",")]:
        r = run(ranks, args.decisions)
        epoch_s = 8192 / (16 * ranks) * r["step_s"]
        base = base or r["median_s"]
        print(f"{ranks:>5} {r['median_s'] * 1e3:>10.2f} {r['p90_s'] * 1e3:>8.2f} {r['max_s'] * 1e3:>8.2f} "
              f"{r['mean_s'] * 1e3:>8.2f} {epoch_s:>8.2f} {100 * r['median_s'] / epoch_s:>9.2f}% "
              f"{r['median_s'] / base:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
