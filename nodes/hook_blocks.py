"""LoRA block weights on hooks: a per-block strength map (the merge library's block names, or an A1111
LoRA Block Weight preset / number list, hooks/lbw.py) on LoRA hooks."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from comfy_api.latest import io

from ..hooks import block_weights, lbw
from ..merge import architectures
from ..merge import blocks as merge_blocks
from . import v3

if TYPE_CHECKING:
    from comfy.hooks import HookGroup
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

AUTO = "auto"
_MODEL_PREFIX = "model."  # merge.blocks reads checkpoint keys (model.diffusion_model....)


def model_blocks(model: ModelPatcher) -> tuple[str, list[str]]:
    """(family id, checkpoint keys) of the model's diffusion model: the family as the table in
    merge/architectures.py detects a file with the same keys and shapes (so block counts come from the
    model: Flux.2 [dev] 8 + 48, Wan 1.3B 30 blocks), else by its config class (the table's ComfyUI
    column); an error naming the model class otherwise."""
    shapes = model_shapes(model)
    family = architectures.detect(shapes).family
    if family == architectures.UNKNOWN:  # weights whose shapes are a storage layout (GGUF): by config
        lineage = (cls.__name__ for cls in type(model.model.model_config).__mro__)
        family = architectures.from_comfy_classes(lineage) or family
    if family == architectures.UNKNOWN:
        raise block_weights.BlockWeightError(
            f"block weights know the families of merge/architectures.py ({', '.join(merge_blocks.ARCHS)}); "
            f"this model ({type(model.model.model_config).__name__}) is none of them: pick arch by hand or "
            f"use key globs (diffusion_model.*).")
    return family, list(shapes)


def model_shapes(model: ModelPatcher) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of every weight of the model's diffusion model."""
    return {architectures.DIFFUSION_PREFIX + key: tuple(value.shape)
            for key, value in model.model.diffusion_model.state_dict().items()}


def strength_map(text: str, arch: str, keys: Collection[str] | None = None) -> Callable[[str], float]:
    """key -> strength for ``text``: block=strength items, ranges (``double_blocks.0-7=0.5``) and globs
    (``OUT*``) checked against ``arch``'s blocks (counted from ``keys``, the model's checkpoint keys,
    when given), with did-you-mean; or an A1111 LoRA Block Weight preset or number list (hooks/lbw.py)."""
    if not lbw.is_lbw(text):
        try:
            mapping = merge_blocks.expand_ranges(block_weights.parse_block_map(text))
        except ValueError as error:
            raise block_weights.BlockWeightError(f"block map: {error}.") from None
        return _strength_of(mapping, arch, keys)
    try:
        weights = lbw.block_map(text, arch)
    except lbw.LbwError as error:
        raise block_weights.BlockWeightError(f"block map {text.strip()!r} is not name=strength items, so "
                                             f"it is read as a LoRA Block Weight preset or list: {error}"
                                             ) from None
    mapping = dict(weights.blocks)
    if keys is not None:  # a fixed-length vector names blocks a smaller model lacks (schnell: guidance_in)
        present = set(merge_blocks.block_names(arch, keys))
        mapping = {block: value for block, value in mapping.items() if block in present}
    return _strength_of(mapping, arch, keys, weights.text)


def _strength_of(mapping: dict[str, float], arch: str, keys: Collection[str] | None = None,
                 text: tuple[tuple[str, float], ...] = ()) -> Callable[[str], float]:
    """The strength function of a checked block map; ``text``: (text-encoder key prefix, strength)
    pairs that win over BASE (Flux's T5 in an lbw vector)."""
    mapping.setdefault("default", 1.0)
    try:
        merge_blocks.check_map(mapping, arch, None if keys is None else set(keys))
    except ValueError as error:
        raise block_weights.BlockWeightError(f"block map: {error}.") from None

    def strength_of(key: str) -> float:
        if not key.startswith("diffusion_model."):  # text encoder weights
            found = next((value for prefix, value in text if key.startswith(prefix)), None)
            return float(mapping.get("BASE", mapping["default"]) if found is None else found)
        return float(merge_blocks.resolve(mapping, arch, _MODEL_PREFIX + key, where="block map"))
    return strength_of


def model_strength_map(text: str, model: ModelPatcher, arch: str = AUTO) -> Callable[[str], float]:
    """``strength_map`` for ``model``: its family (or ``arch``), blocks counted from its keys."""
    if arch == AUTO:
        arch, keys = model_blocks(model)
    else:
        keys = list(model_shapes(model))
    return strength_map(text, arch, keys)


_BLOCKS_TIP = ("block=strength items: SD1.5/SDXL BASE, IN00.., M00, OUT00..; Flux double_blocks.N, "
               "single_blocks.N, Wan blocks.N ... (counted from the model); ranges (double_blocks.0-7=0.5, "
               "IN00-05=0), globs (OUT*, single_blocks.*) and default (1 when left out). BASE = the text "
               "encoder. Or, as A1111's LoRA Block Weight: a preset (INALL, MIDD, OUTD, OUTALL, ALL, "
               "FLUXALL, ...) or a number list (SD1.5 17 or 26, SDXL 12 or 20, Flux 61).")


class PatchbayHookBlockWeights(v3.Node):
    NODE_ID = "PatchbayHookBlockWeights"
    DISPLAY_NAME = "LoRA Hook Block Weights (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category="Patchbay/hooks/create",
            description=("Per-block strengths on LoRA hooks (the block names of every family of the "
                         "architecture table, ranges such as double_blocks.0-7=0.5, or an A1111 LoRA Block "
                         "Weight preset such as OUTALL or number list), e.g. to keep a regional or scheduled "
                         "LoRA out of the blocks that carry style."),
            inputs=[
                io.Hooks.Input("hooks", tooltip="LoRA hooks (Patchbay's or core's Create Hook LoRA)."),
                io.Model.Input("model", tooltip="The model the hooks are for (maps LoRA keys to blocks)."),
                io.String.Input("blocks", default="IN00=1, M00=1, OUT00=1, default=1", multiline=True,
                                tooltip=_BLOCKS_TIP),
                io.Combo.Input("arch", options=[AUTO, *merge_blocks.ARCHS],
                               tooltip="Whose block names (the families of the architecture table); auto: "
                                       "detected from the model's keys."),
                io.Clip.Input("clip", optional=True, tooltip="Connect when the hooks also go on the CLIP "
                                                             "(Set CLIP Hooks), so BASE applies to it."),
            ],
            outputs=[v3.output(io.Hooks, "hooks", "New hooks: each LoRA scaled block by block (schedules and "
                                                  "strengths kept).")])

    @classmethod
    def execute(cls, hooks: HookGroup, model: ModelPatcher, blocks: str, arch: str = AUTO,
                clip: CLIP | None = None) -> io.NodeOutput:
        strength_of = model_strength_map(blocks, model, arch)
        return io.NodeOutput(block_weights.block_weighted(hooks, model, clip, strength_of))


NODES = [PatchbayHookBlockWeights]
