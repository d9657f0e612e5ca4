"""Per-sample gradient Gram matrices from forward/backward hooks, without per-sample gradients.

For a linear layer ``z = a W^T + b`` the gradient of sample i is ``G_i^T A_i`` (``A_i`` [T, in]: its
inputs at the T positions, ``G_i`` [T, out]: the gradients of its loss with respect to the outputs;
T = 1 for plain vectors). Inner products between samples therefore follow from activations and output
gradients alone (the "ghost norm" of Goodfellow 2015, Opacus, Li et al. 2022):

    <dW_i, dW_j> = sum_{t,s} (G_it . G_js) (A_it . A_js)      T = 1:  K_W = (G G^T) * (A A^T)
    <db_i, db_j> = (sum_t G_it) . (sum_s G_js)

A Conv2d is the same layer applied at every output position after ``F.unfold`` (``A_i`` = the
unfolded patches [P, C*kh*kw]). Per layer the cheaper of two exact routes is taken: the ghost form
(``n^2 T^2 (in + out)`` flops) or materialising that layer's per-sample weight gradients with one
einsum (``n T in out`` flops, then ``n^2 in out`` for the Gram), which wins for convolutions with many
positions and few channels. Either way no full per-sample gradient of the model is built, only one
forward and one backward to the layer outputs (``torch.autograd.grad``; the parameter gradients are
never computed), and the weighted gradient ``sum_i w_i g_i`` of any per-sample weights comes from the
same stored tensors.

Requirements: every trainable parameter is the weight or bias of a ``Linear`` or ``Conv2d``
(``groups=1``, zero padding) used once per forward, and ``loss_fn`` returns the *mean* of per-sample
losses over the batch (``F.cross_entropy`` does). `supported` says why a model does not qualify.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _module_of(model: nn.Module, group: list[str]) -> tuple[str, nn.Module]:
    prefix = group[0].rsplit(".", 1)[0] if "." in group[0] else ""
    return prefix, model.get_submodule(prefix)


def supported(model: nn.Module, groups: list[list[str]]) -> str | None:
    """None if the hook engine handles every layer group, else the reason it does not."""
    for group in groups:
        prefix, module = _module_of(model, group)
        leaves = {n.rsplit(".", 1)[-1] for n in group}
        if not isinstance(module, (nn.Linear, nn.Conv2d)) or not leaves <= {"weight", "bias"}:
            return f"parameters {group} are not the weight/bias of a Linear or Conv2d"
        if isinstance(module, nn.Conv2d):
            if module.groups != 1 or module.padding_mode != "zeros" or module.padding == "same":
                return f"Conv2d {prefix!r} has groups/padding the hooks do not support"
    return None


@dataclass
class _Layer:
    """What one hooked module saw: inputs A [n, T, in] and per-sample output gradients G [n, T, out]."""

    module: nn.Module
    a: torch.Tensor | None = None
    out: torch.Tensor | None = None
    calls: int = 0
    g: torch.Tensor | None = None
    per_sample: torch.Tensor | None = None  # [n, out, in] when materialised

    def unfolded(self) -> None:
        """Bring A and G to [n, T, features]; pick the cheaper exact route for this layer."""
        m, a, g = self.module, self.a, self.g
        assert a is not None and g is not None
        n = a.shape[0]
        if isinstance(m, nn.Conv2d):
            padding = 0 if m.padding == "valid" else m.padding
            a = F.unfold(a, m.kernel_size, dilation=m.dilation, padding=padding, stride=m.stride)
            self.a, self.g = a.transpose(1, 2), g.flatten(2).transpose(1, 2)
        else:
            self.a, self.g = a.reshape(n, -1, a.shape[-1]), g.reshape(n, -1, g.shape[-1])
        t, d_in, d_out = self.a.shape[1], self.a.shape[2], self.g.shape[2]
        if t > 1 and t * t * (d_in + d_out) > d_in * d_out:
            self.per_sample = torch.einsum("nto,nti->noi", self.g, self.a)

    def gram(self, leaves: set[str]) -> torch.Tensor:
        """float64 [n, n] Gram of this layer's per-sample gradients over the named leaves."""
        assert self.a is not None and self.g is not None
        a, g = self.a, self.g
        total = torch.zeros(a.shape[0], a.shape[0], dtype=torch.float64, device=a.device)
        if "weight" in leaves:
            if self.per_sample is not None:
                flat = self.per_sample.flatten(1)
                total += (flat @ flat.T).double()
            elif a.shape[1] == 1:
                total += (g[:, 0] @ g[:, 0].T).double() * (a[:, 0] @ a[:, 0].T).double()
            else:
                gg = torch.einsum("nto,mso->nmts", g, g).double()
                total += (gg * torch.einsum("nti,msi->nmts", a, a).double()).sum((2, 3))
        if "bias" in leaves:
            gb = g.sum(1)
            total += (gb @ gb.T).double()
        return total

    def weighted(self, leaf: str, w: torch.Tensor) -> torch.Tensor:
        """``sum_i w_i g_i`` for the leaf ("weight" or "bias"), shaped like the parameter."""
        assert self.a is not None and self.g is not None
        w = w.to(self.g.dtype)
        if leaf == "bias":
            return torch.einsum("n,nto->o", w, self.g)
        shape = self.module.weight.shape
        if self.per_sample is not None:
            return torch.tensordot(w, self.per_sample, dims=1).reshape(shape)
        gw = (self.g * w[:, None, None]).flatten(0, 1)
        return (gw.T @ self.a.flatten(0, 1)).reshape(shape)


