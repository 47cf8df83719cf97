"""Regional prompts with one LoRA hook each (core's masked conds): masks, feathering, the base prompt's
"rest" mask and the region diagram a user checks before sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import comfy.hooks
import torch
from PIL import Image, ImageDraw

from ..patcher import drawing

__all__ = ["Region", "feather", "region_diagram", "regional_conditioning", "rest_mask"]

REGION_COLOURS = ((214, 82, 72), (66, 133, 214), (92, 170, 80), (222, 170, 50))
BASE_COLOUR = (96, 96, 104)
DIAGRAM_WIDTH = 512


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
    rest (where no region mask is; everywhere when no region has a mask).

        feather(mask, pixels)   -> the mask with soft edges (a separable triangle blur of radius ``pixels``)
        rest_mask(masks)        -> 1 - max(masks): where no region is, for the base prompt
        regional_conditioning(regions, base) -> one CONDITIONING: each region's cond with its mask and hooks
                                   (core's set_conds_props, as Cond Set Props does), then the base, combined
        region_diagram(regions, labels, base, feather_px) -> an IMAGE of where each region (and the base)
                                   samples: region colours weighted by the feathered masks, labels at their
                                   centres; what a user checks before sampling

    Masks are ComfyUI MASKs ([H, W] or [B, H, W], values in 0..1). Nothing passed in is changed.
    """
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


def _diagram_masks(regions: Sequence[Region], feather_px: int) -> tuple[list[torch.Tensor], tuple[int, int]]:
    """[H, W] float masks, one per region (a region without a mask covers everything)."""
    sized = [_as_batch(feather(r.mask, feather_px)).float()[0] for r in regions if r.mask is not None]
    shape = tuple(sized[0].shape) if sized else (DIAGRAM_WIDTH, DIAGRAM_WIDTH)
    if any(tuple(m.shape) != shape for m in sized):
        raise ValueError(f"region masks differ in size {sorted({tuple(m.shape) for m in sized})}; "
                         f"make them one size (e.g. the image's).")
    masks = [torch.ones(shape) if r.mask is None else _as_batch(feather(r.mask, feather_px)).float()[0]
             for r in regions]
    return masks, shape


def region_diagram(regions: Sequence[Region], labels: Sequence[str], base: bool = False,
                   feather_px: int = 0) -> torch.Tensor:
    """An IMAGE ([1, H, W, 3], DIAGRAM_WIDTH wide) of the regions: each pixel the mean of the region
    colours weighted by their masks (the base's grey on the rest when there is a base, the background
    where nothing samples), each region's number and label at its mask's centre of mass."""
    if len(labels) != len(regions):
        raise ValueError(f"{len(regions)} regions but {len(labels)} labels")
    masks, (height, width) = _diagram_masks(regions, feather_px)
    weights = torch.stack(masks)  # [R, H, W]
    colours = torch.tensor([REGION_COLOURS[i % len(REGION_COLOURS)] for i in range(len(regions))],
                           dtype=torch.float32)
    total = weights.sum(0)
    rgb = torch.einsum("rhw,rc->hwc", weights, colours)
    rest = (1.0 - weights.max(0).values).clamp(0.0, 1.0) if base else torch.zeros(height, width)
    rgb += rest.unsqueeze(-1) * torch.tensor(BASE_COLOUR, dtype=torch.float32)
    total = total + rest
    empty = torch.tensor(drawing.BG, dtype=torch.float32).expand(height, width, 3)
    rgb = torch.where(total.unsqueeze(-1) > 0, rgb / total.clamp(min=1e-6).unsqueeze(-1), empty)
    scale = DIAGRAM_WIDTH / width
    size = (DIAGRAM_WIDTH, max(1, round(height * scale)))
    image = Image.fromarray(rgb.clamp(0, 255).round().to(torch.uint8).numpy(), "RGB").resize(size,
                                                                                         Image.NEAREST)
    draw = ImageDraw.Draw(image)
    font = drawing.font(max(12, size[0] // 28))
    spots = [(f"{i + 1}: {label}", _centre(mask))
             for i, (label, mask) in enumerate(zip(labels, masks, strict=True))]
    if base and float(rest.sum()) > 0:
        spots.append(("base prompt", _centre(rest)))
    placed: list[tuple[float, float]] = []
    for text, (cy, cx) in spots:
        x, y = cx * scale, cy * scale
        while any(abs(y - py) < font.size * 1.4 and abs(x - px) < size[0] / 3 for px, py in placed):
            y += font.size * 1.4  # regions with one centre (no masks): stack their labels
        placed.append((x, y))
        draw.text((x, y), text, fill=drawing.TEXT, font=font, anchor="mm", stroke_width=2,
                  stroke_fill=drawing.BG)
    return drawing.to_comfy_image(image)


def _centre(mask: torch.Tensor) -> tuple[float, float]:
    """(row, column) of the mask's centre of mass; the middle for an empty mask."""
    total = float(mask.sum())
    height, width = mask.shape
    if total <= 0:
        return height / 2, width / 2
    rows = torch.arange(height, dtype=torch.float32).unsqueeze(1) + 0.5
    cols = torch.arange(width, dtype=torch.float32).unsqueeze(0) + 0.5
    return float((mask * rows).sum()) / total, float((mask * cols).sum()) / total
