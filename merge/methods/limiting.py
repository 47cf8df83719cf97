"""Clamping a tensor into the range spanned by other tensors."""

from __future__ import annotations

import functools

import torch

from ..declare import AnySpace, builtin_method


@builtin_method(paper="https://github.com/ljleb/sd-mecha")
def clamp(a: AnySpace, *bounds: AnySpace, stiffness: float = 0.0) -> AnySpace:
    """Clamp a element-wise into [min(bounds), max(bounds)]; stiffness pulls the range to the mean."""
    maximums = functools.reduce(torch.maximum, bounds)
    minimums = functools.reduce(torch.minimum, bounds)
    if stiffness:
        stacked = torch.stack(bounds)
        average = stacked.mean(dim=0)
        smallest_positive, largest_negative = maximums, minimums
        for bound in stacked:
            smallest_positive = torch.where((smallest_positive >= bound) & (bound >= average),
                                            bound, smallest_positive)
            largest_negative = torch.where((largest_negative <= bound) & (bound <= average),
                                           bound, largest_negative)
        maximums = (1 - stiffness) * maximums + stiffness * smallest_positive
        minimums = (1 - stiffness) * minimums + stiffness * largest_negative
    return torch.minimum(torch.maximum(a, minimums), maximums)
