"""Exact mean gradients over unequal per-rank batches, on top of ``hvd.DistributedOptimizer``.

The only module that touches gradients and Horovod's allreduce.

Horovod refuses per-rank prescale factors, so the weighting happens before Horovod sees a gradient:
a tensor hook on every parameter (it runs before autograd accumulates into ``p.grad``, hence before
Horovod's post-accumulation hook starts the allreduce) multiplies the local gradient by b_i / B, and
Horovod then allreduces with ``op=Sum``. With a loss that is the mean over the local batch this gives
sum_i (b_i / B) * (1 / b_i) * sum_{j in batch i} grad_j = the mean over all B samples, exactly.

Gradients live as views into one flat buffer per (device, dtype): zeroing is one kernel, the global
gradient norm is one pass, and the gradient statistics can read all layers at once.

Failed steps. A step whose synchronised gradient is not finite (NaN/inf loss or gradient on any
rank) is skipped on every rank alike, because all ranks see the same allreduced norm; its samples
count as seen. An out-of-memory error inside ``with opt.guard():`` is caught; at ``step()`` the ranks
agree through a one-element-per-rank status allreduce (launched before ``synchronize()`` so Horovod
fuses it with the gradients), skip the update, shrink the failed rank's batch (``oom_handler``) and
rewind the loader so the same samples are redone.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

import horovod.torch as hvd
import torch

from ..data.loader import AdaptiveLoader
from .lr_scaling import LR_RULES, lr_factor
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
        for (device, dtype), members in groups.items():
            sizes = [params[i].numel() for i in members]
            buf = torch.zeros(sum(sizes), device=device, dtype=dtype)
            bounds = [0]
            for i, n in zip(members, sizes):
                self.views[i] = buf[bounds[-1]:bounds[-1] + n].view_as(params[i])
                bounds.append(bounds[-1] + n)
            self.buffers.append(buf)
            self.offsets.append(torch.tensor(bounds, dtype=torch.int64))
            self.members.append(members)
        # Prepared once per buffer: each call is then a single compiled pass over the buffer.
        self._norms = [SegmentSqNorms(buf, off) for buf, off in zip(self.buffers, self.offsets)]
        self.attach()

    def attach(self) -> None:
        """Point every ``p.grad`` at its view, keeping any gradient that lives elsewhere."""
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is None or g.data_ptr() != view.data_ptr():
                if g is not None:
                    view.copy_(g)
                p.grad = view

    def sq_norms(self) -> torch.Tensor:
        """Squared norm of every parameter's gradient (float64, parameter order), one pass per buffer."""
        out = torch.empty(len(self.params), dtype=torch.float64, device=self.buffers[0].device)
        for norms, members in zip(self._norms, self.members):
            out[members] = norms().to(out.device)
        return out

    def zero(self) -> None:
        self.attach()
        for buf in self.buffers:
            buf.zero_()


