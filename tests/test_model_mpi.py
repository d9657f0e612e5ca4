"""The "model" policy in a real two-rank job with one rank 3x slower: the slow rank gets the smaller
batch and neither rank starves (their compute times meet)."""
from __future__ import annotations

from test_controller_mpi import JOBS, controller_run

# Every rank sleeps 1 ms + 0.5 ms per sample in forward/backward; rank 1 three times as long. A run of the
# controller job on 2 ranks under mpirun (tests/test_controller_mpi.py): the same job, one start, alone.
JOBS["mpirun-2"][2]["model-balance"] = ["--policy", "model", "--sizes", "32,32", "--samples", "3840", "--epochs", "2",
                                        "--every", "8", "--max-batch", "256", "--timeout", "30",
                                        "--sleep-per-sample", "0.0005", "--sleep-fixed", "0.001", "--slow-rank", "1",
                                        "--slow-factor", "3"]


def test_model_policy_balances_a_three_times_slower_rank(tmp_path_factory):
    history = controller_run("mpirun-2", "model-balance", tmp_path_factory)[0][0]["history"]
    assert len(history) >= 5
    for d in history:
        assert sum(d["sizes"]) >= 64, "never below the initial global batch"
        assert all(b >= 2 for b in d["sizes"]), d
    final = history[-1]["sizes"]
    assert final[1] < final[0], f"the slow rank should hold the smaller batch: {final}"
    # compute times measured in the intervals after the second decision (the report of decision k
    # covers the interval run with decision k-1's sizes)
    ratios = [min(d["compute_s"]) / max(d["compute_s"]) for d in history[3:]]
    print(f"sizes per decision: {[d['sizes'] for d in history]}")
    print(f"compute fast/slow after the second decision: {[round(r, 3) for r in ratios]}")
    # loose: on a shared 2-core machine one interval can be disturbed (0.78 seen once at fixed sizes);
    # a starved rank (a speed split that gives it 1 sample) would be near 0.1
    assert min(ratios) > 0.6, "a rank is starved or overloaded"
    assert sorted(ratios)[len(ratios) // 2] > 0.85, "the median interval is not balanced"
