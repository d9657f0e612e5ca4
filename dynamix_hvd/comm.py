"""Control-plane messages between ranks: the only module that talks to mpi4py.

The controller's collectives, each with a deadline and an error that names the rank that did not answer:
- ``gather_array``/``gather_arrays`` and ``broadcast_array``: the per-rank reports and the decision
  as float64 buffers (layout in `dynamix_hvd.control.wire`), nothing pickled;
- ``any_true``: agreement on a flag (e.g. a stop request);
- ``gather(obj)``/``broadcast(obj)``: small Python objects (checkpoint coordination).

Under ``mpirun``/``srun``/``horovodrun --mpi`` they run on a ``Dup()`` of MPI_COMM_WORLD, so control
messages can never match Horovod's own traffic, using nonblocking point-to-point messages polled
against a deadline (blocking MPI collectives cannot time out). Under ``horovodrun --gloo`` there is
no MPI world; they fall back to Horovod's object collectives, guarded by a watchdog thread: those
cannot be abandoned, so on timeout the process exits with the error instead of hanging forever.

The rest of the library's collectives (run log, elastic state, DBA counts) are the named ones at the
end of this module: ``allgather_object``, ``gather_object``, ``broadcast_object`` and
``allgather_tensor``, each given a `Collective` (name and deadline) and issued on `library_channel()`.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import numpy as np

from . import validate

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_TAG_GATHER, _TAG_BCAST = 7301, 7302


class ControlPlaneTimeout(RuntimeError):
    """A rank did not take part in a control-plane collective within the deadline."""


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
            self._wait([self._comm.issend(obj, dest=0, tag=_TAG_GATHER)], [0], f"sending {what} to rank 0")
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
            # Synchronous sends: rank 0 leaves only once every rank has taken the object, so it cannot
            # exit (and have Horovod finalize MPI everywhere) while a rank still waits for it.
            sends = [self._comm.issend(obj, dest=dst, tag=_TAG_BCAST) for dst in range(1, self.size)]
            self._wait(sends, list(range(1, self.size)), f"sending {what} from rank 0", sends_may_drop=True)
            return obj
        return self._wait([self._comm.irecv(source=0, tag=_TAG_BCAST)], [0],
                          f"receiving {what} from rank 0", grace_s=self._root_grace())[0]

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
        # One collective; a timeout names every peer. The other ranks wait a grace longer than rank 0, so
        # that when a third rank is the silent one, rank 0 (which can name it) ends the job first.
        self._wait([request] * len(peers), peers, doing, grace_s=0.0 if self.rank == 0 else self._root_grace())
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
        # Rooted (gather on rank 0, then broadcast) rather than one Iallreduce, so a timeout names the
        # rank that did not answer, on every rank (rank 0 tells the others whom it missed).
        flags = self.allgather_object(bool(flag), Collective(f"dx.any_true.{what}", self.timeout_s))
        return any(flags)

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
    @staticmethod
    def _mpi_finalized() -> bool:
        from mpi4py import MPI

        return bool(MPI.Is_finalized())

    def _root_grace(self) -> float:
        return 1.0 + 0.1 * self.timeout_s

    def _wait(self, requests: list, peers: list[int], doing: str, grace_s: float = 0.0,
              sends_may_drop: bool = False) -> list[Any]:
        """Poll nonblocking requests until all complete or the deadline (+ `grace_s`) passes.
        `sends_may_drop`: the requests are rank 0's sends of a broadcast (see `_mpi_poll`)."""
        waited_s = self.timeout_s + grace_s
        deadline = time.monotonic() + waited_s
        results: list[Any] = [None] * len(requests)
        pending = set(range(len(requests)))
        spin_until = time.monotonic() + 0.002  # most answers arrive within microseconds: spin first
        while pending:
            if self._comm is not None and self._mpi_finalized():
                if sends_may_drop:
                    return results
                raise ControlPlaneTimeout(f"rank {self.rank}: MPI was shut down while {doing} (another rank "
                                          "exited: Horovod finalizes MPI on every rank when one shuts down)")
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
                    f"rank {self.rank}: timed out after {waited_s:.0f} s {doing} "
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


    # ==============================================================================================
    # Named library collectives: every collective the library issues outside the
    # gradient allreduce and the controller's messages above. Each call takes a `Collective` (a name
    # and a deadline; the library's own are listed at the end of this module). Under MPI they are
    # nonblocking point-to-point messages on this channel's Dup()'d communicator, rooted at one rank,
    # so the root knows which rank did not answer (and, in an allgather, tells the others). Under
    # Gloo they are Horovod collectives of that name under a watchdog that ends the process at the
    # deadline (Horovod collectives cannot be abandoned).
    # At exit: Horovod, when it initialised MPI, finalises it on every rank as soon as one rank shuts
    # down, so a rank must not exit while a peer still waits for its messages. `library_channel()`
    # therefore registers an exit barrier (`EXIT_BARRIER`) that runs before Horovod's own shutdown.
    # Sends are synchronous (issend), so a rank leaves a collective only once its peers took its messages.
    # ==============================================================================================
    def allgather_object(self, obj: Any, op: Collective) -> list[Any]:
        """Every rank's object on every rank (a list in rank order)."""
        if self._comm is None:
            return self._hvd_within(op, lambda h: h.allgather_object(obj, name=op.name))
        deadline = time.monotonic() + op.deadline_s
        gathered = self._mpi_gather(obj, op, 0, deadline, tell_others=True)
        return self._mpi_bcast(gathered, op, 0, deadline + _grace(op))

    def gather_object(self, obj: Any, op: Collective, root: int = 0) -> list[Any] | None:
        """Every rank's object on `root` (a list in rank order); None on the other ranks."""
        self._check_root(root, op)
        if self._comm is None:
            everyone = self._hvd_within(op, lambda h: h.allgather_object(obj, name=op.name))
            return everyone if _hvd_rank() == root else None
        return self._mpi_gather(obj, op, root, time.monotonic() + op.deadline_s, tell_others=False)

    def broadcast_object(self, obj: Any, op: Collective, root: int = 0) -> Any:
        """`root`'s object on every rank (`obj` is ignored on the other ranks)."""
        self._check_root(root, op)
        if self._comm is None:
            return self._hvd_within(op, lambda h: h.broadcast_object(obj, root_rank=root, name=op.name))
        return self._mpi_bcast(obj, op, root, time.monotonic() + op.deadline_s)

    def allgather_tensor(self, tensor: Any, op: Collective) -> Any:
        """Every rank's tensor concatenated along dim 0 in rank order (what ``hvd.allgather`` returns)."""
        if self._comm is None:
            return self._hvd_within(op, lambda h: h.allgather(tensor, name=op.name))
        import torch

        parts = self.allgather_object(tensor.detach().cpu().numpy(), op)
        return torch.cat([torch.from_numpy(p) for p in parts]).to(tensor.device)

    def _check_root(self, root: int, op: Collective) -> None:
        size = self.size if self._comm is not None else _hvd_size()
        if not (isinstance(root, int) and 0 <= root < size):
            raise ValueError(f"collective '{op.name}': root={root!r} is not a rank of this world of {size}")

    def _mpi_gather(self, obj: Any, op: Collective, root: int, deadline: float, tell_others: bool) -> list[Any] | None:
        others = [r for r in range(self.size) if r != root]
        if self.rank != root:
            send = self._comm.issend(("obj", op.name, obj), dest=root, tag=_tag(op))
            self._mpi_poll(op, {root: send}, [], deadline, f"sending to rank {root}")
            return None
        try:
            got = self._mpi_poll(op, {}, others, deadline, f"gathering on rank {root}")
        except CollectiveTimeout as exc:
            if tell_others:  # they wait a grace longer for this note, so their errors name the rank too
                for dst in others:
                    _ABANDONED.append(self._comm.isend(("missing", op.name, exc.missing), dest=dst, tag=_tag(op)))
            raise
        got[root] = ("obj", obj)
        return [got[r][1] for r in range(self.size)]

    def _mpi_bcast(self, obj: Any, op: Collective, root: int, deadline: float) -> Any:
        if self.rank == root:
            sends = {dst: self._comm.issend(("ok", op.name, obj), dest=dst, tag=_tag(op))
                     for dst in range(self.size) if dst != root}
            self._mpi_poll(op, sends, [], deadline, f"sending from rank {root}", sends_may_drop=True)
            return obj
        kind, value = self._mpi_poll(op, {}, [root], deadline, f"receiving from rank {root}")[root]
        if kind == "missing":
            raise CollectiveTimeout(
                f"rank {self.rank}: collective '{op.name}' timed out after {op.deadline_s:g} s on rank {root}; "
                f"rank(s) {value} did not answer. A rank that crashed, hangs, or skipped this point causes this.",
                missing=value)
        return value

    def _mpi_poll(self, op: Collective, sends: dict[int, Any], sources: list[int], deadline: float,
                  doing: str, sends_may_drop: bool = False) -> dict[int, tuple[str, Any]]:
        """Complete `sends` ({peer: request}) and take one message from each of `sources` by `deadline`.

        `sends_may_drop`: a root's broadcast, whose receivers may take it and end (Horovod then
        finalizes MPI here before our synchronous sends report completion): that is success.

        Receives are matched probes (improbe), so nothing is posted that would have to be cancelled."""
        from mpi4py import MPI

        tag, received, waiting = _tag(op), {}, list(sources)
        spin_until = time.monotonic() + 0.002
        while True:
            if MPI.Is_finalized():  # Horovod, when it initialised MPI, finalises it once any rank has ended
                if not waiting and sends_may_drop:
                    return received  # only our sends were pending: the peers took them and ended
                raise CollectiveTimeout(f"rank {self.rank}: collective '{op.name}' cannot complete: MPI was "
                                        "finalised under it (Horovod shut down: another rank ended)",
                                        missing=sorted({*waiting, *sends}))
            for src in list(waiting):
                message = self._comm.improbe(source=src, tag=tag)
                if message is not None:
                    kind, name, value = message.recv()
                    if name != op.name:
                        raise RuntimeError(f"rank {self.rank}: in collective '{op.name}' rank {src} sent a message "
                                           f"of collective '{name}': the ranks issue collectives in different orders")
                    received[src] = (kind, value)
                    waiting.remove(src)
            sends = {peer: request for peer, request in sends.items() if not request.Test()}
            if not waiting and not sends:
                return received
            if time.monotonic() > deadline:
                _ABANDONED.extend(sends.values())
                missing = sorted({*waiting, *sends})
                raise CollectiveTimeout(
                    f"rank {self.rank}: collective '{op.name}' timed out after {op.deadline_s:g} s {doing}; "
                    f"rank(s) {missing} did not answer. A rank that crashed, hangs, or skipped this point "
                    "causes this.", missing=missing)
            if time.monotonic() > spin_until:
                time.sleep(self.poll_s)

    @staticmethod
    def _hvd_within(op: Collective, call: Callable[[Any], Any]) -> Any:
        import horovod.torch as hvd

        finished, start = threading.Event(), time.monotonic()

        def watchdog() -> None:
            if not finished.wait(op.deadline_s):
                sys.stderr.write(
                    f"[dynamix_hvd] rank {hvd.rank()}: collective '{op.name}' did not complete within "
                    f"{op.deadline_s:g} s under Gloo ({time.monotonic() - start:.1f} s waited); some rank did not "
                    "answer. Under Gloo a rank cannot tell which: every rank that waited prints this line, so the "
                    "silent rank is the one without it. Exiting instead of hanging.\n")
                sys.stderr.flush()
                os._exit(3)

        threading.Thread(target=watchdog, name=f"dx-deadline-{op.name}", daemon=True).start()
        try:
            return call(hvd)
        finally:
            finished.set()


