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


def model_weights(text: str, count: int, method: str) -> list[float]:
    """Per-model weights from ``text`` ("0.5, 0.3, 0.2"; empty: 1 each), one per input model.

    Raises ``ValueError`` naming the value and the fix when the count or a number is wrong."""
    if not text.strip():
        return [1.0] * count
    parts = [p for p in text.replace(";", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{method}: weights={text!r} is not a list of numbers; write one number per input "
                         f"model, comma-separated, e.g. \"0.5, 0.3, 0.2\" (empty: equal)") from None
    if len(weights) != count or not all(math.isfinite(w) for w in weights):
        raise ValueError(f"{method}: weights={text!r} gives {len(weights)} finite numbers for {count} "
                         f"input models; give exactly {count}, comma-separated (empty: equal weights)")
    return weights
