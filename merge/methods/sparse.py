"""Sparsified task arithmetic after mergekit (sparsify.py, generalized_task_arithmetic.py, sce.py): Model
Breadcrumbs, DELLA and SCE, deltas in, a delta out (add it with ``add_difference``); per-model weights
are one comma-separated string. Differences from mergekit: docs/merge-methods.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..context import KeyContext
from ..declare import Delta, Fraction, builtin_method
from ._util import generator, model_weights

BREADCRUMBS = "https://arxiv.org/abs/2312.06795"
DELLA = "https://arxiv.org/abs/2406.11617"
SCE = "https://arxiv.org/abs/2408.07990"


@builtin_method(paper=BREADCRUMBS)
def breadcrumbs(*deltas: Delta, weights: str = "", density: Fraction = 0.9, gamma: Fraction = 0.01,
                normalize: bool = False, rescale: bool = False) -> Delta:
    """Model Breadcrumbs: drop each delta's largest (gamma) and smallest entries, keep density; sum."""
    kept = [_rescaled(d, breadcrumbs_mask(d, density, gamma), rescale) for d in deltas]
    return task_arithmetic(kept, model_weights(weights, len(deltas), "breadcrumbs"), False, normalize)


@builtin_method(paper=BREADCRUMBS)
def breadcrumbs_ties(*deltas: Delta, weights: str = "", density: Fraction = 0.9, gamma: Fraction = 0.01,
                     normalize: bool = False, rescale: bool = False) -> Delta:
    """Model Breadcrumbs, then TIES' sign election: only entries agreeing with the weighted-sum sign count."""
    kept = [_rescaled(d, breadcrumbs_mask(d, density, gamma), rescale) for d in deltas]
    return task_arithmetic(kept, model_weights(weights, len(deltas), "breadcrumbs_ties"), True, normalize)


@builtin_method(paper=DELLA, random=True)
def della_linear(*deltas: Delta, weights: str = "", density: Fraction = 0.5, epsilon: Fraction = 0.15,
                 normalize: bool = False, rescale: bool = True, seed: int | None = None,
                 ctx: KeyContext) -> Delta:
    """DELLA (mergekit's della_linear): drop entries with a per-row, magnitude-ranked chance; weighted sum."""
    gen = generator(ctx, seed, deltas[0].device)
    kept = [_rescaled(d, della_mask(d, density, epsilon, gen), rescale) for d in deltas]
    return task_arithmetic(kept, model_weights(weights, len(deltas), "della_linear"), False, normalize)


@builtin_method(paper=DELLA, random=True)
def della(*deltas: Delta, weights: str = "", density: Fraction = 0.5, epsilon: Fraction = 0.15,
          normalize: bool = True, rescale: bool = True, seed: int | None = None, ctx: KeyContext) -> Delta:
    """DELLA with TIES' sign election (mergekit's della): magnitude-ranked dropout, elect, weighted mean."""
    gen = generator(ctx, seed, deltas[0].device)
    kept = [_rescaled(d, della_mask(d, density, epsilon, gen), rescale) for d in deltas]
    return task_arithmetic(kept, model_weights(weights, len(deltas), "della"), True, normalize)


@builtin_method(paper=SCE)
def sce(*deltas: Delta, select_topk: Fraction = 1.0) -> Delta:
    """SCE: keep the entries the deltas vary most on, weight deltas by energy, erase minority signs, mean."""
    stacked = torch.stack(deltas)
    if select_topk < 1:
        stacked = stacked * sce_mask(stacked, select_topk)
    energy = stacked.pow(2).flatten(start_dim=1).mean(dim=1)
    total = float(energy.sum())
    w = energy / total if total > 0 else torch.full_like(energy, 1 / len(deltas))
    w = w.reshape(-1, *[1] * (stacked.dim() - 1)) * _majority(stacked)
    return (stacked * w).sum(dim=0) / w.sum(dim=0).clamp(min=1e-6)