class WeightedDistributedOptimizer:
    """Wrap a torch optimizer so each step applies the exact mean gradient over all ranks' samples.

    Args:
        optimizer: any torch optimizer (SGD, Adam, AdamW, ...) over the model's parameters.
        named_parameters: ``model.named_parameters()``, the same order on every rank.
        loader: the `AdaptiveLoader` feeding this rank; it tells each step's per-rank sample counts.
        loss_reduction: "mean" if the loss is the mean over the local batch (PyTorch's default),
            "sum" if it is the sum.
        max_grad_norm: clip the synchronised gradient to this norm (identical on every rank).
        lr_rule: couple the learning rate to the global batch: none / linear / sqrt / adascale.
        base_batch_size: global batch the learning rate was tuned for (default: the loader's first).
        compression: Horovod compression (``hvd.Compression.none`` or ``.fp16``).
        track_grad_norms: record local and global gradient squared norms per step (cheap; the
            gradient-noise statistics need them).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]], loader: AdaptiveLoader, *,
                 loss_reduction: Literal["mean", "sum"] = "mean", max_grad_norm: float | None = None,
                 lr_rule: str = "none", base_batch_size: int | None = None,
                 compression: Any = None, track_grad_norms: bool = True) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}; choose 'mean' or 'sum'")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r}; it must be a positive number or None")
        if lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule={lr_rule!r}; choose one of {', '.join(LR_RULES)}")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("named_parameters has no parameter that requires grad")
        if loader.world_size != hvd.size():
            raise ValueError(f"loader plans {loader.world_size} ranks (batch_sizes={list(loader.batch_sizes)}) "
                             f"but Horovod runs {hvd.size()}")
        self.loader = loader
        self.loss_reduction = loss_reduction
        self.max_grad_norm = max_grad_norm
        self.lr_rule = lr_rule
        self.base_batch_size = base_batch_size or loader.global_batch_size
        self.lr_gain = 1.0  # AdaScale gain (or any extra factor) set by the controller
        self.track_grad_norms = track_grad_norms
        self.param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.flat = FlatGradients(self._params)
        device = self._params[0].device
        self._local_sq = torch.zeros(len(self._params), dtype=torch.float64, device=device)
        # Per-parameter sums over the steps since the controller last read them (no host sync).
        self._layer_sums = torch.zeros(2, len(self._params), dtype=torch.float64, device=device)
        self._layer_steps = 0
        self.sqnorm_backend = backend_for(self.flat.buffers[0])
        self._hooks = [p.register_hook(self._make_weight_hook(i)) for i, p in enumerate(self._params)]
        # status[r] > 0: rank r ran out of memory this step with that many samples
        self._status = torch.zeros(loader.world_size, dtype=torch.float64)
        self.oom_handler: Callable[[list[int], list[int]], list[int]] = halve_failed_ranks
        self.last_status = "ok"
        self.skipped_steps = {"nonfinite": 0, "oom": 0}
        self._hvd = hvd.DistributedOptimizer(
            optimizer, named_parameters=named, op=hvd.Sum,
            compression=compression if compression is not None else hvd.Compression.none)
        self.last_grad_norm = float("nan")

    # --- gradient weighting (runs inside backward, once per parameter) ---------------------------
    def _make_weight_hook(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def weight(grad: torch.Tensor) -> torch.Tensor:
            step = self.loader.current_step
            local = step.counts[self.loader.rank]
            scale = (local if self.loss_reduction == "mean" else 1.0) / step.global_count
            if self.track_grad_norms:
                # Squared norm of this rank's local *mean* gradient, taken before the allreduce.
                unit = 1.0 if self.loss_reduction == "mean" else 1.0 / local
                sq = torch.linalg.vector_norm(grad, dtype=torch.float64).square() * unit**2
                self._local_sq[index] = sq
            return grad * scale
        return weight

    # --- torch.optim.Optimizer surface -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._hvd.param_groups

    @property
    def state(self) -> Any:
        return self._hvd.state

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state plus this wrapper's own (plain values under "dynamix")."""
        return {**self._hvd.state_dict(), "dynamix": {"lr_gain": float(self.lr_gain),
                                                      "skipped_steps": dict(self.skipped_steps)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        own = state.pop("dynamix", None)  # absent in a plain torch optimizer's state
        self._hvd.load_state_dict(state)
        if own is not None:
            self.lr_gain = float(own["lr_gain"])
            self.skipped_steps = dict(own["skipped_steps"])

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero all gradients in one kernel. `set_to_none` is ignored: gradients stay flat views."""
        if self._hvd._handles:
            raise RuntimeError("zero_grad() called after backward() but before step(): the gradient "
                               "allreduce is still running; call step() (or synchronize()) first")
        self.flat.zero()
        self._local_sq.zero_()

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap forward+backward: an out-of-memory error becomes a redone step with a smaller batch."""
        try:
            yield
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            self._status[self.loader.rank] = self.loader.current_step.counts[self.loader.rank]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def synchronize(self) -> None:
        self._hvd.synchronize()
        self.flat.attach()  # compression may have replaced p.grad with a new tensor

    @contextmanager
    def _scaled_lr(self) -> Iterator[float]:
        factor = lr_factor(self.lr_rule, self.loader.global_batch_size, self.base_batch_size,
                           gain=self.lr_gain)
        saved = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = g["lr"] * factor  # applied for this step only, so user LR schedulers compose
        try:
            yield self.param_groups[0]["lr"]
        finally:
            for g, lr in zip(self.param_groups, saved):
                g["lr"] = lr

    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise ValueError("closures are not supported: they recompute gradients outside the "
                             "per-step weighting; call loss.backward() before step()")
        tracker = self.loader.tracker
        tracker.step_started()
        if len(self._status) != self.loader.world_size:  # the world changed (elastic reset)
            self._status = torch.zeros(self.loader.world_size, dtype=torch.float64)
        status = hvd.allreduce_async_(self._status, name="dx.step_status", op=hvd.Sum)
        self.synchronize()
        failed = [int(v) for v in hvd.synchronize(status).tolist()]
        self._status.zero_()
        tracker.synchronized()
        global_sq = self.flat.sq_norms()
        grad_norm = float(global_sq.sum()) ** 0.5
        if any(failed):
            self._skip("oom", tracker, grad_norm)
            sizes = list(self.loader.batch_sizes)
            self.loader.redo_current_step(self.oom_handler(sizes, failed))
            return
        if not math.isfinite(grad_norm):
            self._skip("nonfinite", tracker, grad_norm)
            return
        if self.track_grad_norms:
            self._layer_sums[0] += self._local_sq
            self._layer_sums[1] += global_sq
            self._layer_steps += 1
        if self.max_grad_norm is not None:
            clip = self.max_grad_norm / (grad_norm + 1e-6)
            if clip < 1.0:
                for buf in self.flat.buffers:
                    buf.mul_(clip)
        with self._scaled_lr() as lr, self._hvd.skip_synchronize():
            self._hvd.step()
        self.last_grad_norm = grad_norm
        self.last_status = "ok"
        extra: dict[str, Any] = {"lr": float(lr), "grad_norm": grad_norm}
        if self.track_grad_norms:
            extra["local_grad_sq"] = float(self._local_sq.sum())
            extra["global_grad_sq"] = grad_norm**2
        tracker.step_finished(**extra)

    def _skip(self, reason: str, tracker: Any, grad_norm: float) -> None:
        """Drop this step's gradients on every rank (all ranks reach the same verdict)."""
        self.flat.zero()
        self._local_sq.zero_()
        self.last_status = reason
        self.skipped_steps[reason] += 1
        tracker.step_finished(status=reason, grad_norm=grad_norm)

    def set_local_gradients(self, grads: Mapping[str, torch.Tensor], local: Mapping[str, int],
                            global_: Mapping[str, int]) -> None:
        """Use gradients computed outside ``backward()`` (e.g. DBA's selected-subset means) as this
        rank's contribution to the next ``step()``: ``grads[name]`` is this rank's mean gradient over
        ``local[name]`` samples, and the update is the mean over ``global_[name]`` samples of all
        ranks. No backward may run between this call and ``step()``."""
        self.flat.attach()
        for i, name in enumerate(self.param_names):
            view = self.flat.views[i]
            view.copy_(grads[name].reshape(view.shape) * (local[name] / global_[name]))
            if self.track_grad_norms:
                self._local_sq[i] = torch.linalg.vector_norm(grads[name], dtype=torch.float64).square()

    def pop_layer_means(self) -> tuple[list[float], list[float]] | None:
        """Mean per-parameter squared norms (local, global) since the last call, then reset."""
        if self._layer_steps == 0:
            return None
        local, global_ = (self._layer_sums / self._layer_steps).tolist()
        self._layer_sums.zero_()
        self._layer_steps = 0
        return local, global_

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or an allocator RuntimeError that says it ran out of memory."""
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if oom_types and isinstance(exc, oom_types):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def halve_failed_ranks(sizes: list[int], failed: list[int]) -> list[int]:
    """Default OOM response without a controller: halve the batch of every rank that failed."""
    return [max(1, f // 2) if f else b for b, f in zip(sizes, failed)]
