"""Random dropout merge of several deltas (DARE-style "n-supermario" with controllable overlap)."""

from __future__ import annotations

import math

import torch

from ..context import KeyContext
from ..declare import Delta, Fraction, builtin_method
from ._util import generator


@builtin_method(paper="https://arxiv.org/abs/2311.03099", random=True)
def dropout(*deltas: Delta, probability: Fraction = 0.9, rescale: float = 1.0, overlap: float = 1.0,
            overlap_emphasis: float = 0.0, seed: int | None = None, ctx: KeyContext) -> Delta:
    """Keep each delta's entries with probability 1 - p (overlap shapes the kept sets), average, rescale."""
    shape, device = deltas[0].shape, deltas[0].device
    gen = generator(ctx, seed, device)
    if overlap % 2 == 1:
        keep = torch.full(shape, 1 - probability, device=device)
        masks = [torch.bernoulli(keep, generator=gen).bool() for _ in deltas]
    else:
        pmf = overlapping_sets_pmf(len(deltas), probability, overlap, overlap_emphasis).to(device)
        choice = torch.multinomial(pmf, max(math.prod(shape), 1), replacement=True, generator=gen)
        choice = choice[: math.prod(shape)].reshape(shape)
        masks = [(choice & 2**i) != 0 for i in range(len(deltas))]
    final = torch.zeros_like(deltas[0])
    for mask, delta in zip(masks, deltas, strict=True):
        final[mask] += delta[mask]
    rescalar = 1.0
    if probability != 1.0:
        rescalar = (1.0 - probability) ** rescale
        rescalar = rescalar if math.isfinite(rescalar) else 1.0
    return final / sum(m.float() for m in masks).clamp(1) / rescalar


def overlapping_sets_pmf(n: int, p: float, overlap: float, emphasis: float) -> torch.Tensor:
    """Probabilities of the 2**n keep-sets (index = bit mask of models keeping an entry)."""
    sizes = torch.tensor([bin(i).count("1") for i in range(1, 2**n)], dtype=torch.float64)
    if math.isclose(overlap, round(overlap)):
        pmf = (sizes == 1).double() / n if round(overlap) % 2 == 0 else (sizes == n).double()
    else:
        if math.floor(overlap) % 2 == 1:
            overlap = -overlap
        pmf = torch.softmax(math.tan(math.pi * (overlap - 0.5)) * (sizes - n / 2), dim=0)
    # binomial pmf of the set size spread evenly over the sets of that size: p^k (1 - p)^(n - k)
    binomial = torch.tensor([p**k * (1 - p) ** (n - k) for k in range(n + 1)], dtype=torch.float64)
    expanded = binomial[sizes.long()]
    expanded = expanded / expanded.sum()
    pmf = torch.lerp(pmf, torch.lerp(pmf, expanded, 1 - abs(2 * overlap - 1)), emphasis)
    pmf = pmf.clamp(min=0) / pmf.clamp(min=0).sum()  # sd-mecha goes negative (and fails) past overlap 1
    return torch.cat([torch.tensor([p], dtype=torch.float64), pmf * (1 - p)])
