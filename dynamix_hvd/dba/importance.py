"""DBA's unbiased variant: keep samples at random with probability growing with their gradient norm.

Sample i of n is kept with probability ``p_i`` and, if kept, weighted ``1 / (n p_i)``, so the update

    u = (1/n) sum_{i kept} g_i / p_i,        E[u] = (1/n) sum_i g_i = m_B

is an unbiased estimate of the full-batch mean gradient whatever the p_i are: the selection can drop
easy samples but cannot tilt the update towards them. Its noise (Poisson sampling) is

    E|u - m_B|^2 = (1/n^2) sum_i (1/p_i - 1) |g_i|^2,

which for a given expected size ``sum_i p_i`` is smallest with ``p_i`` proportional to ``|g_i|``
(Alain et al. 2015; Katharopoulos & Fleuret 2018). Size rule: ``p_i = min(1, c |g_i|)`` with

    c = sum_i |g_i| / (n^2 tau^2 |m_B|^2 + sum_i |g_i|^2),

the smallest c for which the unclipped noise equals ``tau^2 |m_B|^2`` (``tau = DBAConfig.max_noise``);
clipping at 1 only removes noise, so the update's relative error ``|u - m_B| / |m_B|`` has RMS at most
tau. The batch keeps about ``sum_i p_i`` samples: few when the gradients agree (|m_B| large), nearly
all when they cancel. Everything comes from the Gram diagonal and sum (|g_i|^2, n^2 |m_B|^2).
"""
from __future__ import annotations

import torch


def importance_weights(gram: torch.Tensor, max_noise: float, shared: bool, uniform: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample weights [L, n] (0 for dropped samples) and the bound on the relative RMS error [L].

    ``gram`` is [L, n, n]; ``shared`` uses one keep probability per sample for all layers (norms and
    means summed over layers); ``uniform`` [n] in [0, 1) is the random draw, shared by the layers.
    """
    L, n, _ = gram.shape
    norm2 = gram.diagonal(0, 1, 2).clamp_min(0.0)            # [L, n] |g_i|^2
    total2 = gram.sum((1, 2)).clamp_min(0.0)                  # [L] n^2 |m_B|^2
    if shared:
        norm2, total2 = norm2.sum(0, keepdim=True), total2.sum(0, keepdim=True)
    norm = norm2.sqrt()
    c = norm.sum(1) / (max_noise**2 * total2 + norm2.sum(1)).clamp_min(torch.finfo(gram.dtype).tiny)
    p = (c[:, None] * norm).clamp(max=1.0)                    # [L or 1, n]
    keep = uniform.to(p.device, p.dtype)[None] < p
    weights = torch.where(keep, 1.0 / (n * p.clamp_min(torch.finfo(gram.dtype).tiny)), torch.zeros_like(p))
    noise2 = ((1.0 / p.clamp_min(torch.finfo(gram.dtype).tiny) - 1.0) * norm2).where(p > 0, 0.0).sum(1)
    bound = (noise2 / total2.clamp_min(torch.finfo(gram.dtype).tiny)).sqrt()
    return weights.expand(L, n), bound.expand(L)
