"""Dynamic Batch Adaptation (arXiv 2208.00815): per-step selection of the samples whose per-sample
gradients best improve a metric (`selection`, one process), and its exact data-parallel form over
Horovod (`distributed`). Per-sample Gram matrices come from layer hooks (`ghost`) or torch.func; the
unbiased importance draws are in `importance`, the compiled greedy search in `fastgreedy` (numba).
Only `distributed` talks to other ranks (through `comm`); gradients are written through `dynamix_hvd.optim.grads` (the
optimizer plane is the only writer of ``p.grad``).
"""
