"""TIES merging (with DARE / DELLA dropout), Model Stock and the geometric median of deltas."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..context import KeyContext
from ..declare import AnySpace, Delta, Fraction, builtin_method
from ._util import generator, is_close, kth_smallest_magnitude

TIES = "https://arxiv.org/abs/2306.01708"
DARE = "https://arxiv.org/abs/2311.03099"
MODEL_STOCK = "https://arxiv.org/abs/2403.19522"
GEOMETRIC_MEDIAN = "https://arxiv.org/abs/1912.13445"


@builtin_method(paper=TIES)
def ties_sum(*models: Delta, k: Fraction = 1.0, vote_sgn: bool = False) -> Delta:
    """TIES: keep each delta's top-k magnitudes, elect a sign, average the agreeing entries."""
    if models[0].numel() == 0:
        return models[0]
    if not any(bool(m.any()) for m in models):  # no delta at all (a text encoder the fine-tunes left alone):
        return torch.zeros_like(models[0])  # what the vote gives (0 / n), without sorting zeros
    filtered, counts = ties_sum_deltas(models, k, vote_sgn)
    return torch.nan_to_num(filtered.sum(dim=0) / counts, nan=0, posinf=0, neginf=0)


@builtin_method(paper=TIES)
def ties_sum_extended(*models: Delta, k: Fraction = 0.2, vote_sgn: bool = False, apply_stock: bool = False,
                      apply_median: bool = False, cos_eps: float = 1e-6, eps: float = 1e-6,
                      maxiter: int = 100, ftol: float = 1e-20) -> Delta:
    """TIES with the agreeing entries combined by Model Stock (default) or the geometric median."""
    if models[0].numel() == 0:
        return models[0]
    return _ties_extended(models, k, vote_sgn, apply_stock, apply_median, cos_eps, eps, maxiter, ftol)


@builtin_method(paper=DARE, random=True)
def ties_sum_with_dropout(*deltas: Delta, probability: Fraction = 0.9, della_eps: float = 0.0,
                          rescale: bool = True, k: Fraction = 0.2, vote_sgn: bool = False,
                          apply_stock: bool = False, cos_eps: float = 1e-6, apply_median: bool = False,
                          eps: float = 1e-6, maxiter: int = 100, ftol: float = 1e-20,
                          seed: int | None = None, ctx: KeyContext) -> Delta:
    """DARE (della_eps=0) or DELLA: drop entries with probability p, then TIES, then rescale by 1/(1-p)."""
    if is_close(probability, 1.0):
        return torch.zeros_like(deltas[0])
    gen = generator(ctx, seed, deltas[0].device)
    dropped = [d * della_dropout_mask(d, probability, della_eps, gen) for d in deltas]
    res = _ties_extended(dropped, k, vote_sgn, apply_stock, apply_median, cos_eps, eps, maxiter, ftol)
    return res / (1.0 - probability) if rescale else res


@builtin_method(paper=MODEL_STOCK)
def model_stock(*deltas: Delta, cos_eps: float = 1e-6) -> Delta:
    """Model Stock: the mean delta scaled by t = n cos / (1 + (n - 1) cos) of neighbouring deltas.

    A convolution counts as its [out, in * kh * kw] matrix, a single value as the mean (``model_stock_t``)."""
    return torch.nan_to_num(model_stock_t(deltas, cos_eps) * (sum(deltas) / len(deltas)))


@builtin_method(paper=GEOMETRIC_MEDIAN)
def geometric_median(*models: AnySpace, eps: float = 1e-6, maxiter: int = 100,
                     ftol: float = 1e-20) -> AnySpace:
    """The geometric median of the tensors by Weiszfeld iterations (robust to an outlier model)."""
    return _geometric_median(models, eps, maxiter, ftol)


def filter_top_k(a: torch.Tensor, k: float) -> torch.Tensor:
    """``a`` with all but its largest ``k`` fraction of magnitudes zeroed (ties kept)."""
    kth = max(int((1 - k) * a.numel()), 1)
    k_value = kth_smallest_magnitude(a, kth)
    return a * (a.abs() >= k_value).float()


