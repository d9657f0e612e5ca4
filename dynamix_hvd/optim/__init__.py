"""The optimizer plane: the only code that writes ``p.grad`` (checked by tests/test_contracts.py).

Owns the weighted distributed optimizer (`weighted`: local gradients scaled by b_i/B before Horovod's
Sum allreduce, so every update is the exact mean over all ranks' samples; clipping; the per-step
gradient norms the statistics need, read from the flat gradient buffers of `flat`), the learning-rate rules for a changing global batch
and their warm-up (`lr_scaling`; AdaScale by default), LR schedules driven by scale-invariant
progress (`progress`) and `grads.assign_gradients` for callers that compute their own update (DBA). May
import torch, Horovod (lazily, in `weighted`), `data` and `stats`; never mpi4py, `comm` or `control`.
"""
