"""The trace of one sampling run as a timeline picture and a plain-text report, for the Trace node: steps
across, one row per lane, bar height and colour = strength. Pillow only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw, ImageFont

from . import drawing
from .trace import Trace

__all__ = ["LANE_KINDS", "Lane", "lanes", "report", "timeline_image", "timeline_tensor"]

LANE_KINDS = ("hook", "patch", "wrapper", "callback")
_KIND_COLOURS = {"hook": (86, 156, 214), "patch": (197, 134, 192), "wrapper": (78, 201, 176),
                 "callback": (220, 180, 90)}
_LANE_H, _LABEL_W, _PAD, _TITLE_H, _AXIS_H, _LEGEND_H, _SIGMA_H = 30, 230, 16, 40, 46, 40, 46


@dataclass(frozen=True)
class Lane:
    """One row of the timeline: everything of one kind and name that ran, by step.

    cells: (step, strength, count) per step it ran at; strength is the largest magnitude seen at
    that step (None when none of its events carried a strength), count how often it ran there.
    """

    kind: str
    name: str
    cells: tuple[tuple[int, float | None, int], ...]


def lanes(trace: Trace) -> tuple[Lane, ...]:
    """The trace's lanes, hooks first, then patches, wrappers and callbacks, each in order of first use."""
    cells: dict[tuple[str, str], dict[int, tuple[float | None, int]]] = {}
    for event in trace.events:
        if event.kind not in LANE_KINDS:
            continue
        row = cells.setdefault((event.kind, event.name), {})
        strength, count = row.get(event.step, (None, 0))
        if event.strength is not None and (strength is None or abs(event.strength) > abs(strength)):
            strength = event.strength
        row[event.step] = (strength, count + 1)
    ordered = sorted(cells, key=lambda key: LANE_KINDS.index(key[0]))  # stable: first use within a kind
    return tuple(_lane(kind, name, cells[(kind, name)]) for kind, name in ordered)


def _lane(kind: str, name: str, row: dict[int, tuple[float | None, int]]) -> Lane:
    return Lane(kind, name, tuple((step, strength, count) for step, (strength, count) in sorted(row.items())))





def timeline_image(trace: Trace, width: int | None = None, *,
                   message: str = "nothing recorded for this run") -> Image.Image:
    """The timeline picture of ``trace``: sampler steps on the x axis, one lane per hook, patch, wrapper
    or callback; a bar where it ran, its height and colour the strength (relative to the strongest;
    red for negative, a hatched full bar where no strength applies), labelled with the value where it
    fits. ``width`` defaults to 32 px a step (between 480 and 1200 px of plot); ``message`` is shown
    when there is no lane."""
    rows = lanes(trace)
    steps = max(trace.total_steps, 1)
    plot_w = width or min(max(32 * steps, 480), 1200)
    peak = max((abs(s) for lane in rows for _, s, _ in lane.cells if s is not None), default=0.0) or 1.0
    has_sigma = len(trace.sigmas) >= 2
    plot_h = max(len(rows), 1) * _LANE_H
    top = _TITLE_H + (_SIGMA_H if has_sigma else 0)
    size = (_LABEL_W + plot_w + 2 * _PAD, top + plot_h + _AXIS_H + _LEGEND_H)
    image = Image.new("RGB", size, drawing.BG)
    draw = ImageDraw.Draw(image)
    small, normal = drawing.font(12), drawing.font(15)
    x0, step_w = _LABEL_W + _PAD, plot_w / steps

    draw.text((_PAD, 12), f"Patchbay trace: {trace.total_steps} steps, {len(rows)} lanes, "
                          f"{len(trace.events)} events", fill=drawing.TEXT, font=normal)
    if has_sigma:
        _draw_sigmas(draw, trace.sigmas, (x0, _TITLE_H + 6, plot_w, _SIGMA_H - 14), step_w, small)
    for step in range(steps + 1):
        x = x0 + step * step_w
        draw.line([(x, top), (x, top + plot_h)], fill=drawing.GRID)
    if not rows:
        draw.text((x0 + 8, top + 8), message, fill=drawing.MUTED, font=small)
    for index, lane in enumerate(rows):
        y = top + index * _LANE_H
        draw.line([(x0, y + _LANE_H), (x0 + plot_w, y + _LANE_H)], fill=drawing.GRID)
        draw.rectangle([_PAD, y + 9, _PAD + 10, y + 19], fill=_KIND_COLOURS[lane.kind])
        draw.text((_PAD + 16, y + 8), drawing.fit(draw, f"{lane.name} ({lane.kind})", small, _LABEL_W - 24),
                  fill=drawing.TEXT, font=small)
        for step, strength, _count in lane.cells:
            if 0 <= step < steps:
                _draw_cell(draw, (x0 + step * step_w, y, step_w, _LANE_H), strength, peak, small)
    _draw_axis(draw, (x0, top + plot_h, plot_w), steps, step_w, small)
    _draw_legend(draw, (x0, top + plot_h + _AXIS_H, plot_w), peak, small)
    return image


def _draw_cell(draw: ImageDraw.ImageDraw, box: tuple[float, float, float, float], strength: float | None,
               peak: float, font: ImageFont.ImageFont) -> None:
    x, y, w, h = box
    inner_w, inner_h = max(w - 2, 1), h - 6
    if strength is None:
        draw.rectangle([x + 1, y + 3, x + inner_w, y + 3 + inner_h], outline=drawing.MUTED)
        for offset in range(0, int(inner_w + inner_h), 6):
            draw.line([(x + 1 + max(offset - inner_h, 0), y + 3 + min(offset, inner_h)),
                       (x + 1 + min(offset, inner_w), y + 3 + max(offset - inner_w, 0))], fill=drawing.MUTED)
        return
    fraction = abs(strength) / peak
    bar_h = max(inner_h * fraction, 1.0)
    colour = drawing.NEGATIVE if strength < 0 else drawing.strength_colour(fraction)
    draw.rectangle([x + 1, y + 3 + inner_h - bar_h, x + inner_w, y + 3 + inner_h], fill=colour)
    label = f"{strength:.2g}"
    if draw.textlength(label, font=font) <= inner_w - 2:
        dark = fraction > 0.5 and strength >= 0
        ink = drawing.BG if dark else drawing.TEXT
        draw.text((x + w / 2, y + h / 2), label, fill=ink, font=font, anchor="mm")


