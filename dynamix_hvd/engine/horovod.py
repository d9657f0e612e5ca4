"""The Horovod engine: ``hvd.DistributedOptimizer`` as the gradient allreduce, Horovod's named
allreduces, and Horovod's object collectives (under ``horovodrun --gloo``, where there is no MPI).

Horovod refuses per-rank prescale factors, so the optimizer weighs a gradient right before Horovod
sends it: with one backward pass per step inside the compression object Horovod calls on ``p.grad``
as it starts that gradient's allreduce (`WeighThenCompress`), in place; Horovod then sums with
``op=Sum``.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

import horovod.torch as hvd


class HorovodPlane:
    name = "horovod"

    def size(self) -> int:
        return hvd.size()

    def allreduce_sum(self, tensor: Any, name: str) -> Any:
        return hvd.allreduce(tensor, name=name, op=hvd.Sum)

    def allreduce_sum_async(self, tensor: Any, name: str) -> Any:
        return hvd.allreduce_async(tensor, name=name, op=hvd.Sum)

    def wait(self, handle: Any) -> Any:
        return hvd.synchronize(handle)

    def default_compression(self) -> Any:
        return hvd.Compression.none

    def uncompressed(self, compression: Any) -> bool:
        return compression is hvd.Compression.none

    def gradient_reducer(self, optimizer: Any, named: list[tuple[str, Any]], passes: int, compression: Any,
                         owner: Any, model: Any = None) -> "HorovodReducer":
        return HorovodReducer(optimizer, named, passes, WeighThenCompress(owner._weigh, compression))


class HorovodReducer:
    """Horovod's optimizer as the allreduce engine only (hooks, fusion, compression); it never steps."""

    recovers_oom = True
    reduced_in_backward = False

    def __init__(self, optimizer: Any, named: list[tuple[str, Any]], passes: int, compression: Any) -> None:
        self._params = [p for _, p in named]
        self._engine = hvd.DistributedOptimizer(optimizer, named_parameters=named, op=hvd.Sum,
                                                backward_passes_per_step=passes, compression=compression)
        # Without hooks (one process outside elastic mode) Horovod never calls compress(): the
        # optimizer weighs every gradient itself before synchronize().
        self.hooked = bool(self._engine._requires_update)

    def synchronize(self) -> None:
        self._engine.synchronize()

    def in_flight(self) -> bool:
        return bool(self._engine._handles)

    def unsent(self) -> list[int]:
        handles = self._engine._handles
        return [i for i, p in enumerate(self._params) if handles.get(p, (None,))[0] is None]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self._engine.set_backward_passes_per_step(passes)

    def reset(self, passes: int) -> None:
        self._engine._handles = {}
        self._engine._synchronized = False
        self._engine.set_backward_passes_per_step(passes)


class WeighThenCompress:
    """The compression Horovod's engine is given: weigh the gradient in place, then the user's
    compression (``hvd.Compression.none`` or ``.fp16``) as usual."""

    def __init__(self, weigh: Callable[[Any], None], inner: Any) -> None:
        self.weigh, self.inner = weigh, inner

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        self.weigh(tensor)
        return self.inner.compress(tensor)

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return self.inner.decompress(tensor, ctx)


class HorovodObjects:
    """Horovod's collectives of the given name under one watchdog that ends the process at the
    deadline (Horovod collectives cannot be abandoned)."""

    name = "horovod-objects"

    @property
    def rank(self) -> int:
        return hvd.rank()  # read live: an elastic reset changes it

    @property
    def size(self) -> int:
        return hvd.size()

    def allgather_object(self, obj: Any, name: str, deadline_s: float) -> list[Any]:
        return _within(name, deadline_s, lambda: hvd.allgather_object(obj, name=name))

    def broadcast_object(self, obj: Any, root: int, name: str, deadline_s: float) -> Any:
        return _within(name, deadline_s, lambda: hvd.broadcast_object(obj, root_rank=root, name=name))

    def allgather_tensor(self, tensor: Any, name: str, deadline_s: float) -> Any:
        return _within(name, deadline_s, lambda: hvd.allgather(tensor, name=name))


def _within(name: str, deadline_s: float, call: Callable[[], Any]) -> Any:
    finished, start = threading.Event(), time.monotonic()

    def watchdog() -> None:
        if not finished.wait(deadline_s):
            sys.stderr.write(
                f"[dynamix_hvd] rank {hvd.rank()}: collective '{name}' did not complete within "
                f"{deadline_s:g} s under Gloo ({time.monotonic() - start:.1f} s waited); some rank did not "
                "answer. Under Gloo a rank cannot tell which: every rank that waited prints this line, so the "
                "silent rank is the one without it. Exiting instead of hanging.\n")
            sys.stderr.flush()
            os._exit(3)

    threading.Thread(target=watchdog, name=f"dx-deadline-{name}", daemon=True).start()
    try:
        return call()
    finally:
        finished.set()