class CollectiveTimeout(ControlPlaneTimeout):
    """A named collective missed its deadline; `missing` lists the ranks that did not answer."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)


@dataclass(frozen=True)
class Collective:
    """A named collective and its deadline in seconds; the same name on every rank, one name per call site."""

    name: str
    deadline_s: float
    where: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"Collective name={self.name!r}; give every collective a non-empty name")
        validate.number(f"Collective '{self.name}': deadline_s", self.deadline_s, above=0,
                        what="a positive finite number of seconds")


def _tag(op: Collective) -> int:
    # The same name gives the same tag on every rank; clear of the controller's 7301/7302, below MPI_TAG_UB.
    return 10_000 + zlib.crc32(op.name.encode()) % 20_000


def _grace(op: Collective) -> float:
    """How much longer non-root ranks wait than the root, so the root's note naming the silent rank arrives."""
    return 1.0 + 0.1 * op.deadline_s


def _hvd_rank() -> int:
    import horovod.torch as hvd

    return hvd.rank()  # read live: an elastic reset changes it


def _hvd_size() -> int:
    import horovod.torch as hvd

    return hvd.size()


# The library's collectives outside the gradient allreduce: name, deadline (s), where issued.
RUNLOG_CLOCK = Collective("dx.runlog.clock_origin", 600.0, "runs.runlog.RunLog(): the ranks' common clock origin")
RUNLOG_EPOCH = Collective("dx.runlog.epoch_rows", 600.0, "runs.runlog.RunLog.end_epoch(): one row per rank")
RUNLOG_FINISH = Collective("dx.runlog.finish", 600.0, "runs.runlog.RunLog.finish(): every rank's trace to rank 0")
ELASTIC_LOADER = Collective("dx.elastic.loader", 300.0, "resilience.elastic: loader state on sync")
ELASTIC_CONTROLLER = Collective("dx.elastic.controller", 300.0, "resilience.elastic: controller root on commit")
ELASTIC_CONTROLLER_SYNC = Collective("dx.elastic.controller.sync", 300.0,
                                     "resilience.elastic: controller state on sync")