def _draw_sigmas(draw: ImageDraw.ImageDraw, sigmas: tuple[float, ...], box: tuple[float, float, float, float],
                 step_w: float, font: ImageFont.ImageFont) -> None:
    x0, y0, _w, h = box
    floor = min((s for s in sigmas if s > 0), default=1.0)  # the final sigma is often 0: keep it off -inf
    logs = [math.log(max(s, floor)) for s in sigmas]
    low, high = min(logs), max(logs)
    span = (high - low) or 1.0
    points = [(x0 + i * step_w, y0 + h - (v - low) / span * h) for i, v in enumerate(logs)]
    draw.line(points, fill=drawing.MUTED, width=2)
    draw.text((_PAD, y0), f"sigma {sigmas[0]:.3g} -> {sigmas[-1]:.3g} (log)", fill=drawing.MUTED, font=font)


def _draw_axis(draw: ImageDraw.ImageDraw, origin: tuple[float, float, float], steps: int, step_w: float,
               font: ImageFont.ImageFont) -> None:
    x0, y, plot_w = origin
    draw.line([(x0, y), (x0 + plot_w, y)], fill=drawing.TEXT)
    every = max(1, math.ceil(28 / step_w))
    for step in range(0, steps, every):
        x = x0 + (step + 0.5) * step_w
        draw.line([(x, y), (x, y + 4)], fill=drawing.TEXT)
        draw.text((x, y + 6), str(step), fill=drawing.TEXT, font=font, anchor="ma")
    draw.text((x0 + plot_w / 2, y + 26), "sampler step", fill=drawing.TEXT, font=font, anchor="ma")
    draw.text((_PAD, y + 6), "lane (kind)", fill=drawing.MUTED, font=font)


def _draw_legend(draw: ImageDraw.ImageDraw, origin: tuple[float, float, float], peak: float,
                 font: ImageFont.ImageFont) -> None:
    x0, y, _plot_w = origin
    draw.text((_PAD, y + 8), "strength (bar height)", fill=drawing.MUTED, font=font)
    ramp_w = 160
    for i in range(ramp_w):
        draw.line([(x0 + i, y + 8), (x0 + i, y + 22)], fill=drawing.strength_colour(i / (ramp_w - 1)))
    draw.text((x0, y + 24), "0", fill=drawing.MUTED, font=font)
    draw.text((x0 + ramp_w, y + 24), f"{peak:.3g}", fill=drawing.MUTED, font=font, anchor="ra")
    draw.rectangle([x0 + ramp_w + 20, y + 8, x0 + ramp_w + 34, y + 22], fill=drawing.NEGATIVE)
    draw.text((x0 + ramp_w + 40, y + 8), "negative", fill=drawing.MUTED, font=font)
    draw.rectangle([x0 + ramp_w + 120, y + 8, x0 + ramp_w + 134, y + 22], outline=drawing.MUTED)
    draw.text((x0 + ramp_w + 140, y + 8), "ran, no strength", fill=drawing.MUTED, font=font)



def timeline_tensor(trace: Trace, width: int | None = None, *,
                    message: str = "nothing recorded for this run") -> torch.Tensor:
    """``timeline_image`` as a ComfyUI IMAGE tensor."""
    return drawing.to_comfy_image(timeline_image(trace, width, message=message))


def _steps_text(steps: list[int]) -> str:
    runs: list[str] = []
    for step in steps:
        if runs and runs[-1].split("-")[-1] == str(step - 1):
            runs[-1] = f"{runs[-1].split('-')[0]}-{step}"
        else:
            runs.append(str(step))
    return ", ".join(runs)


def _strength_text(values: list[float]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:g}" if low == high else f"{low:g}..{high:g}"


def report(trace: Trace) -> str:
    """The trace as text: a header, one line per lane (steps it ran at, strength range), one line per step."""
    rows = lanes(trace)
    sigma = f", sigma {trace.sigmas[0]:.4g} -> {trace.sigmas[-1]:.4g}" if trace.sigmas else ""
    lines = [f"Patchbay trace: {trace.total_steps} steps, {len(trace.events)} events{sigma}"]
    if not rows:
        return "\n".join([*lines, "No hook, patch, wrapper or callback was recorded in this run."])
    name_w = max(len(f"{lane.kind} {lane.name}") for lane in rows)
    lines += ["", f"{'lane':<{name_w}}  steps / strength"]
    for lane in rows:
        strengths = [s for _, s, _ in lane.cells if s is not None]
        lines.append(f"{lane.kind + ' ' + lane.name:<{name_w}}  {_steps_text([c[0] for c in lane.cells])}"
                     f" / {_strength_text(strengths)}")
    lines.append("")
    for step in range(trace.total_steps):
        ran = [f"{lane.name}={s:g}" if s is not None else lane.name
               for lane in rows for at, s, _ in lane.cells if at == step]
        sigma_here = f" (sigma {trace.sigmas[step]:.4g})" if step < len(trace.sigmas) else ""
        lines.append(f"step {step}{sigma_here}: {', '.join(ran) or '-'}")
    return "\n".join(lines)
