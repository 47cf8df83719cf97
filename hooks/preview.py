"""What strength each hook has at each step, before sampling: core's keyframe logic run on a copy, so the
Hook Schedule Preview shows what the sampler will apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import comfy.hooks
import comfy.samplers
import torch

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

__all__ = ["StrengthTrace", "sampling_sigmas", "step_percents", "strength_trace"]


@dataclass(frozen=True)
class StrengthTrace:
    """One hook's strength_model at each step (index = step, 0 = first)."""

    name: str
    strengths: tuple[float, ...]


def sampling_sigmas(model: ModelPatcher, steps: int, scheduler: str, denoise: float = 1.0) -> torch.Tensor:
    """The sigmas KSampler samples with (steps + 1 values, the last 0), denoise as KSampler applies it."""
    if scheduler not in comfy.samplers.SCHEDULER_NAMES:
        names = ", ".join(comfy.samplers.SCHEDULER_NAMES)
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {names}.")
    if steps < 1:
        raise ValueError(f"steps {steps} is below 1; preview at least one step.")
    if not 0.0 < denoise <= 1.0:
        raise ValueError(f"denoise {denoise} is outside (0, 1]; use the sampler's denoise.")
    sampling = model.get_model_object("model_sampling")
    total = int(steps / denoise)
    sigmas = comfy.samplers.calculate_sigmas(sampling, scheduler, total).cpu()
    return sigmas[-(steps + 1):]


def strength_trace(hooks: comfy.hooks.HookGroup, model: ModelPatcher,
                   sigmas: torch.Tensor) -> list[StrengthTrace]:
    """Each WeightHook's strength_model at each step of a run over ``sigmas``, named by its hook_id
    (Patchbay's LoRA nodes set the file name) or its place in the group.

        sampling_sigmas(model, steps, scheduler, denoise) -> the sigmas KSampler would use
        strength_trace(hooks, model, sigmas) -> one StrengthTrace per WeightHook: strength_model per step

    The keyframes are cloned and driven exactly as sampling drives them (initialize_timesteps, then
    prepare_current_keyframe at each step's sigma with ``sample_sigmas`` set), so core's keyframes and
    Patchbay's report what the sampler will apply. Nothing passed in is changed.
    """
    base = model.model
    options = {"sample_sigmas": sigmas}
    traces = []
    for i, hook in enumerate(hooks.get_type(comfy.hooks.EnumHookType.Weight)):
        copy = hook.clone()
        copy.hook_keyframe = hook.hook_keyframe.clone()
        copy.initialize_timesteps(base)
        values = []
        for sigma in sigmas[:-1]:
            copy.hook_keyframe.prepare_current_keyframe(curr_t=sigma, transformer_options=options)
            values.append(float(copy.strength_model))
        traces.append(StrengthTrace(hook.hook_id or f"hook {i + 1}", tuple(values)))
    return traces


def step_percents(model: ModelPatcher, sigmas: torch.Tensor) -> tuple[float, ...]:
    """The sampling percent of each step's sigma (the inverse of model_sampling.percent_to_sigma,
    by bisection, so it holds for any model sampling): the percent a keyframe needs to start there."""
    sampling = model.get_model_object("model_sampling")
    percents = []
    for sigma in sigmas[:-1].tolist():
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sampling.percent_to_sigma(mid) > sigma else (lo, mid)
        percents.append(round(hi, 4))
    return tuple(percents)
