"""Small helpers shared by the method modules: scalar-or-tensor checks, seeded generators."""

from __future__ import annotations

import math

import torch

from ..context import KeyContext, key_seed

Scalar = float | torch.Tensor


def is_close(value: Scalar, target: float) -> bool:
    """``value`` is a single number close to ``target`` (a per-element tensor never is)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and math.isclose(value.item(), target)
    return math.isclose(value, target)


def generator(ctx: KeyContext, seed: int | None, device: torch.device) -> torch.Generator:
    """``seed`` as given (sd-mecha's behaviour, same draw for every key) or, when None, one
    derived from the merge seed and the key (``ctx.generator()``)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(key_seed(ctx.seed, ctx.key) if seed is None or seed < 0 else seed)
    return gen
