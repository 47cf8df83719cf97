"""Schedule preview node: every hook's strength against step and sampling percent, before sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import comfy.samplers
from comfy_api.latest import io

from ..hooks.preview_plot import preview
from . import v3

if TYPE_CHECKING:
    from comfy.hooks import HookGroup
    from comfy.model_patcher import ModelPatcher


class PatchbayHookSchedulePreview(v3.Node):
    NODE_ID = "PatchbayHookSchedulePreview"
    DISPLAY_NAME = "Hook Schedule Preview (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category="Patchbay/hooks/preview",
            description=("Draws every LoRA hook's strength at each step (and its sampling percent) for the "
                         "given steps, scheduler and denoise, without sampling."),
            inputs=[
                io.Model.Input("model", tooltip="The model you sample with (its sigmas place the steps)."),
                io.Hooks.Input("hooks", tooltip="The hooks to draw (a HOOKS output, or several combined)."),
                io.Int.Input("steps", default=20, min=1, max=1000, tooltip="The sampler's steps."),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS,
                               tooltip="The sampler's scheduler."),
                io.Float.Input("denoise", default=1.0, min=0.01, max=1.0, step=0.01,
                               tooltip="The sampler's denoise."),
            ],
            outputs=[
                v3.output(io.Image, "image", "The schedule plot; connect a Preview Image."),
                v3.output(io.String, "report", "The same as text: the percent of each step and each hook's "
                                               "strengths."),
            ])

    @classmethod
    def execute(cls, model: ModelPatcher, hooks: HookGroup, steps: int, scheduler: str,
                denoise: float = 1.0) -> io.NodeOutput:
        return io.NodeOutput(*preview(hooks, model, steps, scheduler, denoise))


NODES = [PatchbayHookSchedulePreview]
