"""Merge Grid: one recipe, up to two parameter axes, every variant merged, sampled and laid out in one
labelled image (SuperMerger's XY plot in the graph); memory stays that of one merge. Data flow:
docs/architecture.md (Merge Grid).
"""

from __future__ import annotations

import gc
import re
from typing import Any

import comfy.model_management
import comfy.samplers
import comfy.utils
import torch
from comfy_api.latest import io

from ..comfy_merge import runtime
from ..merge import grid
from ..patcher import drawing
from . import v3
from .merge_inputs import LATER, pattern_map
from .merge_outputs import common_inputs, option_fields, policy_input
from .merge_recipes import recipe_to_text

LABEL_PX = 20  # height of the label band above each cell


def parse_values(text: str, axis: str) -> list[Any]:
    """An axis' values: numbers (commas, semicolons or new lines between them), or one parameter map per
    line when the text has ``=`` or ``{`` (``IN*=0.2, default=1`` or a JSON object, as Key Patterns)."""
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return []
    if not any("=" in line or "{" in line for line in lines):
        values = []
        for item in (i.strip() for i in re.split(r"[,;\n]", "\n".join(lines))):
            if not item:
                continue
            try:
                values.append(float(item))
            except ValueError:
                raise ValueError(f"{axis}_values: {item!r} is not a number; give numbers (0.2, 0.5, 0.8) or "
                                 f"one map per line (IN*=0.2, default=1)") from None
        return values
    try:
        return [pattern_map(line, LATER) for line in lines]
    except ValueError as error:
        raise ValueError(f"{axis}_values: {error}") from None



def snake_order(count: int, columns: int) -> list[int]:
    """The order the cells are merged in: row by row, every other row backwards, so that each variant
    follows the one whose x value it shares (a row's last cell and the next row's first): the keys the
    y value leaves alone keep their values in the model (runtime.build_models)."""
    rows = [list(range(start, min(count, start + columns))) for start in range(0, count, columns)]
    return [i for r, row in enumerate(rows) for i in (row[::-1] if r % 2 else row)]


