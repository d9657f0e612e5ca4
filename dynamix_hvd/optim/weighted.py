"""Exact mean gradients over unequal per-rank batches, on Horovod or torch.distributed.

The only module that touches gradients. The reduction itself is the engine's (`dynamix_hvd.engine`):
``hvd.DistributedOptimizer``, a DistributedDataParallel communication hook, or one allreduce per
flat buffer.

The weighting happens before a gradient is sent: with one backward pass per step, as the engine takes
it (inside the compression object Horovod calls on ``p.grad`` right before it starts that gradient's
allreduce, or in DDP's hook on each bucket; in place: no extra autograd hook); with accumulation, in a
tensor hook on every parameter (each micro-batch is weighted before autograd adds it to ``p.grad``).
Either multiplies the local gradient by b_i / B, and the engine then sums over the ranks. With a
loss that is the mean over the local batch this gives
sum_i (b_i / B) * (1 / b_i) * sum_{j in batch i} grad_j = the mean over all B samples, exactly.
Where the factor is the same on every rank (equal sizes, or a summed loss: 1 / B) and gradients travel
uncompressed, it multiplies each flat buffer once after the allreduce instead (one kernel, not one
per parameter).

Gradients live as views into one flat buffer per (device, dtype) (`flat.FlatGradients`): zeroing is
one kernel, the global gradient norm is one pass, and the gradient statistics can read all layers at once.

Failed steps. A step whose synchronised gradient is not finite (NaN/inf loss or gradient on any
rank) is skipped on every rank alike, because all ranks see the same allreduced norm; its samples
count as seen. An out-of-memory error inside ``with opt.guard():`` is caught and poisons the rank's
gradients that Horovod has not taken yet with NaN, so every rank's allreduced norm is NaN; only then
(a rare step) do the ranks run a one-element-per-rank status allreduce to learn who failed with how
many samples, skip the update, shrink the failed rank's batch (``oom_handler``) and rewind the loader
so the same samples are redone. A healthy step runs no collective besides the gradients' own.

Cost per step over plain Horovod (see BENCHMARKS.md, "Overhead: where the time goes"): per parameter,
inside Horovod's compress() call, the local squared norm (one dot product in the gradient's own
precision, written into a preallocated slot on the device) and, at unequal sizes, an in-place
multiply; and ``step()`` reads back one small tensor (the local and global squared norms, and the
scaler's inf flag) for the non-finite check and the step record.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

import torch

from .. import engine as engines
from ..data.loader import AdaptiveLoader
from .lr_scaling import LR_RULES, LRCoupling
from .progress import ProgressAccounting
from . import precondition
from .flat import FlatGradients
from .. import validate


_CLASSES: dict[type, type] = {}
_HIDDEN_BY_SCALER = ("grad_scale", "found_inf")


def _inner(obj: Any, name: str) -> Callable[..., Any]:
    """The user's optimizer's method `name` (skipping this module's class in the MRO), unbound; for
    ``step`` without torch's profiling/step-hook wrapper, since our own step already ran the hooks."""
    for klass in type(obj).__mro__[1:]:
        if klass is not WeightedDistributedOptimizer and name in vars(klass):
            fn = vars(klass)[name]
            return fn.__wrapped__ if getattr(fn, "hooked", False) else fn
    raise AttributeError(name)


class WeightedDistributedOptimizer(torch.optim.Optimizer, ProgressAccounting):
    """Wrap a torch optimizer so each step applies the exact mean gradient over all ranks' samples.

    The object returned is a real ``torch.optim.Optimizer`` of the user's class, like Horovod's
    ``DistributedOptimizer``: a class built at run time whose bases are the user's optimizer class and
    this one (``isinstance(opt, torch.optim.SGD)`` and ``isinstance(opt, WeightedDistributedOptimizer)``
    both hold). It shares the user's ``param_groups`` and ``state``, so every LR scheduler,
    ``state_dict``/``load_state_dict`` and ``hvd.broadcast_optimizer_state`` work on it.

    Learning rate, in this order at every step: an LR scheduler (or the user) owns ``group["lr"]``, the
    *base* LR; ``step()`` multiplies it by the LR rule's factor for the current global batch B (for
    ``adascale``, the default, that factor is ``lr_gain`` (its square root on an adaptive optimizer such
    as Adam: the square-root scaling rule), the AdaScale gain the controller sets at each
    decision from its gradient statistics, 1 until it has some: r at the samples of one optimizer step,
    ``backward_passes_per_step`` micro-batches of the new sizes, over ``base_batch_size``), eased in over ``lr_warmup_steps`` after
    B grows, runs the inner optimizer, and restores ``group["lr"]``. So the effective LR of a step is
    ``scheduler_lr * ramp(lr_factor(rule, B, base_batch_size, lr_gain))``, the scheduler never sees (and
    never compounds) the factor, and ``state_dict()`` stores the base LR. An explicit ``lr_rule`` is
    what runs: the controller only sets ``lr_gain``, which only ``adascale`` reads. Progress: each step
    adds what it was worth in base iterations (the gain) to ``scale_invariant_steps`` (AdaScale's tau, in base iterations; also
    ``scale_invariant_epochs``); drive a schedule by it with `dynamix_hvd.optim.progress.ProgressScheduler`
    and stop at ``progress_done(total_base_steps)``, so schedules and budgets mean the same when B changes.

    Mixed precision follows Horovod's pattern::

        scaler = torch.amp.GradScaler(device)
        opt = WeightedDistributedOptimizer(..., grad_scaler=scaler)
        with torch.autocast(device, dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)                    # optional: needed only to clip yourself
        torch.nn.utils.clip_grad_norm_(...)     # optional (or max_grad_norm=)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    The gradient statistics are taken at ``synchronize()`` (before any user clipping) and divided by
    the loss scale squared, so they describe unscaled gradients; ``max_grad_norm`` clips the unscaled
    gradient. A step with a non-finite gradient (the scaler's inf check, or NaN/inf in fp32) is skipped
    on every rank alike (the check reads the allreduced gradient) and feeds no statistics; the scaler
    still backs off its scale. bf16 autocast needs no scaler and nothing else.

    Gradient accumulation: with ``backward_passes_per_step=k`` every k loader steps (micro-batches,
    one ``backward()`` each) make one optimizer step; call ``step()`` when ``should_step()`` says so.
    Each micro-batch's local mean gradient is turned into a sum (times its local count), Horovod
    allreduces the accumulated sums once, and ``synchronize()`` divides by the total sample count of the
    k micro-steps of all ranks: the update is the exact mean over all of them. A rank's batch size in
    the loader is its micro-batch size, which is what its memory bound limits. Seam for a controller
    that picks micro-batch counts: ``set_backward_passes_per_step(k)`` between steps (the same k on
    every rank, since one loader step is one micro-batch on every rank).

    Args:
        optimizer: any torch optimizer (SGD, Adam, AdamW, ...) over the model's parameters.
        named_parameters: ``model.named_parameters()``, the same order on every rank.
        loader: the `AdaptiveLoader` feeding this rank; it tells each step's per-rank sample counts.
        loss_reduction: "mean" if the loss is the mean over the local batch (PyTorch's default),
            "sum" if it is the sum.
        loss_unit: what the loss averages (or sums) over: "samples", or "tokens" for a per-token loss
            on variable-length data (padding masked out): the update is then the exact mean over all
            valid tokens of all ranks' batches. The token counts come from the loader's ``lengths=``
            (no collective), or, without lengths, from ``set_local_tokens(n)`` called before each
            ``backward()`` (one small allreduce per step). Default: "tokens" when the loader plans by
            token budgets, else "samples".
        max_grad_norm: clip the synchronised gradient to this norm (identical on every rank).
        lr_rule: couple the learning rate to the global batch (`dynamix_hvd.optim.lr_scaling`):
            "adascale" (default; the controller's gain, 1 without a controller), "linear" (SGD while B
            stays below the noise scale), "sqrt" (Adam-type), "none".
        lr_warmup_steps: after B grows, ramp the factor from its last value to the new one over this
            many optimizer steps (0: at once; None: 3% of an epoch at the new B, at least 2).
        adaptive: ``adascale`` applies the square root of the gain (the square-root rule for Adam-type
            optimizers) instead of the gain. False (default) for every optimizer, Adam's included: on
            the workload zoo's Adam jobs the full gain trained faster and ended better.
        base_batch_size: the base batch, the global batch the learning rate was tuned for (default:
            the initial batch, the loader's first global micro-batch times ``backward_passes_per_step``).
        compression: Horovod compression (``hvd.Compression.none`` or ``.fp16``); None under torch.distributed.
        engine: "auto" (DDP when `named_parameters` is a DistributedDataParallel model, torch.distributed
            when a process group is initialised and Horovod is not, Horovod otherwise), "horovod" or "torch".
        track_grad_norms: record local and global gradient squared norms per step (cheap; the
            gradient-noise statistics need them).
        backward_passes_per_step: micro-batches accumulated per optimizer step.
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, if any.
        noise_preconditioner: what the gradient-noise statistics (noise scale, AdaScale gain, growth)
            are measured on: "none" (default: the gradient itself), "adam" (an Adam-type optimizer's
            step direction, the gradient divided by ``sqrt(v_hat) + eps`` as the optimizer applies
            it), "auto" ("adam" for Adam, AdamW, NAdam and RAdam, else "none"). See
            `dynamix_hvd.optim.precondition` for what it changes.
    """

    _step_supports_amp_scaling = True  # GradScaler then always calls step() and tells us found_inf

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> "WeightedDistributedOptimizer":
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        base = type(optimizer)
        if isinstance(optimizer, WeightedDistributedOptimizer) or base.__module__ == engines.HOROVOD_OPTIMIZER_MODULE:
            raise TypeError(f"optimizer is already distributed ({base.__name__} from {base.__module__}); "
                            "pass the plain torch optimizer, not hvd.DistributedOptimizer(...)")
        kind = engines.choose(kwargs.get("engine", "auto"), args[0] if args else kwargs.get("named_parameters"))
        if (base, kind) not in _CLASSES:
            body = {k: v for k, v in WeightedDistributedOptimizer.__dict__.items()
                    if k not in ("__dict__", "__weakref__", "__new__")}
            if kind == "horovod":
                # Horovod's broadcast_optimizer_state recognises its own wrappers by module and then steps
                # only the inner optimizer (super(cls, opt).step()) to create state without an allreduce.
                body["__module__"] = engines.HOROVOD_OPTIMIZER_MODULE
            body["__qualname__"] = f"WeightedDistributed{base.__name__}"
            _CLASSES[base, kind] = type(f"WeightedDistributed{base.__name__}", (base, WeightedDistributedOptimizer), body)
        return torch.optim.Optimizer.__new__(_CLASSES[base, kind])

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]], loader: AdaptiveLoader, *,
                 loss_reduction: Literal["mean", "sum"] = "mean", loss_unit: str | None = None,
                 max_grad_norm: float | None = None,
                 lr_rule: str = "adascale", lr_warmup_steps: int | None = None, adaptive: bool = False,
                 base_batch_size: int | None = None,
                 compression: Any = None, track_grad_norms: bool = True,
                 backward_passes_per_step: int = 1, grad_scaler: Any = None, engine: str = "auto",
                 noise_preconditioner: str = "none") -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}; choose 'mean' or 'sum'")
        if loss_unit is None:
            loss_unit = "tokens" if loader.budget == "tokens" else "samples"
        if loss_unit not in ("samples", "tokens"):
            raise ValueError(f"loss_unit={loss_unit!r}; choose 'samples' or 'tokens'")
        if loss_unit == "samples" and loader.budget == "tokens":
            raise ValueError("loss_unit='samples' with a loader that plans by token budgets: the loss must "
                             "be the mean over valid tokens (loss_unit='tokens')")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r}; it must be a positive number or None")
        if lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule={lr_rule!r}; choose one of {', '.join(LR_RULES)}")
        _check_passes(backward_passes_per_step)
        if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "is_enabled")):
            raise ValueError(f"grad_scaler={grad_scaler!r}; pass a torch.amp.GradScaler or None")
        preconditioned = precondition.choose(noise_preconditioner, optimizer)
        kind = engines.choose(engine, named_parameters)
        ddp_model = named_parameters if engines._is_ddp(named_parameters) else None
        if ddp_model is not None:
            named_parameters = ddp_model.named_parameters()
        elif isinstance(named_parameters, torch.nn.Module):
            raise TypeError(f"named_parameters is a {type(named_parameters).__name__} module: pass "
                            "model.named_parameters(), or the DistributedDataParallel model itself")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("named_parameters has no parameter that requires grad")
        self._plane = engines.data_plane(kind)
        if loader.world_size != self._plane.size():
            raise ValueError(f"loader plans {loader.world_size} ranks (batch_sizes={list(loader.batch_sizes)}) "
                             f"but {'Horovod' if kind == 'horovod' else 'torch.distributed'} runs {self._plane.size()}")
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.state = optimizer.state
        for key, value in vars(optimizer).items():  # class-specific extras (e.g. LBFGS's _params)
            if key not in vars(self) and not callable(value):
                setattr(self, key, value)
        self.loader = loader
        self.loss_reduction = loss_reduction
        self.loss_unit = loss_unit
        # loss_unit="tokens" without lengths: the counts given by set_local_tokens() and their global sums
        self._tokens_given: tuple[int, Any] | None = None  # (local count, allreduce handle) for the next micro-batch
        self._token_seq = 0
        self.max_grad_norm = max_grad_norm
        self.lr_rule = lr_rule
        self.backward_passes_per_step = backward_passes_per_step
        self.base_batch_size = base_batch_size or loader.global_micro_batch * backward_passes_per_step
        self.lr_gain = 1.0  # AdaScale gain set by the controller (read by the adascale rule only)
        self.adaptive = validate.boolean("adaptive", adaptive)
        # warm-up ramp and progress (tau), plain state
        self.lr_coupling = LRCoupling(lr_warmup_steps, adaptive=self.adaptive)
        self.track_grad_norms = track_grad_norms
        self.grad_scaler = grad_scaler
        self.param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.flat = FlatGradients(self._params)
        device = self._params[0].device
        # Adam-type: the noise statistics are taken of the step direction (`precondition`)
        self._preconditioner = (precondition.AdamPreconditioner(self, self._params, self.flat)
                                if preconditioned and track_grad_norms else None)
        self.noise_preconditioner = "adam" if self._preconditioner else "none"
        """What the gradient-noise statistics are measured on: "adam" (the preconditioned gradient) or "none"."""
        # those norms are taken on every `_pre_every`-th step (`set_noise_every`), the others record NaN
        self._pre_every, self._pre_wait, self._pre_cost_s = 1, 0, 0.0
        # The step's squared norms per parameter, [local, global, global preconditioned] (float64),
        # written in place every step: the local ones from the slots of `flat` (filled as Horovod takes
        # each gradient; under Adam from the local gradients `flat` keeps, once the weights are known),
        # the global ones by one fused operation after the allreduce. One small tensor read back per step.
        self._pair = torch.zeros(3, len(self._params), dtype=torch.float64, device=device)
        self._local_row, self._global_row, self._global_pre_row = self._pair.unbind()
        self._totals = torch.zeros(3, dtype=torch.float64, device=device)
        self._local_in_pair = False  # this step's local norms are already in _pair[0] (one fused pass)
        # Per-parameter sums over the steps since the controller last read them (no host sync).
        self._layer_sums = torch.zeros(2, len(self._params), dtype=torch.float64, device=device)
        self._layer_steps = 0
        self.sqnorm_backend = self.flat.backend
        self._micro: list[Any] = []   # the loader steps (micro-batches) accumulated since the last step
        self._micro_n: list[tuple[int, Any]] = []  # per micro-batch: (local count, global count or its handle)
        self._group_t0 = 0.0
        # Where Horovod's compress() finds a gradient: the data pointer of its flat view (a view of
        # no elements shares its pointer with a neighbour, so those are left out: nothing to weigh).
        self._index_of = {v.data_ptr(): i for i, v in enumerate(self.flat.views) if v.numel()}
        self._hooks: list[Any] = []   # the per-micro-batch weighting hooks, while accumulating
        self._preweighted = False     # set_local_gradients() weighed this step's gradients itself
        # (planned step, gradient factor, norm factor, factor applied after the allreduce) of this step
        self._step_scale: tuple[Any, float, float, bool] = (None, 1.0, 1.0, False)
        self._oom_samples = 0  # > 0: this rank ran out of memory in this step with that many samples
        self.oom_handler: Callable[[list[int], list[int]], list[int]] = halve_failed_ranks
        self.last_status = "ok"
        self.skipped_steps = {"nonfinite": 0, "oom": 0}
        self._synced: dict[str, Any] | None = None  # what synchronize() found, until step() uses it
        self._should_synchronize = True
        self._compression = compression if compression is not None else self._plane.default_compression()
        self._uncompressed = self._plane.uncompressed(self._compression)
        # gradients travel uncompressed and in a range where a sum of unweighted ones cannot overflow
        self._exact_wire = self._uncompressed and all(buf.dtype != torch.float16 for buf in self.flat.buffers)
        self._allreduce_bytes: int | None = None
        self.engine = kind
        """"horovod" or "torch": which engine reduces the gradients."""
        self._reducer = self._plane.gradient_reducer(optimizer, named, backward_passes_per_step, self._compression,
                                                     self, model=ddp_model)
        # An unhooked reducer (one Horovod process outside elastic mode; torch.distributed without DDP)
        # never hands gradients over one by one: synchronize() weighs every gradient itself.
        self._engine_hooked = self._reducer.hooked
        self._inner_step = _inner(self, "step")
        self._update_hooks()
        self.last_grad_norm = float("nan")

    # --- gradient weighting -------------------------------------------------------------------------
    def _weigh(self, grad: torch.Tensor) -> None:
        """One backward pass per step: weigh ``p.grad`` in place just before Horovod sends it (called
        from Horovod's compress(), once per parameter and step)."""
        if self.backward_passes_per_step != 1 or self._preweighted or not grad.numel():
            return
        index = self._index_of.get(grad.data_ptr())
        if index is None:
            raise RuntimeError("a gradient reached the allreduce outside its flat buffer (was p.grad replaced "
                               "between zero_grad() and step()?); the weighting cannot place it")
        planned, scale, _, after = self._step_scale
        step = self.loader.current_step
        if step is not planned:
            planned, scale, _, after = self._start_micro_step(step)
        if self.track_grad_norms:
            # Squared norm of this rank's local gradient into its slot (times the step's unit in _local_sq()).
            self.flat.put_sq_norm(index)
        if not after:
            grad.mul_(scale)

    def _weigh_bucket(self, buffer: torch.Tensor, indices: list[int], grads: list[torch.Tensor]) -> bool:
        """DDP's hook, once per bucket: weigh the bucket (a copy of these parameters' local gradients)
        in place. Returns whether the bucket travels now (False: a micro-batch before its step's last,
        whose gradients the per-parameter hooks weighed and autograd accumulates)."""
        if self.backward_passes_per_step != 1 or self._preweighted:
            travels = self.should_step()
            if travels:
                self.loader.tracker.gradients_ready()
            return travels
        planned, scale, _, after = self._step_scale
        step = self.loader.current_step
        if step is not planned:
            planned, scale, _, after = self._start_micro_step(step)
        if self.track_grad_norms:
            for index, grad in zip(indices, grads):
                self.flat.put_sq_norm(index, grad)
        if not after and scale != 1.0:
            buffer.mul_(scale)
        self.loader.tracker.gradients_ready()  # DDP waits for this bucket's sum inside backward
        return True

    def _gradients_reduced(self) -> None:
        """DDP's hook: a bucket's sum has arrived (on the communication thread)."""
        self.loader.tracker.gradients_reduced()

    def _forward_sync(self, started: bool) -> None:
        """DDP's hooks around its broadcast of buffers at the start of a forward pass: time waited there
        is waiting for the other ranks, not compute."""
        tracker = self.loader.tracker
        if started:
            tracker.forward_sync_started()
        else:
            tracker.forward_sync_ended()

    def _update_hooks(self) -> None:
        """Per-parameter hooks exist only while accumulating (micro-batches must be weighted one by one)."""
        if self.backward_passes_per_step > 1 and not self._hooks:
            self._hooks = [p.register_hook(self._make_weight_hook(i)) for i, p in enumerate(self._params)]
        elif self.backward_passes_per_step == 1:
            self.remove_hooks()

    def _make_weight_hook(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def weight(grad: torch.Tensor) -> torch.Tensor:
            planned, scale, _, _ = self._step_scale
            step = self.loader.current_step
            if step is not planned:
                planned, scale, _, _ = self._start_micro_step(step)
            # Accumulation: sums now, divided by the group's global count in synchronize().
            out = grad * scale
            if self.track_grad_norms:  # |local sum so far|^2; the last micro-batch's value is the group's
                acc = out if len(self._micro) == 1 else out + self._params[index].grad
                self.flat.put_sq_norm(index, acc)
            return out
        return weight

    def _start_micro_step(self, step: Any) -> tuple[Any, float, float, bool]:
        """First gradient of a loader step: its gradient factor and norm factor, computed once, and
        whether the factor is the same on every rank (equal counts, or a summed loss), so that one
        multiply of each flat buffer after the allreduce replaces one per parameter before it (not for
        gradients sent as float16, by compression or as the parameters' own type, where weighing first
        keeps the sum in range)."""
        if not self._micro:
            self._group_t0 = getattr(self.loader.tracker, "_t_request", time.perf_counter())
        self._micro.append(step)
        local, global_ = self._counts(step)
        self._micro_n.append((local, global_))
        mean = self.loss_reduction == "mean"
        unit = 1.0 if mean else 1.0 / max(local, 1) ** 2
        if self.backward_passes_per_step == 1 and not isinstance(global_, _PendingCount):
            scale = (local if mean else 1.0) / global_
        else:  # sums now, divided by the global count in synchronize()
            scale = float(local) if mean else 1.0
            if self.backward_passes_per_step > 1:
                unit = 1.0  # the hooks measure the accumulated sum: synchronize() divides by local_n**2
        after = False
        if self.backward_passes_per_step == 1 and self._exact_wire and not isinstance(global_, _PendingCount):
            units = step.counts if self.loss_unit == "samples" else step.tokens
            after = not mean or (units is not None and min(units) == max(units))
        self._step_scale = (step, scale, unit, after)
        return self._step_scale

    def _counts(self, step: Any) -> tuple[int, Any]:
        """What this rank's loss of `step` averages over, and the same for all ranks (an int, or the
        handle of the allreduce that sums the counts given to set_local_tokens())."""
        rank = self.loader.rank
        if self.loss_unit == "samples":
            return step.counts[rank], step.global_count
        if step.tokens is not None:
            return step.tokens[rank], sum(step.tokens)
        given, self._tokens_given = self._tokens_given, None
        if given is None:
            raise RuntimeError("loss_unit='tokens' without the loader's lengths=: call "
                               "optimizer.set_local_tokens(n) with this rank's valid-token count before "
                               "each backward()")
        return given

    def set_local_tokens(self, tokens: int) -> None:
        """This rank's valid-token count in the batch about to go through ``backward()`` (the tokens
        its loss averages over), for ``loss_unit="tokens"`` when the loader has no ``lengths=``.
        Starts one small allreduce of the global count; the update divides by it. Call it on every
        rank for every micro-batch (the same number of times everywhere)."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.item()
        if isinstance(tokens, bool) or not float(tokens).is_integer() or tokens < 0:
            raise ValueError(f"set_local_tokens({tokens!r}); give a whole number of tokens >= 0")
        if self.loss_unit != "tokens":
            raise RuntimeError(f"set_local_tokens() needs loss_unit='tokens' (it is {self.loss_unit!r})")
        if self.loader.lengths is not None:
            raise RuntimeError("the loader knows every sample's length (lengths=): the token counts come "
                               "from its plan, do not call set_local_tokens()")
        if self._tokens_given is not None:
            raise RuntimeError("set_local_tokens() called twice before backward()")
        count = torch.tensor([float(tokens)], dtype=torch.float64)
        handle = self._plane.allreduce_sum_async(count, f"dx.tokens.{self._token_seq}")
        self._token_seq += 1
        self._tokens_given = (int(tokens), _PendingCount(handle))

    def _planned_group(self) -> tuple[int, int]:
        """(local, global) size of the micro-batches since the last step, in the loader's unit."""
        units = [self.loader.units(s) for s in self._micro]
        return sum(u[self.loader.rank] for u in units), sum(sum(u) for u in units)

    def _global_known(self) -> bool:
        return not any(isinstance(g, _PendingCount) for _, g in self._micro_n)

    def _group_counts(self) -> tuple[int, int]:
        """(local, global) counts of the micro-batches since the last step, in the loss's unit."""
        local = sum(n for n, _ in self._micro_n)
        global_ = 0
        for i, (n, g) in enumerate(self._micro_n):
            if isinstance(g, _PendingCount):
                g = int(self._plane.wait(g.handle).item())
                self._micro_n[i] = (n, g)
            global_ += g
        return local, global_

    def _unsent(self) -> list[int]:
        """Parameters whose gradient the engine has not started to reduce in this step."""
        return self._reducer.unsent()

    def _agree_on_failures(self) -> list[int]:
        """The rare collective, run by every rank once the allreduced norm is not finite: per rank the
        samples of an out-of-memory failure in this step (0: none)."""
        status = torch.zeros(self.loader.world_size, dtype=torch.float64)
        status[self.loader.rank] = self._oom_samples
        self._oom_samples = 0
        return [int(v) for v in self._plane.allreduce_sum(status, "dx.step_status").tolist()]

    def _local_sq(self) -> torch.Tensor:
        """This step's local squared norms per parameter, in ``_pair[0]`` (float64; 0 where no gradient
        came, or without ``track_grad_norms``)."""
        local = self._local_row
        if not self.track_grad_norms:
            return local.zero_()
        if not self._local_in_pair:
            self.flat.slot_sq_norms(local)
        unit = self._step_scale[2]
        return local if unit == 1.0 else local.mul_(unit)

    def _clear_local(self) -> None:
        self.flat.clear_slots()
        self._local_in_pair = False
        self._step_scale = (None, 1.0, 1.0, False)
        self._preweighted = False

    # --- torch.optim.Optimizer surface -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state plus this wrapper's own (plain values under "dynamix")."""
        state = _inner(self, "state_dict")(self)
        state["dynamix"] = {"lr_gain": float(self.lr_gain), "skipped_steps": dict(self.skipped_steps),
                            "backward_passes_per_step": int(self.backward_passes_per_step),
                            "lr_coupling": self.lr_coupling.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        own = state_dict.pop("dynamix", None)  # absent in a plain torch optimizer's state
        self._reducer.reset(self.backward_passes_per_step)
        self._synced, self._micro, self._micro_n = None, [], []
        self._tokens_given = None
        self._clear_local()
        self._oom_samples = 0
        _inner(self, "load_state_dict")(self, state_dict)
        if own is not None:
            self.lr_gain = float(own["lr_gain"])
            self.skipped_steps = dict(own["skipped_steps"])
            if "lr_coupling" in own:  # absent in checkpoints from before progress accounting
                self.lr_coupling.load_state_dict(own["lr_coupling"])
            if "backward_passes_per_step" in own:  # absent in checkpoints from before accumulation decisions
                self.set_backward_passes_per_step(int(own["backward_passes_per_step"]))

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own state, which differs between ranks and so is not in ``state_dict()`` (a
        checkpoint holds one per rank): the per-parameter squared-norm sums since the controller last
        read them (`pop_layer_means`), as plain values."""
        return {"layer_sums": self._layer_sums.tolist(), "layer_steps": int(self._layer_steps)}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        sums = torch.tensor(state["layer_sums"], dtype=torch.float64, device=self._layer_sums.device)
        if sums.shape != self._layer_sums.shape:
            raise ValueError(f"per-parameter sums of shape {tuple(sums.shape)} for {len(self._params)} parameters")
        self._layer_sums.copy_(sums)
        self._layer_steps = int(state["layer_steps"])

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero all gradients in one kernel. `set_to_none` is ignored: gradients stay flat views."""
        if self._reducer.in_flight():
            raise RuntimeError("zero_grad() called after backward() but before step(): the gradient "
                               "allreduce is still running (or micro-batches are being accumulated); "
                               "call step() (or synchronize()) first")
        self.flat.zero()
        self._clear_local()
        self._micro, self._micro_n = [], []

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Micro-batches per optimizer step from the next step on (same value on every rank)."""
        _check_passes(passes)
        if self._micro:
            raise RuntimeError("set_backward_passes_per_step() between micro-batches; call it after step()")
        self.backward_passes_per_step = passes
        self._reducer.set_backward_passes_per_step(passes)
        self._update_hooks()

    @property
    def accumulating(self) -> bool:
        """True between the micro-batches of one optimizer step (some accumulated, step() not yet run)."""
        return bool(self._micro)

    def should_step(self) -> bool:
        """True once this step's micro-batches are all in: k of them, or the epoch's last ones."""
        # One pass per step: always (an engine without per-gradient hooks counts the micro-batch only
        # in synchronize(), after this is asked)
        return (self.backward_passes_per_step == 1 or len(self._micro) >= self.backward_passes_per_step
                or self.loader.steps_left == 0)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap forward+backward: an out-of-memory error becomes a redone step with a smaller batch.
        One raised after every gradient of the step went to Horovod is not caught: the update goes
        ahead, and the error is the caller's."""
        try:
            yield
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            unsent = self._unsent() if self._reducer.recovers_oom else []
            if not unsent:
                raise
            # NaN in what Horovod has yet to take (later micro-batches accumulate into NaN, too): every
            # rank's allreduced norm becomes NaN, which sends all of them to _agree_on_failures().
            # A gradient already in flight is Horovod's until synchronize(), so it is not touched.
            self.flat.attach()
            for i in unsent:
                self.flat.views[i].fill_(float("nan"))
            step = self.loader.current_step
            if not self._micro or self._micro[-1] is not step:  # failed before its first gradient
                self._start_micro_step(step)
            self._oom_samples = max(self._oom_samples, step.counts[self.loader.rank])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block uses the preceding ``synchronize()`` (Horovod's AMP pattern)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def synchronize(self) -> None:
        """Finish the allreduce and agree on failures; afterwards ``p.grad`` holds the global mean
        gradient (still multiplied by the loss scale under a GradScaler). Idempotent until step()."""
        if self._synced is not None:
            return
        tracker = self.loader.tracker
        tracker.step_started()
        if not self._engine_hooked:
            self._weigh_all()
        self._reducer.synchronize()
        # Horovod ends with p.grad.set_(decompressed): a compression that returns a new tensor moves
        # the views off the buffer (without one, each is set to itself)
        self.flat.attach(moved=not self._uncompressed)
        step, scale, _, after = self._step_scale
        if after and step is not None and scale != 1.0:  # the factor every rank shares, once, on the sum
            for buf in self.flat.buffers:
                buf.mul_(scale)
        tracker.synchronized()
        local_n = global_n = 0
        local_sq = self._local_sq()
        if self._micro and (self.backward_passes_per_step > 1 or not self._global_known()):
            local_n, global_n = self._group_counts()
            if global_n <= 0:
                raise RuntimeError(f"the step's global count is {global_n} {self.loss_unit}: some rank "
                                   "must give a batch with at least one valid token")
            for buf in self.flat.buffers:
                buf.mul_(1.0 / global_n)
            if self.backward_passes_per_step > 1:
                local_sq.div_(max(local_n, 1) ** 2)
        if self._preconditioner is not None:
            if self.flat.keeping:
                self._preconditioned_norms(local_n)
            else:  # a step that is not measured
                self._local_row.fill_(math.nan)
                self._global_pre_row.fill_(math.nan)
        self._synced = {"global_sq": self.flat.sq_norms(self._global_row), "local_sq": local_sq,
                        "local_n": local_n, "global_n": global_n}

    def _weigh_all(self) -> None:
        """What Horovod's compress() calls do parameter by parameter, for all gradients at once where
        Horovod calls none (one process): the local squared norms as `FlatGradients.sq_norms` takes
        them, the weight in one multiply per buffer."""
        self.flat.attach()
        if self.backward_passes_per_step != 1 or self._preweighted:
            return
        planned, scale, _, after = self._step_scale
        step = self.loader.current_step
        if step is not planned:
            planned, scale, _, after = self._start_micro_step(step)
        if self.track_grad_norms:
            if self.flat.weighted:  # the weights come after the allreduce: norms in _preconditioned_norms()
                if self.flat.keeping:
                    self.flat.keep_all_local()
            else:
                self.flat.sq_norms(self._local_row)
            self._local_in_pair = True
        if not after and scale != 1.0:
            for buf in self.flat.buffers:
                buf.mul_(scale)

    def _preconditioned_norms(self, local_n: int) -> None:
        """The squared norms the noise statistics use under an Adam-type optimizer, once the global
        gradient is final: Adam's weights for the coming step, then the local row (from the local
        gradients kept before the allreduce, in the unit `_local_sq` gives) and the global one."""
        t0 = time.perf_counter()
        scale = (float(self.grad_scaler.get_scale()) if self.grad_scaler is not None and self.grad_scaler.is_enabled()
                 else 1.0)
        self._preconditioner.weigh(scale)
        self.flat.sq_norms(self._global_pre_row, weighted=True)
        unit = self._step_scale[2]
        if self.backward_passes_per_step > 1 and self._micro:
            unit /= max(local_n, 1) ** 2
        self.flat.sq_norms(self._local_row, weighted=True, local=True)
        if unit != 1.0:
            self._local_row.mul_(unit)
        self._pre_cost_s = time.perf_counter() - t0

    def _schedule_preconditioned(self) -> None:
        """After a step: whether the next one takes the preconditioned norms (every rank alike: they
        count the same steps from the same `set_noise_every`)."""
        if self.flat.keeping:  # this step was measured
            self._pre_wait = self._pre_every
        self._pre_wait -= 1
        self.flat.keeping = self._pre_wait <= 0

    def noise_every_for(self, step_s: float) -> int:
        """Optimizer steps between two that take the noise statistics, for steps of `step_s` seconds:
        1 unless they are Adam's preconditioned norms, whose last measured cost decides
        (`precondition.every`)."""
        return precondition.every(self._pre_cost_s, step_s) if self._preconditioner is not None else 1

    def set_noise_every(self, every: int) -> None:
        """The next step takes the noise statistics, then every `every`-th step (a controller calls
        this at the same step on every rank, so they measure the same steps). Only Adam's
        preconditioned norms are ever left out; the others are taken on every step."""
        if int(every) != every or every < 1:
            raise ValueError(f"set_noise_every({every!r}): need an integer >= 1")
        self._pre_every, self._pre_wait = int(every), 0
        if self._preconditioner is not None:
            self.flat.keeping = True

    def _loss_scale(self) -> float:
        called_by_scaler = "found_inf" in vars(self)
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            if called_by_scaler:
                raise RuntimeError("a GradScaler is stepping this optimizer but it was not given one: pass "
                                   "grad_scaler=scaler to WeightedDistributedOptimizer (the gradient "
                                   "statistics must be unscaled)")
            return 1.0
        if not called_by_scaler:
            raise RuntimeError("grad_scaler was given: step through scaler.step(optimizer), not optimizer.step()")
        return float(self.grad_scaler.get_scale())

    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise ValueError("closures are not supported: they recompute gradients outside the "
                             "per-step weighting; call loss.backward() before step()")
        user_synced = self._synced is not None
        if not user_synced:
            if not self._should_synchronize:
                raise RuntimeError("step() inside skip_synchronize() needs optimizer.synchronize() first")
            if "found_inf" in vars(self) and not self._reducer.reduced_in_backward:
                raise RuntimeError("the GradScaler looked at the gradients before the allreduce finished: "
                                   "call optimizer.synchronize() before scaler.unscale_/scaler.step, then "
                                   "scaler.step(optimizer) inside optimizer.skip_synchronize()")
            self.synchronize()
        synced, self._synced = self._synced, None
        assert synced is not None
        tracker = self.loader.tracker
        scale = self._loss_scale()
        # [local, global, global preconditioned] squared norms per parameter
        pair = self._pair
        if scale != 1.0:
            pair.div_(scale**2)
        found_inf = vars(self).get("found_inf")
        # The one read-back of the step: the non-finite check needs the norm on the host.
        totals = torch.sum(pair, 1, out=self._totals)
        if found_inf is not None:
            totals = torch.cat([totals, found_inf.to(pair.device, torch.float64).reshape(1)])
        read = totals.tolist()
        local_total, grad_norm = read[0], read[1] ** 0.5
        # the noise statistics: the local norms with the global ones measured alike
        stat_row, global_total = (2, read[2]) if self._preconditioner is not None else (1, read[1])
        if not math.isfinite(grad_norm) or (found_inf is not None and read[3] > 0):
            failed = self._agree_on_failures()  # every rank is here: they all see the same norm
            if any(failed):
                group = list(self._micro)  # every micro-batch of the step is served again
                self._skip("oom", tracker, grad_norm)
                self.loader.redo_current_step(self.oom_handler(list(self.loader.batch_sizes), failed), group)
            else:
                self._skip("nonfinite", tracker, grad_norm)
            return
        if vars(self).get("grad_scale") is not None:  # the scaler left unscaling to us
            for buf in self.flat.buffers:
                buf.mul_(1.0 / scale)
        if self.track_grad_norms and (self._preconditioner is None or self.flat.keeping):
            self._layer_sums[0] += pair[0]
            self._layer_sums[1] += pair[stat_row]
            self._layer_steps += 1
        if self.max_grad_norm is not None:
            # The user may have clipped (or unscaled) between synchronize() and step(): measure again.
            norm = float(self.flat.sq_norms().sum()) ** 0.5 if user_synced else grad_norm
            clip = self.max_grad_norm / (norm + 1e-6)
            if clip < 1.0:
                for buf in self.flat.buffers:
                    buf.mul_(clip)
        lr = self._inner_step_at_scaled_lr()
        if self._preconditioner is not None:
            self._schedule_preconditioned()
        self.lr_coupling.commit()  # the step happened: progress += its factor, the warm-up moves on
        self.last_grad_norm = grad_norm
        self.last_status = "ok"
        extra: dict[str, Any] = {"lr": float(lr), "grad_norm": grad_norm}
        if self.track_grad_norms:
            extra["local_grad_sq"] = local_total
            extra["global_grad_sq"] = global_total
        if self.backward_passes_per_step > 1 and self._micro:
            step_s = time.perf_counter() - self._group_t0
            local_b, global_b = self._planned_group()
            extra.update(local_batch=local_b, global_batch=global_b, step_s=step_s,
                         samples_per_s=local_b / step_s if step_s > 0 else float("nan"),
                         micro_batches=len(self._micro))
        if self.loss_unit == "tokens" and synced["global_n"]:  # counts given to set_local_tokens()
            extra.update(local_tokens=synced["local_n"], global_tokens=synced["global_n"])
        self._micro, self._micro_n = [], []
        self._clear_local()
        tracker.step_finished(**extra)

    def _inner_step_at_scaled_lr(self) -> float:
        """Run the user's optimizer's step at the LR rule's factor (for this step only, so user LR
        schedulers compose) with the scaler's attributes hidden (the inner optimizer sees unscaled,
        finite gradients; a fused optimizer would otherwise unscale or skip a second time). Returns
        the first group's LR of the step."""
        batch = self.loader.global_micro_batch * self.backward_passes_per_step
        factor = self.lr_coupling.plan(self.lr_rule, batch, self.base_batch_size, self.lr_gain,
                                       math.ceil(self.loader.epoch_size / batch))
        groups = self.param_groups
        saved = [g["lr"] for g in groups]
        if factor != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * factor
        own = vars(self)
        hidden = {k: own.pop(k) for k in _HIDDEN_BY_SCALER if k in own}
        try:
            lr = groups[0]["lr"]
            self._inner_step(self)
        finally:
            own.update(hidden)
            for g, base in zip(groups, saved):  # the base LR, whatever the inner step did to it
                g["lr"] = base
        return lr

    def _skip(self, reason: str, tracker: Any, grad_norm: float) -> None:
        """Drop this step's gradients on every rank (all ranks reach the same verdict)."""
        group = {}
        if len(self._micro) > 1:  # the record covers every micro-batch of the skipped step
            local_b, global_b = self._planned_group()
            group = {"micro_batches": len(self._micro), "global_batch": global_b, "local_batch": local_b}
        self.flat.zero()
        self._clear_local()
        self._micro, self._micro_n = [], []
        self.last_status = reason
        self.skipped_steps[reason] += 1
        tracker.step_finished(status=reason, grad_norm=grad_norm, **group)

    def set_local_gradients(self, grads: Mapping[str, torch.Tensor], local: Mapping[str, int],
                            global_: Mapping[str, int]) -> None:
        """Use gradients computed outside ``backward()`` (e.g. DBA's selected-subset means) as this
        rank's contribution to the next ``step()``: ``grads[name]`` is this rank's mean gradient over
        ``local[name]`` samples, and the update is the mean over ``global_[name]`` samples of all
        ranks. No backward may run between this call and ``step()``."""
        if self.backward_passes_per_step != 1:
            raise RuntimeError("set_local_gradients() needs backward_passes_per_step=1 "
                               f"(it is {self.backward_passes_per_step})")
        self.flat.attach()
        for i, name in enumerate(self.param_names):
            view = self.flat.views[i]
            view.copy_(grads[name].reshape(view.shape) * (local[name] / global_[name]))
            if self.track_grad_norms:
                self.flat.put_sq_norm(i, grads[name])
        self._preweighted = True

    def pop_layer_means(self) -> tuple[list[float], list[float]] | None:
        """Mean per-parameter squared norms (local, global) since the last call, then reset."""
        if self._layer_steps == 0:
            return None
        local, global_ = (self._layer_sums / self._layer_steps).tolist()
        self._layer_sums.zero_()
        self._layer_steps = 0
        return local, global_

    @property
    def allreduce_bytes(self) -> int:
        """Bytes of gradient one optimizer step allreduces, as they travel: after the compression
        (``hvd.Compression.fp16`` halves float32 gradients). The same on every rank."""
        if self._allreduce_bytes is None:
            self._allreduce_bytes = sum(
                p.numel() * (p.element_size() if self._uncompressed else
                             self._compression.compress(torch.zeros(1, dtype=p.dtype))[0].element_size())
                for p in self._params)
        return self._allreduce_bytes

    def time_small_allreduce(self) -> float:
        """Seconds one single-value allreduce takes on this rank: the collective's latency, Horovod's
        negotiation cycle included. A collective: every rank calls it at the same point, between steps."""
        t0 = time.perf_counter()
        self._plane.allreduce_sum(torch.zeros(1), "dx.latency_probe")
        return time.perf_counter() - t0

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


@dataclass(frozen=True)
class _PendingCount:
    """The handle of the allreduce that sums the ranks' counts given to set_local_tokens()."""

    handle: int


def _check_passes(passes: Any) -> None:
    validate.integer("backward_passes_per_step", passes, 1)


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
