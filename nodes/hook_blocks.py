"""LoRA block weights on hooks: a per-block strength map (the merge library's block names, or an A1111
LoRA Block Weight preset / number list, hooks/lbw.py) on LoRA hooks."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..hooks import block_weights, lbw
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


def strength_map(text: str, arch: str) -> Callable[[str], float]:
    """key -> strength for ``text``: block=strength items (checked against ``arch``'s block names, with
    did-you-mean) or an A1111 LoRA Block Weight preset or number list (hooks/lbw.py)."""
    if not lbw.is_lbw(text):
        return _strength_of(_expand_block_globs(block_weights.parse_block_map(text), arch), arch)
    try:
        weights = lbw.block_map(text, arch)
    except lbw.LbwError as error:
        raise block_weights.BlockWeightError(f"block map {text.strip()!r} is not name=strength items, so "
                                             f"it is read as a LoRA Block Weight preset or list: {error}"
                                             ) from None
    return _strength_of(dict(weights.blocks), arch, weights.text)


def _strength_of(mapping: dict[str, float], arch: str, text: tuple[tuple[str, float], ...] = ()
                 ) -> Callable[[str], float]:
    """The strength function of a checked block map; ``text``: (text-encoder key prefix, strength)
    pairs that win over BASE (Flux's T5 in an lbw vector)."""
    mapping.setdefault("default", 1.0)
    try:
        merge_blocks.check_map(mapping, arch)
    except ValueError as error:
        raise block_weights.BlockWeightError(f"block map: {error}.") from None

    def strength_of(key: str) -> float:
        if not key.startswith("diffusion_model."):  # text encoder weights
            found = next((value for prefix, value in text if key.startswith(prefix)), None)
            return float(mapping.get("BASE", mapping["default"]) if found is None else found)
        return float(merge_blocks.resolve(mapping, arch, _MODEL_PREFIX + key, where="block map"))
    return strength_of


class PatchbayHookBlockWeights:
    NODE_ID = "PatchbayHookBlockWeights"
    DISPLAY_NAME = "LoRA Hook Block Weights (Patchbay)"
    DESCRIPTION = ("Per-block strengths on LoRA hooks (SD1.5, SDXL, Flux block names, or an A1111 LoRA Block "
                   "Weight preset such as OUTALL or number list), e.g. to keep a regional or scheduled LoRA "
                   "out of the blocks that carry style.")
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
                                                 "encoder. Or, as A1111's LoRA Block Weight: a preset "
                                                 "(INALL, MIDD, OUTD, OUTALL, ALL, FLUXALL, ...) or a "
                                                 "number list (SD1.5 17 or 26, SDXL 12 or 20, Flux 61)."}),
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
