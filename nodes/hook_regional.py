"""Regional LoRA and Prompt LoRA: conds that carry their own LoRA hooks, made in one node."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..comfy_merge import files
from ..hooks import block_weights, lora_hooks, prompt_tags, regions
from ..hooks import enable as fast_hooks
from ..hooks.keyframes import keyframes_from_points
from . import hook_blocks, lora_files

if TYPE_CHECKING:
    import torch
    from comfy.hooks import HookGroup
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

CATEGORY = "Patchbay/hooks"
REGIONS = 4
_FAST_TIP = "A clone of the model on Patchbay's Fast Hooks engine: regions sample in one batch."


class PatchbayRegionalLora(lora_files.ReadsLoras):
    NODE_ID = "PatchbayRegionalLora"
    DISPLAY_NAME = "Regional LoRA (Patchbay)"
    DESCRIPTION = (f"Up to {REGIONS} regions in one node: each region's prompt, mask and LoRA (a hook on "
                   "that region only), optional feathering and a base prompt for the rest; one conditioning "
                   "out.")
    CATEGORY = CATEGORY
    FUNCTION = "combine"
    RETURN_TYPES = ("CONDITIONING", "MODEL", "IMAGE")
    RETURN_NAMES = ("conditioning", "model", "regions")
    OUTPUT_TOOLTIPS = ("Every region with its mask and LoRA hook, and the base on the rest: the sampler's "
                       "positive.", _FAST_TIP,
                       "A diagram of the regions (feathered masks, numbered, with their LoRAs): connect a "
                       "Preview Image to check them before sampling.")
    FILES_KEPT = REGIONS

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        optional: dict = {"base": ("CONDITIONING",
                                   {"tooltip": "Optional prompt for where no region mask is."})}
        for i in range(1, REGIONS + 1):
            optional[f"cond_{i}"] = ("CONDITIONING", {"tooltip": f"Region {i}'s prompt."})
            optional[f"mask_{i}"] = ("MASK", {"tooltip": f"Region {i}'s mask (none: the whole image)."})
            optional[f"lora_{i}"] = ([lora_files.NONE, *lora_files.lora_names()],
                                     {"tooltip": f"Region {i}'s LoRA (None: no LoRA)."})
            optional[f"strength_{i}"] = ("FLOAT", {"default": 1.0, "min": -20.0, "max": 20.0, "step": 0.01,
                                                   "tooltip": f"Region {i}'s LoRA strength."})
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model the sampler uses; cloned, never changed."}),
                "feather": ("INT", {"default": 0, "min": 0, "max": 512,
                                    "tooltip": "Soften mask edges over this many pixels (0: hard edges)."}),
            },
            "optional": optional,
        }

    def combine(self, model: ModelPatcher, feather: int = 0, base: list | None = None, **inputs) -> tuple:
        numbers = [i for i in range(1, REGIONS + 1) if inputs.get(f"cond_{i}")]
        found = [self._region(model, i, inputs) for i in numbers]
        cond = regions.regional_conditioning(found, base, feather)
        labels = [self._label(inputs.get(f"lora_{i}", lora_files.NONE), inputs.get(f"strength_{i}", 1.0))
                  for i in numbers]
        diagram = regions.region_diagram(found, labels, base is not None, feather)
        return cond, fast_hooks.enable_hook_engine(model), diagram

    @staticmethod
    def _label(name: str, strength: float) -> str:
        if name == lora_files.NONE:
            return "no LoRA"
        return f"{name.rsplit('/', 1)[-1].removesuffix('.safetensors')} {strength:g}"

    def _region(self, model: ModelPatcher, i: int, inputs: dict) -> regions.Region:
        name, hooks = inputs.get(f"lora_{i}", lora_files.NONE), None
        if name != lora_files.NONE:
            name, lora = self.files.lora(name)
            lora_hooks.check_lora_fits(lora, name, model)
            strength = inputs.get(f"strength_{i}", 1.0)
            hooks = lora_hooks.lora_hook(lora, strength, strength, name=name)
        mask: torch.Tensor | None = inputs.get(f"mask_{i}")
        return regions.Region(inputs[f"cond_{i}"], mask, hooks)


class PatchbayPromptLora(lora_files.ReadsLoras):
    NODE_ID = "PatchbayPromptLora"
    DISPLAY_NAME = "Prompt with LoRA Tags (Patchbay)"
    DESCRIPTION = ("A text encoder that reads A1111 <lora:name:0.8> tags (or <lora:name:0@0,1@0.5> for a "
                   "schedule, <lora:name:0.8:lbw=OUTALL> for block weights) and applies those LoRAs as hooks "
                   "on this prompt only.")
    CATEGORY = CATEGORY
    FUNCTION = "encode"
    RETURN_TYPES = ("CONDITIONING", "MODEL", "HOOKS")
    RETURN_NAMES = ("conditioning", "model", "hooks")
    OUTPUT_TOOLTIPS = ("The prompt (tags removed) carrying its LoRA hooks.",
                       _FAST_TIP + " None when no model is connected.",
                       "The prompt's LoRA hooks (None without tags).")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "clip": ("CLIP", {"tooltip": "The text encoder."}),
                "text": ("STRING", {"multiline": True, "dynamicPrompts": True,
                                    "default": "a knight in armor <lora:my_lora:0.8>",
                                    "tooltip": "The prompt; <lora:name:strength> or <lora:name:0@0,1@0.5> "
                                               "tags name files in the loras folder (extension optional); "
                                               "add :lbw=PRESET or :lbw=1,0,... for A1111 block weights."}),
            },
            "optional": {"model": ("MODEL", {"tooltip": "Optional: checked against the LoRAs and returned on "
                                                        "the Fast Hooks engine (needed for lbw=)."})},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, text: str | None = None) -> bool | str:
        try:
            prompt_tags.split_prompt(text or "")
        except ValueError as error:
            return str(error)
        return True

    def encode(self, clip: CLIP, text: str, model: ModelPatcher | None = None) -> tuple:
        clean, tags = prompt_tags.split_prompt(text)
        hooks = None
        for tag in tags:
            hooks = lora_hooks.combine(hooks, self._tag_hook(tag, clip, model))
        cond = lora_hooks.encode(clip if hooks is None else lora_hooks.set_clip_hooks(clip, hooks), clean)
        return cond, None if model is None else fast_hooks.enable_hook_engine(model), hooks

    def _tag_hook(self, tag: prompt_tags.LoraTag, clip: CLIP, model: ModelPatcher | None) -> HookGroup:
        """The tag's LoRA hook, block-weighted by its lbw= (which needs the model to find the blocks)."""
        where = f"LoRA tag at column {tag.column}"
        try:
            name, lora = self.files.lora(tag.name)
        except files.UnknownFileError as error:
            raise files.UnknownFileError(f"{where}: {error}") from None
        if model is not None:
            lora_hooks.check_lora_fits(lora, name, model, clip)
        keyframes = keyframes_from_points(tag.schedule) if tag.schedule else None
        hook = lora_hooks.lora_hook(lora, tag.strength, tag.strength, keyframes, name=name)
        if tag.blocks is None:
            return hook
        if model is None:
            raise block_weights.BlockWeightError(f"{where}: lbw={tag.blocks} needs the model input connected "
                                                 f"(it maps the LoRA's weights to the model's blocks).")
        try:
            strength_of = hook_blocks.model_strength_map(tag.blocks, model)
        except block_weights.BlockWeightError as error:
            raise block_weights.BlockWeightError(f"{where}: {error}") from None
        return block_weights.block_weighted(hook, model, clip, strength_of)


NODES = [PatchbayRegionalLora, PatchbayPromptLora]
