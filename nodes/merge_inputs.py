"""Recipe inputs (checkpoint, diffusion model, LoRA, a MODEL of the graph) and parameter maps (block
weight widgets for SD1.5, SDXL and Flux; block names, ranges and patterns as text for every family of
merge/architectures.py), all as PATCHBAY_RECIPE values."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from comfy_api.latest import io

from ..comfy_merge import files, graph_model
from ..hooks.block_weights import BlockWeightError, parse_block_map
from ..merge import blocks
from ..merge import recipe as R
from . import v3

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

RECIPE = "PATCHBAY_RECIPE"
LATER = "at merge time"  # Key Patterns: block names checked when the merge knows its models
_RECIPE_OUT = "A recipe input for merge method nodes (Patchbay/merge/methods)."
_MAP_OUT = ("A parameter map: connect it to a method's <param>_map input (e.g. alpha_map) to set that "
            "parameter per block or key.")


class _FileInput(v3.Node):
    """A file of one ComfyUI folder as a recipe input: the recipe stores ``<folder>/<name>``."""

    FOLDER, WIDGET, SPACE, TIP, ABOUT = "", "", "weight", "", ""

    @classmethod
    def define_schema(cls) -> io.Schema:
        widget = io.Combo.Input(cls.WIDGET, options=files.names(cls.FOLDER), tooltip=cls.TIP)
        return v3.schema(cls, category="Patchbay/merge/inputs", description=cls.ABOUT, inputs=[widget],
                         outputs=[v3.output(v3.RECIPE, "recipe", _RECIPE_OUT)])

    @classmethod
    def execute(cls, **widget: str) -> io.NodeOutput:
        return io.NodeOutput(R.model(files.model_path(cls.FOLDER, widget[cls.WIDGET]), space=cls.SPACE))

    make = v3.v1_entry()


class PatchbayMergeCheckpoint(_FileInput):
    NODE_ID = "PatchbayMergeCheckpoint"
    DISPLAY_NAME = "Merge Input: Checkpoint (Patchbay)"
    ABOUT = ("A checkpoint of the checkpoints folder as a merge input (weight space): nothing is "
             "loaded until a Merge, Save Merge or Extract LoRA node runs the recipe, key by key.")
    FOLDER, WIDGET, TIP = "checkpoints", "ckpt_name", "A .safetensors file in the checkpoints folder."


class PatchbayMergeDiffusionModel(_FileInput):
    NODE_ID = "PatchbayMergeDiffusionModel"
    DISPLAY_NAME = "Merge Input: Diffusion Model (Patchbay)"
    ABOUT = ("A diffusion-model-only file (diffusion_models / unet folder) as a merge input, e.g. a "
             "Flux or SDXL UNet; it merges key by key with checkpoints of the same architecture.")
    FOLDER, WIDGET, TIP = "diffusion_models", "unet_name", "A .safetensors file in diffusion_models."


class PatchbayMergeLora(_FileInput):
    NODE_ID = "PatchbayMergeLora"
    DISPLAY_NAME = "Merge Input: LoRA as Delta (Patchbay)"
    ABOUT = ("A LoRA of the loras folder as a delta (what LoraLoader adds at strength 1), e.g. for "
             "add_difference(model, lora) or TIES over LoRAs; mapped onto the recipe's first model.")
    FOLDER, WIDGET, SPACE = "loras", "lora_name", "delta"
    TIP = "A kohya LoRA/LoCon, LyCORIS LoHa/LoKr, or PEFT lora_A/lora_B in diffusion_model. names."


class PatchbayMergeModelInput(v3.Node):
    NODE_ID = "PatchbayMergeModelInput"
    DISPLAY_NAME = "Merge Input: Model from Graph (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category="Patchbay/merge/inputs",
            description=("A MODEL of this graph as a merge input, read key by key with its patches applied "
                         "(after LoraLoader, ModelMergeSimple or another merge); the model itself is not "
                         "changed."),
            inputs=[io.Model.Input("model", tooltip="Any MODEL; only its diffusion model is read.")],
            outputs=[v3.output(v3.RECIPE, "recipe", _RECIPE_OUT)])

    @classmethod
    def execute(cls, model: ModelPatcher) -> io.NodeOutput:
        return io.NodeOutput(graph_model.graph_model(model))

    make = v3.v1_entry()


_BLOCK_WIDGET = {"min": -100.0, "max": 100.0, "step": 0.01, "round": False}


class _BlockWeights(v3.Node):
    ARCH, ABOUT = "", ""

    @classmethod
    def widgets(cls) -> list[tuple[str, str]]:
        """(widget name, block name) per block of the architecture; VAE follows BASE."""
        return [(name.replace(".", "_"), name) for name in blocks.block_names(cls.ARCH) if name != "VAE"]

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category="Patchbay/merge/params", description=cls.ABOUT,
            inputs=[io.Float.Input(widget, **_BLOCK_WIDGET, default=0.5,
                                   tooltip=f"The value for block {name}" + (" (and the VAE)" if name == "BASE"
                                                                           else ""))
                    for widget, name in cls.widgets()],
            outputs=[v3.output(v3.RECIPE, "blocks", _MAP_OUT)])

    @classmethod
    def execute(cls, **values: float) -> io.NodeOutput:
        return io.NodeOutput(block_map(cls.ARCH, {name: values[widget] for widget, name in cls.widgets()}))

    make = v3.v1_entry()


def block_map(arch: str, values: dict[str, float]) -> R.LiteralNode:
    """A map literal over every block of ``arch``: the VAE, where it is a block, takes BASE's value."""
    if "VAE" in blocks.block_names(arch):
        values = {**values, "VAE": values["BASE"]}
    return R.literal(values)


