"""A1111-style LoRA tags in a prompt (``<lora:name:0.8>``, ``<lora:name:0@0,1@0.5>``): the text without its
tags is encoded and each tag becomes a LoRA hook on that prompt only. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import lbw
from .schedule_text import Point, ScheduleError, parse_schedule

__all__ = ["LoraTag", "split_prompt"]

_TAG = re.compile(r"<\s*lora\s*:([^>]*)>", re.IGNORECASE)
_FORM = "write <lora:name:0.8>, <lora:name:0@0,1@0.5> or <lora:name:0.8:lbw=OUTALL>"


@dataclass(frozen=True)
class LoraTag:
    """One tag: the LoRA name as written, its strength, its schedule (None: constant), column (1-based)
    and its ``lbw=`` block weights as written (None: every block at full strength)."""

    name: str
    strength: float
    schedule: tuple[Point, ...] | None
    column: int
    blocks: str | None = None


def split_prompt(text: str) -> tuple[str, tuple[LoraTag, ...]]:
    """(the prompt without its LoRA tags, the tags in order). Line breaks count as one column each.

        split_prompt("a knight <lora:armor:0.8>") -> ("a knight", (LoraTag("armor", 0.8, None, 10),))
        split_prompt("<lora:armor:0.8:lbw=OUTALL>")  -> a tag whose ``blocks`` is "OUTALL"

    ``<lora:name>`` is strength 1. ``lbw=`` (the LoRA Block Weight extension's preset or number list,
    hooks/lbw.py) is checked here for what needs no model; the node maps it to blocks. Errors
    (ScheduleError) name the tag and its column.
    """
    tags = tuple(_tag(m.group(1), m.start() + 1, m.group(0)) for m in _TAG.finditer(text))
    opened = text.lower().rfind("<lora:")
    if opened >= 0 and ">" not in text[opened:]:
        raise ScheduleError(f"LoRA tag at column {opened + 1} is not closed: add '>' ({_FORM}).")
    clean = re.sub(r"[ \t]{2,}", " ", _TAG.sub("", text)).strip()
    return clean, tags


def _tag(body: str, column: int, whole: str) -> LoraTag:
    name, *items = body.split(":")
    name = name.strip()
    if not name:
        raise ScheduleError(f"LoRA tag {whole!r} at column {column} has no name; {_FORM}.")
    keyed = [item.strip() for item in items if "=" in item]
    rest = [item.strip() for item in items if "=" not in item and item.strip()]
    blocks = _blocks(keyed, column, whole)
    if len(rest) > 1:
        raise ScheduleError(f"LoRA tag {whole!r} at column {column} has {len(rest)} strengths; separate "
                            f"model and CLIP strengths are not supported here: {_FORM}.")
    if not rest:
        return LoraTag(name, 1.0, None, column, blocks)
    if "@" in rest[0]:
        try:
            points = parse_schedule(rest[0])
        except ScheduleError as error:
            raise ScheduleError(f"LoRA tag {whole!r} at column {column}: {error}") from None
        return LoraTag(name, 1.0, points, column, blocks)
    try:
        strength = float(rest[0])
    except ValueError:
        raise ScheduleError(f"LoRA tag {whole!r} at column {column}: strength {rest[0]!r} is not a number; "
                            f"{_FORM}.") from None
    return LoraTag(name, strength, None, column, blocks)


def _blocks(keyed: list[str], column: int, whole: str) -> str | None:
    """The ``lbw=`` value among a tag's key=value items (checked), None without one."""
    found = None
    for item in keyed:
        key, _, value = item.partition("=")
        if key.strip().lower() != "lbw":
            raise ScheduleError(f"LoRA tag {whole!r} at column {column}: {key.strip()}= is not supported "
                                f"(only lbw=); for start/stop write a schedule, e.g. <lora:name:1@0,0@0.5>.")
        try:
            lbw.check_spec(value)
        except lbw.LbwError as error:
            raise ScheduleError(f"LoRA tag {whole!r} at column {column}: {error}") from None
        found = value.strip()
    return found
