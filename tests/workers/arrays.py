"""Worker: ControlChannel.gather_array(s) / broadcast_array in a real job (mpirun or horovodrun --gloo).

Prints one line per check and rank; the test reads them: GATHER-OK, BCAST-OK, MISMATCH-OK (the rank
that got the length error, with its message) or MISMATCH-SENT (an MPI non-root rank, which does not
learn of it), RAGGED-OK (rank 0: arrays of different lengths), AFTER-OK (the channel still works after the error).
"""
from __future__ import annotations

import math

import horovod.torch as hvd
import numpy as np

from dynamix_hvd.comm import Collective, ControlChannel


def row(rank: int, n: int) -> np.ndarray:
    values = np.arange(n, dtype=np.float64) + 1000.0 * rank + 0.125
    values[0] = math.nan if rank % 2 else -0.0
    values[-1] = 2.0**53 + 2 * rank  # large integers survive exactly
    return values


def main() -> None:
    hvd.init()
    ch = ControlChannel()
    rank, size = ch.rank, ch.size
    rows = ch.gather_array(row(rank, 7), Collective("test.rows", 60, "test rows"))
    if rank == 0:
        expected = np.stack([row(r, 7) for r in range(size)])
        assert rows is not None and rows.shape == (size, 7) and rows.dtype == np.float64
        assert np.array_equal(rows, expected, equal_nan=True), (rows, expected)
        print(f"GATHER-OK rank 0 shape {rows.shape}", flush=True)
    else:
        assert rows is None
        print(f"GATHER-OK rank {rank}", flush=True)
    decision = np.array([3.0, 1.0, 1.5, *range(10, 10 + size), math.nan])
    got = ch.broadcast_array(decision if rank == 0 else None, len(decision), Collective("test.decision", 60, "test decision"))
    assert np.array_equal(got, decision, equal_nan=True), got
    print(f"BCAST-OK rank {rank}", flush=True)
    try:
        ch.gather_array(row(rank, 9 if rank == size - 1 else 7), Collective("test.uneven", 60, "uneven rows"))
        print(f"MISMATCH-SENT rank {rank}", flush=True)
    except ValueError as exc:
        print(f"MISMATCH-OK rank {rank}: {exc}", flush=True)
    ragged = ch.gather_arrays(row(rank, 4 + rank), Collective("test.ragged", 60, "ragged rows"))
    if rank == 0:
        assert [len(r) for r in ragged] == [4 + r for r in range(size)], ragged
        assert all(np.array_equal(got, row(r, 4 + r), equal_nan=True) for r, got in enumerate(ragged))
        print("RAGGED-OK rank 0", flush=True)
    rows = ch.gather_array(row(rank, 3), Collective("test.after", 60, "rows after the error"))
    assert rank != 0 or np.array_equal(rows, np.stack([row(r, 3) for r in range(size)]), equal_nan=True)
    print(f"AFTER-OK rank {rank}", flush=True)
    # Nobody leaves before rank 0 is done: Horovod finalizes MPI on every rank as soon as one exits.
    ch.broadcast_array(np.zeros(1) if rank == 0 else None, 1, Collective("test.done", 60, "done"))
    ch.close()


if __name__ == "__main__":
    main()
