"""FLOATS maker nodes: feed ComfyUI's ``CreateHookKeyframesFromFloats`` (and anything else taking FLOATS)."""

from __future__ import annotations

from comfy_api.latest import io

from ..hooks import floats
from . import v3

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


class PatchbayFloatsFromText(v3.Node):
    NODE_ID = "PatchbayFloatsFromText"
    DISPLAY_NAME = "FLOATS from Text (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY,
            description="Makes a FLOATS list from numbers typed as text, e.g. 0, 0.25, 1.",
            inputs=[io.String.Input("text", default="0, 0.25, 0.5, 1", multiline=True,
                                    tooltip="Numbers separated by commas, spaces or new lines; # starts a "
                                            "comment.")],
            outputs=[v3.output(v3.FLOATS, "floats", _FLOATS_TIP),
                     v3.output(io.Int, "count", "How many numbers the list holds.")])

    @classmethod
    def validate_inputs(cls, text: str | None = None) -> bool | str:
        return _validate_text(text, "FLOATS text")

    @classmethod
    def execute(cls, text: str) -> io.NodeOutput:
        values = floats.parse_floats(text)
        return io.NodeOutput(values, len(values))

    make = v3.v1_entry()


class PatchbayFloatsRamp(v3.Node):
    NODE_ID = "PatchbayFloatsRamp"
    DISPLAY_NAME = "FLOATS Ramp (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        number = {"min": -100.0, "max": 100.0, "step": 0.01}
        return v3.schema(
            cls, category=CATEGORY,
            description="Makes a FLOATS list of count values from start to end, spaced by an easing curve.",
            inputs=[io.Float.Input("start", default=0.0, **number, tooltip="First value."),
                    io.Float.Input("end", default=1.0, **number, tooltip="Last value."),
                    io.Int.Input("count", default=5, min=1, max=10000,
                                 tooltip="How many values, start and end included."),
                    io.Combo.Input("easing", options=list(floats.EASINGS), default="linear",
                                   tooltip="Shape of the ramp: linear, or slow at the start (ease_in), the "
                                           "end (ease_out) or both (ease_in_out).")],
            outputs=[v3.output(v3.FLOATS, "floats", _FLOATS_TIP)])

    @classmethod
    def execute(cls, start: float, end: float, count: int, easing: str) -> io.NodeOutput:
        return io.NodeOutput(floats.ramp(start, end, count, easing))

    make = v3.v1_entry()


class PatchbayFloatsRepeat(v3.Node):
    NODE_ID = "PatchbayFloatsRepeat"
    DISPLAY_NAME = "FLOATS Repeat Pattern (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY,
            description="Makes a FLOATS list by repeating a pattern of numbers until it has length values.",
            inputs=[io.String.Input("pattern", default="1, 0",
                                    tooltip="The numbers to repeat, separated by commas or spaces."),
                    io.Int.Input("length", default=6, min=1, max=10000,
                                 tooltip="How many values the list holds; the last repeat is cut to fit."),
                    io.Combo.Input("mode", options=list(floats.REPEAT_MODES), default="cycle",
                                   tooltip="cycle: a b c a b c; pingpong: a b c b a b.")],
            outputs=[v3.output(v3.FLOATS, "floats", _FLOATS_TIP)])

    @classmethod
    def validate_inputs(cls, pattern: str | None = None) -> bool | str:
        return _validate_text(pattern, "repeat pattern")

    @classmethod
    def execute(cls, pattern: str, length: int, mode: str) -> io.NodeOutput:
        return io.NodeOutput(floats.repeat(pattern, length, mode))

    make = v3.v1_entry()


NODES = [PatchbayFloatsFromText, PatchbayFloatsRamp, PatchbayFloatsRepeat]
