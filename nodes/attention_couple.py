"""Attention Couple: a base prompt and up to 8 regions (prompt, mask, LoRA) sampled in one batch row."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..hooks import couple, lora_hooks
from . import hook_lora, lora_files

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

CATEGORY = "Patchbay/hooks"
REGIONS = couple.MAX_REGIONS


class PatchbayAttentionCouple(lora_files.ReadsLoras):
    """Attention couple on SD1.5/SDXL UNets (hooks/couple.py) and Flux/SD3 DiTs (hooks/couple_dit.py)."""

    NODE_ID = "PatchbayAttentionCouple"
    DISPLAY_NAME = "Attention Couple (Patchbay)"
    DESCRIPTION = (f"Up to {REGIONS} regional prompts in one batch row (SD1.5, SDXL, Flux.1, Flux.2, SD3): "
                   "each region's prompt is attended inside its mask, its LoRA acts only there; the base "
                   "prompt fills the rest.")
    CATEGORY = CATEGORY
    FUNCTION = "couple"
    RETURN_TYPES = ("MODEL", "CONDITIONING")
    RETURN_NAMES = ("model", "positive")
    OUTPUT_TOOLTIPS = ("A clone of the model on Fast Hooks with the couple's attention: sample with it.",
                       "The positive conditioning to sample with (every prompt and region LoRA in one row); "
                       "the negative is sampled as usual.")
    FILES_KEPT = REGIONS

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        optional: dict = {}
        for i in range(1, REGIONS + 1):
            optional[f"prompt_{i}"] = ("STRING", {"multiline": True, "default": "", "dynamicPrompts": True,
                                                  "tooltip": f"Region {i}'s prompt."})
            optional[f"mask_{i}"] = ("MASK", {"tooltip": f"Region {i}'s mask, the image's or the latent's "
                                                         f"size (no mask: region {i} is off)."})
            optional[f"lora_{i}"] = ([lora_files.NONE, *lora_files.lora_names()],
                                     {"tooltip": f"Region {i}'s LoRA, acting inside its mask only "
                                                 f"(None: no LoRA)."})
            optional[f"strength_{i}"] = ("FLOAT", {"default": 1.0, "min": -20.0, "max": 20.0, "step": 0.01,
                                                   "tooltip": f"Region {i}'s LoRA strength (model, CLIP)."})
            optional[f"schedule_{i}"] = ("STRING", {"default": "", "tooltip": (
                f"Region {i}'s LoRA schedule: strength@percent items, e.g. 0@0, 1@0.5; empty = full strength "
                f"throughout.")})
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "An SD1.5, SDXL, Flux.1, Flux.2 or SD3 model; cloned, "
                                             "never changed."}),
                "clip": ("CLIP", {"tooltip": "The text encoder for every prompt."}),
                "base": ("STRING", {"multiline": True, "default": "", "dynamicPrompts": True,
                                    "tooltip": "The prompt where no region mask is (and where masks sum to "
                                               "less than 1)."}),
                "feather": ("INT", {"default": 0, "min": 0, "max": 512,
                                    "tooltip": "Soften mask edges over this many pixels (0: hard edges)."}),
            },
            "optional": optional,
        }

    def couple(self, model: ModelPatcher, clip: CLIP, base: str, feather: int = 0, **inputs) -> tuple:
        numbers = [i for i in range(1, REGIONS + 1) if inputs.get(f"mask_{i}") is not None]
        found = [self._region(model, clip, i, inputs) for i in numbers]
        return couple.attention_couple(model, lora_hooks.encode(clip, base), found, feather)

    def _region(self, model: ModelPatcher, clip: CLIP, i: int, inputs: dict) -> couple.CoupleRegion:
        """Region i's prompt encoded with its LoRA's CLIP part (that prompt only), its mask and its hooks."""
        name, hooks, text = inputs.get(f"lora_{i}", lora_files.NONE), None, inputs.get(f"prompt_{i}", "")
        if name != lora_files.NONE:
            name, lora = self.files.lora(name)
            lora_hooks.check_lora_fits(lora, name, model, clip)
            strength = inputs.get(f"strength_{i}", 1.0)
            keyframes = hook_lora.keyframes_for(inputs.get(f"schedule_{i}", ""), "percent")
            hooks = lora_hooks.lora_hook(lora, strength, strength, keyframes, name=name)
        encoder = clip if not hooks or not hooks.hooks else lora_hooks.set_clip_hooks(clip, hooks)
        return couple.CoupleRegion(lora_hooks.encode(encoder, text), inputs[f"mask_{i}"], hooks)


NODES = [PatchbayAttentionCouple]
