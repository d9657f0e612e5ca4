"""A rank made artificially slow shows up as allreduce wait on the other ranks."""
from __future__ import annotations

import statistics

from test_dataplane_mpi import RUNS, dataplane_run

SLOW_S = 0.05
# a run of the data-plane job on 3 ranks under mpirun (tests/test_dataplane_mpi.py): the same job, one start
RUNS[("mpirun", 3)]["slow-rank"] = ["--sizes", "4,4,4", "--epochs", "2", "--configs", "sgd", "--slow-rank", "1",
                                    "--slow-s", str(SLOW_S)]


def test_slow_rank_shows_as_sync_wait_on_the_others(tmp_path_factory):
    records = [r["configs"]["sgd"]["records"] for r in dataplane_run("mpirun", 3, "slow-rank", tmp_path_factory)]
    wait = [statistics.median(rec["sync_wait_s"] for rec in rank) for rank in records]
    compute = [statistics.median(rec["compute_s"] for rec in rank) for rank in records]
    print(f"median sync wait per rank (s): {wait}; median compute (s): {compute}")
    assert compute[1] >= SLOW_S
    for fast in (0, 2):
        assert wait[fast] >= 0.6 * SLOW_S, f"rank {fast} did not wait for the slow rank"
        assert wait[fast] > 3 * wait[1], "the slow rank itself should barely wait"
