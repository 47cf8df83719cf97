"""Patcher nodes: the patch order of a MODEL, tracing its sampling runs, and the timeline of the last run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..patcher import model_patcher, patch_order, trace, trace_plot

if TYPE_CHECKING:
    import torch
    from comfy.model_patcher import ModelPatcher

CATEGORY = "Patchbay/patcher"
_MODEL_TIP = "The model whose patches are ordered; it is cloned, never changed."
_NO_TRACE = "no trace recorded for this model"
_NO_TRACE_FIX = ("put Trace Sampling (Patchbay) before the sampler, give the sampler and Trace Timeline "
                 "the same MODEL, and connect the sampler's LATENT to Trace Timeline.")


class PatchbayPatchOrder:
    NODE_ID = "PatchbayPatchOrder"
    DISPLAY_NAME = "Patch Order (Patchbay)"
    DESCRIPTION = ("Sets, for this model only, whether LoRAs patch the weights before object patches "
                   "such as torch.compile are applied, and whether the model is fully loaded.")
    CATEGORY = CATEGORY
    FUNCTION = "patch"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("A clone of the model that applies its patches in the chosen order.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": _MODEL_TIP}),
                "patch_order": (list(patch_order.PATCH_ORDERS), {
                    "default": "weight_patch_first",
                    "tooltip": "weight_patch_first: LoRAs and hooks patch the model's own weights, then "
                               "object patches (a compiled UNet or blocks) wrap them; use it with "
                               "torch.compile. object_patch_first: ComfyUI's own order.",
                }),
                "full_load": (list(patch_order.FULL_LOAD_MODES), {
                    "default": "auto",
                    "tooltip": "auto: ComfyUI decides. enabled: load every layer to the GPU even past "
                               "the VRAM budget (no streamed layers, no recompiles from them). "
                               "disabled: never force it; layers past the budget stay in RAM.",
                }),
            }
        }

    def patch(self, model: ModelPatcher, patch_order: str, full_load: str) -> tuple[ModelPatcher]:
        return (model_patcher.set_patch_order(model, patch_order, full_load),)


class PatchbayTrace:
    NODE_ID = "PatchbayTrace"
    DISPLAY_NAME = "Trace Sampling (Patchbay)"
    DESCRIPTION = ("Records which hooks, patches and wrappers run at each sampler step of this model, "
                   "for Trace Timeline and the DEBUG log (logger patchbay.trace).")
    CATEGORY = CATEGORY
    FUNCTION = "trace"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("A clone of the model that records a trace of every sampling run; connect it "
                       "to the sampler and to Trace Timeline.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        tip = "The model to trace; it is cloned, never changed."
        return {"required": {"model": ("MODEL", {"tooltip": tip})}}

    def trace(self, model: ModelPatcher) -> tuple[ModelPatcher]:
        return (trace.enable_trace(model_patcher.upgrade(model)),)


class PatchbayTraceTimeline:
    NODE_ID = "PatchbayTraceTimeline"
    DISPLAY_NAME = "Trace Timeline (Patchbay)"
    DESCRIPTION = ("Draws which hooks, patches and wrappers ran at which sampler step, and how strong, "
                   "in the last sampling run of this model; also as text.")
    CATEGORY = CATEGORY
    FUNCTION = "plot"
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("timeline", "report")
    OUTPUT_TOOLTIPS = ("Steps across, one lane per hook, patch or wrapper; bar height and colour are "
                       "the strength.", "The same trace as plain text, one line per lane and per step.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model the sampler used, traced by Trace Sampling "
                                               "(Patchbay) (or a clone of it)."}),
            },
            "optional": {
                "latent": ("LATENT", {
                    "tooltip": "Connect the sampler's LATENT output so this node runs after sampling "
                               "and again whenever the sampler runs again.",
                }),
            },
        }

    def plot(self, model: ModelPatcher, latent: dict | None = None) -> tuple[torch.Tensor, str]:
        recorded = trace.last_trace(model)
        if recorded is None:
            empty = trace.Trace(events=(), total_steps=0)
            image = trace_plot.timeline_tensor(empty, message=_NO_TRACE)
            return (image, f"{trace_plot.report(empty)}\n{_NO_TRACE}: {_NO_TRACE_FIX}")
        return (trace_plot.timeline_tensor(recorded), trace_plot.report(recorded))


NODES = [PatchbayPatchOrder, PatchbayTrace, PatchbayTraceTimeline]