@dataclass
class GhostStats:
    """Per-layer Gram matrices of a batch, and the weighted gradient of any per-sample weights."""

    gram: torch.Tensor
    """float64 [layers, n, n]."""
    loss: torch.Tensor
    """Mean loss over the batch (detached)."""
    layers: list[tuple[_Layer, list[tuple[str, str]]]]

    def weighted_grads(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: sum_i weights[l, i] g_i}`` with each parameter's layer row l of ``weights`` [L, n]."""
        out = {}
        for (layer, names), w in zip(self.layers, weights):
            for name, leaf in names:
                out[name] = layer.weighted(leaf, w)
        return out


def ghost_stats(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                groups: list[list[str]]) -> GhostStats:
    """One forward, one backward to the layer outputs, and the per-layer Gram matrices."""
    seen: dict[int, _Layer] = {}
    plan = []
    for group in groups:
        _, module = _module_of(model, group)
        layer = seen.setdefault(id(module), _Layer(module))
        plan.append((layer, [(n, n.rsplit(".", 1)[-1]) for n in group]))

    def hook(layer: _Layer) -> Callable:
        def save(_m: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            layer.calls += 1
            layer.a, layer.out = inputs[0].detach(), output
        return save

    handles = [layer.module.register_forward_hook(hook(layer)) for layer in seen.values()]
    try:
        loss = loss_fn(model(x), y)
    finally:
        for h in handles:
            h.remove()
    layers = list(seen.values())
    for layer in layers:
        if layer.calls != 1:
            raise RuntimeError(f"{type(layer.module).__name__} ran {layer.calls} times in one forward; the "
                               "hook engine needs each layer once (use DBAConfig(engine='func'))")
    outs = torch.autograd.grad(loss, [layer.out for layer in layers], allow_unused=True)
    n = x.shape[0]
    for layer, go in zip(layers, outs):
        assert layer.out is not None
        layer.g = (go if go is not None else torch.zeros_like(layer.out)).detach() * n
        layer.out = None
        layer.unfolded()
    gram = torch.stack([layer.gram({leaf for _, leaf in names}) for layer, names in plan])
    return GhostStats(gram, loss.detach(), plan)