DBA_COUNTS = Collective("dx.dba_counts", 300.0, "dba.distributed.exchange_counts(): selected counts, every step")
EXIT_BARRIER = Collective("dx.exit_barrier", 60.0, "comm: at interpreter exit, before Horovod shuts down (MPI only)")
LIBRARY_COLLECTIVES: tuple[Collective, ...] = (RUNLOG_CLOCK, RUNLOG_EPOCH, RUNLOG_FINISH, ELASTIC_LOADER,
                                               ELASTIC_CONTROLLER, ELASTIC_CONTROLLER_SYNC, DBA_COUNTS,
                                               EXIT_BARRIER)

_LIBRARY_CHANNEL: ControlChannel | None = None


def library_channel() -> ControlChannel:
    """The channel the library's named collectives share, made on first use. Under MPI that is a
    Dup() of MPI_COMM_WORLD, itself a collective: every rank reaches its first library collective
    at the same point of the program, which holds because they all run the same one."""
    global _LIBRARY_CHANNEL
    if _LIBRARY_CHANNEL is None:
        _LIBRARY_CHANNEL = ControlChannel()
        if _LIBRARY_CHANNEL._comm is not None:
            import atexit

            # Registered after Horovod's (made when horovod.torch was imported), so it runs first.
            atexit.register(_exit_barrier, _LIBRARY_CHANNEL)
    return _LIBRARY_CHANNEL


