"""Writing gradients computed outside ``backward()`` into ``p.grad`` (the optimizer plane's job).

Code that computes its own update direction (e.g. DBA's selected-subset means) hands it here rather
than assigning ``p.grad`` itself, so that the optimizer plane stays the only writer of gradients.
"""
from __future__ import annotations

from typing import Mapping

import torch


def assign_gradients(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]) -> None:
    """Set ``params[name].grad`` to ``grads[name]`` for every name in ``grads``.

    An existing gradient tensor is written in place, so gradients kept as views of a flat buffer stay
    views; a missing one gets a detached copy. A name that is not a parameter, or a shape that differs
    from the parameter's, raises ValueError naming it.
    """
    for name, g in grads.items():
        if name not in params:
            raise ValueError(f"gradient for {name!r}, which is not one of the parameters")
        p = params[name]
        if g.shape != p.shape:
            raise ValueError(f"gradient for {name!r} has shape {tuple(g.shape)}, the parameter {tuple(p.shape)}")
        if p.grad is None:
            p.grad = g.detach().clone()
        else:
            p.grad.copy_(g)
