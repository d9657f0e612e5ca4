"""Every collective the library issues besides the gradient allreduce: the only module that talks to mpi4py.

One API. Each collective is named by a `Collective` (a name that is the same on every rank, a
deadline in seconds, what its messages carry, where the library issues it) and is a method of
`ControlChannel`:

- ``allgather_object``, ``gather_object``, ``broadcast_object``: small Python objects;
- ``allgather_tensor``: tensors concatenated along dim 0 (what ``hvd.allgather`` returns);
- ``gather_arrays`` (ragged lengths), ``gather_array`` (equal lengths) and ``broadcast_array``:
  1-D float64 arrays (the controller's reports and decisions, layout in `dynamix_hvd.control.wire`);
- ``any_true``: agreement on a flag (e.g. a preemption request).

Under ``mpirun``/``srun``/``horovodrun --mpi`` a channel runs on a ``Dup()`` of MPI_COMM_WORLD, so
its messages can never match Horovod's own traffic. Every collective is nonblocking point-to-point
messages rooted at one rank, polled in one loop (`ControlChannel._mpi_poll`) against the deadline
(blocking MPI collectives cannot time out): the root names the ranks that did not answer and, in an
allgather, tells the others; ranks other than the root wait a grace of ``1 + 0.1 x deadline`` longer
than the root, so the root's message, which names the silent rank, comes first. Under
``horovodrun --gloo`` there is no MPI world: the collectives are Horovod's, of the collective's name,
under one watchdog that ends the process at the deadline (Horovod collectives cannot be abandoned).
Under ``torchrun`` (a torch.distributed process group and no MPI launcher) the same rooted messages as
under MPI travel on a Gloo group of their own (`dynamix_hvd.engine.torchdist.GlooMessages`), each
send and receive with the deadline, so the root names the silent rank there too.

At exit: Horovod, when it initialised MPI, finalises it on every rank as soon as one rank shuts
down, so a rank must not exit while a peer still waits for its messages. `library_channel()`
therefore registers an exit barrier (`EXIT_BARRIER`) that runs before Horovod's own shutdown. Sends
are synchronous (issend), so a rank leaves a collective only once its peers took its messages.

Every collective the library issues is listed below (`CONTROL_COLLECTIVES`: the controller and the
checkpointer, with the controller's ``timeout_s`` as deadline; `LIBRARY_COLLECTIVES`: the rest, on
`library_channel()`).
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, NoReturn

import numpy as np

from . import engine, validate

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")

DEFAULT_TIMEOUT_S = 120.0
"""The deadline of the control collectives when no controller sets one (``ControllerConfig.timeout_s``)."""


class ControlPlaneTimeout(RuntimeError):
    """A rank did not take part in a collective within the deadline."""


class CollectiveTimeout(ControlPlaneTimeout):
    """A named collective missed its deadline; `missing` lists the ranks that did not answer."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)


@dataclass(frozen=True)
class Collective:
    """A named collective: the same name on every rank (one name per call site), its deadline in
    seconds, what its messages carry (`what`, in error messages) and where the library issues it."""

    name: str
    deadline_s: float
    what: str = ""
    where: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"Collective name={self.name!r}; give every collective a non-empty name")
        validate.number(f"Collective '{self.name}': deadline_s", self.deadline_s, above=0,
                        what="a positive finite number of seconds")

    def within(self, deadline_s: float) -> "Collective":
        """The same collective with another deadline (e.g. ``ControllerConfig.timeout_s``)."""
        return replace(self, deadline_s=deadline_s)

    @property
    def carries(self) -> str:
        return self.what or "data"


def _tag(op: Collective) -> int:
    # The same name gives the same tag on every rank; below MPI_TAG_UB, clear of StallWatchdog's tags.
    return 10_000 + zlib.crc32(op.name.encode()) % 20_000


def _grace(op: Collective) -> float:
    """How much longer non-root ranks wait than the root, so the root's note naming the silent rank arrives."""
    return 1.0 + 0.1 * op.deadline_s


# Requests given up on after a timeout. MPI may still write into their buffers, so they must outlive
# the error. They are not cancelled: cancelling mpi4py's pickled irecv crashed the process (SIGSEGV),
# and sends and collectives cannot be cancelled at all.
_ABANDONED: list = []


def launched_under_mpi() -> bool:
    """True when an MPI launcher (mpirun, srun --mpi=pmix, horovodrun --mpi) started this process."""
    return any(v in os.environ for v in _MPI_ENV)