def _exit_barrier(channel: ControlChannel, op: Collective = EXIT_BARRIER) -> None:
    """Wait (nonblocking barrier, up to the deadline) until every rank is done with its MPI messages."""
    from mpi4py import MPI

    if channel._comm is None or MPI.Is_finalized():
        return
    request, end = channel._comm.Ibarrier(), time.monotonic() + op.deadline_s
    while not MPI.Is_finalized() and not request.Test():
        if time.monotonic() > end:
            _ABANDONED.append(request)
            sys.stderr.write(f"[dynamix_hvd] rank {channel.rank}: '{op.name}': not every rank reached exit within "
                             f"{op.deadline_s:g} s; exiting anyway\n")
            return
        time.sleep(0.001)


# ==================================================================================================
# Ending the job. Under MPI an exception on one rank does not end the others (they wait for it in
# the next collective), and a rank that raises while Horovod's background thread is blocked in MPI
# hangs at exit in horovod_shutdown(). So a fault that one rank detects aborts the whole MPI world.
# ==================================================================================================
ABORT_CODE = 70
"""Exit code of a job ended by `abort_world` (mpirun returns it; the other ranks are killed)."""


def abort_world(message: str, code: int = ABORT_CODE) -> NoReturn:
    """Write `message` to stderr and end every rank of the job now: ``MPI.COMM_WORLD.Abort(code)``
    under an MPI launcher, ``os._exit(code)`` otherwise (under Gloo the launcher ends the rest)."""
    sys.stderr.write(f"[dynamix_hvd] {message}\n[dynamix_hvd] ending the job (exit code {code})\n")
    sys.stderr.flush()
    if launched_under_mpi():
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(code)
    os._exit(code)


_TAG_PING, _TAG_PONG = 7321, 7322


