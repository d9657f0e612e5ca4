"""comm's named collectives with deadlines, in real mpirun and horovodrun --gloo jobs."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynamix_hvd import comm
from dynamix_hvd.comm import Collective
from launching import REPO, WORKERS, launch, launch_side_by_side

DEADLINE = 3.0
MARGIN = 6.0  # start-up of the timer and a loaded two-core machine; a hang would last the silent rank's 13 s
# The ranks leave the worker's starting allreduce a little apart; a rank told of the timeout by another
# reports the other's deadline less that lag (2.99 s seen on a loaded machine).
LAG = 0.25


@pytest.mark.mpi
@pytest.mark.parametrize("launcher, ranks", [("mpirun", 3), ("horovodrun-gloo", 2)])
def test_every_collective_delivers_in_rank_order(tmp_path, launcher, ranks):
    launch(launcher, ranks, "collectives.py", "--mode", "correct", "--out", str(tmp_path), timeout=240)
    results = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(ranks)]
    last = ranks - 1
    for r, res in enumerate(results):
        assert res["backend"] == ("mpi4py" if launcher == "mpirun" else "horovod-objects")
        assert res["allgather"] == [{"rank": q, "items": list(range(q))} for q in range(ranks)]
        assert res["gather_last"] == ([f"from {q}" for q in range(ranks)] if r == last else None)
        assert res["bcast_last"] == {"root says": last}
        assert res["big"] == [[2_000_000, q, q] for q in range(ranks)]
        assert res["repeated"] == [[q * 10 + i for q in range(ranks)] for i in range(5)]
        assert res["tensor"] == [[q, 2 * q, 3] for q in range(ranks)]
        assert res["allreduce"] == sum(range(ranks))
        assert res["tensor_float"] == [[q + 0.5] * 2 for q in range(ranks) for _ in range(2)]
        assert res["end"] == (["end"] * ranks if r == 0 else None)


def _timeouts(out: str) -> dict[int, tuple[float, str]]:
    # Lines of different ranks can arrive run together: a message ends at the next rank's marker.
    found = re.findall(r"TIMEOUT-OK rank (\d+) after ([\d.]+) s: (.*?)(?=TIMEOUT-OK rank|RETURNED rank|$)", out, re.M)
    return {int(r): (float(s), msg) for r, s, msg in found}


SILENT_MPI = [  # op, silent rank, ranks that time out, ranks that return
    ("allgather_object", 2, [0, 1], []),
    ("allgather_tensor", 1, [0, 2], []),
    ("gather_object", 2, [0], [1]),        # rank 1 only sends: it needs nothing from rank 2
    ("broadcast_object", 0, [1, 2], []),   # a silent root
]
SILENT_GLOO = ["allgather_object", "broadcast_object"]


@pytest.fixture(scope="module")
def silent_jobs() -> dict[str, subprocess.CompletedProcess]:
    """Every silent-rank job, side by side: each spends most of its time waiting for its sleeping rank (13 s
    under mpirun), so together they take about as long as one. Keys: "mpirun OP", "gloo OP"."""
    def argv(op: str, silent: int) -> list[str]:
        return [sys.executable, str(WORKERS / "collectives.py"), "--mode", "silent", "--op", op, "--silent",
                str(silent), "--deadline", str(DEADLINE)]

    jobs = {f"mpirun {op}": ("mpirun", 3, argv(op, silent)) for op, silent, _, _ in SILENT_MPI}
    jobs.update({f"gloo {op}": ("horovodrun-gloo", 3, argv(op, 1)) for op in SILENT_GLOO})
    return {name: job.proc for name, job in launch_side_by_side(jobs, timeout=240).items()}


@pytest.mark.mpi
@pytest.mark.parametrize("op, silent, waiting, returned", SILENT_MPI)
def test_silent_rank_is_named_within_the_deadline_under_mpi(silent_jobs, op, silent, waiting, returned):
    proc = silent_jobs[f"mpirun {op}"]
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    timeouts = _timeouts(out)
    assert sorted(timeouts) == waiting, out
    for rank, (seconds, message) in timeouts.items():
        assert DEADLINE - LAG <= seconds <= DEADLINE + comm._grace(Collective("x", DEADLINE)) + MARGIN, out
        assert f"collective 'test.silent.{op}'" in message and f"rank(s) [{silent}] did not answer" in message, out
    assert sorted(int(r) for r in re.findall(r"RETURNED rank (\d+)", out)) == returned, out


@pytest.mark.mpi
@pytest.mark.parametrize("op", SILENT_GLOO)
def test_silent_rank_under_gloo_ends_the_job_with_the_collective_named(silent_jobs, op):
    proc = silent_jobs[f"gloo {op}"]
    assert proc.returncode != 0, proc.stdout
    assert "killed: still running" not in proc.stdout, proc.stdout[-6000:]
    lines = re.findall(rf"rank (\d+): collective 'test.silent.{op}' did not complete within 3 s under Gloo "
                       r"\(([\d.]+) s waited\)", proc.stdout)
    # every rank that waited says so (the job ends at the first), and the silent rank never does
    assert lines and all(r != "1" for r, _ in lines), proc.stdout
    assert all(DEADLINE - LAG <= float(s) <= DEADLINE + MARGIN for _, s in lines), proc.stdout
    assert "the silent rank is the one without it" in proc.stdout


def test_library_collectives_have_distinct_names_and_deadlines():
    names = [op.name for op in comm.LIBRARY_COLLECTIVES]
    assert len(names) == len(set(names)) == 8
    assert all(op.deadline_s > 0 and op.where for op in comm.LIBRARY_COLLECTIVES)
    every = comm.LIBRARY_COLLECTIVES + comm.CONTROL_COLLECTIVES
    assert len({op.name for op in every}) == len(every)
    assert all(op.deadline_s > 0 and op.what and op.where for op in every)
    tags = [comm._tag(op) for op in every]
    assert len(set(tags)) == len(tags) and all(10_000 <= t < 30_000 for t in tags)


@pytest.mark.parametrize("name, deadline", [("", 1.0), ("  ", 1.0), ("x", 0), ("x", -2.0), ("x", float("nan")),
                                            ("x", float("inf")), (None, 1.0), ("x", "10")])
def test_a_collective_without_a_name_or_deadline_is_refused(name, deadline):
    with pytest.raises(ValueError, match="name=|deadline_s="):
        Collective(name, deadline)


def test_only_comm_issues_horovod_object_collectives():
    """comm's object collectives run on the Horovod engine's (under horovodrun --gloo); nothing else issues any."""
    pattern = re.compile(r"hvd\.(allgather_object|broadcast_object|allgather|broadcast)\(")
    hits = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "dynamix_hvd").rglob("*.py"))
            if p.relative_to(REPO).as_posix() not in ("dynamix_hvd/comm.py", "dynamix_hvd/engine/horovod.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == [], hits


@pytest.mark.parametrize("exc, failed", [
    (None, False),                       # the block ended normally
    (SystemExit(0), False), (SystemExit(None), False),
    (SystemExit(143), True),             # a preemption's exit: every rank leaves alike
    (KeyboardInterrupt(), True), (RuntimeError("x"), True),
])
def test_a_with_block_left_by_an_error_counts_as_failed(exc, failed):
    # a failed close sends no "done" to the other ranks' stall watchdogs, which then keep watching it
    assert comm.failed_exit(None if exc is None else type(exc), exc) is failed
