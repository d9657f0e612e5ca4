"""The greedy elimination of `selection._greedy` as one compiled loop (numba), for CPU Gram matrices.

The torch version issues some fifty small tensor operations per removed sample; on a batch of 32 that
is most of a DBA step. This kernel does the same arithmetic (same formulas, same first-index tie
break) in a few microseconds. `greedy` returns None when numba is not installed, and the caller then
uses the torch loop (also the path for GPU tensors).
"""
from __future__ import annotations

import math

import numpy as np
import torch

try:
    from numba import njit
except ImportError:  # numba is a declared dependency; the torch loop stays correct without it
    njit = None


def _kernel(gram, diag, full_c, base, variance, model, min_cosine, steps):  # pragma: no cover - compiled
    L, n = diag.shape
    tiny = 2.2250738585072014e-308
    w = np.ones((L, n), dtype=np.bool_)
    c = full_c.copy()
    s2_full = full_c.sum(axis=1)
    s2, q, t = s2_full.copy(), diag.sum(axis=1), s2_full.copy()
    size = np.full(L, float(n))
    active = np.ones(L, dtype=np.bool_)
    path = np.full((steps, L), np.inf)
    order = np.zeros((steps, L), dtype=np.int64)
    scores = np.empty((L, n))
    taken = 0
    for step in range(steps):
        for l in range(L):
            k = size[l] - 1.0
            for j in range(n):
                if not w[l, j]:
                    scores[l, j] = np.inf
                    continue
                s2n = s2[l] - 2.0 * c[l, j] + diag[l, j]
                spread = max(q[l] - diag[l, j] - s2n / k, 0.0)
                value = spread / max(k * (k - 1.0), 1.0)
                if not variance:
                    value = value / max(s2n / (k * k), tiny)
                value = value / base[l]
                if not math.isnan(min_cosine):
                    if t[l] - full_c[l, j] < min_cosine * max(math.sqrt(max(s2n, 0.0) * s2_full[l]), tiny):
                        value = np.inf
                scores[l, j] = value
        any_active = False
        if model:
            best_j, best = 0, np.inf
            for j in range(n):
                m = 0.0
                for l in range(L):
                    m += scores[l, j]
                m /= L
                if m < best:
                    best_j, best = j, m
            for l in range(L):
                active[l] = active[l] and best < np.inf
                order[step, l] = best_j
        else:
            for l in range(L):
                best_j, best = 0, np.inf
                for j in range(n):
                    if scores[l, j] < best:
                        best_j, best = j, scores[l, j]
                active[l] = active[l] and best < np.inf
                order[step, l] = best_j
        for l in range(L):
            any_active = any_active or active[l]
        if not any_active:
            break
        taken += 1
        for l in range(L):
            if not active[l]:
                order[step, l] = 0
                continue
            j = order[step, l]
            path[step, l] = scores[l, j]
            w[l, j] = False
            for i in range(n):
                c[l, i] -= gram[l, i, j]
            s2[l] = s2[l] - 2.0 * c[l, j] - diag[l, j]
            q[l] -= diag[l, j]
            t[l] -= full_c[l, j]
            size[l] -= 1.0
    return path[:taken], order[:taken]


_compiled = njit(cache=True)(_kernel) if njit is not None else None


def greedy(gram: torch.Tensor, diag: torch.Tensor, full_c: torch.Tensor, base: torch.Tensor, variance: bool,
           model: bool, min_cosine: float | None, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """(relative metric after each removal [steps, L], removals) or None without numba / on GPU."""
    if _compiled is None or gram.device.type != "cpu" or gram.dtype != torch.float64:
        return None
    as_np = lambda t: np.ascontiguousarray(t.detach().numpy())  # noqa: E731
    path, order = _compiled(as_np(gram), as_np(diag), as_np(full_c), as_np(base), variance, model,
                            math.nan if min_cosine is None else float(min_cosine), steps)
    return torch.from_numpy(path), list(torch.from_numpy(order))
