"""Attention Couple: a base prompt and up to 8 regions (prompt, mask, LoRA) sampled in one batch row,
from 8 fixed slots (Attention Couple) or from a chain of Couple Region nodes (Attention Couple from
Regions, nodes/couple_region.py); both turn each region into the same hooks/couple.py CoupleRegion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..hooks import couple, lora_hooks
from . import hook_lora, lora_files
from .couple_region import Region, check_chain

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
        regions = [Region(inputs.get(f"prompt_{i}", ""), inputs[f"mask_{i}"],
                          inputs.get(f"lora_{i}", lora_files.NONE), inputs.get(f"strength_{i}", 1.0),
                          inputs.get(f"schedule_{i}", ""))
                   for i in range(1, REGIONS + 1) if inputs.get(f"mask_{i}") is not None]
        return sample_regions(self.files, model, clip, base, feather, regions)


class PatchbayAttentionCoupleRegions(lora_files.ReadsLoras):
    """Attention Couple with its regions from a chain of Couple Region nodes instead of 8 fixed slots."""

    NODE_ID = "PatchbayAttentionCoupleRegions"
    DISPLAY_NAME = "Attention Couple from Regions (Patchbay)"
    DESCRIPTION = (f"Up to {REGIONS} regional prompts, chained by Couple Region nodes, in one batch row "
                   "(SD1.5, SDXL, Flux.1, Flux.2, SD3): Attention Couple with only the regions in use shown.")
    CATEGORY = CATEGORY
    FUNCTION = "couple"
    RETURN_TYPES = PatchbayAttentionCouple.RETURN_TYPES
    RETURN_NAMES = PatchbayAttentionCouple.RETURN_NAMES
    OUTPUT_TOOLTIPS = PatchbayAttentionCouple.OUTPUT_TOOLTIPS
    FILES_KEPT = REGIONS

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        shared = PatchbayAttentionCouple.INPUT_TYPES()["required"]
        return {"required": {
            "model": shared["model"],
            "clip": shared["clip"],
            "regions": ("COUPLE_REGIONS", {"tooltip": f"The last Couple Region (Patchbay) of a chain of up "
                                                      f"to {REGIONS}; regions count in chain order."}),
            "base": shared["base"],
            "feather": shared["feather"],
        }}

    def couple(self, model: ModelPatcher, clip: CLIP, regions: tuple, base: str, feather: int = 0) -> tuple:
        return sample_regions(self.files, model, clip, base, feather, check_chain(regions))


def sample_regions(files: lora_files.LoraFiles, model: ModelPatcher, clip: CLIP, base: str, feather: int,
                   regions: list[Region] | tuple[Region, ...]) -> tuple:
    """(MODEL, positive) of hooks/couple.py attention_couple for ``regions``; ``files`` reads their LoRAs."""
    found = [_region(files, model, clip, region) for region in regions]
    return couple.attention_couple(model, lora_hooks.encode(clip, base), found, feather)


def _region(files: lora_files.LoraFiles, model: ModelPatcher, clip: CLIP,
            region: Region) -> couple.CoupleRegion:
    """The region's prompt encoded with its LoRA's CLIP part (that prompt only), its mask and its hooks."""
    hooks = None
    if region.lora != lora_files.NONE:
        name, lora = files.lora(region.lora)
        lora_hooks.check_lora_fits(lora, name, model, clip)
        keyframes = hook_lora.keyframes_for(region.schedule, "percent")
        hooks = lora_hooks.lora_hook(lora, region.strength, region.strength, keyframes, name=name)
    encoder = clip if not hooks or not hooks.hooks else lora_hooks.set_clip_hooks(clip, hooks)
    return couple.CoupleRegion(lora_hooks.encode(encoder, region.prompt), region.mask, hooks)


NODES = [PatchbayAttentionCouple, PatchbayAttentionCoupleRegions]