def breadcrumbs_mask(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Keep ``density`` of the entries: drop the ``gamma`` largest magnitudes, then the smallest."""
    if density >= 1:
        return torch.ones_like(delta)
    total = delta.numel()
    top = int(gamma * total)
    bottom = total - int(density * total) - top
    if bottom < 0:  # the outliers and the density together exceed the tensor: drop fewer outliers
        top, bottom = top + bottom, 0
    order = torch.argsort(delta.abs().flatten())
    mask = torch.zeros(total, dtype=delta.dtype, device=delta.device)
    mask[order[bottom:total - top]] = 1
    return mask.reshape(delta.shape)


def della_mask(delta: torch.Tensor, density: float, epsilon: float, gen: torch.Generator) -> torch.Tensor:
    """MAGPRUNE: keep each entry with probability density -+ epsilon, by its magnitude rank in its row."""
    if density >= 1:
        return torch.ones_like(delta)
    if density <= 0:
        return torch.zeros_like(delta)
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise ValueError(f"DELLA: density={density:g} +- epsilon={epsilon:g} leaves (0, 1); "
                         f"lower epsilon below {min(density, 1 - density):g} or move density towards 0.5")
    rows = delta.reshape(delta.shape[0], -1) if delta.dim() >= 2 else delta.reshape(1, -1)
    ranks = torch.argsort(torch.argsort(rows.abs(), dim=1), dim=1).to(delta.dtype)
    spread = ranks / max(rows.shape[1] - 1, 1) if rows.shape[1] > 1 else torch.full_like(rows, 0.5)
    probability = (density - epsilon) + spread * 2 * epsilon
    return torch.bernoulli(probability, generator=gen).reshape(delta.shape)


def sce_mask(stacked: torch.Tensor, density: float) -> torch.Tensor:
    """1 on the ``density`` share of the varying entries with the largest variance across models."""
    if density <= 0:
        return torch.zeros_like(stacked[0])
    variance = stacked.var(dim=0, unbiased=False)
    k = int(int(torch.count_nonzero(variance)) * density)
    mask = torch.zeros(variance.numel(), dtype=stacked.dtype, device=stacked.device)
    if k:
        mask[torch.topk(variance.flatten(), k).indices] = 1
    return mask.reshape(variance.shape)


def task_arithmetic(deltas: Sequence[torch.Tensor], weights: Sequence[float], elect: bool,
                    normalize: bool) -> torch.Tensor:
    """sum(w_i d_i), optionally only where d_i's sign agrees with the elected one, optionally / sum(w_i)."""
    stacked = torch.stack(list(deltas))
    w = torch.tensor(weights, dtype=stacked.dtype, device=stacked.device)
    w = w.reshape(-1, *[1] * (stacked.dim() - 1))
    weighted = stacked * w
    if elect:
        agree = _majority(weighted)
        mixed, divisor = (weighted * agree).sum(dim=0), (w * agree).sum(dim=0)
        divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    else:
        mixed, divisor = weighted.sum(dim=0), w.sum(dim=0)
        divisor = torch.where(divisor.abs() < 1e-8, torch.ones_like(divisor), divisor)
    return mixed / divisor if normalize else mixed


def _majority(stacked: torch.Tensor) -> torch.Tensor:
    """1 where an entry's sign equals the sign of the sum over models (ties count as +), else 0."""
    elected = torch.where(stacked.sum(dim=0) >= 0, 1.0, -1.0).to(stacked.dtype)
    return (stacked.sign() == elected).to(stacked.dtype)


def _rescaled(delta: torch.Tensor, mask: torch.Tensor, rescale: bool, eps: float = 1e-7) -> torch.Tensor:
    """``delta * mask``, scaled back to the delta's L1 norm when ``rescale``."""
    kept = delta * mask
    if not rescale:
        return kept
    before, after = float(delta.abs().sum()), float(kept.abs().sum())
    return kept if before < eps or after < eps else kept * (before / after)
