"""Small helpers shared by the method modules: scalar-or-tensor checks, seeded generators, order
statistics of magnitudes."""

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


_RADIX_MIN = 1 << 20  # below this many elements torch.kthvalue alone is as fast


def kth_smallest_magnitude(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th smallest ``|value|`` (1-based, as ``torch.kthvalue``) as a 0-d fp32 tensor: exact.

    Large tensors go by one radix pass: the bit pattern of a non-negative fp32 orders as an integer, so
    a histogram of the top 16 bits finds the bucket that holds the ``k``-th value, and
    ``torch.kthvalue`` runs only inside it (about 4x faster than on the whole tensor on the CPU; TIES
    on SD1.5 spends most of its time here). Where one bucket holds most values (a delta of mostly
    equal values, e.g. zeros where two models share a text encoder) ``kthvalue`` takes the whole
    tensor. NaN magnitudes order above +inf, as in ``kthvalue``.
    """
    flat = values.detach().flatten().abs().float()
    if flat.numel() < _RADIX_MIN:
        return flat.kthvalue(k).values
    high = flat.view(torch.int32) >> 16  # sign bit clear: 0 .. 32767
    below = torch.bincount(high, minlength=1 << 15).cumsum(0)
    bucket = int(torch.searchsorted(below, torch.tensor(k, device=below.device)))
    before = int(below[bucket - 1]) if bucket else 0
    if int(below[bucket]) - before > flat.numel() // 2:  # one bucket holds most (equal deltas: zeros)
        return flat.kthvalue(k).values
    return flat[high == bucket].kthvalue(k - before).values


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
