"""A1111-style LoRA tags in a prompt: ``<lora:name:0.8>`` and ``<lora:name:0@0,1@0.5>`` (a schedule).

    split_prompt("a knight <lora:armor:0.8>") -> ("a knight", (LoraTag("armor", 0.8, None, 10),))

The text without its tags is what gets encoded; each tag becomes a LoRA hook on that prompt only.
``<lora:name>`` is strength 1. Errors (ScheduleError) name the tag and its column. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .schedule_text import Point, ScheduleError, parse_schedule

__all__ = ["LoraTag", "split_prompt"]

_TAG = re.compile(r"<\s*lora\s*:([^>]*)>", re.IGNORECASE)
_FORM = "write <lora:name:0.8> or <lora:name:0@0,1@0.5>"


@dataclass(frozen=True)
class LoraTag:
    """One tag: the LoRA name as written, its strength, its schedule (None: constant) and column (1-based)."""

    name: str
    strength: float
    schedule: tuple[Point, ...] | None
    column: int


def split_prompt(text: str) -> tuple[str, tuple[LoraTag, ...]]:
    """(the prompt without its LoRA tags, the tags in order). Line breaks count as one column each."""
    tags = tuple(_tag(m.group(1), m.start() + 1, m.group(0)) for m in _TAG.finditer(text))
    opened = text.lower().rfind("<lora:")
    if opened >= 0 and ">" not in text[opened:]:
        raise ScheduleError(f"LoRA tag at column {opened + 1} is not closed: add '>' ({_FORM}).")
    clean = re.sub(r"[ \t]{2,}", " ", _TAG.sub("", text)).strip()
    return clean, tags


def _tag(body: str, column: int, whole: str) -> LoraTag:
    name, _, rest = body.partition(":")
    name = name.strip()
    if not name:
        raise ScheduleError(f"LoRA tag {whole!r} at column {column} has no name; {_FORM}.")
    rest = rest.strip()
    if not rest:
        return LoraTag(name, 1.0, None, column)
    if "@" in rest:
        try:
            points = parse_schedule(rest)
        except ScheduleError as error:
            raise ScheduleError(f"LoRA tag {whole!r} at column {column}: {error}") from None
        return LoraTag(name, 1.0, points, column)
    try:
        strength = float(rest)
    except ValueError:
        raise ScheduleError(f"LoRA tag {whole!r} at column {column}: strength {rest!r} is not a number; "
                            f"{_FORM}.") from None
    return LoraTag(name, strength, None, column)
