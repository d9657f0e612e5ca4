"""A rank made artificially slow shows up as allreduce wait on the other ranks."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from launching import launch

SLOW_S = 0.05


def test_slow_rank_shows_as_sync_wait_on_the_others(tmp_path):
    launch("mpirun", 3, "dataplane.py", "--out", str(tmp_path), "--sizes", "4,4,4", "--epochs", "2",
           "--configs", "sgd", "--slow-rank", "1", "--slow-s", str(SLOW_S))
    records = [json.loads(Path(tmp_path, f"rank{r}.json").read_text())["configs"]["sgd"]["records"]
               for r in range(3)]
    wait = [statistics.median(rec["sync_wait_s"] for rec in rank) for rank in records]
    compute = [statistics.median(rec["compute_s"] for rec in rank) for rank in records]
    print(f"median sync wait per rank (s): {wait}; median compute (s): {compute}")
    assert compute[1] >= SLOW_S
    for fast in (0, 2):
        assert wait[fast] >= 0.6 * SLOW_S, f"rank {fast} did not wait for the slow rank"
        assert wait[fast] > 3 * wait[1], "the slow rank itself should barely wait"
