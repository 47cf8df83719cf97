"""exchange_ema: the EMA copy of an LDM checkpoint's UNet in place of its trained weights, and back
(sd-mecha 1.1.8, SD 1.x and 2.x).
"""

from __future__ import annotations

import functools

import torch

from ..architectures import DIFFUSION_PREFIX
from ..context import KeyContext
from ..declare import AnyGroup, AnySpace, builtin_method
from .logistics import SD_MECHA

EMA_PREFIX = "model_ema."
EMA_FAMILIES = ("sd15", "sd2")


def ema_key(key: str) -> str:
    """The EMA copy's name of ``key``: ``model.diffusion_model.a.b`` -> ``model_ema.diffusion_modelab``."""
    return EMA_PREFIX + key.removeprefix("model.").replace(".", "")


@functools.lru_cache(maxsize=4)
def _partners(keys: frozenset[str]) -> dict[str, str]:
    """Each UNet key whose EMA copy is among ``keys`` -> the copy, and each such copy -> its key."""
    pairs: dict[str, str] = {}
    for key in keys:
        if key.startswith(DIFFUSION_PREFIX) and (copy := ema_key(key)) in keys:
            pairs[key], pairs[copy] = copy, key
    return pairs


def _partner(key: str, arch: str, keys: frozenset[str]) -> tuple[str, ...]:
    return (_partners(keys).get(key, key),) if arch in EMA_FAMILIES else (key,)


@builtin_method(paper=SD_MECHA, related=_partner)
def exchange_ema(model: AnyGroup, *, ctx: KeyContext) -> AnySpace:
    """Swap each UNet weight with its EMA copy (model_ema.*) in SD 1.x / 2.x checkpoints.

    SD 1.x and 2.x checkpoints trained with EMA keep a copy of every UNet weight under ``model_ema.`` +
    the key without ``model.`` and without dots (``model.diffusion_model.out.2.weight`` ->
    ``model_ema.diffusion_modelout2weight``). The method swaps each such pair: a key whose copy exists takes
    the copy's values and the copy takes the key's; every other key (text encoder, VAE, ``model_ema.decay``,
    a checkpoint without EMA) passes through. sd-mecha defines it for ``sd1-ldm`` only; the names are the
    same in SD 2.x. Other families name no EMA keys, and are refused.
    """
    if ctx.arch not in EMA_FAMILIES:
        raise ValueError(f"exchange_ema knows the EMA keys (model_ema.*) of {' and '.join(EMA_FAMILIES)} "
                         f"checkpoints, not of {ctx.arch!r}; leave it out of this recipe")
    value: torch.Tensor | None = next(iter(model.values()), None)
    return value
