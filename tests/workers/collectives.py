"""Worker: comm's named collectives in a real job. Modes:

correct  every collective (objects, a 2 MB object, tensors, roots other than 0, one name repeated,
         Horovod's own allreduce in between); each rank writes <out>/rank<r>.json with what it got.
silent   rank `--silent` sleeps past the deadline instead of joining `--op`; the others either time
         out (a line "TIMEOUT-OK rank <r> after <s> s: <message>") or, where they need nothing from
         the silent rank, return (a line "RETURNED rank <r>"). Under Gloo the watchdog ends them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch

from dynamix_hvd.comm import Collective, ControlPlaneTimeout, library_channel

OPS = ("allgather_object", "gather_object", "broadcast_object", "allgather_tensor")


def correct(out: Path) -> None:
    ch, rank, world = library_channel(), hvd.rank(), hvd.size()
    last = world - 1
    result = {
        "backend": ch.backend,
        "allgather": ch.allgather_object({"rank": rank, "items": list(range(rank))}, Collective("test.ag", 30)),
        "gather_last": ch.gather_object(f"from {rank}", Collective("test.gather", 30), root=last),
        "bcast_last": ch.broadcast_object({"root says": rank} if rank == last else None,
                                          Collective("test.bcast", 30), root=last),
        "big": [[len(b), b[0], b[-1]] for b in ch.allgather_object(bytes([rank]) * 2_000_000, Collective("test.big", 60))],
        "repeated": [ch.allgather_object(rank * 10 + i, Collective("test.repeat", 30)) for i in range(5)],
        "tensor": ch.allgather_tensor(torch.tensor([[rank, 2 * rank, 3]], dtype=torch.int64),
                                      Collective("test.tensor", 30)).tolist(),
        "allreduce": hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, name="test.between").item(),
        "tensor_float": ch.allgather_tensor(torch.full((2, 2), rank + 0.5), Collective("test.tensor.f", 30)).tolist(),
    }
    # the last collective before exit is a gather, as in RunLog.finish (see comm: exit and MPI_Finalize)
    result["end"] = ch.gather_object("end", Collective("test.end", 30))
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def silent(op_name: str, silent_rank: int, deadline: float) -> None:
    ch, rank = library_channel(), hvd.rank()
    # every rank starts the test at about the same time (not as each finished starting up): a rank that
    # learns of the timeout from another ends the other's deadline after the other started
    hvd.allreduce(torch.zeros(1), name="test.silent.start")
    if rank == silent_rank:
        time.sleep(deadline + 10)  # alive, but never joins
        return
    op = Collective(f"test.silent.{op_name}", deadline)
    call = {"allgather_object": lambda: ch.allgather_object(rank, op),
            "gather_object": lambda: ch.gather_object(rank, op, root=0),
            "broadcast_object": lambda: ch.broadcast_object(rank, op, root=0),
            "allgather_tensor": lambda: ch.allgather_tensor(torch.tensor([rank]), op)}[op_name]
    start = time.monotonic()
    try:
        call()
        _say(f"RETURNED rank {rank}")
    except ControlPlaneTimeout as exc:
        _say(f"TIMEOUT-OK rank {rank} after {time.monotonic() - start:.2f} s: {exc}")
    # Stay until the others are done: a rank that exits ends Horovod everywhere, which (having initialised
    # MPI) finalises it under the feet of ranks still polling.
    time.sleep(max(0.0, start + deadline + 6 - time.monotonic()))


def _say(line: str) -> None:
    # One write per line: print() writes text and newline separately, and mpirun's output forwarding can
    # put another rank's line between them.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["correct", "silent"], required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--op", choices=OPS, default="allgather_object")
    ap.add_argument("--silent", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=3.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    if args.mode == "correct":
        correct(Path(args.out))
    else:
        silent(args.op, args.silent, args.deadline)


if __name__ == "__main__":
    main()
