"""FLOATS maker nodes: feed ComfyUI's ``CreateHookKeyframesFromFloats`` (and anything else taking FLOATS)."""

from __future__ import annotations

from ..hooks import floats

CATEGORY = "Patchbay/schedule"
_FLOATS_TIP = "A list of numbers, e.g. for Create Hook Keyframes From Floats (floats_strength)."


def _validate_text(text: str | None, what: str) -> bool | str:
    """A FLOATS text error at validation time, before anything runs (True when fine or linked)."""
    if text is None:
        return True
    try:
        floats.parse_floats(text, what=what)
    except floats.FloatsError as error:
        return str(error)
    return True


class PatchbayFloatsFromText:
    NODE_ID = "PatchbayFloatsFromText"
    DISPLAY_NAME = "FLOATS from Text (Patchbay)"
    DESCRIPTION = "Makes a FLOATS list from numbers typed as text, e.g. 0, 0.25, 1."
    CATEGORY = CATEGORY
    FUNCTION = "make"
    RETURN_TYPES = ("FLOATS", "INT")
    RETURN_NAMES = ("floats", "count")
    OUTPUT_TOOLTIPS = (_FLOATS_TIP, "How many numbers the list holds.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "text": ("STRING", {
                    "default": "0, 0.25, 0.5, 1",
                    "multiline": True,
                    "tooltip": "Numbers separated by commas, spaces or new lines; # starts a comment.",
                }),
            }
        }

    @classmethod
    def VALIDATE_INPUTS(cls, text: str | None = None) -> bool | str:
        return _validate_text(text, "FLOATS text")

    def make(self, text: str) -> tuple[list[float], int]:
        values = floats.parse_floats(text)
        return (values, len(values))


class PatchbayFloatsRamp:
    NODE_ID = "PatchbayFloatsRamp"
    DISPLAY_NAME = "FLOATS Ramp (Patchbay)"
    DESCRIPTION = "Makes a FLOATS list of count values from start to end, spaced by an easing curve."
    CATEGORY = CATEGORY
    FUNCTION = "make"
    RETURN_TYPES = ("FLOATS",)
    RETURN_NAMES = ("floats",)
    OUTPUT_TOOLTIPS = (_FLOATS_TIP,)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        number = {"min": -100.0, "max": 100.0, "step": 0.01}
        return {
            "required": {
                "start": ("FLOAT", {**number, "default": 0.0, "tooltip": "First value."}),
                "end": ("FLOAT", {**number, "default": 1.0, "tooltip": "Last value."}),
                "count": ("INT", {
                    "default": 5, "min": 1, "max": 10000,
                    "tooltip": "How many values, start and end included.",
                }),
                "easing": (list(floats.EASINGS), {
                    "default": "linear",
                    "tooltip": "Shape of the ramp: linear, or slow at the start (ease_in), "
                               "the end (ease_out) or both (ease_in_out).",
                }),
            }
        }

    def make(self, start: float, end: float, count: int, easing: str) -> tuple[list[float]]:
        return (floats.ramp(start, end, count, easing),)


class PatchbayFloatsRepeat:
    NODE_ID = "PatchbayFloatsRepeat"
    DISPLAY_NAME = "FLOATS Repeat Pattern (Patchbay)"
    DESCRIPTION = "Makes a FLOATS list by repeating a pattern of numbers until it has length values."
    CATEGORY = CATEGORY
    FUNCTION = "make"
    RETURN_TYPES = ("FLOATS",)
    RETURN_NAMES = ("floats",)
    OUTPUT_TOOLTIPS = (_FLOATS_TIP,)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "pattern": ("STRING", {
                    "default": "1, 0",
                    "tooltip": "The numbers to repeat, separated by commas or spaces.",
                }),
                "length": ("INT", {
                    "default": 6, "min": 1, "max": 10000,
                    "tooltip": "How many values the list holds; the last repeat is cut to fit.",
                }),
                "mode": (list(floats.REPEAT_MODES), {
                    "default": "cycle",
                    "tooltip": "cycle: a b c a b c; pingpong: a b c b a b.",
                }),
            }
        }

    @classmethod
    def VALIDATE_INPUTS(cls, pattern: str | None = None) -> bool | str:
        return _validate_text(pattern, "repeat pattern")

    def make(self, pattern: str, length: int, mode: str) -> tuple[list[float]]:
        return (floats.repeat(pattern, length, mode),)


NODES = [PatchbayFloatsFromText, PatchbayFloatsRamp, PatchbayFloatsRepeat]
