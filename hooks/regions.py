"""Regional prompts with one LoRA hook each: masks, feathering and the base prompt's "rest" mask.

    feather(mask, pixels)   -> the mask with soft edges (a separable triangle blur of radius ``pixels``)
    rest_mask(masks)        -> 1 - max(masks): where no region is, for the base prompt
    regional_conditioning(regions, base) -> one CONDITIONING: each region's cond with its mask and hooks
                               (core's set_conds_props, as Cond Set Props does), then the base, combined

Masks are ComfyUI MASKs ([H, W] or [B, H, W], values in 0..1). Nothing passed in is changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import comfy.hooks
import torch

__all__ = ["Region", "feather", "regional_conditioning", "rest_mask"]


@dataclass(frozen=True)
class Region:
    """One region: its conditioning, its mask (None: the whole image) and its hooks (None: no LoRA)."""

    cond: list
    mask: torch.Tensor | None
    hooks: Any = None


def _as_batch(mask: torch.Tensor) -> torch.Tensor:
    if mask.ndim == 2:
        return mask.unsqueeze(0)
    if mask.ndim != 3:
        raise ValueError(f"a MASK has shape [H, W] or [B, H, W], got {tuple(mask.shape)}; "
                         f"connect a MASK output.")
    return mask


def feather(mask: torch.Tensor, pixels: int) -> torch.Tensor:
    """``mask`` with edges softened over about ``pixels`` pixels each side (0: unchanged)."""
    if pixels < 0:
        raise ValueError(f"feather {pixels} is negative; use 0 for hard edges or a width in pixels.")
    if pixels == 0:
        return mask
    batch = _as_batch(mask).float()
    weights = torch.cat([torch.arange(1, pixels + 2), torch.arange(pixels, 0, -1)]).float()
    weights = weights / weights.sum()
    x = batch.unsqueeze(1)
    x = torch.nn.functional.pad(x, (pixels, pixels, 0, 0), mode="replicate")
    x = torch.nn.functional.conv2d(x, weights.view(1, 1, 1, -1))
    x = torch.nn.functional.pad(x, (0, 0, pixels, pixels), mode="replicate")
    x = torch.nn.functional.conv2d(x, weights.view(1, 1, -1, 1))
    return x.squeeze(1).clamp(0.0, 1.0).reshape(mask.shape)


def rest_mask(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Where no region is: 1 - the element-wise max of ``masks`` (all of one size)."""
    shapes = {tuple(_as_batch(m).shape[-2:]) for m in masks}
    if len(shapes) > 1:
        raise ValueError(f"region masks differ in size {sorted(shapes)}; "
                         f"make them one size (e.g. the image's).")
    stacked = torch.stack([_as_batch(m).float()[0] for m in masks])
    return (1.0 - stacked.max(dim=0).values).clamp(0.0, 1.0)


def regional_conditioning(regions: Sequence[Region], base: list | None = None, feather_px: int = 0) -> list:
    """One CONDITIONING: every region's cond with its (feathered) mask and hooks, then ``base`` on the
    rest (where no region mask is; everywhere when no region has a mask)."""
    if not regions:
        raise ValueError("no region: connect at least one cond_N (with its mask_N and lora_N).")
    out: list = []
    for region in regions:
        mask = None if region.mask is None else feather(region.mask, feather_px)
        (cond,) = comfy.hooks.set_conds_props([region.cond], 1.0, "default", mask=mask, hooks=region.hooks)
        out.extend(cond)
    if base is not None:
        masks = [feather(r.mask, feather_px) for r in regions if r.mask is not None]
        rest = rest_mask(masks) if masks else None
        (cond,) = comfy.hooks.set_conds_props([base], 1.0, "default", mask=rest)
        out.extend(cond)
    return out
