"""Pure step bookkeeping behind patcher/events.py: which step a sampler is in, and where a run sits in
the full sigma schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["CALLBACK_MODE", "SIGMA_MODE", "Emission", "ScheduleMatch", "StepTracker", "cond_active",
           "find_slice", "locate_run"]

CALLBACK_MODE = "callback"
SIGMA_MODE = "sigma"
REL_TOL = 1e-5
ABS_TOL = 1e-7


def cond_active(cond: dict, sigma: float) -> bool:
    """Whether core evaluates ``cond`` at ``sigma``: its rule for a cond's timestep range
    (``timestep_start`` / ``timestep_end``, in sigmas) in comfy/samplers.py::get_area_and_mult."""
    start, end = cond.get("timestep_start"), cond.get("timestep_end")
    return not (start is not None and sigma > start) and not (end is not None and sigma < end)


@dataclass(frozen=True)
class Emission:
    """One step event to fire: ``name`` is "step_start" or "step_end", ``step`` the run-local index."""

    name: str
    step: int


class StepTracker:
    """Turns model evaluations and sampler callbacks into ordered step_start/step_end emissions.

    **Steps of one run.** A run samples ``n = len(sigmas) - 1`` steps; step ``i`` covers the sigma
    interval ``(sigmas[i + 1], sigmas[i]]``. A model evaluation at sigma ``s`` belongs to the step whose
    interval holds ``s``, never to an earlier step than the current one. k-diffusion samplers call their
    per-step callback with ``i`` right after the *first* evaluation of step ``i`` and evaluate the rest of
    the step afterwards (heun's corrector at ``sigmas[i + 1]``, dpmpp_sde's midpoint, heunpp2's look
    ahead to ``sigmas[i + 2]``), so in ``"callback"`` mode (every schedule-following sampler):

    - an evaluation may move at most one step past the last step the callback reported;
    - callback ``i`` means step ``i`` has begun (earlier steps end, step ``i`` starts if it had not).

    So step ``i`` starts right before the first evaluation inside its interval and ends right before
    the first evaluation of a later step (or when the sampler returns). An evaluation exactly at
    ``sigmas[i + 1]`` (heun's corrector) counts for step ``i + 1``: hooks see that sigma as step
    ``i + 1`` too. In ``"sigma"`` mode (dpm_fast, dpm_adaptive: they use only the first and last sigma,
    pick their own points and number their callbacks on their own grid) callbacks are ignored and the
    interval rule alone applies. Steps never reached start and end when the sampler returns, so every
    run emits ``step_start``/``step_end`` exactly once per step, in order.

    **Global position.** A split run (KSamplerAdvanced start/end step, SplitSigmas, denoise < 1) sees
    only a slice of the schedule. ``locate_run`` finds the run's sigmas as a contiguous slice of a
    candidate full schedule (shortest first); see ``locate_run`` for the rule and its limits.
    """

    def __init__(self, sigmas: Sequence[float], mode: str = CALLBACK_MODE) -> None:
        if mode not in (CALLBACK_MODE, SIGMA_MODE):
            raise ValueError(f"mode {mode!r} is not {CALLBACK_MODE!r} or {SIGMA_MODE!r}")
        self.sigmas = tuple(float(s) for s in sigmas)
        self.steps = max(len(self.sigmas) - 1, 0)
        self.mode = mode
        self.started = 0
        self.ended = 0
        self.reported = -1

    @property
    def current(self) -> int:
        """The step an evaluation now belongs to (the open step, else the last one that ended)."""
        return max(min(self.started - 1, self.steps - 1), 0)

    def _floor(self) -> int:
        return self.current if self.started else 0

    def _advance_to(self, step: int) -> list[Emission]:
        """End every step before ``step`` and start ``step`` (starting skipped steps on the way)."""
        out: list[Emission] = []
        step = min(step, self.steps - 1)
        while self.ended < step:
            if self.started == self.ended:
                out.append(Emission("step_start", self.started))
                self.started += 1
            out.append(Emission("step_end", self.ended))
            self.ended += 1
        if self.started == self.ended and self.started < self.steps:
            out.append(Emission("step_start", self.started))
            self.started += 1
        return out

    def evaluation(self, sigma: float) -> tuple[list[Emission], int]:
        """Emissions due before a model evaluation at ``sigma``, and the step it belongs to."""
        target = self.interval_of(sigma)
        if self.mode == CALLBACK_MODE:
            target = min(target, self.reported + 1)
        return self._advance_to(max(target, self._floor())), self.current

    def callback(self, index: int) -> list[Emission]:
        """Emissions due when the sampler reports step ``index`` (ignored in sigma mode)."""
        if self.mode == SIGMA_MODE or not 0 <= index < self.steps:
            return []
        self.reported = max(self.reported, index)
        return self._advance_to(max(index, self._floor()))

    def finish(self) -> list[Emission]:
        """Emissions that end the run: the open step and any step never reached."""
        out = self._advance_to(self.steps - 1) if self.steps else []
        if self.ended < self.started:
            out.append(Emission("step_end", self.ended))
            self.ended += 1
        return out

    def interval_of(self, sigma: float) -> int:
        """The step whose interval ``(sigmas[i + 1], sigmas[i]]`` holds ``sigma`` (clamped to the run)."""
        step = 0
        while step + 1 < self.steps and self.sigmas[step + 1] >= sigma - ABS_TOL - REL_TOL * abs(sigma):
            step += 1
        return step


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def _slice_at(run: Sequence[float], full: Sequence[float], start: int) -> bool:
    return all(_close(run[j], full[start + j]) for j in range(len(run)))


def find_slice(run: Sequence[float], full: Sequence[float], *, forced_end: bool = False) -> int | None:
    """Where ``run`` sits in ``full`` as a contiguous slice, or None.

    ``forced_end=True`` instead matches a run whose last sigma is 0 against a slice whose last value
    was replaced by 0 (what KSampler does for ``force_full_denoise``).
    """
    size = len(run)
    if size < 2 or size > len(full) or (forced_end and run[-1] != 0.0):
        return None
    head = run[:-1] if forced_end else run
    for start in range(len(full) - size + 1):
        if forced_end and full[start + size - 1] == 0.0:
            continue
        if _slice_at(head, full, start):
            return start
    return None


@dataclass(frozen=True)
class ScheduleMatch:
    """Where a run sits: its first global step, the schedule's step count, the schedule itself.

    ``known`` is False when no candidate schedule held the run; then the run is its own schedule
    (``first_step`` 0, ``total_steps`` its own step count).
    """

    first_step: int
    total_steps: int
    schedule: tuple[float, ...]
    scheduler: str | None = None
    known: bool = False


def locate_run(run: Sequence[float], groups: Iterable[Sequence[tuple[str, Sequence[float]]]]
               ) -> ScheduleMatch:
    """The first candidate ``(scheduler name, full sigmas)`` that holds ``run`` as a slice.

    ``groups`` hold candidates of one total step count each, by increasing total; within a group an
    exact slice beats a ``force_full_denoise`` one. Rule: the shortest schedule that holds the run
    wins, so a complete run is always its own schedule. Limits: a run cut from a longer schedule by
    ``denoise < 1`` has exactly the sigmas of the matching KSamplerAdvanced split and is reported the
    same way (steps ``total - n .. total - 1``); a one-step tail ``[sigma_min, 0]`` matches many totals
    and gets the smallest; custom sigmas match nothing and fall back to the run itself.
    """
    values = tuple(float(s) for s in run)
    for group in groups:
        for forced_end in (False, True):
            for name, full in group:
                start = find_slice(values, full, forced_end=forced_end)
                if start is not None:
                    schedule = tuple(float(s) for s in full)
                    return ScheduleMatch(start, len(schedule) - 1, schedule, name, True)
    return ScheduleMatch(0, max(len(values) - 1, 0), values, None, False)
