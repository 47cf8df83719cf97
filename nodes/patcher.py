"""Patcher nodes: the patch order of a MODEL, tracing its sampling runs, and the timeline of the last run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from comfy_api.latest import io

from ..patcher import model_patcher, patch_order, trace, trace_plot
from . import v3

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

CATEGORY = "Patchbay/patcher"
_MODEL_TIP = "The model whose patches are ordered; it is cloned, never changed."
_ORDER_TIP = ("weight_patch_first: LoRAs and hooks patch the model's own weights, then object patches (a "
              "compiled UNet or blocks) wrap them; use it with torch.compile. object_patch_first: ComfyUI's "
              "own order.")
_FULL_LOAD_TIP = ("auto: ComfyUI decides. enabled: load every layer to the GPU even past the VRAM budget (no "
                  "streamed layers, no recompiles from them). disabled: never force it; layers past the "
                  "budget stay in RAM.")
_NO_TRACE = "no trace recorded for this model"
_NO_TRACE_FIX = ("put Trace Sampling (Patchbay) before the sampler, give the sampler and Trace Timeline "
                 "the same MODEL, and connect the sampler's LATENT to Trace Timeline.")


class PatchbayPatchOrder(v3.Node):
    NODE_ID = "PatchbayPatchOrder"
    DISPLAY_NAME = "Patch Order (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY,
            description=("Sets, for this model only, whether LoRAs patch the weights before object patches "
                         "such as torch.compile are applied, and whether the model is fully loaded."),
            inputs=[
                io.Model.Input("model", tooltip=_MODEL_TIP),
                io.Combo.Input("patch_order", options=list(patch_order.PATCH_ORDERS),
                               default="weight_patch_first", tooltip=_ORDER_TIP),
                io.Combo.Input("full_load", options=list(patch_order.FULL_LOAD_MODES), default="auto",
                               tooltip=_FULL_LOAD_TIP),
            ],
            outputs=[v3.output(io.Model, "model",
                               "A clone of the model that applies its patches in the chosen order.")])

    @classmethod
    def execute(cls, model: ModelPatcher, patch_order: str, full_load: str) -> io.NodeOutput:
        return io.NodeOutput(model_patcher.set_patch_order(model, patch_order, full_load))


class PatchbayTrace(v3.Node):
    NODE_ID = "PatchbayTrace"
    DISPLAY_NAME = "Trace Sampling (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY,
            description=("Records which hooks, patches and wrappers run at each sampler step of this model, "
                         "for Trace Timeline and the DEBUG log (logger patchbay.trace)."),
            inputs=[io.Model.Input("model", tooltip="The model to trace; it is cloned, never changed.")],
            outputs=[v3.output(io.Model, "model", "A clone of the model that records a trace of every "
                                                  "sampling run; connect it to the sampler and to Trace "
                                                  "Timeline.")])

    @classmethod
    def execute(cls, model: ModelPatcher) -> io.NodeOutput:
        return io.NodeOutput(trace.enable_trace(model_patcher.upgrade(model)))


class PatchbayTraceTimeline(v3.Node):
    NODE_ID = "PatchbayTraceTimeline"
    DISPLAY_NAME = "Trace Timeline (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY,
            description=("Draws which hooks, patches and wrappers ran at which sampler step, and how strong, "
                         "in the last sampling run of this model; also as text."),
            inputs=[
                io.Model.Input("model", tooltip="The model the sampler used, traced by Trace Sampling "
                                                "(Patchbay) (or a clone of it)."),
                io.Latent.Input("latent", optional=True,
                                tooltip="Connect the sampler's LATENT output so this node runs after "
                                        "sampling and again whenever the sampler runs again."),
            ],
            outputs=[
                v3.output(io.Image, "timeline", "Steps across, one lane per hook, patch or wrapper; bar "
                                                "height and colour are the strength."),
                v3.output(io.String, "report",
                          "The same trace as plain text, one line per lane and per step."),
            ])

    @classmethod
    def execute(cls, model: ModelPatcher, latent: dict | None = None) -> io.NodeOutput:
        recorded = trace.last_trace(model)
        if recorded is None:
            empty = trace.Trace(events=(), total_steps=0)
            image = trace_plot.timeline_tensor(empty, message=_NO_TRACE)
            return io.NodeOutput(image, f"{trace_plot.report(empty)}\n{_NO_TRACE}: {_NO_TRACE_FIX}")
        return io.NodeOutput(trace_plot.timeline_tensor(recorded), trace_plot.report(recorded))


NODES = [PatchbayPatchOrder, PatchbayTrace, PatchbayTraceTimeline]