def ties_sum_deltas(models: Sequence[torch.Tensor], k: float,
                    vote_sgn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-model deltas kept by trim + sign election, number of kept entries per element)."""
    deltas = torch.stack([filter_top_k(m, k) for m in models], dim=0)
    signs = torch.sign(deltas)
    final_sign = torch.sign(torch.sum(deltas if vote_sgn else signs, dim=0))
    kept = (signs == final_sign).float()
    return deltas * kept, kept.sum(dim=0)


def model_stock_t(deltas: Sequence[torch.Tensor], cos_eps: float) -> torch.Tensor | float:
    """Model Stock's interpolation ratio ``t = n cos / (1 + (n - 1) cos)``, ``cos`` the mean cosine of
    consecutive deltas per output unit: each row of a linear's matrix, as sd-mecha computes it.

    Where sd-mecha differs (it takes the cosine over the last dimension whatever the tensor): trailing
    dimensions of size 1 are dropped, and a tensor of three or more dimensions (a convolution kernel
    ``[out, in, kh, kw]``) is taken as its ``[out, in * kh * kw]`` matrix, one vector per output filter,
    as a linear has one per output row. sd-mecha's cosine over a kernel row has 3 values in a 3x3 conv,
    so two deltas can point almost opposite ways and ``t`` grows without bound, and 1 value in a 1x1
    conv (a sign: where two deltas differ in sign ``t = -inf``, written out as +-3.4e38). A tensor with
    a single value has no angle: ``t = 1``, the mean delta."""
    shape = deltas[0].shape
    kept = len(shape)
    while kept > 0 and shape[kept - 1] == 1:
        kept -= 1
    if kept == 0 or math.prod(shape) <= 1:
        return 1.0
    rows = (shape[0], math.prod(shape[1:kept])) if kept >= 3 else tuple(shape[:kept])
    n = len(deltas)
    cos = torch.nn.CosineSimilarity(dim=-1, eps=cos_eps)
    flat = [d.reshape(rows) for d in deltas]
    cos_theta = torch.stack([cos(flat[i], flat[i + 1]) for i in range(n - 1)]).mean(dim=0)
    t = n * cos_theta / (1 + (n - 1) * cos_theta)
    return t.reshape(*rows[:-1], *([1] * (len(shape) - len(rows) + 1)))


def della_dropout_mask(delta: torch.Tensor, probability: float | torch.Tensor, della_eps: float,
                       gen: torch.Generator) -> torch.Tensor:
    """Bernoulli keep-mask with keep probability 1 - p, shifted by magnitude rank for DELLA."""
    shift: torch.Tensor | float = 0.0
    if not math.isclose(della_eps, 0.0):
        order = torch.argsort(delta.abs().flatten(), stable=True)
        ranks = torch.empty_like(order)
        ranks[order] = torch.arange(1, order.numel() + 1, device=order.device)
        ne = delta.numel()
        shift = ((ranks.reshape(delta.shape) / ne - (ne + 1) / (ne * 2)) * della_eps).nan_to_num(
            nan=0, posinf=0, neginf=0)
    keep = (torch.ones_like(delta) - probability + shift).clamp(min=0, max=1)
    return torch.bernoulli(keep, generator=gen)


def _ties_extended(models: Sequence[torch.Tensor], k: float, vote_sgn: bool, apply_stock: bool,
                   apply_median: bool, cos_eps: float, eps: float, maxiter: int, ftol: float) -> torch.Tensor:
    filtered, counts = ties_sum_deltas(models, k, vote_sgn)
    if apply_median:
        res = _geometric_median(tuple(filtered), eps, maxiter, ftol)
    else:
        t = 1.0 if apply_stock else model_stock_t(filtered, cos_eps)
        res = filtered.sum(dim=0) * t / counts
    return torch.nan_to_num(res, nan=0, posinf=0, neginf=0)


def _weighted_average(points: Sequence[torch.Tensor], weights: torch.Tensor | None = None) -> torch.Tensor:
    if weights is None:
        return sum(points) / len(points)
    return sum(p * weights[i] for i, p in enumerate(points)) / sum(weights)


def _geometric_median(models: Sequence[torch.Tensor], eps: float, maxiter: int, ftol: float) -> torch.Tensor:
    median = _weighted_average(models)
    weights = new_weights = torch.ones(len(models), device=models[0].device, dtype=models[0].dtype)
    objective = torch.mean(torch.stack([torch.dist(p, median) for p in models]) * weights)
    for _ in range(max(0, maxiter)):
        previous = objective
        distances = torch.stack([torch.dist(p, median) for p in models])
        new_weights = weights / torch.clamp(distances, min=eps)
        median = _weighted_average(models, new_weights)
        objective = torch.mean(torch.stack([torch.dist(p, median) for p in models]) * weights)
        if abs(previous - objective) <= ftol * objective:
            break
    return _weighted_average(models, new_weights)
