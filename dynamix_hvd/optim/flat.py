"""Gradients as views into one flat buffer per (device, dtype), and their squared norms.

Zeroing is one kernel per buffer. The per-parameter squared norms of all gradients are written into
a tensor the caller keeps: on CUDA by the Numba-CUDA segment kernel of `dynamix_hvd.stats.sqnorm`
(one launch per buffer); on CPU by one dot product per parameter into preallocated slots (faster than
torch's multi-tensor norm, whose reduction kernel is slower, and without the Numba CPU kernel's load
time in every process), or torch's multi-tensor norm for 16-bit gradients. Squared norms taken one
parameter at a time, as each gradient is handed to the allreduce, go into preallocated slots too,
read at once. Pure torch: no Horovod, no MPI.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch

from ..stats.sqnorm import SegmentSqNorms, backend_for


class FlatGradients:
    """Keeps ``p.grad`` of every parameter as a view into a flat buffer per (device, dtype)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self.buffers: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(params)
        self.offsets: list[torch.Tensor] = []  # per buffer: int64 [n_params_in_buffer + 1]
        self.members: list[list[int]] = []     # per buffer: indices of its parameters, in order
        self._homes: list[tuple[torch.Tensor, int]] = [(torch.empty(0), 0)] * len(params)  # (buffer, offset)
        self._lines: list[torch.Tensor] = [torch.empty(0)] * len(params)  # each view as a 1-D slice of its buffer
        for (device, dtype), members in groups.items():
            sizes = [params[i].numel() for i in members]
            buf = torch.zeros(sum(sizes), device=device, dtype=dtype)
            bounds = [0]
            for i, n in zip(members, sizes):
                self._lines[i] = buf[bounds[-1]:bounds[-1] + n]
                self.views[i] = self._lines[i].view_as(params[i])
                bounds.append(bounds[-1] + n)
            for i, start in zip(members, bounds):
                self._homes[i] = (buf, start)
            self.buffers.append(buf)
            self.offsets.append(torch.tensor(bounds, dtype=torch.int64))
            self.members.append(members)
        # where each view's data starts in its buffer (None: a view of no elements)
        self._home_ptrs: list[int | None] = [buf.data_ptr() + start * buf.element_size() if v.numel() else None
                                             for v, (buf, start) in zip(self.views, self._homes)]
        # per parameter: its squared norm as one dot product where `sq_norm` would take one
        self._by_dot = [_by_dot(v) for v in self.views]
        # Per-parameter squared norms of a buffer. CUDA: the Numba-CUDA segment kernel, prepared once
        # (one launch over the buffer). CPU: a dot product per parameter into its slot (or torch's
        # multi-tensor norm), which spares every process the load of the Numba CPU kernel.
        cuda = self.buffers[0].device.type == "cuda"
        by_dot = [all(self._by_dot[i] for i in members) for members in self.members]
        self.backend = (backend_for(self.buffers[0]) if cuda else "torch-dot" if all(by_dot)
                        else "torch-foreach" if not any(by_dot) else "torch-dot+foreach")
        self._norms = [_cuda_norms(SegmentSqNorms(buf, off)) if buf.device.type == "cuda" else self._cpu_norms(members)
                       for buf, off, members in zip(self.buffers, self.offsets, self.members)]
        # one buffer holding every parameter in order: its norms are written straight into `out`
        self._in_order = len(self.buffers) == 1 and self.members[0] == list(range(len(params)))
        self._member_index = [torch.tensor(m, dtype=torch.int64, device=b.device) for b, m in zip(self.buffers, self.members)]
        # Slots for squared norms taken one parameter at a time (`put_sq_norm`): one preallocated tensor
        # per buffer (in the precision the norm is taken in), zeroed by `clear_slots` when written.
        self._slot_bufs = [torch.zeros(len(m), dtype=_norm_dtype(b.dtype), device=b.device)
                           for b, m in zip(self.buffers, self.members)]
        self._slots: list[torch.Tensor] = [torch.empty(0)] * len(params)
        for slots, members in zip(self._slot_bufs, self.members):
            for slot, i in zip(slots.unbind(), members):
                self._slots[i] = slot
        self._slots_written = False
        # Squared norms of weighted gradients (`enable_weights`): per buffer the weights, a copy of this
        # rank's local gradients and a scratch buffer for gradient times weights, in the same layout.
        self.weighted = False
        self.keeping = True  # weighted: whether put_sq_norm keeps local gradients (on steps that are measured)
        self._weight_bufs: list[torch.Tensor] = []
        self._local_bufs: list[torch.Tensor] = []
        self._scaled_bufs: list[torch.Tensor] = []
        self._weight_lines: list[torch.Tensor] = []
        self._local_lines: list[torch.Tensor] = []
        self._weighted_norms: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self.attach()

    def enable_weights(self) -> None:
        """For norms of the gradients times a weight per element, weights that are only known after the
        allreduce (e.g. Adam's preconditioner, which depends on the global gradient): from now on
        `put_sq_norm` keeps a copy of the local gradient instead of taking its norm (while `keeping`), and
        `sq_norms(weighted=True)` takes the norms of the global (or, `local=True`, of the kept local)
        gradients times the weights written through `weight_line` (1 until written). Costs three
        buffers of the gradients' size."""
        if self.weighted:
            return
        for buf, off, members in zip(self.buffers, self.offsets, self.members):
            if buf.is_complex():
                raise ValueError("weighted squared norms of complex gradients are not supported")
            dtype = torch.float32 if buf.dtype in (torch.float16, torch.bfloat16) else buf.dtype
            weights = torch.ones(buf.numel(), dtype=dtype, device=buf.device)
            scaled = torch.zeros_like(weights)
            self._weight_bufs.append(weights)
            self._local_bufs.append(torch.zeros_like(buf))
            self._scaled_bufs.append(scaled)
            self._weighted_norms.append(_cuda_norms(SegmentSqNorms(scaled, off)) if buf.device.type == "cuda"
                                        else self._cpu_norms(members, scaled))
        self._weight_lines = [self._line_of(self._weight_bufs, i) for i in range(len(self.params))]
        self._local_lines = [self._line_of(self._local_bufs, i) for i in range(len(self.params))]
        self.weighted = True

    def _line_of(self, buffers: list[torch.Tensor], index: int) -> torch.Tensor:
        """Parameter `index`'s 1-D slice of the buffer in `buffers` that matches its gradient buffer."""
        home, start = self._homes[index]
        k = next(j for j, b in enumerate(self.buffers) if b is home)
        return buffers[k][start:start + self.params[index].numel()]

    def weight_line(self, index: int) -> torch.Tensor:
        """Parameter `index`'s weights as a 1-D tensor to write in place (after `enable_weights`)."""
        return self._weight_lines[index]

    def grad_line(self, index: int) -> torch.Tensor:
        """Parameter `index`'s gradient as a 1-D view of its buffer."""
        return self._lines[index]

    def square_into_weights(self, factor: float = 1.0) -> None:
        """Set every weight to its gradient squared times `factor` (after `enable_weights`)."""
        for buf, weights in zip(self.buffers, self._weight_bufs):
            torch.mul(buf, buf, out=weights)
            if factor != 1.0:
                weights.mul_(factor)

    def keep_all_local(self) -> None:
        """Copy every gradient as this rank's local gradient (after `enable_weights`; one copy per buffer)."""
        for buf, local in zip(self.buffers, self._local_bufs):
            local.copy_(buf)

    def _cpu_norms(self, members: list[int], buffer: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """Per-parameter squared norms of the gradient buffer of `members`, or of `buffer` (same layout)."""
        if buffer is None:
            lines, views = [self._lines[i] for i in members], [self.views[i] for i in members]
        else:
            lines = [buffer[self._homes[i][1]:self._homes[i][1] + self.params[i].numel()] for i in members]
            views = [line.view_as(self.params[i]) for line, i in zip(lines, members)]
        if all(_by_dot(v) for v in views):
            scratch = torch.zeros(len(members), dtype=views[0].dtype)
            pairs = list(zip(lines, scratch.unbind()))

            def dots(out: torch.Tensor) -> torch.Tensor:
                for line, slot in pairs:
                    torch.dot(line, line, out=slot)
                return out.copy_(scratch)
            return dots
        half = views[0].dtype in (torch.float16, torch.bfloat16)

        def norms(out: torch.Tensor) -> torch.Tensor:
            found = torch._foreach_norm(views, 2, dtype=torch.float32) if half else torch._foreach_norm(views)
            return torch.stack(found, out=out).square_()
        return norms

    def attach(self, moved: bool = False) -> None:
        """Point every ``p.grad`` at its view, keeping any gradient that lives elsewhere.

        A view itself may have been moved off the buffer (`moved`: check for it): Horovod's
        synchronize() with a compression (fp16) ends with ``p.grad.set_(decompressed)``, which gives
        the view object (that is ``p.grad``) the decompressed tensor's storage. Such a view is set
        back onto its place in the buffer, its values copied along, so the view objects (which the
        norms hold) stay valid. Without `moved`, the usual case (every ``p.grad`` is its view) costs
        one pass in C over the parameters."""
        if not moved and all(map(operator.is_, map(_GRAD, self.params), self.views)):
            return
        for p, view, (buf, start), home in zip(self.params, self.views, self._homes, self._home_ptrs):
            g = p.grad
            if g is view and (home is None or view.data_ptr() == home):
                continue  # the usual case, checked first: p.grad is its view, in place
            if home is not None and view.data_ptr() != home:
                moved = view.detach()  # shares the storage the view was moved to
                view.set_(buf.untyped_storage(), buf.storage_offset() + start, p.shape)
                view.copy_(moved)
            if g is None or g.data_ptr() != view.data_ptr():
                if g is not None:
                    view.copy_(g)
                p.grad = view

    def sq_norms(self, out: torch.Tensor | None = None, weighted: bool = False, local: bool = False) -> torch.Tensor:
        """Squared norm of every parameter's gradient (float64, parameter order), one fused operation
        per buffer; written into `out` (float64, one entry per parameter) when given. `weighted`: of
        the gradient times its weights (after `enable_weights`), one more multiply per buffer;
        `local`: of the local gradients `put_sq_norm` kept instead."""
        if out is None:
            out = torch.empty(len(self.params), dtype=torch.float64, device=self.buffers[0].device)
        all_norms = self._norms
        if weighted:
            if not self.weighted:
                raise RuntimeError("sq_norms(weighted=True) before enable_weights()")
            for buf, weights, scaled in zip(self._local_bufs if local else self.buffers, self._weight_bufs,
                                            self._scaled_bufs):
                torch.mul(buf, weights, out=scaled)
            all_norms = self._weighted_norms
        elif local:
            raise ValueError("sq_norms(local=True) takes the norms of the kept local gradients times their "
                             "weights: pass weighted=True")
        if self._in_order:
            return all_norms[0](out)
        for norms, members, index in zip(all_norms, self.members, self._member_index):
            part = norms(torch.empty(len(members), dtype=torch.float64, device=index.device))
            out.index_copy_(0, index.to(out.device), part.to(out.device))
        return out

    def put_sq_norm(self, index: int, grad: torch.Tensor | None = None) -> None:
        """Write the squared norm (`sq_norm`) of parameter `index`'s gradient into its slot: of its view
        in the buffer (the caller has checked that ``p.grad`` is its view, at home), or of `grad`.
        After `enable_weights`: keep a copy of it as this rank's local gradient instead."""
        slot = self._slots[index]
        self._slots_written = True
        if self.weighted:  # the weights come after the allreduce: keep the gradient, norms later
            if not self.keeping:
                return
            if grad is not None:
                self._local_lines[index].copy_(grad.reshape(-1))
            elif self._local_lines[index].numel():
                self._local_lines[index].copy_(self._lines[index])
            return
        if grad is None:
            if self._by_dot[index]:
                line = self._lines[index]
                torch.dot(line, line, out=slot)
            else:
                slot.copy_(sq_norm(self.views[index]))
        elif self._by_dot[index] and grad.dtype == slot.dtype:
            line = grad.reshape(-1)
            torch.dot(line, line, out=slot)
        else:
            slot.copy_(sq_norm(grad))

    def slot_sq_norms(self, out: torch.Tensor) -> torch.Tensor:
        """The slots' squared norms into `out` (float64, parameter order; 0 where none was written)."""
        if self._in_order:
            return out.copy_(self._slot_bufs[0])
        for slots, index in zip(self._slot_bufs, self._member_index):
            out.index_copy_(0, index.to(out.device), slots.to(out.device, out.dtype))
        return out

    def clear_slots(self) -> None:
        """Zero the slots (one kernel per buffer, only when some were written)."""
        if self._slots_written:
            for slots in self._slot_bufs:
                slots.zero_()
            self._slots_written = False

    def zero(self) -> None:
        self.attach()
        for buf in self.buffers:
            buf.zero_()


def sq_norm(grad: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm as a 0-d tensor on the gradient's device: in the gradient's precision (a float64
    cast would copy the whole gradient) as one dot product, 16-bit gradients accumulated in float32
    (they could overflow)."""
    if _by_dot(grad):
        flat = grad.reshape(-1)
        return torch.dot(flat, flat)
    if grad.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    return torch.linalg.vector_norm(grad).square()


_GRAD = operator.attrgetter("grad")


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `sq_norm` returns for a gradient of `dtype`."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return torch.empty(0, dtype=dtype).abs().dtype  # complex: its real counterpart


def _cuda_norms(prepared: SegmentSqNorms) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda out: out.copy_(prepared())


def _by_dot(t: torch.Tensor) -> bool:
    """Whether `sq_norm` takes one dot product: not 16-bit, complex or longer than cuBLAS counts."""
    return t.dtype not in (torch.float16, torch.bfloat16) and not t.is_complex() and t.numel() <= _DOT_MAX


_DOT_MAX = 2**31 - 1
"""Most elements torch.dot takes on CUDA (cuBLAS counts in 32-bit integers)."""