def torch_env_from_mpi(port: int | None = None) -> dict[str, str]:
    """Under an MPI launcher (mpirun, srun --mpi=pmix), set what ``torch.distributed.init_process_group()``
    reads from the environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (rank 0's
    host name) and MASTER_PORT (`port`, or a port free on rank 0), learnt with one broadcast over
    MPI_COMM_WORLD; call it on every rank before ``init_process_group``. Variables already set are
    kept. Returns the variables it set."""
    if not launched_under_mpi():
        raise RuntimeError("torch_env_from_mpi() needs an MPI launcher (mpirun, srun --mpi=pmix); under "
                           "torchrun the environment is already set")
    import socket

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    if world.Get_rank() == 0:
        if port is None:
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = probe.getsockname()[1]
        head = (socket.gethostname(), int(port))
    else:
        head = None
    host, port = world.bcast(head, root=0)
    values = {"RANK": world.Get_rank(), "WORLD_SIZE": world.Get_size(), "LOCAL_RANK": local.Get_rank(),
              "LOCAL_WORLD_SIZE": local.Get_size(), "MASTER_ADDR": host, "MASTER_PORT": port}
    local.Free()
    set_now = {k: str(v) for k, v in values.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


class ControlChannel:
    """The collectives of this module on one communicator (see the module docstring)."""

    def __init__(self, poll_s: float = 0.0005, *, _library: bool = False) -> None:
        self.poll_s = poll_s
        self._p2p: Any = None      # torch.distributed: Gloo messages
        self._objects: Any = None  # Horovod under Gloo: its object collectives
        if launched_under_mpi():
            from mpi4py import MPI

            self._comm = MPI.COMM_WORLD.Dup()
            self._rank, self._size = self._comm.Get_rank(), self._comm.Get_size()
            self.backend = "mpi4py"
            if not _library:
                # Its exit barrier keeps a rank that is done from shutting Horovod down (which finalizes
                # MPI on every rank) while another still waits in one of this channel's collectives.
                # Made after this channel's Dup, once, on every rank alike (channels are made collectively).
                library_channel()
        elif engine.torch_distributed_ready():
            from .engine.torchdist import GlooMessages

            self._comm = None
            self._p2p = GlooMessages()
            self._rank, self._size = self._p2p.rank, self._p2p.size
            self.backend = "torch-gloo"
        else:
            from .engine.horovod import HorovodObjects

            self._comm = None
            self._objects = HorovodObjects()
            self._rank = self._size = -1
            self.backend = "horovod-objects"

    @property
    def rank(self) -> int:
        """This rank; under Gloo Horovod's, read live (an elastic reset changes it)."""
        if self._objects is None:
            return self._rank
        return self._objects.rank

    @property
    def size(self) -> int:
        if self._objects is None:
            return self._size
        return self._objects.size

    def close(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    # --- objects -------------------------------------------------------------------------------------
    def allgather_object(self, obj: Any, op: Collective) -> list[Any]:
        """Every rank's object on every rank (a list in rank order)."""
        if self._objects is not None:
            return self._objects.allgather_object(obj, op.name, op.deadline_s)
        deadline = time.monotonic() + op.deadline_s
        gathered = self._gather(obj, op, 0, deadline, tell_others=True)
        return self._bcast(gathered, op, 0, deadline + _grace(op), deadline + _grace(op))

    def gather_object(self, obj: Any, op: Collective, root: int = 0) -> list[Any] | None:
        """Every rank's object on `root` (a list in rank order); None on the other ranks."""
        self._check_root(root, op)
        if self._objects is not None:
            everyone = self._objects.allgather_object(obj, op.name, op.deadline_s)
            return everyone if self.rank == root else None
        return self._gather(obj, op, root, time.monotonic() + op.deadline_s, tell_others=False)

    def broadcast_object(self, obj: Any, op: Collective, root: int = 0) -> Any:
        """`root`'s object on every rank (`obj` is ignored on the other ranks)."""
        self._check_root(root, op)
        if self._objects is not None:
            return self._objects.broadcast_object(obj, root, op.name, op.deadline_s)
        deadline = time.monotonic() + op.deadline_s
        return self._bcast(obj, op, root, deadline, deadline + _grace(op))

    def any_true(self, flag: bool, op: Collective) -> bool:
        """True on every rank if `flag` is true on any rank (e.g. one rank received SIGTERM). An
        allgather, so a timeout names the rank that did not answer on every rank."""
        return any(self.allgather_object(bool(flag), op))

    # --- tensors and float64 arrays --------------------------------------------------------------------
    def allgather_tensor(self, tensor: Any, op: Collective) -> Any:
        """Every rank's tensor concatenated along dim 0 in rank order (what ``hvd.allgather`` returns)."""
        if self._objects is not None:
            return self._objects.allgather_tensor(tensor, op.name, op.deadline_s)
        import torch

        parts = self.allgather_object(tensor.detach().cpu().numpy(), op)
        return torch.cat([torch.from_numpy(p) for p in parts]).to(tensor.device)

    def gather_arrays(self, values: np.ndarray, op: Collective) -> list[np.ndarray] | None:
        """Every rank's 1-D float64 array on rank 0, one per rank in rank order (the lengths may
        differ); None on the other ranks."""
        return self._gather_ragged(values, op)[0]

    def gather_array(self, values: np.ndarray, op: Collective) -> np.ndarray | None:
        """Every rank's 1-D float64 array of the same length n; rank 0 gets [size, n] in rank order,
        the others None. A rank whose length differs raises ValueError (naming it) on rank 0 (MPI)
        or on every rank (Gloo)."""
        rows, lengths = self._gather_ragged(values, op)
        if lengths is not None and len(set(lengths)) > 1:
            raise ValueError(self._length_error(op, lengths))
        return None if rows is None else np.stack(rows)

    def broadcast_array(self, values: np.ndarray | None, n: int, op: Collective) -> np.ndarray:
        """Rank 0's 1-D float64 array of length n on every rank (the others pass None and the same n)."""
        if self.rank == 0:
            sent = _as_vector(values, op)
            if len(sent) != n:
                raise ValueError(f"rank 0: broadcast of {op.carries} (collective '{op.name}'): array has "
                                 f"{len(sent)} values, n={n}")
        else:
            sent = None
        got = _as_vector(self.broadcast_object(sent, op, root=0), op)
        if len(got) != n:
            raise ValueError(f"rank {self.rank}: broadcast of {op.carries} (collective '{op.name}'): rank 0 sent "
                             f"{len(got)} values, this rank expects n={n}")
        return got

    def _gather_ragged(self, values: np.ndarray, op: Collective) -> tuple[list[np.ndarray] | None, list[int] | None]:
        """(rank 0: the arrays in rank order, else None; every length where this rank knows them)."""
        send = _as_vector(values, op)
        if self._objects is not None:  # every rank receives every array, so every rank checks the lengths
            everyone = [_as_vector(a, op) for a in self.allgather_object(send, op)]
            return (everyone if self.rank == 0 else None), [len(a) for a in everyone]
        rows = self.gather_object(send, op, root=0)
        if rows is None:
            return None, None
        rows = [_as_vector(a, op) for a in rows]
        return rows, [len(a) for a in rows]

    def _length_error(self, op: Collective, lengths: list[int]) -> str:
        expected = min(set(lengths), key=lambda n: (-lengths.count(n), n != lengths[0]))  # ties: rank 0's
        odd = {r: n for r, n in enumerate(lengths) if n != expected}
        return (f"rank {self.rank}: gathering {op.carries} (collective '{op.name}'): rank(s) {sorted(odd)} sent "
                f"{[odd[r] for r in sorted(odd)]} values where the others sent {expected}. Every rank must "
                "report the same number of steps per decision (a rank skipped or added a step).")

    def _check_root(self, root: int, op: Collective) -> None:
        size = self.size
        if not (isinstance(root, int) and 0 <= root < size):
            raise ValueError(f"collective '{op.name}': root={root!r} is not a rank of this world of {size}")

    def _gather(self, obj: Any, op: Collective, root: int, deadline: float, tell_others: bool) -> list[Any] | None:
        if self._p2p is not None:
            return self._p2p_gather(obj, op, root, deadline, tell_others)
        return self._mpi_gather(obj, op, root, deadline, tell_others)

    def _bcast(self, obj: Any, op: Collective, root: int, send_deadline: float, receive_deadline: float) -> Any:
        if self._p2p is not None:
            return self._p2p_bcast(obj, op, root, send_deadline, receive_deadline)
        return self._mpi_bcast(obj, op, root, send_deadline, receive_deadline)

    # --- mechanics: Gloo messages (torch.distributed) --------------------------------------------------
    def _p2p_gather(self, obj: Any, op: Collective, root: int, deadline: float, tell_others: bool) -> list[Any] | None:
        others = [r for r in range(self.size) if r != root]
        if self.rank != root:
            if self._p2p.send(("obj", op.name, obj), [root], _tag(op), deadline):
                raise self._timeout(op, f"sending {op.carries} to rank {root}", [root])
            return None
        got, missing = self._p2p.recv(others, _tag(op), deadline)
        if missing:
            if tell_others:  # they wait a grace longer for this note, so their errors name the rank too
                self._p2p.send(("missing", op.name, missing), [r for r in others if r not in missing], _tag(op),
                               deadline, wait=False)
            raise self._timeout(op, f"gathering {op.carries} on rank {root}", missing)
        rows = {root: obj}
        for src, (kind, name, value) in got.items():
            self._check_order(op, src, name)
            rows[src] = value
        return [rows[r] for r in range(self.size)]

    def _p2p_bcast(self, obj: Any, op: Collective, root: int, send_deadline: float, receive_deadline: float) -> Any:
        if self.rank == root:
            missing = self._p2p.send(("ok", op.name, obj), [r for r in range(self.size) if r != root], _tag(op),
                                     send_deadline)
            if missing:
                raise self._timeout(op, f"sending {op.carries} from rank {root}", missing)
            return obj
        got, missing = self._p2p.recv([root], _tag(op), receive_deadline)
        if missing:
            raise self._timeout(op, f"receiving {op.carries} from rank {root}", missing)
        kind, name, value = got[root]
        self._check_order(op, root, name)
        if kind == "missing":
            raise CollectiveTimeout(
                f"rank {self.rank}: collective '{op.name}' timed out after {op.deadline_s:g} s on rank {root}; "
                f"rank(s) {value} did not answer. A rank that crashed, hangs, or skipped this point causes this.",
                missing=value)
        return value

    def _timeout(self, op: Collective, doing: str, missing: list[int]) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"rank {self.rank}: collective '{op.name}' timed out after {op.deadline_s:g} s {doing}; "
            f"rank(s) {missing} did not answer. A rank that crashed, hangs, or skipped this point "
            "causes this.", missing=missing)

    def _check_order(self, op: Collective, src: int, name: str) -> None:
        if name != op.name:
            raise RuntimeError(f"rank {self.rank}: in collective '{op.name}' rank {src} sent a message "
                               f"of collective '{name}': the ranks issue collectives in different orders")

    # --- mechanics: MPI ------------------------------------------------------------------------------
    def _mpi_gather(self, obj: Any, op: Collective, root: int, deadline: float, tell_others: bool) -> list[Any] | None:
        others = [r for r in range(self.size) if r != root]
        if self.rank != root:
            send = self._comm.issend(("obj", op.name, obj), dest=root, tag=_tag(op))
            self._mpi_poll(op, {root: send}, [], deadline, f"sending {op.carries} to rank {root}")
            return None
        try:
            got = self._mpi_poll(op, {}, others, deadline, f"gathering {op.carries} on rank {root}")
        except CollectiveTimeout as exc:
            if tell_others:  # they wait a grace longer for this note, so their errors name the rank too
                for dst in others:
                    _ABANDONED.append(self._comm.isend(("missing", op.name, exc.missing), dest=dst, tag=_tag(op)))
            raise
        got[root] = ("obj", obj)
        return [got[r][1] for r in range(self.size)]

    def _mpi_bcast(self, obj: Any, op: Collective, root: int, send_deadline: float, receive_deadline: float) -> Any:
        if self.rank == root:
            # Synchronous sends: the root leaves only once every rank has taken the object, so it cannot
            # exit (and have Horovod finalize MPI everywhere) while a rank still waits for it.
            sends = {dst: self._comm.issend(("ok", op.name, obj), dest=dst, tag=_tag(op))
                     for dst in range(self.size) if dst != root}
            self._mpi_poll(op, sends, [], send_deadline, f"sending {op.carries} from rank {root}", sends_may_drop=True)
            return obj
        kind, value = self._mpi_poll(op, {}, [root], receive_deadline, f"receiving {op.carries} from rank {root}")[root]
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
        start = time.monotonic()
        spin_until = start + 0.002  # most answers arrive within microseconds: spin first
        while True:
            if MPI.Is_finalized():  # Horovod, when it initialised MPI, finalises it once any rank has ended
                if not waiting and sends_may_drop:
                    return received  # only our sends were pending: the peers took them and ended
                raise CollectiveTimeout(f"rank {self.rank}: collective '{op.name}' cannot complete {doing}: MPI "
                                        "was finalised under it (Horovod shut down: another rank ended)",
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
            now = time.monotonic()
            if now > deadline:
                _ABANDONED.extend(sends.values())
                missing = sorted({*waiting, *sends})
                raise CollectiveTimeout(
                    f"rank {self.rank}: collective '{op.name}' timed out after {now - start:.0f} s {doing}; "
                    f"rank(s) {missing} did not answer. A rank that crashed, hangs, or skipped this point "
                    "causes this.", missing=missing)
            if now > spin_until:
                time.sleep(self.poll_s)

def _as_vector(values: Any, op: Collective) -> np.ndarray:
    arr = np.ascontiguousarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{op.carries} (collective '{op.name}'): need a 1-D array of float64 values, "
                         f"got shape {arr.shape}")
    return arr


# Every collective the library issues outside the gradient allreduce: name, deadline (s), what, where.
# The controller's and the checkpointer's: their deadline is the controller's timeout_s (`within`).
CONTROL_REPORTS = Collective("dx.control.reports", DEFAULT_TIMEOUT_S, "metrics",
                             "control.controller.decide(): every rank's report to rank 0")
CONTROL_DECISION = Collective("dx.control.decision", DEFAULT_TIMEOUT_S, "batch-size decision",
                              "control.controller.decide(): rank 0's decision to every rank")
CONTROL_CHANGE = Collective("dx.control.change_vote", DEFAULT_TIMEOUT_S, "change vote",
                            "control.controller: every few tenths of a second of training, whether any rank's own "
                            "step time changed since the last decision")
CONTROL_MEMORY = Collective("dx.control.memory", DEFAULT_TIMEOUT_S, "memory sharing key",
                            "control.controller: at the first decision of each world, which ranks share a "
                            "memory budget")
PREEMPTION_VOTE = Collective("dx.checkpoint.vote", DEFAULT_TIMEOUT_S, "preemption flag",
                             "resilience.checkpoint: about once a second of training (or every check_every steps), "
                             "whether any rank was signalled, with each rank's step time")
CHECKPOINT_RANK_STATE = Collective("dx.checkpoint.rank_state", DEFAULT_TIMEOUT_S, "per-rank checkpoint state",
                                   "resilience.checkpoint.Checkpointer.save(): every rank's part to rank 0")
CHECKPOINT_WRITTEN = Collective("dx.checkpoint.written", DEFAULT_TIMEOUT_S, "checkpoint written",
                                "resilience.checkpoint.Checkpointer.save(): rank 0's outcome")
CHECKPOINT_LIST = Collective("dx.checkpoint.list", DEFAULT_TIMEOUT_S, "checkpoint list",
                             "resilience.checkpoint.Checkpointer.restore(): rank 0's candidates")
CHECKPOINT_CHECKED = Collective("dx.checkpoint.checked", DEFAULT_TIMEOUT_S, "checkpoint check",
                                "resilience.checkpoint.Checkpointer.restore(): every rank's verdict on a candidate")
CHECKPOINT_APPLIED = Collective("dx.checkpoint.applied", DEFAULT_TIMEOUT_S, "checkpoint applied",
                                "resilience.checkpoint.Checkpointer.restore(): every rank's outcome of applying it")
WATCHDOG_ADDRESSES = Collective("dx.watchdog.addresses", DEFAULT_TIMEOUT_S, "watchdog address",
                                "comm.StallWatchdog: under torch.distributed, where each rank's watchdog listens")
CONTROL_COLLECTIVES: tuple[Collective, ...] = (CONTROL_REPORTS, CONTROL_DECISION, CONTROL_MEMORY, PREEMPTION_VOTE,
                                               CHECKPOINT_RANK_STATE, CHECKPOINT_WRITTEN, CHECKPOINT_LIST,
                                               CHECKPOINT_CHECKED, CHECKPOINT_APPLIED, WATCHDOG_ADDRESSES)
# The rest, on `library_channel()`.
RUNLOG_CLOCK = Collective("dx.runlog.clock_origin", 600.0, "clock origin",
                          "runs.runlog.RunLog(): the ranks' common clock origin")
RUNLOG_EPOCH = Collective("dx.runlog.epoch_rows", 600.0, "epoch rows", "runs.runlog.RunLog.end_epoch(): one row per rank")
RUNLOG_FINISH = Collective("dx.runlog.finish", 600.0, "trace", "runs.runlog.RunLog.finish(): every rank's trace to rank 0")
ELASTIC_LOADER = Collective("dx.elastic.loader", 300.0, "loader state", "resilience.elastic: loader state on sync")
ELASTIC_CONTROLLER = Collective("dx.elastic.controller", 300.0, "controller state",
                                "resilience.elastic: controller root on commit")
ELASTIC_CONTROLLER_SYNC = Collective("dx.elastic.controller.sync", 300.0, "controller state",
                                     "resilience.elastic: controller state on sync")
DBA_COUNTS = Collective("dx.dba_counts", 300.0, "selected counts",
                        "dba.distributed.exchange_counts(): selected counts, every step")
EXIT_BARRIER = Collective("dx.exit_barrier", 60.0, "exit barrier",
                          "comm: at interpreter exit, before Horovod shuts down (MPI only)")
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
        _LIBRARY_CHANNEL = ControlChannel(_library=True)
        if _LIBRARY_CHANNEL._comm is not None:
            import atexit

            # Registered after Horovod's (made by hvd.init(), which comes before any channel), so it
            # runs first; a channel made before hvd.init() would find MPI finalized here and do nothing.
            atexit.register(_exit_barrier, _LIBRARY_CHANNEL)
    return _LIBRARY_CHANNEL


def _exit_barrier(channel: ControlChannel, op: Collective = EXIT_BARRIER) -> None:
    """Wait (nonblocking barrier, up to the deadline) until every rank is done with its MPI messages.

    A rank that ends on an unhandled exception (e.g. a `CollectiveTimeout` naming a stopped rank, raised
    to the training script) and whose peers do not reach the exit in time ends the job: MPI's own
    shutdown would wait for the stopped rank forever."""
    from mpi4py import MPI

    if channel._comm is None or MPI.Is_finalized():
        return
    request, end = channel._comm.Ibarrier(), time.monotonic() + op.deadline_s
    while not MPI.Is_finalized() and not request.Test():
        if time.monotonic() > end:
            _ABANDONED.append(request)
            failed = getattr(sys, "last_value", None)  # set by the interpreter for an unhandled exception
            if failed is not None:
                abort_world(f"rank {channel.rank}: '{op.name}': not every rank reached exit within {op.deadline_s:g} s "
                            f"after this rank failed ({type(failed).__name__}: {failed})")
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


# Watchdog messages travel on the library channel, which lives until the process exits: a message
# still in flight when a controller's own communicator is freed would land in the next communicator
# that reuses its context id and, out of sequence there, block that communicator's later messages
# from the same peer. Each watchdog has its own three tags (ping, pong, closed) and its number in
# every message, from a count that every rank advances alike (watchdogs are made at collective
# points: a controller, a checkpointer); a message left over from an earlier watchdog is dropped.
_TAG_BASE, _TAG_SLOTS = 7000, 900  # below the control collectives' tags (from 10_000)
_WATCHDOG_COUNT = itertools.count()


def _uncaught() -> Any:
    """The exception that ended the program, once the interpreter has printed it (None before)."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def failed_exit(exc_type: type | None, exc: BaseException | None) -> bool:
    """Whether a ``with`` block of ours is left by an error: any exception but ``SystemExit`` with
    code 0 or None (a preemption's exit code counts as an error; every rank leaves then anyway)."""
    return exc_type is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None))


