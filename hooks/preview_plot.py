"""The schedule preview picture: every hook's strength against step and sampling percent, in the trace
timeline's look (patcher/drawing.py), sized to stay readable at the frontend's preview size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from PIL import Image, ImageDraw, ImageFont

from ..patcher import drawing  # the trace timeline's palette and helpers, so both pictures look alike
from .preview import StrengthTrace, sampling_sigmas, step_percents, strength_trace

__all__ = ["preview", "schedule_image"]

_LANE_H, _LABEL_W, _PAD, _TITLE_H, _SIGMA_H, _AXIS_H = 44, 220, 18, 48, 54, 70


def schedule_image(traces: Sequence[StrengthTrace], percents: Sequence[float], sigmas: Sequence[float],
                   title: str) -> Image.Image:
    """The preview of ``traces`` over len(percents) steps; ``sigmas`` has one more value (the end).

        preview(hooks, model, steps, scheduler, denoise) -> (IMAGE, text): hooks/preview.py's strengths drawn
        traces (name, strength per step), percents, sigmas --schedule_image()--> PIL image
            one lane per hook (bars by step, height and colour = strength, the value written in),
            x axis: step number and, under it, the sampling percent of that step; sigma curve on top

    The trace timeline's style (patcher/trace_plot.py), sized to stay readable at the frontend's
    preview size (large fonts, at most ~1000 px wide).
    """
    steps = max(len(percents), 1)
    plot_w = min(max(44 * steps, 520), 1000)
    step_w = plot_w / steps
    top = _TITLE_H + _SIGMA_H
    plot_h = max(len(traces), 1) * _LANE_H
    image = Image.new("RGB", (_LABEL_W + plot_w + 2 * _PAD, top + plot_h + _AXIS_H), drawing.BG)
    draw = ImageDraw.Draw(image)
    small, normal, large = drawing.font(14), drawing.font(17), drawing.font(20)
    x0 = _LABEL_W + _PAD
    peak = max((abs(v) for t in traces for v in t.strengths), default=0.0) or 1.0
    draw.text((_PAD, 14), title, fill=drawing.TEXT, font=large)
    _sigma_curve(draw, list(sigmas), (x0, _TITLE_H + 4, step_w, _SIGMA_H - 14), small)
    for step in range(steps + 1):
        draw.line([(x0 + step * step_w, top), (x0 + step * step_w, top + plot_h)], fill=drawing.GRID)
    if not traces:
        draw.text((x0 + 8, top + 12), "no LoRA or model-as-LoRA hook", fill=drawing.MUTED, font=normal)
    for row, trace in enumerate(traces):
        y = top + row * _LANE_H
        draw.line([(x0, y + _LANE_H), (x0 + plot_w, y + _LANE_H)], fill=drawing.GRID)
        label = drawing.fit(draw, trace.name.removesuffix(".safetensors"), normal, _LABEL_W - 10)
        draw.text((_PAD, y + _LANE_H / 2), label, fill=drawing.TEXT, font=normal, anchor="lm")
        for step, value in enumerate(trace.strengths):
            _bar(draw, (x0 + step * step_w, y, step_w, _LANE_H), value, peak, small)
    _axis(draw, (x0, top + plot_h), percents, step_w, small)
    return image


def _bar(draw: ImageDraw.ImageDraw, box: tuple[float, float, float, float], value: float, peak: float,
         font: ImageFont.ImageFont) -> None:
    x, y, w, h = box
    inner_h = h - 8
    fraction = abs(value) / peak
    bar_h = max(inner_h * fraction, 1.0)
    draw.rectangle([x + 1, y + 4 + inner_h - bar_h, x + w - 1, y + 4 + inner_h],
                   fill=drawing.NEGATIVE if value < 0 else drawing.strength_colour(fraction))
    label = f"{value:.2g}"
    if draw.textlength(label, font=font) <= w - 4:
        dark = fraction > 0.5 and value >= 0
        ink = drawing.BG if dark else drawing.TEXT
        draw.text((x + w / 2, y + h / 2), label, fill=ink, font=font, anchor="mm")


def _sigma_curve(draw: ImageDraw.ImageDraw, sigmas: list[float], box: tuple[float, float, float, float],
                 font: ImageFont.ImageFont) -> None:
    if len(sigmas) < 2:
        return
    x0, y0, step_w, h = box
    floor = min((s for s in sigmas if s > 0), default=1.0)
    logs = [math.log(max(s, floor)) for s in sigmas]
    low, span = min(logs), (max(logs) - min(logs)) or 1.0
    points = [(x0 + i * step_w, y0 + h - (v - low) / span * h) for i, v in enumerate(logs)]
    draw.line(points, fill=drawing.MUTED, width=2)
    draw.text((_PAD, y0 + 4), f"sigma {sigmas[0]:.3g} -> {sigmas[-1]:.3g}", fill=drawing.MUTED, font=font)


def _axis(draw: ImageDraw.ImageDraw, origin: tuple[float, float], percents: Sequence[float], step_w: float,
          font: ImageFont.ImageFont) -> None:
    x0, y = origin
    draw.line([(x0, y), (x0 + step_w * len(percents), y)], fill=drawing.TEXT)
    every = max(1, math.ceil(40 / step_w))
    for step in range(0, len(percents), every):
        x = x0 + (step + 0.5) * step_w
        draw.text((x, y + 6), str(step + 1), fill=drawing.TEXT, font=font, anchor="ma")
        draw.text((x, y + 26), f"{percents[step]:.2f}", fill=drawing.MUTED, font=font, anchor="ma")
    draw.text((_PAD, y + 6), "step", fill=drawing.TEXT, font=font)
    draw.text((_PAD, y + 26), "sampling percent", fill=drawing.MUTED, font=font)
    legend = "bar height and colour = strength (red: negative)"
    draw.text((_PAD, y + 46), legend, fill=drawing.MUTED, font=font)


def preview(hooks, model, steps: int, scheduler: str, denoise: float = 1.0) -> tuple[torch.Tensor, str]:
    """(IMAGE tensor, text report) of every WeightHook in ``hooks`` over a KSampler run."""
    sigmas = sampling_sigmas(model, steps, scheduler, denoise)
    traces = strength_trace(hooks, model, sigmas) if hooks is not None else []
    percents = step_percents(model, sigmas)
    title = f"Hook schedule: {steps} steps, {scheduler}, denoise {denoise:g}"
    image = schedule_image(traces, percents, sigmas.tolist(), title)
    lines = [title, "step  " + " ".join(f"{i + 1:>5}" for i in range(steps)),
             "pct   " + " ".join(f"{p:5.2f}" for p in percents)]
    lines += [f"{t.name}: " + ", ".join(f"{v:g}" for v in t.strengths) for t in traces]
    return drawing.to_comfy_image(image), "\n".join(lines)
