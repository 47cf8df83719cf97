"""Where a recipe goes: Merge (MODEL, CLIP, VAE, no file), Save Merge, Extract LoRA, Merge LoRA Stack,
and Clear Merge Cache. The work is in nodes/merge_runtime.py; data flow: docs/design-merge-nodes.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..merge.io import ARCHITECTURE_POLICIES, OUT_DTYPES
from ..merge.plan import MISSING_POLICIES, SHAPE_POLICIES
from . import merge_files, merge_runtime

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

RECIPE = "PATCHBAY_RECIPE"
CATEGORY = "Patchbay/merge"
CACHE_MB = merge_runtime.DEFAULT_CACHE_MB
COMMON_INPUTS = {
    "merge_seed": ("INT", {"default": 0, "min": 0, "max": 2**32 - 1,
                           "tooltip": "Seed of the random methods (dropout, DARE, randomised SVD); the same "
                                      "seed gives the same merge."}),
    "cache_mb": ("INT", {"default": CACHE_MB, "min": 0, "max": 1 << 20, "step": 256,
                         "tooltip": "Memory for merge results kept across runs (a changed parameter "
                                    "recomputes only what depends on it); 0 = no cache (and empty it)."}),
    "shape_policy": (list(SHAPE_POLICIES), {"tooltip": "Inputs of different shapes (inpainting conv_in): "
                                                       "merge the overlap, keep the first, or stop."}),
    "missing_policy": (list(MISSING_POLICIES), {"tooltip": "Keys some inputs lack: take the first that "
                                                           "has them, leave them out, or stop."}),
}
# optional, after every other input: saved workflows' widget values keep their positions
POLICY_INPUTS = {"architecture_policy": (list(ARCHITECTURE_POLICIES), {
    "default": "refuse", "tooltip": "Inputs of different model families or block counts (Flux.1 and Flux.2, "
                                    "Wan 1.3B and 14B): refuse (stop before anything is written), or allow "
                                    "to merge them key by key (rarely a model ComfyUI can load)."})}
_IF_EXISTS = (list(merge_files.IF_EXISTS), {"tooltip": "When the file exists: number (a new name with "
                                                       "_00001, ...), error, or overwrite."})


def option_fields(merge_seed: int, cache_mb: int, shape_policy: str, missing_policy: str,
                  architecture_policy: str) -> dict[str, Any]:
    """The merge options (merge_runtime.merge_options' fields) from the inputs every merging node shares
    (COMMON_INPUTS, POLICY_INPUTS)."""
    return {"seed": merge_seed, "cache_mb": cache_mb, "shape_policy": shape_policy,
            "missing_policy": missing_policy, "architecture_policy": architecture_policy}


class PatchbayMerge:
    NODE_ID = "PatchbayMerge"
    DISPLAY_NAME = "Merge (Patchbay)"
    DESCRIPTION = ("Runs a recipe into a MODEL, CLIP and VAE for this graph, key by key (about one model in "
                   "memory, no file written); unchanged results come from the merge cache. Stops on inf or "
                   "NaN; values far beyond the inputs' range are warned about in the node and the log.")
    FUNCTION = "merge"
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "CLIP", "VAE")
    RETURN_NAMES = ("model", "clip", "vae")
    OUTPUT_TOOLTIPS = ("The merged diffusion model.", "The merged text encoder (None when no input has one).",
                       "The merged VAE (None when no input has one).")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        tip = "The recipe to run (a method node, recipe text)."
        return {"required": {"recipe": (RECIPE, {"tooltip": tip}), **COMMON_INPUTS},
                "optional": POLICY_INPUTS, "hidden": {"unique_id": "UNIQUE_ID"}}

    def merge(self, recipe: Any, merge_seed: int = 0, cache_mb: int = CACHE_MB,
              shape_policy: str = "overlap", missing_policy: str = "first",
              architecture_policy: str = "refuse", unique_id: str | None = None) -> dict:
        fields = option_fields(merge_seed, cache_mb, shape_policy, missing_policy, architecture_policy)
        model, clip, vae, lines = merge_runtime.merge_models(recipe, **fields)
        if len(lines) > 1:  # warnings: shown under the node too (they are in the log already)
            merge_runtime.show_in_node(unique_id, "\n".join(lines))
        return {"ui": {"text": lines}, "result": (model, clip, vae)}


class PatchbayMergeSave:
    NODE_ID = "PatchbayMergeSave"
    DISPLAY_NAME = "Save Merge (Patchbay)"
    DESCRIPTION = ("Streams a recipe into a .safetensors checkpoint in the output folder, key by key (never "
                   "the whole model in memory), recipe in its metadata; the same bytes as the command line.")
    FUNCTION = "save"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("path",)
    OUTPUT_TOOLTIPS = ("The full path of the file written.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {
            "recipe": (RECIPE, {"tooltip": "The recipe to run."}),
            "filename": ("STRING", {"default": "checkpoints/patchbay-merge",
                                    "tooltip": "Name under the output folder (subfolders allowed; "
                                               ".safetensors added)."}),
            "if_exists": _IF_EXISTS,
            "dtype": (list(OUT_DTYPES), {"tooltip": "Float type of the saved weights."}),
            **COMMON_INPUTS,
        }, "optional": POLICY_INPUTS}

    def save(self, recipe: Any, filename: str, if_exists: str = "number", dtype: str = "fp16",
             merge_seed: int = 0, cache_mb: int = CACHE_MB, shape_policy: str = "overlap",
             missing_policy: str = "first", architecture_policy: str = "refuse") -> dict:
        fields = option_fields(merge_seed, cache_mb, shape_policy, missing_policy, architecture_policy)
        path, report = merge_runtime.save_merge(recipe, filename, if_exists, dtype=dtype, **fields)
        text = f"{path.name}: {report.keys} keys, {report.bytes_written / 2**20:.1f} MiB, {report.arch}"
        return {"ui": {"text": [text, *report.warnings]}, "result": (str(path),)}


class PatchbayMergeExtractLora:
    NODE_ID = "PatchbayMergeExtractLora"
    DISPLAY_NAME = "Extract LoRA from Merge (Patchbay)"
    DESCRIPTION = ("Decomposes a delta recipe (e.g. subtract(tuned, base)) into a kohya LoRA in the loras "
                   "folder (LoraLoader lists it at the next queue); optionally applies it to a MODEL/CLIP.")
    FUNCTION = "extract"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    RETURN_TYPES = ("MODEL", "CLIP", "STRING")
    RETURN_NAMES = ("model", "clip", "lora_name")
    OUTPUT_TOOLTIPS = ("The model input with the LoRA applied (None without one).",
                       "The CLIP input with the LoRA applied (None without one).",
                       "The LoRA's name in the loras list.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        strength = {"default": 1.0, "min": -20.0, "max": 20.0, "step": 0.01}
        return {
            "required": {
                "recipe": (RECIPE, {"tooltip": "A delta recipe: subtract(tuned, base), a LoRA delta, TIES."}),
                "filename": ("STRING", {"default": "patchbay-extracted",
                                        "tooltip": "Name in the loras folder (.safetensors added)."}),
                "if_exists": _IF_EXISTS,
                "size_by": (["rank", "energy"], {"tooltip": "A fixed rank per module, or the smallest rank "
                                                            "that keeps `energy` of each delta."}),
                "rank": ("INT", {"default": 32, "min": 1, "max": 4096, "tooltip": "Rank (size_by rank)."}),
                "energy": ("FLOAT", {"default": 0.9, "min": 0.01, "max": 1.0, "step": 0.01,
                                     "tooltip": "Share of each delta's squared singular values kept (size_by "
                                                "energy)."}),
                "conv_rank": ("INT", {"default": 0, "min": 0, "max": 4096,
                                      "tooltip": "Rank of 3x3 convolutions; 0 = the same as rank."}),
                "dtype": (list(OUT_DTYPES), {"tooltip": "Float type of the LoRA."}),
            },
            "optional": {
                "model": ("MODEL", {"tooltip": "Optional: returned with the LoRA applied (as LoraLoader)."}),
                "clip": ("CLIP", {"tooltip": "Optional: returned with the LoRA applied (as LoraLoader)."}),
                "strength_model": ("FLOAT", {**strength, "tooltip": "LoRA strength on the model."}),
                "strength_clip": ("FLOAT", {**strength, "tooltip": "LoRA strength on the CLIP."}),
                **POLICY_INPUTS,
            },
        }

    def extract(self, recipe: Any, filename: str, if_exists: str = "number", size_by: str = "rank",
                rank: int = 32, energy: float = 0.9, conv_rank: int = 0, dtype: str = "fp16",
                model: ModelPatcher | None = None, clip: CLIP | None = None, strength_model: float = 1.0,
                strength_clip: float = 1.0, architecture_policy: str = "refuse") -> dict:
        size = {"rank": rank, "energy": None} if size_by == "rank" else {"rank": None, "energy": energy}
        name, report = merge_runtime.extract(recipe, filename, if_exists, conv_rank=conv_rank or None,
                                             dtype=dtype, architecture_policy=architecture_policy, **size)
        if model is not None or clip is not None:
            model, clip = merge_runtime.apply_lora(model, clip, name, strength_model, strength_clip)
        text = f"{name}: {report.modules} modules, mean relative error {report.mean_error:.4f}"
        return {"ui": {"text": [text, *report.warnings]}, "result": (model, clip, name)}


class PatchbayMergeLoraStack:
    NODE_ID = "PatchbayMergeLoraStack"
    DISPLAY_NAME = "Merge LoRA Stack (Patchbay)"
    DESCRIPTION = ("Merges several LoRAs (strengths, block weights) into one LoRA of the loras folder: their "
                   "factors joined exactly, then cut to a rank or energy per module; reports each module's "
                   "error and where the LoRAs pull in opposite directions.")
    FUNCTION = "merge"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    RETURN_TYPES = ("MODEL", "CLIP", "STRING", "STRING")
    RETURN_NAMES = ("model", "clip", "lora_name", "report")
    OUTPUT_TOOLTIPS = (*PatchbayMergeExtractLora.OUTPUT_TOOLTIPS,
                       "Per module: rank kept, relative truncation error, opposed LoRAs (cosine < 0).")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        extract = PatchbayMergeExtractLora.INPUT_TYPES()
        lines = ("One LoRA a line: name.safetensors: strength[, clip strength] [| block map], e.g.\n"
                 "ink.safetensors: 0.8\nstyle.safetensors: -0.5, 0 | OUT*=0, default=1")
        required = {k: v for k, v in extract["required"].items() if k not in ("recipe", "conv_rank")}
        filename = ("STRING", {"default": "patchbay-lora-stack",
                               "tooltip": "Name in the loras folder (.safetensors added)."})
        return {
            "required": {"loras": ("STRING", {"multiline": True, "default": "", "tooltip": lines}),
                         **required, "filename": filename},
            "optional": {"lora_stack": ("LORA_STACK", {"tooltip": "Another pack's LoRA stack: its LoRAs "
                                                                  "are merged after the lines above."}),
                         **{k: v for k, v in extract["optional"].items() if k != "architecture_policy"}},
        }  # LoRAs of different families are always refused (merge/stack_to_lora.py): no policy to choose

    def merge(self, loras: str, filename: str, if_exists: str = "number", size_by: str = "rank",
              rank: int = 32, energy: float = 0.9, dtype: str = "fp16", lora_stack: Any = None,
              model: ModelPatcher | None = None, clip: CLIP | None = None, strength_model: float = 1.0,
              strength_clip: float = 1.0) -> dict:
        size = {"rank": rank, "energy": None} if size_by == "rank" else {"rank": None, "energy": energy}
        name, report = merge_runtime.merge_lora_stack(loras, lora_stack, filename, if_exists, dtype=dtype,
                                                      **size)
        if model is not None or clip is not None:
            model, clip = merge_runtime.apply_lora(model, clip, name, strength_model, strength_clip)
        lines = report.lines()
        text = "\n".join([*lines, *(f"{m.name}: rank {m.rank}/{m.full_rank}, error {m.error:.4f}"
                                    for m in report.modules.values())])
        return {"ui": {"text": lines}, "result": (model, clip, name, text)}


class PatchbayMergeCacheClear:
    NODE_ID = "PatchbayMergeCacheClear"
    DISPLAY_NAME = "Clear Merge Cache (Patchbay)"
    DESCRIPTION = ("Empties the merge cache (results kept across runs by Merge and Save Merge); runs every "
                   "queue.")
    FUNCTION = "clear"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    RETURN_TYPES = ()

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {}}

    @classmethod
    def IS_CHANGED(cls) -> float:
        return float("nan")  # never equal to itself: ComfyUI runs it every time

    def clear(self) -> dict:
        before = merge_runtime.CACHE.stats()
        merge_runtime.CACHE.clear()
        text = f"merge cache cleared: {before.entries} entries, {before.bytes / 2**20:.1f} MiB"
        return {"ui": {"text": [text]}}


NODES = [PatchbayMerge, PatchbayMergeSave, PatchbayMergeExtractLora, PatchbayMergeLoraStack,
         PatchbayMergeCacheClear]
