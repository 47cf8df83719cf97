"""Keyframe nodes (HOOK_KEYFRAMES) that reach their last value on the last step; text, steps and sigmas."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..hooks import schedule_text
from ..hooks.keyframes import keyframes_from_points

if TYPE_CHECKING:
    from comfy.hooks import HookKeyframeGroup

CATEGORY = "Patchbay/hooks/scheduling"
_OUT_TIP = ("Keyframes for Set Hook Keyframes or a Patchbay LoRA hook; a keyframe at percent 1 "
            "starts on the last step.")
_PERCENT = {"min": 0.0, "max": 1.0, "step": 0.001}
_STRENGTH = {"min": -20.0, "max": 20.0, "step": 0.001}
_PREV = {"prev_hook_kf": ("HOOK_KEYFRAMES", {"tooltip": "Optional keyframes to add these to (not changed)."})}


def _validate(text: str | None, positions: str | None) -> bool | str:
    """Schedule text errors at validation time, before anything runs (True when fine or linked)."""
    if text is None:
        return True
    try:
        schedule_text.parse_schedule(text, positions or "percent")
    except schedule_text.ScheduleError as error:
        return str(error)
    return True


class _Keyframes:
    CATEGORY = CATEGORY
    FUNCTION = "make"
    RETURN_TYPES = ("HOOK_KEYFRAMES",)
    RETURN_NAMES = ("HOOK_KF",)
    OUTPUT_TOOLTIPS = (_OUT_TIP,)


class PatchbayHookKeyframe(_Keyframes):
    NODE_ID = "PatchbayHookKeyframe"
    DISPLAY_NAME = "Hook Keyframe (Patchbay)"
    DESCRIPTION = "One hook keyframe: strength from start_percent on (1.0 = the last step)."

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "strength": ("FLOAT", {**_STRENGTH, "default": 1.0,
                                       "tooltip": "Multiplies the hook's strength from this keyframe on."}),
                "start_percent": ("FLOAT", {**_PERCENT, "default": 0.0,
                                            "tooltip": "Sampling percent where it starts: 0 first step, "
                                                       "1 the last step."}),
            },
            "optional": _PREV,
        }

    def make(self, strength: float, start_percent: float,
             prev_hook_kf: HookKeyframeGroup | None = None) -> tuple[HookKeyframeGroup]:
        at = schedule_text.check_percent(start_percent, "start_percent")
        return (keyframes_from_points([schedule_text.Point(strength, at)], prev=prev_hook_kf),)


class PatchbayHookKeyframesInterpolated(_Keyframes):
    NODE_ID = "PatchbayHookKeyframesInterpolated"
    DISPLAY_NAME = "Hook Keyframes Interpolated (Patchbay)"
    DESCRIPTION = ("keyframes_count keyframes evenly from start to end percent, strengths eased from "
                   "strength_start to strength_end; the last one applies on the last step when end is 1.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "strength_start": ("FLOAT", {**_STRENGTH, "default": 1.0, "tooltip": "First strength."}),
                "strength_end": ("FLOAT", {**_STRENGTH, "default": 0.0, "tooltip": "Last strength."}),
                "interpolation": (list(schedule_text.INTERPOLATIONS), {
                    "default": "linear",
                    "tooltip": "How strengths move between the ends (core's formulas)."}),
                "start_percent": ("FLOAT", {**_PERCENT, "default": 0.0,
                                            "tooltip": "Where the first keyframe is."}),
                "end_percent": ("FLOAT", {**_PERCENT, "default": 1.0,
                                          "tooltip": "Where the last keyframe is; 1 = the last step."}),
                "keyframes_count": ("INT", {"default": 5, "min": 2, "max": 100,
                                            "tooltip": "How many keyframes, both ends included."}),
            },
            "optional": _PREV,
        }

    def make(self, strength_start: float, strength_end: float, interpolation: str, start_percent: float,
             end_percent: float, keyframes_count: int,
             prev_hook_kf: HookKeyframeGroup | None = None) -> tuple[HookKeyframeGroup]:
        points = schedule_text.interpolate(strength_start, strength_end, keyframes_count, interpolation,
                                           start_percent, end_percent)
        return (keyframes_from_points(points, prev=prev_hook_kf),)


class PatchbayHookKeyframesFromFloats(_Keyframes):
    NODE_ID = "PatchbayHookKeyframesFromFloats"
    DISPLAY_NAME = "Hook Keyframes From FLOATS (Patchbay)"
    DESCRIPTION = ("One keyframe per FLOATS value, evenly from start to end percent; unlike core's node the "
                   "last value applies (on the last step when end_percent is 1).")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "floats": ("FLOATS", {"forceInput": True,
                                      "tooltip": "Strengths, e.g. from FLOATS from Text / Ramp / Repeat."}),
                "start_percent": ("FLOAT", {**_PERCENT, "default": 0.0,
                                            "tooltip": "Where the first value starts."}),
                "end_percent": ("FLOAT", {**_PERCENT, "default": 1.0,
                                          "tooltip": "Where the last value starts; 1 = the last step."}),
            },
            "optional": _PREV,
        }

    def make(self, floats: list[float], start_percent: float, end_percent: float,
             prev_hook_kf: HookKeyframeGroup | None = None) -> tuple[HookKeyframeGroup]:
        points = schedule_text.spread(floats, start_percent, end_percent)
        return (keyframes_from_points(points, prev=prev_hook_kf),)


class PatchbayHookKeyframesFromText(_Keyframes):
    NODE_ID = "PatchbayHookKeyframesFromText"
    DISPLAY_NAME = "Hook Keyframes From Text (Patchbay)"
    DESCRIPTION = ("Keyframes typed as strength@position (loractl form, e.g. 0@0, 1@0.3, 0.2@1); "
                   "positions in "
                   "sampling percent, in steps or in sigmas.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "text": ("STRING", {"default": "0@0, 1@0.3, 0.2@1", "multiline": True,
                                    "tooltip": "strength@position items separated by commas or new lines; "
                                               "# starts a comment."}),
                "positions": (list(schedule_text.UNITS), {
                    "default": "percent",
                    "tooltip": "percent: 0 first step .. 1 last step; step: step number, 0 = the first; "
                               "sigma: starts once the sampler's sigma is at or below it "
                               "(two-stage models)."}),
            },
            "optional": _PREV,
        }

    @classmethod
    def VALIDATE_INPUTS(cls, text: str | None = None, positions: str | None = None) -> bool | str:
        return _validate(text, positions)

    def make(self, text: str, positions: str,
             prev_hook_kf: HookKeyframeGroup | None = None) -> tuple[HookKeyframeGroup]:
        points = schedule_text.parse_schedule(text, positions)
        return (keyframes_from_points(points, positions, prev=prev_hook_kf),)


NODES = [PatchbayHookKeyframe, PatchbayHookKeyframesInterpolated, PatchbayHookKeyframesFromFloats,
         PatchbayHookKeyframesFromText]