class _MPIProbes:
    """The watchdog's messages under MPI: ping, pong and closing, each on its own tag from `slot`."""

    def __init__(self, channel: ControlChannel, comm: Any, slot: int) -> None:
        self.channel, self.comm = channel, comm
        self.tags = {"ping": slot, "pong": slot + 1, "closing": slot + 2}
        self._sends: list = []  # touched by the watchdog's thread only

    def alive(self) -> bool:
        from mpi4py import MPI

        return self.channel._comm is not None and not MPI.Is_finalized()

    def send(self, kind: str, dst: int, message: tuple) -> None:
        self._sends.append(self.comm.isend(message, dest=dst, tag=self.tags[kind]))

    def poll(self) -> list[tuple[str, int, tuple]]:
        from mpi4py import MPI

        got, status = [], MPI.Status()
        for kind, tag in self.tags.items():
            while (message := self.comm.improbe(tag=tag, status=status)) is not None:
                got.append((kind, status.Get_source(), message.recv()))
        self._sends = [r for r in self._sends if not r.Test()]
        return got

    def abandon(self) -> None:
        _ABANDONED.extend(self._sends)
        self._sends = []


class StallWatchdog:
    """Ends the job when some rank no longer answers (stopped, dead, or wedged holding the GIL) while
    this rank waits for it: in the gradient allreduce, or anywhere else (a collective of the user's,
    e.g. an epoch-end ``hvd.broadcast_object``) once no step has finished for `deadline_s`.

    A background thread answers liveness probes from the other ranks and probes every other rank
    - once this rank's current wait in the gradient allreduce (``waiting_since()``: its start in
      `time.perf_counter` seconds, or None when not waiting) passes `deadline_s`: a rank that does not
      answer within `probe_s`, or whose watchdog has closed (it left training and will never join
      this allreduce), is named and the MPI world is aborted (`abort_world`);
    - once this rank has made no progress for `deadline_s` (``progress_at()``: the last time it got a
      batch, asked for one, or entered or left the allreduce), wherever it is. Its idleness says
      nothing about when a peer went silent (this rank may have evaluated for most of it), so a peer
      is named only after it has failed every probe for a further `deadline_s`: a peer stopped for
      less than `deadline_s` is never taken for a dead one.
    Ranks that answer but are busy elsewhere (e.g. one rank evaluates while the others wait) are
    waited for: for those, Horovod's ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` is the bound. A watchdog
    closed without an error tells the others, so a rank that finished training is not taken for a
    stopped one outside the allreduce; one closed on an error (``close(failed=True)``: an exception
    leaving the controller's ``with`` block; at exit, an exception that ended the program) does not,
    so the others name it. Under MPI (needs MPI_THREAD_MULTIPLE, which Horovod asks for) and under
    torch.distributed (probes over TCP, `dynamix_hvd.engine.probes.SocketProbes`); not
    under Horovod's Gloo, where Horovod's own collective timeout ends the wait.
    """

    def __init__(self, channel: ControlChannel, waiting_since: Callable[[], float | None], deadline_s: float,
                 probe_s: float | None = None, poll_s: float = 0.2,
                 progress_at: Callable[[], float] | None = None) -> None:
        self.channel, self.waiting_since, self.deadline_s = channel, waiting_since, deadline_s
        self.progress_at = progress_at
        self.probe_s = probe_s if probe_s is not None else min(10.0, 2.0 + 0.1 * deadline_s)
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._probe = 0
        self._closed: set[int] = set()         # peers whose watchdog closed without an error
        self._silent: dict[int, float] = {}    # peer -> when it first failed an idle probe still unanswered
        self._started = time.perf_counter()
        self._uncaught_before = _uncaught()  # an earlier error of an interactive session is not this one
        self._probes: Any = None
        self._thread: threading.Thread | None = None
        if channel.backend == "torch-gloo":
            from .engine.probes import SocketProbes

            self._number = next(_WATCHDOG_COUNT)
            self._probes = SocketProbes(channel.rank, lambda address: channel.allgather_object(
                address, WATCHDOG_ADDRESSES.within(deadline_s)))
        elif channel._comm is not None:
            from mpi4py import MPI

            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                return
            # The library channel's exit barrier keeps every rank from shutting Horovod down (which
            # finalizes MPI on all ranks) while another rank's watchdog may still be polling: that would crash it.
            self._number = next(_WATCHDOG_COUNT)
            self._probes = _MPIProbes(channel, library_channel()._comm, _TAG_BASE + 3 * (self._number % _TAG_SLOTS))
        else:
            return
        import atexit

        self._thread = threading.Thread(target=self._run, name="dynamix-stall-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)  # after Horovod's handler (hvd.init()), so it runs first

    @property
    def active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, failed: bool = False) -> None:
        """Stop the thread (before the channel's communicator is freed) and, unless `failed` (this
        rank leaves training on an error), tell the other ranks' watchdogs that this rank is done.
        Idempotent."""
        import atexit

        atexit.unregister(self._close_at_exit)
        if self.active and self._alive() and not failed:
            # Sent while the thread still answers: a peer that probes before the news arrives gets a pong.
            for dst in range(self.channel.size):
                if dst != self.channel.rank:
                    self._probes.send("closing", dst, (self._number, 0, 0.0))
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._probes is not None and (self._thread is None or not self._thread.is_alive()):
            self._probes.abandon()  # else the thread still owns its sends

    def _close_at_exit(self) -> None:
        uncaught = _uncaught()
        self.close(failed=uncaught is not None and uncaught is not self._uncaught_before)

    # --- the thread ---------------------------------------------------------------------------------
    def _alive(self) -> bool:
        return not self._stop.is_set() and self._probes.alive()

    def _answer(self) -> dict[int, Any]:
        """Answer every pending probe, note closed peers; return the answers to our own probes that
        arrived ({rank: status})."""
        pongs = {}
        for kind, source, (number, probe, status) in self._probes.poll():
            if number != self._number:
                continue  # left over from an earlier watchdog
            if kind == "ping":
                since = self.waiting_since()
                self._probes.send("pong", source, (number, probe, None if since is None else time.perf_counter() - since))
            elif kind == "pong" and probe == self._probe:
                pongs[source] = status
            elif kind == "closing":
                self._closed.add(source)
        return pongs

    def _idle_since(self) -> float | None:
        """When this rank last made progress (or the watchdog started); None without a progress clock."""
        return None if self.progress_at is None else max(self._started, self.progress_at())

    def _run(self) -> None:
        checked_wait = None  # the wait we already probed for, and when to probe again
        recheck_at = idle_recheck_at = 0.0
        while self._alive():
            self._answer()
            since, idle = self.waiting_since(), self._idle_since()
            now = time.perf_counter()
            if since is not None and now - since > self.deadline_s and (checked_wait != since or now > recheck_at):
                checked_wait, recheck_at = since, now + self.deadline_s
                self._probe_peers(since)
            elif since is None and idle is not None and now - idle > self.deadline_s and (
                    self._silent or now > idle_recheck_at):
                # While a peer is silent, probe it again at once: it is named after `deadline_s` of failures.
                idle_recheck_at = now + self.deadline_s
                self._probe_idle(idle)
            elif since is not None or idle is None or now - idle <= self.deadline_s:
                self._silent.clear()  # progress again: silences counted later start afresh
            self._stop.wait(self.poll_s)

    def _ask(self, peers: list[int]) -> dict[int, Any]:
        """Probe `peers`; their answers within `probe_s` ({rank: seconds waited in the allreduce or None})."""
        self._probe += 1
        for dst in peers:
            self._probes.send("ping", dst, (self._number, self._probe, None))
        answers: dict[int, Any] = {}
        end = time.perf_counter() + self.probe_s
        while self._alive() and len(answers) < len(peers) and time.perf_counter() < end:
            answers.update(self._answer())
            answers = {r: s for r, s in answers.items() if r in peers}
            time.sleep(0.01)
        return answers

    def _peers(self) -> list[int]:
        return [r for r in range(self.channel.size) if r != self.channel.rank and r not in self._closed]

    def _probe_peers(self, since: float) -> None:
        rank = self.channel.rank
        peers = self._peers()
        answers = self._ask(peers)
        if self._closed:
            # A peer that closed may have done so right after the allreduce this rank is about to leave:
            # named only if this rank still waits in it `probe_s` later.
            end = time.perf_counter() + self.probe_s
            while self._alive() and self.waiting_since() == since and time.perf_counter() < end:
                self._answer()
                time.sleep(0.01)
        # Only while this rank still waits in the same allreduce: the peers may have joined it meanwhile.
        if not self._alive() or self.waiting_since() != since:
            return
        waited_s = time.perf_counter() - since
        missing = [r for r in peers if r not in answers and r not in self._closed]
        left = sorted(self._closed)
        waiting = sorted([rank, *(r for r, s in answers.items() if s is not None)])
        if missing or left:
            abort_world(f"rank {rank}: waited {waited_s:.0f} s in the gradient allreduce (deadline {self.deadline_s:g} s); "
                        + (f"rank(s) {missing} did not answer a liveness probe within {self.probe_s:g} s (stopped, "
                           f"crashed or hung); " if missing else "")
                        + (f"rank(s) {left} have closed their controller (left training); " if left else "")
                        + f"rank(s) {waiting} were waiting in the allreduce.")
        busy = sorted(r for r, s in answers.items() if s is None)
        if busy:
            sys.stderr.write(f"[dynamix_hvd] rank {rank}: waited {waited_s:.0f} s in the gradient allreduce; rank(s) "
                             f"{busy} are alive but elsewhere (e.g. evaluating); still waiting\n")

    def _probe_idle(self, idle: float) -> None:
        rank, peers = self.channel.rank, self._peers()
        asked_at = time.perf_counter()
        answers = self._ask(peers)
        # Only while this rank is still idle since then: progress means the peers answered in kind.
        if not self._alive() or self._idle_since() != idle or self.waiting_since() is not None:
            self._silent.clear()
            return
        for r in peers:
            if r in answers or r in self._closed:
                self._silent.pop(r, None)
            else:
                self._silent.setdefault(r, asked_at)
        now = time.perf_counter()
        silent = sorted(r for r, t in self._silent.items() if now - t >= self.deadline_s)
        if silent:
            abort_world(f"rank {rank}: no training step finished here for {now - idle:.0f} s (deadline "
                        f"{self.deadline_s:g} s); rank(s) {silent} did not answer a liveness probe for "
                        f"{now - min(self._silent[r] for r in silent):.0f} s (stopped, crashed or hung) while "
                        f"this rank waited outside the gradient allreduce (e.g. in a collective of the "
                        f"training script).")


# Horovod's own stall handling (read by hvd.init()): a warning naming the ranks that did not submit a
# tensor after CHECK seconds, and Horovod shut down after SHUTDOWN seconds (0: never). It covers a rank
# that is alive but away from the gradient allreduce (e.g. hung in its data loader); a stopped or dead
# rank blocks Horovod's own negotiation too, and is caught by `StallWatchdog` instead (within about
# 2 timeout_s wherever the others wait).
STALL_DEFAULTS = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "60", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "900"}


def set_horovod_stall_defaults(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set `STALL_DEFAULTS` in `environ` (default os.environ) where the user has not set them; call it
    before ``hvd.init()``. Returns the values in force. The launch wrappers set the same defaults."""
    env = os.environ if environ is None else environ
    for name, value in STALL_DEFAULTS.items():
        env.setdefault(name, value)
    return {name: env[name] for name in STALL_DEFAULTS}
