"""Strength schedules as text and as curves (``0@0, 1@0.3``, the loractl form): the pure logic behind
Patchbay's keyframe nodes. Standard library only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["INTERPOLATIONS", "UNITS", "Point", "ScheduleError", "interpolate", "parse_schedule", "spread"]

UNITS = ("percent", "step", "sigma")


class ScheduleError(ValueError):
    """Bad schedule input; the message names the value (and its line and column) and the fix."""


@dataclass(frozen=True)
class Point:
    """One keyframe: ``strength`` from ``at`` on (a percent, a step number or a sigma, by unit)."""

    strength: float
    at: float


INTERPOLATIONS: dict[str, Callable[[float], float]] = {
    "linear": lambda t: t,
    "ease_in": lambda t: t * t,
    "ease_out": lambda t: 1 - (1 - t) ** 2,
    "ease_in_out": lambda t: (1 - math.cos(t * math.pi)) / 2,
}
"""The curves of ComfyUI's CreateHookKeyframesInterpolated, same formulas (f(0) = 0, f(1) = 1)."""

_ITEM = re.compile(r"[^,;\s]+")
_EXAMPLE = "write strength@position items separated by commas, e.g. 0@0, 1@0.3, 0.2@1"


def parse_schedule(text: str, unit: str = "percent") -> tuple[Point, ...]:
    """Parse ``strength@position`` items separated by commas, semicolons, spaces or new lines.

    ``#`` starts a comment. A bare number (no ``@``) is a strength from position 0. Points are
    returned sorted by position (stable: two points at one position make a jump, the later wins).
    Positions: percent in [0, 1]; step a whole number >= 0; sigma a number >= 0.

    >>> parse_schedule("0@0, 1@0.3")
    (Point(strength=0.0, at=0.0), Point(strength=1.0, at=0.3))

        "0@0, 1@0.3, 0.2@1"  --parse_schedule-->  (Point(0.0, 0.0), Point(1.0, 0.3), Point(0.2, 1.0))
        strengths + positions --interpolate----->  count points from start to end along an easing curve
        FLOATS                --spread---------->  one point per value, evenly from start to end percent

    A point is ``strength@position`` (the loractl form). Positions are sampling percent in [0, 1] by
    default, or step numbers (0 = the first step) with ``unit="step"``, or sigmas with ``unit="sigma"``.
    Errors are :class:`ScheduleError` naming the item, its line and column and the fix.
    """
    _check_unit(unit)
    points: list[Point] = []
    for line_no, raw in enumerate(text.splitlines() or [""], start=1):
        line = raw.split("#", 1)[0]
        for match in _ITEM.finditer(line):
            points.append(_point(match.group(), line_no, match.start() + 1, unit))
    if not points:
        raise ScheduleError(f"schedule {text!r} holds no keyframe: {_EXAMPLE}.")
    ordered = sorted(points, key=lambda p: p.at) if unit != "sigma" else sorted(points, key=lambda p: -p.at)
    return tuple(ordered)


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise ScheduleError(f"unknown position unit {unit!r}; choose one of {', '.join(UNITS)}.")


def _point(item: str, line_no: int, column: int, unit: str) -> Point:
    where = f"at line {line_no}, column {column}"
    strength_text, _, at_text = item.partition("@")
    strength = _number(strength_text, "strength", item, where)
    if not at_text:
        if "@" in item:
            raise ScheduleError(f"schedule item {item!r} {where} has no position after '@'; {_EXAMPLE}.")
        return Point(strength, 0.0)
    at = _number(at_text, "position", item, where)
    column_at = f"at line {line_no}, column {column + len(strength_text) + 1}"
    if unit == "percent" and not 0.0 <= at <= 1.0:
        hint = f"; for step {at:g} choose positions in steps" if at > 1 and at == int(at) else ""
        raise ScheduleError(f"schedule position {at_text!r} {column_at} is outside [0, 1]: positions are "
                            f"sampling percent (0 = first step, 1 = last){hint}.")
    if unit == "step" and (at < 0 or at != int(at)):
        raise ScheduleError(f"schedule position {at_text!r} {column_at} is not a step number; "
                            f"write a whole number >= 0 (0 = the first step).")
    if unit == "sigma" and at < 0:
        raise ScheduleError(f"schedule position {at_text!r} {column_at} is a negative sigma; "
                            f"sigmas are >= 0.")
    return Point(strength, at)


def _number(text: str, what: str, item: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ScheduleError(f"schedule item {item!r} {where}: {what} {text!r} is not a number; "
                            f"{_EXAMPLE}.") from None
    if not math.isfinite(value):
        raise ScheduleError(f"schedule item {item!r} {where}: {what} {text!r} is not finite; "
                            f"use an ordinary number.")
    return value


def check_percent(value: float, name: str) -> float:
    """``value`` if it lies in [0, 1], else a ScheduleError naming ``name``."""
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ScheduleError(f"{name} {value!r} is outside [0, 1]; sampling percent runs from 0 (first "
                            f"step) to 1 (last step).")
    return float(value)


def _linspace(start: float, end: float, count: int) -> list[float]:
    if count == 1:
        return [float(start)]
    return [start + (end - start) * i / (count - 1) for i in range(count)]


def spread(values: Sequence[float], start_percent: float = 0.0,
           end_percent: float = 1.0) -> tuple[Point, ...]:
    """One point per value, evenly from ``start_percent`` to ``end_percent`` (both included)."""
    values = list(values) if not isinstance(values, int | float) else [float(values)]
    if not values:
        raise ScheduleError("the FLOATS list is empty; give at least one strength (e.g. FLOATS from Text "
                            "with 0, 1).")
    for i, value in enumerate(values):
        if not math.isfinite(float(value)):
            raise ScheduleError(f"FLOATS value {i} ({value!r}) is not finite; use an ordinary number.")
    start = check_percent(start_percent, "start_percent")
    end = check_percent(end_percent, "end_percent")
    if end < start:
        raise ScheduleError(f"end_percent {end} is before start_percent {start}; swap them.")
    return tuple(Point(float(v), p) for v, p in zip(values, _linspace(start, end, len(values)), strict=True))


def interpolate(strength_start: float, strength_end: float, count: int, interpolation: str = "linear",
                start_percent: float = 0.0, end_percent: float = 1.0) -> tuple[Point, ...]:
    """``count`` points from ``start_percent`` to ``end_percent`` (evenly spaced), their strengths
    from ``strength_start`` to ``strength_end`` along ``interpolation`` (as core's Interp. node)."""
    curve = INTERPOLATIONS.get(interpolation)
    if curve is None:
        raise ScheduleError(f"unknown interpolation {interpolation!r}; "
                            f"choose one of {', '.join(INTERPOLATIONS)}.")
    if count < 2:
        raise ScheduleError(f"keyframes count {count} is below 2; an interpolation needs a start and an end.")
    ts = _linspace(0.0, 1.0, count)
    strengths = [strength_start + (strength_end - strength_start) * curve(t) for t in ts]
    return spread(strengths, start_percent, end_percent)
