"""LORA_STACK lists from other packs (Efficiency Nodes, Comfyroll, LoRA Manager), checked once at the
edge, and the schedule text of each entry.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PureWindowsPath

__all__ = ["StackEntry", "StackError", "entry_schedules", "stack_entries"]

_SHAPE = "(LoRA name, model strength, clip strength)"
_SKIPPED = "None"


class StackError(ValueError):
    """A LORA_STACK that is not a list of (name, model strength, clip strength), or a bad schedule label."""


@dataclass(frozen=True)
class StackEntry:
    """One LoRA of a stack: its 1-based position in the stack as given, file name and strengths."""

    position: int
    name: str
    strength_model: float
    strength_clip: float

    @property
    def stem(self) -> str:
        """The file name without folder and extension, lower case (either separator)."""
        return PureWindowsPath(self.name).stem.lower()


def stack_entries(stack: Sequence | None) -> tuple[StackEntry, ...]:
    """The entries of ``stack`` (None: none), "None" names skipped; raises StackError on a bad entry.

        stack_entries([("ink.safetensors", 0.8, 1.0)])  -> (StackEntry(1, "ink.safetensors", 0.8, 1.0),)
        entry_schedules("2: 0@0, 1@0.5\\nink: 1@0, 0@1", entries)  -> {2: "0@0, 1@0.5", 1: "1@0, 0@1"}

    A LORA_STACK is a list of (LoRA file name, model strength, clip strength) tuples, as Efficiency Nodes'
    LoRA Stacker, Comfyroll's CR LoRA Stack and LoRA Manager's Lora Stacker make it: names as ComfyUI lists
    the loras folder (LoRA Manager writes the OS separator, and an absolute path for a file outside the
    loras roots it knows); "None" entries are skipped, as those packs skip them. Data flow: a node's
    LORA_STACK input -> ``stack_entries`` (shape and numbers checked here) -> per entry the node layer
    resolves the name in the loras folder (comfy_merge/files.py, nearest names on a miss) and
    ``entry_schedules`` gives its schedule text (hooks/schedule_text.py syntax) -> lora_hooks.lora_hook.
    Errors (StackError) name the entry, its value and the fix.
    """
    if stack is None:
        return ()
    if isinstance(stack, (str, bytes, dict)) or not isinstance(stack, Sequence):
        raise StackError(f"LORA_STACK is a {type(stack).__name__}, not a list of {_SHAPE}; connect a LoRA "
                         f"stacker's LORA_STACK output.")
    out = []
    for position, entry in enumerate(stack, start=1):
        where = f"LORA_STACK entry {position} ({entry!r})"
        if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 3:
            raise StackError(f"{where} is not {_SHAPE}; fix or remove it in the node that made the stack.")
        name, *strengths = entry
        if not isinstance(name, str) or not name.strip():
            raise StackError(f"{where} has no LoRA name; pick a LoRA in the node that made the stack.")
        if name.strip() == _SKIPPED:
            continue
        numbers = [_number(value, where, label) for value, label in zip(strengths, ("model", "clip"),
                                                                         strict=True)]
        out.append(StackEntry(position, name.strip(), *numbers))
    return tuple(out)


def _number(value: object, where: str, label: str) -> float:
    """A strength as a float (LoRA Manager's are floats, others' widget values; a numeric string passes)."""
    try:
        number = math.nan if isinstance(value, bool) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise StackError(f"{where}: {label} strength {value!r} is not a finite number; set it in the node "
                         f"that made the stack.")
    return number


_LINE = re.compile(r"^(?P<label>[^:]*):(?P<schedule>[^:]*)$")


def entry_schedules(text: str, entries: Sequence[StackEntry]) -> dict[int, str]:
    """Position -> schedule text, from ``LABEL: schedule`` lines (``#`` comments); LABEL is a 1-based
    stack position or a LoRA name (folder and extension optional, any case: every entry of that name).
    Entries no line names keep a constant strength."""
    out: dict[int, str] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None or not match["label"].strip():
            raise StackError(f"schedules line {line_no} ({line!r}) is not LABEL: schedule; write e.g. "
                             f"'1: 0@0, 1@0.5' (stack position) or 'my_lora: 1@0, 0@0.6' (LoRA name).")
        for position in _positions(match["label"].strip(), entries, line_no):
            out[position] = match["schedule"].strip()
    return out


def _positions(label: str, entries: Sequence[StackEntry], line_no: int) -> list[int]:
    if label.isdigit():
        if any(e.position == int(label) for e in entries):
            return [int(label)]
        held = ", ".join(str(e.position) for e in entries) or "none"
        raise StackError(f"schedules line {line_no}: the stack has no LoRA at position {label} (positions "
                         f"held: {held}); count from 1 as the stack lists them.")
    stem = PureWindowsPath(label.replace("/", "\\")).stem.lower()
    found = [e.position for e in entries if e.stem == stem]
    if found:
        return found
    close = difflib.get_close_matches(stem, list(dict.fromkeys(e.stem for e in entries)), n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
        f"the stack holds {', '.join(repr(e.name) for e in entries) or 'no LoRA'}."
    raise StackError(f"schedules line {line_no}: no LoRA named {label!r} in the stack; {hint}")
