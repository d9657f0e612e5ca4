"""Worker: rank 1 stops (SIGSTOP); rank 0 calls a library collective with a 3 s deadline, which raises a
CollectiveTimeout naming rank 1, and leaves it unhandled. Without the exit barrier's abort, MPI's
shutdown would wait for the stopped rank forever."""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import horovod.torch as hvd

from dynamix_hvd.comm import Collective, library_channel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hvd.init()
    channel = library_channel()
    if hvd.rank() == 1:
        Path(args.out, "victim.json").write_text(json.dumps({"pid": os.getpid(), "t": time.time()}))
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(1.0)
    channel.allgather_object(hvd.rank(), Collective("test.exit_abort", 3.0, "rank", "tests/workers/exit_abort.py"))


if __name__ == "__main__":
    main()
