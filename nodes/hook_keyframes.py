"""Keyframe nodes (HOOK_KEYFRAMES) that reach their last value on the last step; text, steps and sigmas."""

from __future__ import annotations

from typing import TYPE_CHECKING

from comfy_api.latest import io

from ..hooks import schedule_text
from ..hooks.keyframes import keyframes_from_points
from . import v3

if TYPE_CHECKING:
    from comfy.hooks import HookKeyframeGroup

CATEGORY = "Patchbay/hooks/scheduling"
_OUT_TIP = ("Keyframes for Set Hook Keyframes or a Patchbay LoRA hook; a keyframe at percent 1 "
            "starts on the last step.")
_PERCENT = {"min": 0.0, "max": 1.0, "step": 0.001}
_STRENGTH = {"min": -20.0, "max": 20.0, "step": 0.001}


def _validate(text: str | None, positions: str | None) -> bool | str:
    """Schedule text errors at validation time, before anything runs (True when fine or linked)."""
    if text is None:
        return True
    try:
        schedule_text.parse_schedule(text, positions or "percent")
    except schedule_text.ScheduleError as error:
        return str(error)
    return True


def _prev() -> io.Input:
    return io.HookKeyframes.Input("prev_hook_kf", optional=True,
                                  tooltip="Optional keyframes to add these to (not changed).")


def _percent(name: str, default: float, tooltip: str) -> io.Input:
    return io.Float.Input(name, **_PERCENT, default=default, tooltip=tooltip)


def _schema(node: type[v3.Node], description: str, inputs: list[io.Input]) -> io.Schema:
    """A keyframe node's schema: its inputs, then prev_hook_kf; one HOOK_KF output."""
    return v3.schema(node, category=CATEGORY, description=description, inputs=[*inputs, _prev()],
                     outputs=[v3.output(io.HookKeyframes, "HOOK_KF", _OUT_TIP)])


class PatchbayHookKeyframe(v3.Node):
    NODE_ID = "PatchbayHookKeyframe"
    DISPLAY_NAME = "Hook Keyframe (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return _schema(cls, "One hook keyframe: strength from start_percent on (1.0 = the last step).", [
            io.Float.Input("strength", **_STRENGTH, default=1.0,
                           tooltip="Multiplies the hook's strength from this keyframe on."),
            _percent("start_percent", 0.0,
                     "Sampling percent where it starts: 0 first step, 1 the last step."),
        ])

    @classmethod
    def execute(cls, strength: float, start_percent: float,
                prev_hook_kf: HookKeyframeGroup | None = None) -> io.NodeOutput:
        at = schedule_text.check_percent(start_percent, "start_percent")
        return io.NodeOutput(keyframes_from_points([schedule_text.Point(strength, at)], prev=prev_hook_kf))


class PatchbayHookKeyframesInterpolated(v3.Node):
    NODE_ID = "PatchbayHookKeyframesInterpolated"
    DISPLAY_NAME = "Hook Keyframes Interpolated (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return _schema(cls, (
            "keyframes_count keyframes evenly from start to end percent, strengths eased from "
            "strength_start to strength_end; the last one applies on the last step when end is 1."), [
            io.Float.Input("strength_start", **_STRENGTH, default=1.0, tooltip="First strength."),
            io.Float.Input("strength_end", **_STRENGTH, default=0.0, tooltip="Last strength."),
            io.Combo.Input("interpolation", options=list(schedule_text.INTERPOLATIONS), default="linear",
                           tooltip="How strengths move between the ends (core's formulas)."),
            _percent("start_percent", 0.0, "Where the first keyframe is."),
            _percent("end_percent", 1.0, "Where the last keyframe is; 1 = the last step."),
            io.Int.Input("keyframes_count", default=5, min=2, max=100,
                         tooltip="How many keyframes, both ends included."),
        ])

    @classmethod
    def execute(cls, strength_start: float, strength_end: float, interpolation: str, start_percent: float,
                end_percent: float, keyframes_count: int,
                prev_hook_kf: HookKeyframeGroup | None = None) -> io.NodeOutput:
        points = schedule_text.interpolate(strength_start, strength_end, keyframes_count, interpolation,
                                           start_percent, end_percent)
        return io.NodeOutput(keyframes_from_points(points, prev=prev_hook_kf))


class PatchbayHookKeyframesFromFloats(v3.Node):
    NODE_ID = "PatchbayHookKeyframesFromFloats"
    DISPLAY_NAME = "Hook Keyframes From FLOATS (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return _schema(cls, (
            "One keyframe per FLOATS value, evenly from start to end percent; unlike core's node the last "
            "value applies (on the last step when end_percent is 1)."), [
            v3.FLOATS.Input("floats", extra_dict={"forceInput": True},
                            tooltip="Strengths, e.g. from FLOATS from Text / Ramp / Repeat."),
            _percent("start_percent", 0.0, "Where the first value starts."),
            _percent("end_percent", 1.0, "Where the last value starts; 1 = the last step."),
        ])

    @classmethod
    def execute(cls, floats: list[float], start_percent: float, end_percent: float,
                prev_hook_kf: HookKeyframeGroup | None = None) -> io.NodeOutput:
        points = schedule_text.spread(floats, start_percent, end_percent)
        return io.NodeOutput(keyframes_from_points(points, prev=prev_hook_kf))


class PatchbayHookKeyframesFromText(v3.Node):
    NODE_ID = "PatchbayHookKeyframesFromText"
    DISPLAY_NAME = "Hook Keyframes From Text (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return _schema(cls, (
            "Keyframes typed as strength@position (loractl form, e.g. 0@0, 1@0.3, 0.2@1); positions in "
            "sampling percent, in steps or in sigmas."), [
            io.String.Input("text", default="0@0, 1@0.3, 0.2@1", multiline=True,
                            tooltip="strength@position items separated by commas or new lines; # starts a "
                                    "comment."),
            io.Combo.Input("positions", options=list(schedule_text.UNITS), default="percent",
                           tooltip="percent: 0 first step .. 1 last step; step: step number, 0 = the first; "
                                   "sigma: starts once the sampler's sigma is at or below it (two-stage "
                                   "models)."),
        ])

    @classmethod
    def validate_inputs(cls, text: str | None = None, positions: str | None = None) -> bool | str:
        return _validate(text, positions)

    @classmethod
    def execute(cls, text: str, positions: str,
                prev_hook_kf: HookKeyframeGroup | None = None) -> io.NodeOutput:
        points = schedule_text.parse_schedule(text, positions)
        return io.NodeOutput(keyframes_from_points(points, positions, prev=prev_hook_kf))


NODES = [PatchbayHookKeyframe, PatchbayHookKeyframesInterpolated, PatchbayHookKeyframesFromFloats,
         PatchbayHookKeyframesFromText]
