"""Candidate full sigma schedules for a run, built with ComfyUI's own schedulers: core passes a run only
its own slice of sigmas, so the global step of a split run is recovered from these.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import comfy.samplers

from .step_clock import CALLBACK_MODE, SIGMA_MODE, ScheduleMatch, locate_run

__all__ = ["clear_cache", "locate", "max_total_steps", "sampler_function_name", "step_mode"]

# KSampler computes one extra step and drops the penultimate sigma for these sampler functions.
_DISCARD_PENULTIMATE = {"sample_dpm_2", "sample_dpm_2_ancestral", "sample_unipc", "sample_unipc_bh2"}
# sgm_uniform(N) == normal(N + 1) but for its last sigma; see _candidates.
_ONE_STEP_LATER = {"sgm_uniform"}
_PROBES = (0.0, 0.25, 0.5, 0.75, 1.0)
# These integrate between the first and last sigma on their own grid (see patcher/step_clock.py).
_OFF_GRID = {"dpm_fast_function", "dpm_adaptive_function", "sample_dpm_fast", "sample_dpm_adaptive"}


def max_total_steps(run_steps: int) -> int:
    """The longest full schedule searched for a run of ``run_steps`` steps."""
    return max(4 * run_steps, run_steps + 64)


def sampler_function_name(sampler: object) -> str:
    """The name of a KSAMPLER's sampling function ("sample_euler", "dpm_fast_function", ...), or ""."""
    function = getattr(sampler, "sampler_function", None)
    while isinstance(function, partial):
        function = function.func
    return getattr(function, "__name__", "") if function is not None else ""


def step_mode(sampler: object) -> str:
    """How steps are followed for this sampler: "sigma" for dpm_fast/dpm_adaptive, else "callback"."""
    return SIGMA_MODE if sampler_function_name(sampler) in _OFF_GRID else CALLBACK_MODE


def _schedule(model_sampling: Any, name: str, total: int, discard_penultimate: bool) -> list[float]:
    if not discard_penultimate:
        return comfy.samplers.calculate_sigmas(model_sampling, name, total).tolist()
    longer = comfy.samplers.calculate_sigmas(model_sampling, name, total + 1).tolist()
    return longer[:-2] + longer[-1:]


def _groups(model_sampling: Any, run_steps: int, discard_penultimate: bool
            ) -> Iterator[list[tuple[str, Sequence[float]]]]:
    """Candidate schedules, one group per total. sgm_uniform(N) joins the group of normal(N + 1),
    whose sigmas it shares but for the last, after it: a run that stops early reads as normal's."""
    low, high = max(run_steps // 2, 1), max_total_steps(run_steps)  # ddim_uniform may give more steps
    names = sorted(comfy.samplers.SCHEDULER_NAMES, key=lambda name: name in _ONE_STEP_LATER)
    for total in range(low, high + 2):
        group: list[tuple[str, Sequence[float]]] = []
        for name in names:
            steps = total - 1 if name in _ONE_STEP_LATER else total
            if low <= steps <= high:
                group.append((name, _schedule(model_sampling, name, steps, False)))
                if discard_penultimate:
                    group.append((name, _schedule(model_sampling, name, steps, True)))
        yield group


@dataclass(frozen=True)
class _Sampling:
    """A model_sampling object compared by what its schedules depend on (its type and sigma curve)."""

    type_name: str
    curve: tuple[float, ...]
    model_sampling: Any = field(compare=False, hash=False)

    @classmethod
    def of(cls, model_sampling: Any) -> _Sampling:
        curve = tuple(float(model_sampling.percent_to_sigma(p)) for p in _PROBES)
        curve += (float(model_sampling.sigma_min), float(model_sampling.sigma_max))
        return cls(type(model_sampling).__qualname__, curve, model_sampling)


@lru_cache(maxsize=128)
def _locate(sampling: _Sampling, run: tuple[float, ...], discard: bool) -> ScheduleMatch:
    return locate_run(run, _groups(sampling.model_sampling, len(run) - 1, discard))


def locate(model_sampling: Any, run_sigmas: Sequence[float], sampler: object = None) -> ScheduleMatch:
    """Where the run with ``run_sigmas`` sits in a schedule of ``model_sampling`` (see module doc).

    Results are memoised per model-sampling curve, sigmas and sampler variant (``clear_cache``).

    core passes a run only its own slice of sigmas (``transformer_options["sample_sigmas"]`` is that
    slice too), so the global step of a split run is recovered here: every scheduler in
    ``comfy.samplers.SCHEDULER_NAMES`` is asked for its schedule at the run's model sampling, for totals
    from the run's own step count up to ``max_total_steps(n)``, and the first one holding the run as a
    contiguous slice wins (patcher/step_clock.py::locate_run has the rule and its limits). sgm_uniform with N
    steps and normal with N + 1 share all sigmas but the last: a run that stops before the end is read as
    normal's (KSampler's default), one that reaches the end is unambiguous. KSampler's variant
    for dpm_2, dpm_2_ancestral, uni_pc and uni_pc_bh2 (one extra step, penultimate sigma dropped) is tried
    for those samplers.
    """
    run = tuple(float(s) for s in run_sigmas)
    if len(run) < 2 or model_sampling is None:
        return locate_run(run, ())
    discard = sampler_function_name(sampler) in _DISCARD_PENULTIMATE
    return _locate(_Sampling.of(model_sampling), run, discard)


def clear_cache() -> None:
    """Forget memoised matches (they hold a reference to their model_sampling object)."""
    _locate.cache_clear()
