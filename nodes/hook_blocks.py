"""LoRA block weights on hooks: a per-block strength map (the merge library's block names) on LoRA hooks."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from ..hooks import block_weights
from ..merge import blocks as merge_blocks

if TYPE_CHECKING:
    from comfy.hooks import HookGroup
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

AUTO = "auto"
_MODEL_PREFIX = "model."  # merge.blocks reads checkpoint keys (model.diffusion_model....)


def arch_of(model: ModelPatcher) -> str:
    """sd15, sdxl or flux from the model's config class or the core class it derives from (KOALA_700M,
    SSD1B and Segmind_Vega are SDXLs, FluxSchnell a Flux); an error naming it otherwise."""
    lineage = [cls.__name__.lower() for cls in type(model.model.model_config).__mro__]
    for arch in ("sdxl", "flux", "sd15"):
        if any(arch in name for name in lineage):
            return arch
    raise block_weights.BlockWeightError(f"block weights know {', '.join(merge_blocks.ARCHS)}; this model is "
                                         f"{type(model.model.model_config).__name__}: pick arch by hand or "
                                         f"use key globs (diffusion_model.*).")


def _expand_block_globs(mapping: dict[str, float], arch: str) -> dict[str, float]:
    """Globs that match block names (``OUT*``, ``IN0?``) become those blocks; a block named outright
    wins over a glob, an earlier glob over a later one. Globs matching no block stay key globs."""
    names = merge_blocks.block_names(arch)
    out = {k: v for k, v in mapping.items() if not any(ch in k for ch in "*?[")}
    for entry, value in mapping.items():
        matched = fnmatch.filter(names, entry) if entry not in out else []
        for name in matched:
            out.setdefault(name, value)
        if not matched and entry not in out:
            out[entry] = value
    return out


def strength_map(text: str, arch: str):
    """key -> strength for ``text`` (checked against ``arch``'s block names, with did-you-mean)."""
    mapping = _expand_block_globs(block_weights.parse_block_map(text), arch)
    mapping.setdefault("default", 1.0)
    try:
        merge_blocks.check_map(mapping, arch)
    except ValueError as error:
        raise block_weights.BlockWeightError(f"block map: {error}.") from None

    def strength_of(key: str) -> float:
        if not key.startswith("diffusion_model."):
            return float(mapping.get("BASE", mapping["default"]))  # text encoder weights
        return float(merge_blocks.resolve(mapping, arch, _MODEL_PREFIX + key, where="block map"))
    return strength_of


class PatchbayHookBlockWeights:
    NODE_ID = "PatchbayHookBlockWeights"
    DISPLAY_NAME = "LoRA Hook Block Weights (Patchbay)"
    DESCRIPTION = ("Per-block strengths on LoRA hooks (SD1.5, SDXL, Flux block names), e.g. to keep a "
                   "regional or scheduled LoRA out of the blocks that carry style.")
    CATEGORY = "Patchbay/hooks/create"
    FUNCTION = "apply"
    RETURN_TYPES = ("HOOKS",)
    RETURN_NAMES = ("hooks",)
    OUTPUT_TOOLTIPS = ("New hooks: each LoRA scaled block by block (schedules and strengths kept).",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "hooks": ("HOOKS", {"tooltip": "LoRA hooks (Patchbay's or core's Create Hook LoRA)."}),
                "model": ("MODEL", {"tooltip": "The model the hooks are for (maps LoRA keys to blocks)."}),
                "blocks": ("STRING", {"default": "IN00=1, M00=1, OUT00=1, default=1", "multiline": True,
                                      "tooltip": "block=strength items: SD1.5/SDXL BASE, IN00.., M00, "
                                                 "OUT00..; Flux double_blocks.N, single_blocks.N ...; globs "
                                                 "(OUT*) and default (1 when left out). BASE = the text "
                                                 "encoder."}),
                "arch": ([AUTO, *merge_blocks.ARCHS],
                         {"tooltip": "Whose block names; auto: from the model."}),
            },
            "optional": {"clip": ("CLIP", {"tooltip": "Connect when the hooks also go on the CLIP "
                                                      "(Set CLIP Hooks), so BASE applies to it."})},
        }

    def apply(self, hooks: HookGroup, model: ModelPatcher, blocks: str, arch: str = AUTO,
              clip: CLIP | None = None) -> tuple:
        strength_of = strength_map(blocks, arch_of(model) if arch == AUTO else arch)
        return (block_weights.block_weighted(hooks, model, clip, strength_of),)


NODES = [PatchbayHookBlockWeights]
