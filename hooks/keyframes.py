"""Patchbay's hook keyframes: core's HookKeyframeGroup never applies a keyframe at percent 1.0; this one
does, and also places keyframes by step or by sigma.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from comfy.hooks import HookKeyframe, HookKeyframeGroup

from .schedule_text import UNITS, Point, ScheduleError

if TYPE_CHECKING:
    from comfy.model_base import BaseModel

__all__ = ["Keyframe", "KeyframeGroup", "keyframes_from_points"]

_ALWAYS = 999999999.9  # core's start_t for percent 0: active from the first call
_NEVER = -1.0  # no sigma is below it
_SLACK = 1.0 + 1e-5  # a step's own sigma, read back in another dtype, still counts as reached


class Keyframe(HookKeyframe):
    """A HookKeyframe positioned by ``unit``: percent (core's ``start_percent``), step or sigma."""

    def __init__(self, strength: float, start_percent: float = 0.0, guarantee_steps: int = 1,
                 unit: str = "percent", at: float | None = None) -> None:
        super().__init__(strength=strength, start_percent=start_percent, guarantee_steps=guarantee_steps)
        if unit not in UNITS:
            raise ScheduleError(f"unknown keyframe unit {unit!r}; choose one of {', '.join(UNITS)}.")
        self.unit = unit
        self.at = float(start_percent if at is None else at)

    def clone(self) -> Keyframe:
        c = Keyframe(self.strength, self.start_percent, self.guarantee_steps, self.unit, self.at)
        c.start_t = self.start_t
        return c

    def start_t_for(self, sample_sigmas: torch.Tensor) -> float | None:
        """This run's start sigma where it depends on the run (None: core's percent_to_sigma stands)."""
        calls = len(sample_sigmas) - 1  # model calls: one per step, at sigmas[0 .. n-1]
        if self.unit == "sigma":
            return self.at
        if self.unit == "step":
            step = int(self.at)
            if step == 0:
                return _ALWAYS
            return float(sample_sigmas[step]) * _SLACK if step < calls else _NEVER
        if self.start_percent >= 1.0 and calls >= 1:
            return float(sample_sigmas[calls - 1]) * _SLACK
        return None


class KeyframeGroup(HookKeyframeGroup):
    """core's HookKeyframeGroup; Patchbay keyframes in it resolve against each run's sigmas.

    Core's keyframe group switches to a keyframe once the sampler's sigma is at or below the keyframe's
    ``start_t = percent_to_sigma(start_percent)``. percent_to_sigma(1.0) is 0, which no model evaluation
    reaches, so a keyframe at percent 1.0 (the last value of CreateHookKeyframesFromFloats) never applies.
    :class:`KeyframeGroup` keeps core's rules for every other keyframe and adds:

    - a keyframe at percent 1.0 starts on the **last step** of the run (the sigma of its last model call);
    - keyframes positioned by **step** (0 = first step; a step past the run is never reached) and by
      **sigma** (starts once the sampler's sigma is at or below it), resolved when a run starts from its
      ``sample_sigmas``.

    It is a ``HookKeyframeGroup`` (socket ``HOOK_KEYFRAMES``): core's SetHookKeyframes, the hook engine
    and core's hook path all drive it through ``initialize_timesteps`` / ``prepare_current_keyframe``.
    Clones (core's CreateHookKeyframe adds to a clone) stay Patchbay groups.
    """

    def __init__(self) -> None:
        super().__init__()
        self._resolved = False

    def clone(self) -> KeyframeGroup:
        c = KeyframeGroup()
        c.keyframes = [kf.clone() for kf in self.keyframes]
        c._set_first_as_current()
        return c

    def reset(self) -> None:
        super().reset()
        self._resolved = False

    def initialize_timesteps(self, model: BaseModel) -> None:
        super().initialize_timesteps(model)
        for kf in self.keyframes:
            if isinstance(kf, Keyframe) and kf.unit == "sigma":
                kf.start_t = kf.at
        self._resolved = False

    def prepare_current_keyframe(self, curr_t: float, transformer_options: dict) -> bool:
        sigmas = transformer_options.get("sample_sigmas")
        if not self._resolved and sigmas is not None and not self.is_empty():
            self._resolve(sigmas)
        return super().prepare_current_keyframe(curr_t, transformer_options)

    def _resolve(self, sigmas: torch.Tensor) -> None:
        for kf in self.keyframes:
            start_t = kf.start_t_for(sigmas) if isinstance(kf, Keyframe) else None
            if start_t is not None:
                kf.start_t = start_t
        # core keeps keyframes in start_percent order; steps and sigmas only order by start_t
        self.keyframes = sorted(self.keyframes, key=lambda kf: -kf.start_t)
        self._current_index = 0
        self._current_keyframe = self.keyframes[0]
        self._resolved = True


def _placeholder_percent(unit: str, at: float) -> float:
    """A start_percent that sorts keyframes of one unit in sampling order before a run resolves them."""
    if unit == "percent":
        return at
    if unit == "step":
        return min(at / 1000.0, 0.999)
    return 1.0 / (1.0 + at)  # higher sigma = earlier


def keyframes_from_points(points: Iterable[Point], unit: str = "percent",
                          prev: HookKeyframeGroup | None = None) -> KeyframeGroup:
    """A new KeyframeGroup: ``prev``'s keyframes (cloned; ``prev`` is not changed) plus one per point.

    The first point gets core's guarantee_steps=1 (as core's keyframe nodes give their first), the
    rest 0.
    """
    group = KeyframeGroup()
    if prev is not None:
        group.keyframes = [kf.clone() for kf in prev.keyframes]
    for i, point in enumerate(points):
        group.add(Keyframe(point.strength, _placeholder_percent(unit, point.at), 1 if i == 0 else 0,
                           unit, point.at))
    return group