class StallWatchdog:
    """Ends the job when this rank has waited `deadline_s` in the gradient allreduce and some rank no
    longer answers (stopped, dead, or wedged holding the GIL).

    A background thread answers liveness probes from the other ranks and, once this rank's current
    wait in the gradient allreduce (``waiting_since()``: its start in `time.perf_counter` seconds, or
    None when not waiting) passes `deadline_s`, probes every other rank. A rank that does not answer
    within `probe_s` is named and the MPI world is aborted (`abort_world`). Ranks that answer but are
    busy elsewhere (e.g. one rank evaluates while the others wait) are logged, and waited for: for
    those, Horovod's ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` is the bound. MPI only (under Gloo,
    Horovod's own collective timeout ends the wait); needs MPI_THREAD_MULTIPLE, which Horovod asks for.
    """

    def __init__(self, channel: ControlChannel, waiting_since: Callable[[], float | None], deadline_s: float,
                 probe_s: float | None = None, poll_s: float = 0.2) -> None:
        from mpi4py import MPI

        self.channel, self.waiting_since, self.deadline_s = channel, waiting_since, deadline_s
        self.probe_s = probe_s if probe_s is not None else min(10.0, 2.0 + 0.1 * deadline_s)
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._sends: list = []
        self._probe = 0
        if channel._comm is None or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            self._thread = None
            return
        import atexit

        # The library channel's exit barrier keeps every rank from shutting Horovod down (which finalizes
        # MPI on all ranks) while another rank's watchdog may still be polling: that would crash it.
        library_channel()
        self._thread = threading.Thread(target=self._run, name="dynamix-stall-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # after Horovod's handler, so it runs first: stopped before MPI is finalized

    @property
    def active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (before the channel's communicator is freed). Idempotent."""
        import atexit

        atexit.unregister(self.close)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        _ABANDONED.extend(self._sends)
        self._sends = []

    # --- the thread ---------------------------------------------------------------------------------
    def _alive(self) -> bool:
        from mpi4py import MPI

        return not self._stop.is_set() and self.channel._comm is not None and not MPI.Is_finalized()

    def _answer(self) -> dict[int, Any]:
        """Answer every pending probe; return the answers to our own probes that arrived ({rank: status})."""
        from mpi4py import MPI

        comm, pongs, status_ = self.channel._comm, {}, MPI.Status()
        while True:
            message = comm.improbe(tag=_TAG_PING, status=status_)
            if message is None:
                break
            source, probe = status_.Get_source(), message.recv()
            since = self.waiting_since()
            status = None if since is None else time.perf_counter() - since
            self._sends.append(comm.isend((probe, status), dest=source, tag=_TAG_PONG))
        while True:
            message = comm.improbe(tag=_TAG_PONG, status=status_)
            if message is None:
                break
            source, (probe, status) = status_.Get_source(), message.recv()
            if probe == self._probe:
                pongs[source] = status
        self._sends = [r for r in self._sends if not r.Test()]
        return pongs

    def _run(self) -> None:
        checked_wait = None  # the wait we already probed for, and when to probe again
        recheck_at = 0.0
        while self._alive():
            self._answer()
            since = self.waiting_since()
            now = time.perf_counter()
            if since is not None and now - since > self.deadline_s and (checked_wait != since or now > recheck_at):
                checked_wait, recheck_at = since, now + self.deadline_s
                self._probe_peers(now - since)
            self._stop.wait(self.poll_s)

    def _probe_peers(self, waited_s: float) -> None:
        rank, size, comm = self.channel.rank, self.channel.size, self.channel._comm
        self._probe += 1
        peers = [r for r in range(size) if r != rank]
        for dst in peers:
            self._sends.append(comm.isend(self._probe, dest=dst, tag=_TAG_PING))
        answers: dict[int, Any] = {}
        end = time.perf_counter() + self.probe_s
        while self._alive() and len(answers) < len(peers) and time.perf_counter() < end:
            answers.update(self._answer())
            time.sleep(0.01)
        if not self._alive():
            return
        missing = [r for r in peers if r not in answers]
        waiting = sorted([rank, *(r for r, s in answers.items() if s is not None)])
        if missing:
            abort_world(f"rank {rank}: waited {waited_s:.0f} s in the gradient allreduce (deadline {self.deadline_s:g} s); "
                        f"rank(s) {missing} did not answer a liveness probe within {self.probe_s:g} s (stopped, "
                        f"crashed or hung); rank(s) {waiting} were waiting in the allreduce.")
        busy = sorted(r for r, s in answers.items() if s is None)
        if busy:
            sys.stderr.write(f"[dynamix_hvd] rank {rank}: waited {waited_s:.0f} s in the gradient allreduce; rank(s) "
                             f"{busy} are alive but elsewhere (e.g. evaluating); still waiting\n")


# Horovod's own stall handling (read by hvd.init()): a warning naming the ranks that did not submit a
# tensor after CHECK seconds, and Horovod shut down after SHUTDOWN seconds (0: never). It covers a rank
# that is alive but away from the gradient allreduce (e.g. hung in its data loader); a stopped or dead
# rank blocks Horovod's own negotiation too, and is caught by `StallWatchdog` instead.
STALL_DEFAULTS = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "60", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "900"}


def set_horovod_stall_defaults(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set `STALL_DEFAULTS` in `environ` (default os.environ) where the user has not set them; call it
    before ``hvd.init()``. Returns the values in force. The launch wrappers set the same defaults."""
    env = os.environ if environ is None else environ
    for name, value in STALL_DEFAULTS.items():
        env.setdefault(name, value)
    return {name: env[name] for name in STALL_DEFAULTS}
