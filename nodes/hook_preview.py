"""Schedule preview node: every hook's strength against step and sampling percent, before sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import comfy.samplers

from ..hooks.preview_plot import preview

if TYPE_CHECKING:
    from comfy.hooks import HookGroup
    from comfy.model_patcher import ModelPatcher


class PatchbayHookSchedulePreview:
    NODE_ID = "PatchbayHookSchedulePreview"
    DISPLAY_NAME = "Hook Schedule Preview (Patchbay)"
    DESCRIPTION = ("Draws every LoRA hook's strength at each step (and its sampling percent) for the given "
                   "steps, scheduler and denoise, without sampling.")
    CATEGORY = "Patchbay/hooks/preview"
    FUNCTION = "draw"
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("image", "report")
    OUTPUT_TOOLTIPS = ("The schedule plot; connect a Preview Image.",
                       "The same as text: the percent of each step and each hook's strengths.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model you sample with (its sigmas place the steps)."}),
                "hooks": ("HOOKS", {"tooltip": "The hooks to draw (a HOOKS output, or several combined)."}),
                "steps": ("INT", {"default": 20, "min": 1, "max": 1000, "tooltip": "The sampler's steps."}),
                "scheduler": (comfy.samplers.KSampler.SCHEDULERS, {"tooltip": "The sampler's scheduler."}),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01,
                                      "tooltip": "The sampler's denoise."}),
            }
        }

    def draw(self, model: ModelPatcher, hooks: HookGroup, steps: int, scheduler: str,
             denoise: float = 1.0) -> tuple:
        return preview(hooks, model, steps, scheduler, denoise)


NODES = [PatchbayHookSchedulePreview]
