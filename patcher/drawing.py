"""The pack's pictures share one look (the trace timeline, the schedule preview, the region diagram, the
Merge Grid): palette, font, fitted text, strength ramp, labelled grid and the hand-over to an IMAGE.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["BG", "GRID", "MUTED", "NEGATIVE", "TEXT", "fit", "font", "labelled_grid", "strength_colour",
           "to_comfy_image"]

BG, GRID, TEXT, MUTED = (24, 24, 28), (58, 58, 66), (232, 232, 236), (150, 150, 160)
NEGATIVE = (214, 69, 65)
# viridis at 0, 1/4, 1/2, 3/4, 1: dark = weak, yellow = strong
_STRENGTH_STOPS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


def font(size: int) -> ImageFont.ImageFont:
    """Pillow's default font at ``size`` pixels (the small bitmap font on Pillow < 10.1)."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:
        return ImageFont.load_default()


def strength_colour(fraction: float) -> tuple[int, int, int]:
    """The viridis colour of ``fraction`` (clamped to 0..1)."""
    position = min(max(fraction, 0.0), 1.0) * (len(_STRENGTH_STOPS) - 1)
    low = min(int(position), len(_STRENGTH_STOPS) - 2)
    t = position - low
    a, b = _STRENGTH_STOPS[low], _STRENGTH_STOPS[low + 1]
    return tuple(round(x + (y - x) * t) for x, y in zip(a, b, strict=True))


def fit(draw: ImageDraw.ImageDraw, text: str, face: ImageFont.ImageFont, width: int) -> str:
    """``text``, cut and ended with '...' where it is wider than ``width`` pixels."""
    if draw.textlength(text, font=face) <= width:
        return text
    while text and draw.textlength(text + "...", font=face) > width:
        text = text[:-1]
    return text + "..."


def to_comfy_image(image: Image.Image) -> torch.Tensor:
    """A PIL image as a ComfyUI IMAGE: float32 [1, H, W, 3] in 0..1."""
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(array).unsqueeze(0)


def labelled_grid(images: Sequence[torch.Tensor], labels: Sequence[Sequence[str]], columns: int,
                  band: int) -> torch.Tensor:
    """One IMAGE [1, H, W, 3]: ``images`` ([h, w, C], all one size) row by row, ``columns`` across, each
    under a white band ``band`` pixels high with its labels."""
    height, width = images[0].shape[0], images[0].shape[1]
    rows = -(-len(images) // columns)
    canvas = Image.new("RGB", (columns * width, rows * (height + band)), "white")
    draw = ImageDraw.Draw(canvas)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        x, y = (index % columns) * width, (index // columns) * (height + band)
        pixels = (image[..., :3].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        canvas.paste(Image.fromarray(pixels), (x, y + band))
        draw.text((x + 3, y + 4), "  ".join(label), fill="black")
    return to_comfy_image(canvas)
