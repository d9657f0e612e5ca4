"""Control-plane messages between ranks: the only module that talks to mpi4py.

Two collectives, both with a deadline and an error that names the rank that did not answer:
- ``gather(obj)``: every rank's object arrives at rank 0 (a list in rank order; None elsewhere).
- ``broadcast(obj)``: rank 0's object arrives at every rank.

Under ``mpirun``/``srun``/``horovodrun --mpi`` they run on a ``Dup()`` of MPI_COMM_WORLD, so control
messages can never match Horovod's own traffic, using nonblocking point-to-point messages polled
against a deadline (blocking MPI collectives cannot time out). Under ``horovodrun --gloo`` there is
no MPI world; they fall back to Horovod's object collectives, guarded by a watchdog thread: those
cannot be abandoned, so on timeout the process exits with the error instead of hanging forever.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import numpy as np

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_TAG_GATHER, _TAG_BCAST = 7301, 7302


class ControlPlaneTimeout(RuntimeError):
    """A rank did not take part in a control-plane collective within the deadline."""


class _BufferRequest:
    """Adapts a buffer request (Test() -> bool) to the object-request interface (test() -> (bool, value))."""

    def __init__(self, request) -> None:
        self._request = request

    def test(self):
        return self._request.Test(), None


# Requests given up on after a timeout. MPI may still write into their buffers, so they must outlive
# the error. They are not cancelled: cancelling mpi4py's pickled irecv crashed the process (SIGSEGV),
# and sends and collectives cannot be cancelled at all.
_ABANDONED: list = []


def launched_under_mpi() -> bool:
    """True when an MPI launcher (mpirun, srun --mpi=pmix, horovodrun --mpi) started this process."""
    return any(v in os.environ for v in _MPI_ENV)


class ControlChannel:
    """Rank-0-rooted gather and broadcast of small Python objects, each with a timeout."""

    def __init__(self, timeout_s: float = 120.0, poll_s: float = 0.0005) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}; it must be a positive number of seconds")
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._seq = 0
        if launched_under_mpi():
            from mpi4py import MPI

            self._comm = MPI.COMM_WORLD.Dup()
            self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
            self.backend = "mpi4py"
        else:
            import horovod.torch as hvd

            self._comm = None
            self.rank, self.size = hvd.rank(), hvd.size()
            self.backend = "horovod-objects"

    # --- public collectives ------------------------------------------------------------------------
    def gather(self, obj: Any, what: str = "metrics") -> list[Any] | None:
        self._seq += 1
        if self._comm is None:
            # Horovod matches collectives by name; its default name is the object's type, which
            # differs between rank 0 (a decision) and the others (None), so name them explicitly.
            everyone = self._hvd_guarded(lambda h: h.allgather_object(obj, name=f"dx.gather.{self._seq}"), what)
            return everyone if self.rank == 0 else None
        if self.rank != 0:
            self._wait([self._comm.isend(obj, dest=0, tag=_TAG_GATHER)], [0], f"sending {what} to rank 0")
            return None
        requests = [self._comm.irecv(source=src, tag=_TAG_GATHER) for src in range(1, self.size)]
        received = self._wait(requests, list(range(1, self.size)), f"gathering {what} on rank 0")
        return [obj, *received]

    def broadcast(self, obj: Any = None, what: str = "decision") -> Any:
        self._seq += 1
        if self._comm is None:
            return self._hvd_guarded(
                lambda h: h.broadcast_object(obj, root_rank=0, name=f"dx.bcast.{self._seq}"), what)
        if self.rank == 0:
            sends = [self._comm.isend(obj, dest=dst, tag=_TAG_BCAST) for dst in range(1, self.size)]
            self._wait(sends, list(range(1, self.size)), f"sending {what} from rank 0")
            return obj
        return self._wait([self._comm.irecv(source=0, tag=_TAG_BCAST)], [0],
                          f"receiving {what} from rank 0")[0]

    # --- numeric arrays: fixed-size float64 buffers, no pickling ------------------------------------
    # Under MPI the gather is point-to-point into buffers on rank 0 (not Igather), so that a silent
    # rank is named as the object gather names it; rank 0 probes each message's length before
    # receiving it, so a rank that sends a different length gets a clear error, never garbage.
    _TAG_ARRAY = 7311

    class _Mpi:
        """A request of this section: answers ControlPlaneTimeout once MPI has been shut down under it
        (Horovod finalizes MPI when any rank exits), instead of calling into a finalized MPI."""

        def __init__(self, doing: str, rank: int) -> None:
            self.doing, self.rank = doing, rank

        def _check_alive(self) -> None:
            from mpi4py import MPI

            if MPI.Is_finalized():
                raise ControlPlaneTimeout(f"rank {self.rank}: MPI was shut down while {self.doing} (another rank "
                                          "exited: Horovod finalizes MPI on every rank when one shuts down)")

    class _KeepBuffer(_Mpi):
        """A buffer request that keeps its buffer alive for as long as MPI may use it."""

        def __init__(self, request, buffer, doing: str, rank: int) -> None:
            super().__init__(doing, rank)
            self._request, self.buffer = request, buffer

        def test(self):
            self._check_alive()
            return self._request.Test(), None

    class _ProbedArray(_Mpi):
        """Receives one float64 array of any length from `source` once it has arrived (probe, then receive)."""

        def __init__(self, comm, source: int, tag: int, doing: str, rank: int) -> None:
            super().__init__(doing, rank)
            self._comm, self._source, self._tag = comm, source, tag

        def test(self):
            from mpi4py import MPI

            self._check_alive()
            status = MPI.Status()
            if not self._comm.Iprobe(source=self._source, tag=self._tag, status=status):
                return False, None
            buf = np.empty(status.Get_count(MPI.DOUBLE), dtype=np.float64)
            self._comm.Recv(buf, source=self._source, tag=self._tag)
            return True, buf

    def gather_array(self, values: np.ndarray, what: str = "metrics") -> np.ndarray | None:
        """Every rank's 1-D float64 array of the same length n; rank 0 gets [size, n] in rank order,
        the others None. A rank whose length differs raises ValueError (naming it) on rank 0 (MPI)
        or on every rank (Gloo)."""
        rows, lengths = self._gather_ragged(values, what)
        if lengths is not None and len(set(lengths)) > 1:
            raise ValueError(self._length_error(what, lengths))
        return None if rows is None else np.stack(rows)

    def gather_arrays(self, values: np.ndarray, what: str = "metrics") -> list[np.ndarray] | None:
        """As :meth:`gather_array`, but the lengths may differ: rank 0 gets one array per rank."""
        return self._gather_ragged(values, what)[0]

    def _gather_ragged(self, values: np.ndarray, what: str) -> tuple[list[np.ndarray] | None, list[int] | None]:
        """(rank 0: the arrays in rank order, else None; every length where this rank knows them)."""
        send = self._as_vector(values, what)
        self._seq += 1
        if self._comm is None:
            return self._hvd_guarded(lambda h: self._hvd_gather_arrays(h, send), what)
        if self.rank != 0:
            doing = f"sending {what} to rank 0"
            request = self._KeepBuffer(self._comm.Isend(send, dest=0, tag=self._TAG_ARRAY), send, doing, self.rank)
            self._wait([request], [0], doing)
            return None, None
        peers, doing = list(range(1, self.size)), f"gathering {what} on rank 0"
        received = self._wait([self._ProbedArray(self._comm, src, self._TAG_ARRAY, doing, self.rank) for src in peers],
                              peers, doing)
        rows = [send, *received]
        return rows, [len(r) for r in rows]

    def broadcast_array(self, values: np.ndarray | None, n: int, what: str = "decision") -> np.ndarray:
        """Rank 0's 1-D float64 array of length n on every rank (the others pass None and the same n)."""
        if self.rank == 0:
            buf = self._as_vector(values, what)
            if len(buf) != n:
                raise ValueError(f"rank 0: broadcast of {what}: array has {len(buf)} values, n={n}")
        else:
            buf = np.empty(n, dtype=np.float64)
        self._seq += 1
        if self._comm is None:
            import torch

            t = torch.from_numpy(buf)
            out = self._hvd_guarded(lambda h: h.broadcast(t, root_rank=0, name=f"dx.bcast_array.{self._seq}"), what)
            return out.numpy()
        peers = (list(range(1, self.size)) if self.rank == 0 else [0]) or [0]
        doing = f"sending {what} from rank 0" if self.rank == 0 else f"receiving {what} from rank 0"
        request = self._KeepBuffer(self._comm.Ibcast(buf, root=0), buf, doing, self.rank)
        self._wait([request] * len(peers), peers, doing)  # one collective; a timeout names every peer
        return buf

    @staticmethod
    def _as_vector(values: np.ndarray | None, what: str) -> np.ndarray:
        arr = np.ascontiguousarray(values, dtype=np.float64)
        if arr.ndim != 1:
            raise ValueError(f"{what}: need a 1-D array of float64 values, got shape {arr.shape}")
        return arr

    def _length_error(self, what: str, lengths: list[int]) -> str:
        expected = min(set(lengths), key=lambda n: (-lengths.count(n), n != lengths[0]))  # ties: rank 0's
        odd = {r: n for r, n in enumerate(lengths) if n != expected}
        return (f"rank {self.rank}: gathering {what} (control message #{self._seq}): rank(s) {sorted(odd)} sent "
                f"{[odd[r] for r in sorted(odd)]} values where the others sent {expected}. Every rank must "
                "report the same number of steps per decision (a rank skipped or added a step).")

    def _hvd_gather_arrays(self, h: Any, send: np.ndarray) -> tuple[list[np.ndarray] | None, list[int]]:
        import torch

        lengths = h.allgather(torch.tensor([len(send)], dtype=torch.int64), name=f"dx.gather_lens.{self._seq}").tolist()
        data = h.allgather(torch.from_numpy(send), name=f"dx.gather_array.{self._seq}").numpy()  # concatenated
        if self.rank != 0:
            return None, lengths
        return np.split(data, np.cumsum(lengths)[:-1]), lengths

    def any_true(self, flag: bool, what: str = "stop flag") -> bool:
        """True on every rank if `flag` is true on any rank (e.g. one rank received SIGTERM)."""
        self._seq += 1
        if self._comm is None:
            import torch

            t = torch.tensor([1 if flag else 0], dtype=torch.int32)
            out = self._hvd_guarded(lambda h: h.allreduce(t, op=h.Max, name=f"dx.any.{self._seq}"), what)
            return bool(out.item())
        import numpy as np
        from mpi4py import MPI

        send, recv = np.array([1 if flag else 0], dtype=np.int32), np.zeros(1, dtype=np.int32)
        request = self._comm.Iallreduce(send, recv, op=MPI.MAX)
        self._wait([_BufferRequest(request)], list(range(self.size)), f"agreeing on the {what}")
        return bool(recv[0])

    def rebind(self, rank: int, size: int) -> None:
        """After an elastic reset (Horovod object collectives only: no MPI world there)."""
        if self._comm is not None:
            raise RuntimeError("an MPI control plane cannot change its world; restart from a checkpoint")
        self.rank, self.size = rank, size
        self._seq = 0  # collectives are matched by name; a newcomer starts counting at 0 too

    def close(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    # --- mechanics ---------------------------------------------------------------------------------
    def _wait(self, requests: list, peers: list[int], doing: str) -> list[Any]:
        """Poll nonblocking requests until all complete or the deadline passes."""
        deadline = time.monotonic() + self.timeout_s
        results: list[Any] = [None] * len(requests)
        pending = set(range(len(requests)))
        spin_until = time.monotonic() + 0.002  # most answers arrive within microseconds: spin first
        while pending:
            for i in list(pending):
                done, value = requests[i].test()
                if done:
                    results[i] = value
                    pending.discard(i)
            if not pending:
                break
            if time.monotonic() > deadline:
                _ABANDONED.extend(requests[i] for i in pending)
                missing = sorted(peers[i] for i in pending)
                raise ControlPlaneTimeout(
                    f"rank {self.rank}: timed out after {self.timeout_s:.0f} s {doing} "
                    f"(control message #{self._seq}); rank(s) {missing} did not answer. A rank that "
                    "crashed, hangs, or skipped the decision point (different step counts) causes this.")
            if time.monotonic() > spin_until:
                time.sleep(self.poll_s)
        return results

    def _hvd_guarded(self, call, what: str) -> Any:
        import horovod.torch as hvd

        finished = threading.Event()

        def watchdog() -> None:
            if not finished.wait(self.timeout_s):
                sys.stderr.write(
                    f"[dynamix_hvd] rank {self.rank}: control-plane collective '{what}' (#{self._seq}) did not "
                    f"complete within {self.timeout_s:.0f} s under Gloo; some rank did not answer (Horovod's "
                    "stall warnings above name the missing ranks). Exiting instead of hanging.\n")
                sys.stderr.flush()
                os._exit(3)

        threading.Thread(target=watchdog, daemon=True).start()
        try:
            return call(hvd)
        finally:
            finished.set()
