"""Copying a region of B into A: along the first dimension, or by magnitude rank."""

from __future__ import annotations

import math

import torch

from ..declare import AnySpace, builtin_method
from ._util import kth_smallest_magnitude

SUPERMERGER = "https://github.com/hako-mikan/sd-webui-supermerger"


@builtin_method(paper=SUPERMERGER)
def tensor_sum(a: AnySpace, b: AnySpace, *, width: float = 0.5, offset: float = 0.0) -> AnySpace:
    """Rows [offset, offset + width) (fractions of dim 0, wrapping) from B, the rest from A."""
    if a.dim() == 0:
        return b if width > 0.5 else a
    start, end, inverted = ratio_to_region(width, offset, a.size(0))
    outer, inner = (b, a) if inverted else (a, b)
    res = outer.clone()
    res[start:end] = inner[start:end]
    return res


@builtin_method(paper=SUPERMERGER)
def top_k_tensor_sum(a: AnySpace, b: AnySpace, *, width: float = 1.0, offset: float = 0.0) -> AnySpace:
    """A's values re-ordered by B's ranking, within the magnitude band [offset, offset + width)."""
    a_flat = torch.flatten(a)
    a_dist = torch.msort(a_flat)
    redist_indices = torch.argsort(torch.argsort(torch.flatten(b), stable=True))
    start, end, inverted = ratio_to_region(width, offset, a.numel())
    start_top_k, end_top_k = _kth_abs(a_dist, start), _kth_abs(a_dist, end)
    mask = (start_top_k <= a_dist.abs()) & (a_dist.abs() <= end_top_k)
    if inverted:
        mask = ~mask
    mask = torch.gather(mask.float(), 0, redist_indices)
    a_redist = torch.gather(a_dist, 0, redist_indices)
    return ((1 - mask) * a_flat + mask * a_redist).reshape_as(a)


def _kth_abs(a: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0:
        return torch.tensor(-1, device=a.device)
    return kth_smallest_magnitude(a, k)


def ratio_to_region(width: float, offset: float, n: int) -> tuple[int, int, bool]:
    """(start, end, inverted) of the fractional region on ``n`` rows; inverted = it wraps around."""
    if width < 0:
        offset += width
        width = -width
    width = min(width, 1)
    if offset < 0:
        offset = 1 + offset - int(offset)
    offset = math.fmod(offset, 1.0)
    if width + offset <= 1:
        return round(offset * n), round((width + offset) * n), False
    return round((width + offset - 1) * n), round(offset * n), True
