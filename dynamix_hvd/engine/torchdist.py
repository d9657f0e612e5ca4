"""The torch.distributed engine: ``DistributedDataParallel`` with a communication hook that weighs
each rank's gradients before DDP sums them, and Gloo point-to-point messages for the control plane.

DDP divides the summed gradients by the world size, so unequal local batches would give a biased
mean. The hook (`DDPReducer`) replaces DDP's averaging: it multiplies this rank's bucket by
b_i / B (its share of the step's samples) and allreduces with SUM, which with a loss that is the mean
over the local batch gives the exact mean over all B samples. DDP keeps everything else: bucketing,
overlap with backward, the initial broadcast, ``no_sync``. Without DDP (`FlatReducer`) the optimizer
weighs its flat gradient buffers and allreduces each of them once, after backward.

Control messages (`GlooMessages`) run on a Gloo group of their own, also when the gradients use
NCCL: a pickled object as a length and a byte tensor, sent and received with a deadline, so that a
collective of `dynamix_hvd.comm` can name the rank that did not answer.
"""
from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

# Messages given up on after a timeout: Gloo may still write into their buffers, so they must outlive it.
_ABANDONED: list[Any] = []


class TorchPlane:
    name = "torch"

    def __init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("the torch.distributed engine needs an initialised process group: call "
                               "torch.distributed.init_process_group() (torchrun sets its environment) first")
        # NCCL reduces only CUDA tensors; the small allreduces travel on this device
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                       else torch.device("cpu"))

    def size(self) -> int:
        return dist.get_world_size()

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        out = tensor.to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(tensor.device)

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> Any:
        out = tensor.to(self.device, copy=True)
        return dist.all_reduce(out, op=dist.ReduceOp.SUM, async_op=True), out, tensor.device

    def wait(self, handle: Any) -> torch.Tensor:
        work, out, device = handle
        work.wait()
        return out.to(device)

    def default_compression(self) -> Any:
        return None

    def uncompressed(self, compression: Any) -> bool:
        return compression is None

    def gradient_reducer(self, optimizer: Any, named: list[tuple[str, Any]], passes: int, compression: Any,
                         owner: Any, model: Any = None) -> "DDPReducer | FlatReducer":
        if compression is not None:
            raise ValueError(f"compression={compression!r} under torch.distributed: gradients travel as they are "
                             "(pass compression=None)")
        if model is not None:
            return DDPReducer(model, named, owner)
        return FlatReducer(owner)


class DDPReducer:
    """DDP's communication hook: weigh this rank's bucket, then sum it over the ranks."""

    hooked = True
    recovers_oom = False  # DDP cannot finish a backward pass that failed half way on one rank
    reduced_in_backward = True

    def __init__(self, model: Any, named: list[tuple[str, Any]], owner: Any) -> None:
        if getattr(model, "gradient_as_bucket_view", False):
            raise ValueError("DistributedDataParallel(..., gradient_as_bucket_view=True): the weighted optimizer "
                             "keeps every gradient in its own flat buffer; build the DDP model without it")
        index = {id(p): i for i, (_, p) in enumerate(named)}
        trained = [n for n, p in model.named_parameters() if p.requires_grad]
        if len(trained) != len(named) or any(id(p) not in index for _, p in model.named_parameters()
                                             if p.requires_grad):
            raise ValueError("named_parameters are not the DistributedDataParallel model's own: pass the DDP "
                             "model itself (WeightedDistributedOptimizer(optimizer, ddp_model, loader))")
        self._index = index
        self._owner = owner
        self._group = getattr(model, "process_group", None)
        self._pending = False
        def hook(state, bucket):  # DDP checks a hook's annotations against its own types: none here
            return self._reduce(bucket)

        try:
            model.register_comm_hook(None, hook)
        except RuntimeError as exc:
            raise ValueError(f"the DistributedDataParallel model already has a communication hook ({exc}); the "
                             "weighted optimizer must be the one that reduces its gradients") from exc
        # DDP broadcasts the module's buffers (BatchNorm statistics) at the start of every forward pass
        # (broadcast_buffers=True): a rank that waits there waits for the others. The wrapper's pre-hook
        # runs before that broadcast, the wrapped module's after it.
        if getattr(model, "broadcast_buffers", False) and any(True for _ in model.module.buffers()):
            model.register_forward_pre_hook(lambda module, args: owner._forward_sync(started=True))
            model.module.register_forward_pre_hook(lambda module, args: owner._forward_sync(started=False))

    def _reduce(self, bucket: Any) -> torch.futures.Future:
        buffer = bucket.buffer()
        self._pending = True
        indices = [self._index[id(p)] for p in bucket.parameters()]
        if not self._owner._weigh_bucket(buffer, indices, bucket.gradients()):
            done: torch.futures.Future = torch.futures.Future()  # a micro-batch before the step's last:
            done.set_result(buffer)                              # nothing travels, gradients accumulate
            return done
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        return work.get_future().then(self._reduced)

    def _reduced(self, fut: torch.futures.Future) -> torch.Tensor:
        self._owner._gradients_reduced()  # the wait inside backward ends with the last bucket's sum
        return fut.value()[0]

    def synchronize(self) -> None:
        self._pending = False  # DDP waited for every bucket at the end of backward

    def in_flight(self) -> bool:
        return self._pending

    def unsent(self) -> list[int]:
        return []

    def set_backward_passes_per_step(self, passes: int) -> None:
        pass  # each bucket asks the optimizer whether its step is complete

    def reset(self, passes: int) -> None:
        self._pending = False


