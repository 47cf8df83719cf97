"""FLOATS makers: ComfyUI's hook keyframe nodes accept a ``FLOATS`` list but no core node makes one; the
pure logic (parse, ramp, repeat) behind Patchbay's FLOATS nodes. Standard library only; errors are
FloatsError naming the value (and for text its line and column) and the fix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

__all__ = ["EASINGS", "REPEAT_MODES", "FloatsError", "parse_floats", "ramp", "repeat"]


class FloatsError(ValueError):
    """Bad input for a FLOATS maker; the message names the value and the fix."""


def _ease_in_out_quad(t: float) -> float:
    return 2 * t * t if t < 0.5 else 1 - (-2 * t + 2) ** 2 / 2


def _ease_in_out_cubic(t: float) -> float:
    return 4 * t**3 if t < 0.5 else 1 - (-2 * t + 2) ** 3 / 2


EASINGS: dict[str, Callable[[float], float]] = {
    "linear": lambda t: t,
    "ease_in": lambda t: t * t,
    "ease_out": lambda t: 1 - (1 - t) * (1 - t),
    "ease_in_out": _ease_in_out_quad,
    "ease_in_cubic": lambda t: t**3,
    "ease_out_cubic": lambda t: 1 - (1 - t) ** 3,
    "ease_in_out_cubic": _ease_in_out_cubic,
    "ease_in_out_sine": lambda t: -(math.cos(math.pi * t) - 1) / 2,
}
"""Easing curves on [0, 1] -> [0, 1], each with f(0) = 0 and f(1) = 1."""

REPEAT_MODES = ("cycle", "pingpong")

_ITEM = re.compile(r"[^,\s]+")
_EXAMPLE = "write numbers separated by commas or new lines, e.g. 0, 0.25, 1"


def parse_floats(text: str, *, what: str = "FLOATS text") -> list[float]:
    """Parse numbers separated by commas, spaces or new lines; ``#`` starts a comment.

    >>> parse_floats("0, 0.25, 1")
    [0.0, 0.25, 1.0]

    Raises FloatsError naming the line and column (1-based) of the first item that is not a
    finite number, of an empty item between two commas, or saying the text holds no number.
    """
    values: list[float] = []
    for line_no, raw_line in enumerate(text.splitlines() or [""], start=1):
        line = raw_line.split("#", 1)[0]
        _check_empty_items(line, line_no, what)
        for match in _ITEM.finditer(line):
            values.append(_to_float(match.group(), line_no, match.start() + 1, what))
    if not values:
        raise FloatsError(f"{what} {text!r} holds no number: {_EXAMPLE}.")
    return values


def _check_empty_items(line: str, line_no: int, what: str) -> None:
    stripped = line.strip()
    if not stripped:
        return
    for match in re.finditer(r",\s*(?=,)", line):
        raise FloatsError(
            f"{what}: empty item at line {line_no}, column {match.start() + 2}; "
            f"remove the extra comma or put a number there."
        )
    if stripped.startswith(","):
        raise FloatsError(
            f"{what}: empty item at line {line_no}, column {line.index(',') + 1}; "
            f"remove the leading comma."
        )


def _to_float(item: str, line_no: int, column: int, what: str) -> float:
    try:
        value = float(item)
    except ValueError:
        raise FloatsError(
            f"{what}: {item!r} at line {line_no}, column {column} is not a number; {_EXAMPLE}."
        ) from None
    if not math.isfinite(value):
        raise FloatsError(
            f"{what}: {item!r} at line {line_no}, column {column} is not finite; "
            f"use an ordinary number such as 1.0."
        )
    return value


def ramp(start: float, end: float, count: int, easing: str = "linear") -> list[float]:
    """``count`` values from ``start`` to ``end`` (both included), spaced by an easing curve.

    >>> ramp(0.0, 1.0, 5)
    [0.0, 0.25, 0.5, 0.75, 1.0]
    """
    if count < 1:
        raise FloatsError(f"ramp count {count} is below 1; ask for at least one value.")
    curve = EASINGS.get(easing)
    if curve is None:
        raise FloatsError(
            f"unknown easing {easing!r}; choose one of {', '.join(EASINGS)}."
        )
    for name, value in (("start", start), ("end", end)):
        if not math.isfinite(value):
            raise FloatsError(f"ramp {name} {value!r} is not finite; use an ordinary number.")
    if count == 1:
        return [float(start)]
    return [start + (end - start) * curve(i / (count - 1)) for i in range(count)]


def repeat(pattern: str, length: int, mode: str = "cycle") -> list[float]:
    """Repeat the numbers of ``pattern`` until there are ``length`` of them.

    ``cycle`` repeats a, b, c, a, b, c ...; ``pingpong`` goes back and forth a, b, c, b, a, b ...
    without doubling the turning points.

    >>> repeat("0, 1", 5)
    [0.0, 1.0, 0.0, 1.0, 0.0]
    """
    if length < 1:
        raise FloatsError(f"repeat length {length} is below 1; ask for at least one value.")
    if mode not in REPEAT_MODES:
        raise FloatsError(f"unknown repeat mode {mode!r}; choose one of {', '.join(REPEAT_MODES)}.")
    values = parse_floats(pattern, what="repeat pattern")
    period = values if mode == "cycle" or len(values) < 3 else values + values[-2:0:-1]
    return [period[i % len(period)] for i in range(length)]
