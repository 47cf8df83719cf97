"""Hook nodes: turn on Patchbay's hook engine for a MODEL, so ComfyUI's own hook nodes run fast."""

from __future__ import annotations

from typing import TYPE_CHECKING

from comfy_api.latest import io

from ..hooks import enable as fast_hooks
from . import v3

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

CATEGORY = "Patchbay/hooks"
_ROUNDING_TIP = ("Only for weights stored in fp8/fp16/bf16. compute: the LoRA is added in the compute dtype, "
                 "the closest to an fp32 result (like LoraLoader under lowvram). loraloader: weight + LoRA "
                 "rounded to the stored dtype, as full-load LoraLoader does, for its images bit for bit "
                 "(full deltas in the cache; slower).")


class PatchbayHookEngine(v3.Node):
    NODE_ID = "PatchbayHookEngine"
    DISPLAY_NAME = "Fast Hooks (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY,
            description=("Runs the LoRA and model-as-LoRA hooks of ComfyUI's hook nodes (Create Hook LoRA, "
                         "keyframes, Cond Set Props, regional masks) on this model without swapping "
                         "weights: all prompts sample in one batch and re-runs reuse everything. Same images "
                         "as core, except on fp8/fp16 weights, where the LoRA is added unrounded unless "
                         "rounding is loraloader."),
            inputs=[
                io.Model.Input("model", tooltip="The model the sampler uses; it is cloned, never changed."),
                io.Float.Input("cache_mb", default=2048.0, min=0.0, max=1 << 20, step=64.0,
                               tooltip="Memory budget (MiB) for full deltas of LoHa, LoKr, DoRA and "
                                       "model-as-LoRA hooks, kept between steps and runs. LoRA and LoCon "
                                       "hooks need none."),
                io.Clip.Input("clip", optional=True,
                              tooltip="Optional: put it before Set CLIP Hooks; prompts encoded with the same "
                                      "CLIP hooks and strengths are encoded once."),
                io.Combo.Input("rounding", options=list(fast_hooks.ROUNDINGS), default="compute",
                               optional=True, tooltip=_ROUNDING_TIP),
            ],
            outputs=[
                v3.output(io.Model, "model", "A clone of the model on which hooks run through Patchbay's "
                                             "engine."),
                v3.output(io.Clip, "clip", "A clone of the CLIP that remembers its encodings (None when no "
                                           "CLIP is connected)."),
            ])

    @classmethod
    def execute(cls, model: ModelPatcher, cache_mb: float, clip: CLIP | None = None,
                rounding: str = "compute") -> io.NodeOutput:
        fast_clip = None if clip is None else fast_hooks.enable_clip_cache(clip)
        return io.NodeOutput(fast_hooks.enable_hook_engine(model, cache_mb, rounding), fast_clip)


NODES = [PatchbayHookEngine]