class PatchbayMergeBlockWeightsSD15(_BlockWeights):
    NODE_ID = "PatchbayMergeBlockWeightsSD15"
    DISPLAY_NAME = "Merge Block Weights SD1.5 (Patchbay)"
    ABOUT = "One value per SD1.5 block (26: BASE, IN00-IN11, M00, OUT00-OUT11) for a method's parameter."
    ARCH = "sd15"


class PatchbayMergeBlockWeightsSDXL(_BlockWeights):
    NODE_ID = "PatchbayMergeBlockWeightsSDXL"
    DISPLAY_NAME = "Merge Block Weights SDXL (Patchbay)"
    ABOUT = "One value per SDXL block (20: BASE, IN00-IN08, M00, OUT00-OUT08) for a method's parameter."
    ARCH = "sdxl"


class PatchbayMergeBlockWeightsFlux(_BlockWeights):
    NODE_ID = "PatchbayMergeBlockWeightsFlux"
    DISPLAY_NAME = "Merge Block Weights Flux (Patchbay)"
    ABOUT = ("One value per Flux block (BASE, the input/output layers, double_blocks 0-18, "
             "single_blocks 0-37) for a method's parameter.")
    ARCH = "flux"


_PATTERNS_TIP = ("JSON object or name=value items (commas or new lines, # comments): block names, ranges "
                 "(double_blocks.0-7, IN00-05), globs over keys or block names (*.attn2.*, single_blocks.*), "
                 "default. Block counts are the files'.")


class PatchbayMergeKeyPatterns(v3.Node):
    NODE_ID = "PatchbayMergeKeyPatterns"
    DISPLAY_NAME = "Merge Key Patterns (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category="Patchbay/merge/params",
            description=("A parameter per block name or key pattern, for every family of the architecture "
                         "table: {\"IN00\": 0.2, \"*.attn2.*\": 0.8, \"default\": 0.5} or lines such as "
                         "double_blocks.0-7=0.5, single_blocks.*=1, default=0; exact key, then block, then "
                         "the first glob matching the key or its block, then default."),
            inputs=[
                io.String.Input("patterns", multiline=True, default="IN00=0.2, *.attn2.*=0.8, default=0.5",
                                tooltip=_PATTERNS_TIP),
                io.Combo.Input("check_blocks", options=[LATER, *blocks.ARCHS],
                               tooltip="Check block names against this family of the architecture table now "
                                       "(did-you-mean on a typo), or when the merge knows its models (and "
                                       "counts their blocks)."),
            ],
            outputs=[v3.output(v3.RECIPE, "patterns", _MAP_OUT)])

    @classmethod
    def validate_inputs(cls, patterns: str | None = None, check_blocks: str | None = None) -> bool | str:
        try:
            if patterns is not None:
                pattern_map(patterns, check_blocks or LATER)
        except ValueError as error:
            return str(error)
        return True

    @classmethod
    def execute(cls, patterns: str, check_blocks: str = LATER) -> io.NodeOutput:
        return io.NodeOutput(pattern_map(patterns, check_blocks))

    make = v3.v1_entry()


def pattern_map(text: str, arch: str) -> R.LiteralNode:
    """The map literal ``text`` describes; every bad entry is named (and block names checked for ``arch``)."""
    if arch not in (LATER, *blocks.ARCHS):
        raise ValueError(f"check_blocks {arch!r}: choose {LATER!r} or one of {', '.join(blocks.ARCHS)}")
    if text.lstrip().startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"key patterns: not a JSON object ({error}); or write name=value "
                             f"items") from None
        if not isinstance(mapping, dict):
            raise ValueError("key patterns: write a JSON object {\"IN00\": 0.2, \"default\": 0.5}")
        for name, value in mapping.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"key patterns: entry {name!r} has {value!r}, not a number")
    else:
        try:
            mapping = parse_block_map(text)
        except BlockWeightError as error:
            raise ValueError(f"key patterns: {error}") from None
    try:
        mapping = blocks.expand_ranges(mapping)
        if arch in blocks.ARCHS:
            blocks.check_map(mapping, arch)
    except ValueError as error:
        raise ValueError(f"key patterns: {error}") from None
    return R.literal(mapping)


NODES = [PatchbayMergeCheckpoint, PatchbayMergeDiffusionModel, PatchbayMergeLora, PatchbayMergeModelInput,
         PatchbayMergeBlockWeightsSD15, PatchbayMergeBlockWeightsSDXL, PatchbayMergeBlockWeightsFlux,
         PatchbayMergeKeyPatterns]