class PatchbayMergeGrid(v3.Node):
    NODE_ID = "PatchbayMergeGrid"
    DISPLAY_NAME = "Merge Grid (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        axis = ("A free parameter of the recipe (&alpha in recipe text), method.parameter "
                "(weighted_sum.alpha) or a parameter of one method (alpha)")
        values = ("Numbers (0.2, 0.5, 0.8), or one parameter map per line (IN*=0.2, OUT*=0.8, default=0.5 "
                  "or a JSON object), as the Key Patterns node reads them")
        return v3.schema(
            cls, category="Patchbay/merge",
            description=("Merges a recipe once per value of one or two parameters (alpha 0.2, 0.5, 0.8 x "
                         "three block maps), samples each with the same seed and returns one labelled grid "
                         "image and each variant's recipe. The merge cache recomputes only the keys a value "
                         "changes."),
            inputs=[
                v3.RECIPE.Input("recipe", tooltip="The recipe to vary (a method node, recipe text)."),
                io.String.Input("x_param", default="alpha", tooltip=axis + " across the grid."),
                io.String.Input("x_values", multiline=True, default="0.2, 0.5, 0.8", tooltip=values),
                io.String.Input("y_param", default="", tooltip=axis + " down the grid; empty: one row."),
                io.String.Input("y_values", multiline=True, default="", tooltip=values),
                io.String.Input("positive", multiline=True, default="a photo of a cat",
                                tooltip="Prompt, encoded by each variant's merged text encoder (or the clip "
                                        "input when the recipe merges none)."),
                io.String.Input("negative", multiline=True, default="blurry", tooltip="Negative prompt."),
                io.Latent.Input("latent_image", tooltip="The latent every variant samples from."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF,
                             tooltip="Sampling seed, the same for every variant."),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip="Sampling steps."),
                io.Float.Input("cfg", default=7.0, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale (as KSampler)."),
                io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS,
                               tooltip="Sampler (as KSampler)."),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS,
                               tooltip="Noise schedule (as KSampler)."),
                *common_inputs(),
                io.Clip.Input("clip", optional=True,
                              tooltip="Text encoder for recipes that merge none (diffusion model only)."),
                io.Vae.Input("vae", optional=True, tooltip="VAE for recipes that merge none."),
                io.Boolean.Input("allow_large_grid", optional=True, default=False,
                                 tooltip="Allow more than 64 variants (each is a merge and a sampling run)."),
                policy_input(),
            ],
            outputs=[v3.output(io.Image, "grid", "The variants row by row (y down, x across), each under its "
                                                 "labels."),
                     v3.output(io.String, "recipes",
                               "Each variant's recipe as .mecha text, after a '# x=..., y=...' line.")])

    @classmethod
    def execute(cls, recipe: Any, x_param: str, x_values: str, y_param: str, y_values: str, positive: str,
            negative: str, latent_image: dict, seed: int, steps: int, cfg: float, sampler_name: str,
            scheduler: str, merge_seed: int = 0, cache_mb: int = runtime.DEFAULT_CACHE_MB,
            shape_policy: str = "overlap", missing_policy: str = "first", clip: Any = None, vae: Any = None,
            allow_large_grid: bool = False, architecture_policy: str = "refuse") -> io.NodeOutput:
        """The grid (docs/architecture.md, Merge Grid); the node's text lists each variant's merge line (keys
        merged, keys from the merge cache)."""
        x = (x_param, parse_values(x_values, "x"))
        y = (y_param, parse_values(y_values, "y")) if y_param.strip() or y_values.strip() else None
        if y is not None and not y_param.strip():
            raise ValueError("y_values are given but y_param is empty: name the parameter they set")
        cells = grid.variants(recipe, x, y, allow_large=allow_large_grid)
        fields = option_fields(merge_seed, cache_mb, shape_policy, missing_policy, architecture_policy)
        encoded: dict[str, Any] = {}  # prompt -> conditioning by the clip input (merged encoders vary)
        images, lines = [None] * len(cells), [""] * len(cells)
        texts = [f"# {', '.join(labels)}\n{recipe_to_text(variant)}" for labels, variant in cells]
        bar = comfy.utils.ProgressBar(len(cells))
        slot: list = []  # the only reference to the previous variant's MODEL (runtime.build_models)
        order = snake_order(len(cells), len(x[1]))
        keep = runtime.cache_wants([cells[i][1] for i in order], **fields)
        try:
            for number, index in enumerate(order):
                labels, variant = cells[index]
                comfy.model_management.throw_exception_if_processing_interrupted()
                cell_fields = fields if keep is None else {**fields, "cache_keep": keep[number]}
                images[index], merged, whole = cls._sample(
                    variant, cell_fields, slot, clip, vae, encoded, positive, negative, latent_image, seed,
                    steps, cfg, sampler_name, scheduler)
                last_read = keep[number - 1] - keep[number] if keep and number else ()  # no later reader
                runtime.release(last_read)
                keep = None if whole else keep  # a new model per variant: every key merged each time
                lines[index] = f"{', '.join(labels)}: {merged}"
                bar.update_absolute(number + 1, len(cells))
        finally:
            slot.clear()
            gc.collect()
            comfy.model_management.cleanup_models()
        grid_image = drawing.labelled_grid(images, [labels for labels, _ in cells], len(x[1]), LABEL_PX)
        return io.NodeOutput(grid_image, "\n\n".join(texts), ui={"text": lines})

    run = v3.v1_entry()

    @staticmethod
    def _sample(variant: Any, fields: dict, slot: list, clip: Any, vae: Any, encoded: dict, positive: str,
                negative: str, latent_image: dict, seed: int, steps: int, cfg: float, sampler_name: str,
                scheduler: str) -> tuple[torch.Tensor, str, bool]:
        """One cell: the variant merged (into the MODEL in ``slot`` when it gives only diffusion-model
        weights: no second model), encoded, sampled, decoded; its MODEL left in ``slot``. Also whether
        the merge built a text encoder or VAE too (then the next variant builds a new model)."""
        import nodes as comfy_nodes  # ComfyUI's nodes.py (loaded before any custom node)

        model, merged_clip, merged_vae, lines = runtime.merge_models(variant, reuse=slot, **fields)
        whole = merged_clip is not None or merged_vae is not None
        slot[:] = [model]
        try:
            text_encoder, decoder = merged_clip or clip, merged_vae or vae
            if text_encoder is None or decoder is None:
                part = "text encoder" if text_encoder is None else "VAE"
                raise ValueError(f"the recipe merges no {part} (a diffusion model only): connect the "
                                 f"{'clip' if text_encoder is None else 'vae'} input of Merge Grid")
            conds = []
            for text in (positive, negative):
                cond = encoded.get(text) if text_encoder is clip else None
                if cond is None:
                    cond = comfy_nodes.CLIPTextEncode().encode(text_encoder, text)[0]
                    if text_encoder is clip:
                        encoded[text] = cond
                conds.append(cond)
            (latent,) = comfy_nodes.common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, *conds,
                                                    latent_image)
            image = decoder.decode(latent["samples"])
            image = image.reshape(-1, *image.shape[-3:])[0]
        finally:  # a merged text encoder and VAE go before the next variant is merged
            if merged_clip is not None or merged_vae is not None:
                del merged_clip, merged_vae
                gc.collect()
                comfy.model_management.cleanup_models()
        del model
        return image, lines[0], whole


NODES = [PatchbayMergeGrid]
