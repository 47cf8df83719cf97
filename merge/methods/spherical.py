"""Averages on the sphere after mergekit (karcher.py, nuslerp.py, multislerp.py): the Karcher mean,
NuSLERP and multi-SLERP of any number of tensors of one key; relative to a base, use a delta-space
recipe. Differences from mergekit: docs/merge-methods.md.
"""

from __future__ import annotations

import torch

from ..declare import AnySpace, Count, builtin_method
from ._util import model_weights

KARCHER = "https://en.wikipedia.org/wiki/Karcher_mean"
MULTISLERP = "https://goddard.blog/posts/multislerp-wow-what-a-cool-idea"
SLERP = "https://doi.org/10.1145/325165.325242"


@builtin_method(paper=KARCHER)
def karcher(*models: AnySpace, max_iter: Count = 10, tol: float = 1e-5) -> AnySpace:
    """Karcher (Riemannian) mean of the unit directions, scaled by the mean norm (mergekit's karcher)."""
    if len(models) == 1:
        return models[0]
    norms = [float(m.norm()) for m in models]
    units = [m.flatten() / n for m, n in zip(models, norms, strict=True) if n > tol]
    if not units:
        return torch.zeros_like(models[0])
    mean = sum(units) / len(units)
    mean_norm = float(mean.norm())
    u = units[0] if mean_norm < tol else mean / mean_norm
    for _ in range(max_iter):
        tangent = torch.zeros_like(u)
        for x in units:
            cos = torch.dot(u, x).clamp(-1.0, 1.0)
            angle = torch.arccos(cos)
            if float(angle) >= tol:  # the log map of x at u, averaged over the directions
                tangent += (angle / torch.sin(angle)) * (x - cos * u) / len(units)
        step = tangent.norm()
        if float(step) < tol:
            break
        u = torch.cos(step) * u + torch.sin(step) * tangent / step  # the exponential map back
        length = float(u.norm())
        if length > tol:
            u = u / length
    return (sum(norms) / len(models) * u).reshape(models[0].shape)


@builtin_method(paper=SLERP)
def nuslerp(a: AnySpace, b: AnySpace, *, alpha: float = 0.5, row_wise: bool = False,
            flatten: bool = True) -> AnySpace:
    """Slerp without norm interpolation, of the whole tensor (flatten) or per row / column (mergekit)."""
    shape = a.shape
    if flatten or a.dim() == 0:
        v0, v1 = a.reshape(1, -1), b.reshape(1, -1)
    else:
        v0, v1 = (a.transpose(0, -1), b.transpose(0, -1)) if row_wise else (a, b)
    u0 = v0 / v0.norm(dim=-1, keepdim=True).clamp(min=1e-7)
    u1 = v1 / v1.norm(dim=-1, keepdim=True).clamp(min=1e-7)
    angle = torch.arccos((u0 * u1).sum(dim=-1, keepdim=True).clamp(-1, 1))
    sin = torch.sin(angle)
    res = (torch.sin((1 - alpha) * angle) * v0 + torch.sin(alpha * angle) * v1) / sin
    res = torch.where(sin.abs() < 1e-8, torch.lerp(v0, v1, alpha), res)  # (anti)parallel rows: lerp
    if row_wise and not flatten and a.dim() > 0:
        res = res.transpose(0, -1)
    return res.reshape(shape)


@builtin_method(paper=MULTISLERP)
def multislerp(*models: AnySpace, weights: str = "", normalize_weights: bool = True,
               eps: float = 1e-8) -> AnySpace:
    """Weighted slerp of any number of tensors through the tangent space at their mean direction."""
    if len(models) == 1:
        return models[0]
    flat = torch.stack([m.flatten() for m in models])
    w = torch.tensor(model_weights(weights, len(models), "multislerp"), dtype=flat.dtype, device=flat.device)
    if normalize_weights:
        if float(w.sum()) == 0:
            raise ValueError(f"multislerp: weights={weights!r} sum to 0 and cannot be normalized; "
                             f"change a weight or set normalize_weights=false")
        w = w / w.sum()
    norms = flat.norm(dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * w[:, None]).sum(dim=0)
    mean_norm = mean.norm()
    if float(mean_norm) < eps:
        if len(models) == 2:
            return models[0] * w[0] + models[1] * w[1]
        raise ValueError("multislerp: the weighted directions cancel out (antipodal inputs with balancing "
                         f"weights={weights!r}); change the weights")
    mean = mean / mean_norm
    tangents = units - (units * mean).sum(dim=-1, keepdim=True) * mean
    step = (tangents * w[:, None]).sum(dim=0)
    length = step.norm() + eps
    res = mean * torch.cos(length) + step * (torch.sin(length) / length)
    return (res * (norms.squeeze(-1) * w).sum()).reshape(models[0].shape)