class FlatReducer:
    """Without DDP: one allreduce per flat gradient buffer, after backward (the optimizer weighs first)."""

    hooked = False
    recovers_oom = True  # nothing travels before synchronize(): a failed rank still takes part
    reduced_in_backward = False

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def synchronize(self) -> None:
        works = [dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True) for buf in self._owner.flat.buffers]
        for work in works:
            work.wait()

    def in_flight(self) -> bool:
        return False

    def unsent(self) -> list[int]:
        return list(range(len(self._owner.flat.params)))

    def set_backward_passes_per_step(self, passes: int) -> None:
        pass

    def reset(self, passes: int) -> None:
        pass


class GlooMessages:
    """Pickled objects between ranks over a Gloo group of their own, each send and receive with a deadline.
    Made collectively: every rank constructs it at the same point of the program.

    Gloo closes the connection to a peer when a wait with a timeout expires, so the waits themselves
    have none: a daemon thread waits, and the caller gives up on it at the deadline (a rank that did
    not answer leaves a thread waiting, which does not keep the process from exiting; the job ends
    with the error that names that rank)."""

    name = "torch-gloo"

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def send(self, obj: Any, dests: list[int], tag: int, deadline: float, wait: bool = True) -> list[int]:
        """Send `obj` to every rank of `dests`; the ranks that did not take it by `deadline`."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        head = torch.tensor([len(payload)], dtype=torch.int64)
        works = {dst: (dist.isend(head, dst, group=self.group, tag=2 * tag),
                       dist.isend(data, dst, group=self.group, tag=2 * tag + 1)) for dst in dests}
        if not wait:
            _ABANDONED.append((works, head, data))
            return []
        waits = {dst: [_waiting(w.wait) for w in pair] for dst, pair in works.items()}
        missing = [dst for dst, pair in waits.items() if not all(_done(f, deadline) for f in pair)]
        if missing:
            _ABANDONED.append((works, head, data))
        return missing

    def recv(self, sources: list[int], tag: int, deadline: float) -> tuple[dict[int, Any], list[int]]:
        """One object from each of `sources` by `deadline`: ({source: object}, the sources that sent none)."""
        heads = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
        works = {src: dist.irecv(heads[src], src, group=self.group, tag=2 * tag) for src in sources}
        waits = {src: _waiting(work.wait) for src, work in works.items()}
        got: dict[int, Any] = {}
        missing: list[int] = []
        for src in sources:
            if not _done(waits[src], deadline):
                missing.append(src)
                _ABANDONED.append((works[src], heads[src]))
                continue
            data = torch.empty(int(heads[src].item()), dtype=torch.uint8)
            work = dist.irecv(data, src, group=self.group, tag=2 * tag + 1)
            if not _done(_waiting(work.wait), deadline):
                missing.append(src)
                _ABANDONED.append((work, data))
                continue
            got[src] = pickle.loads(data.numpy().tobytes())
        return got, missing


def _waiting(wait: Any) -> Future:
    """`wait()` run in a daemon thread; its outcome as a Future."""
    outcome: Future = Future()

    def run() -> None:
        try:
            outcome.set_result(wait())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome.set_exception(exc)

    threading.Thread(target=run, name="dx-gloo-wait", daemon=True).start()
    return outcome


def _done(waiting: Future, deadline: float) -> bool:
    """Whether the wait completed by `deadline` (a peer that closed its connection counts as not)."""
    try:
        waiting.result(timeout=max(deadline - time.monotonic(), 0.05))  # what has arrived completes within this
    except Exception:  # noqa: BLE001 - a timeout, or the peer's connection closed: either way, no answer
        return False
    return True

