"""Where a recipe goes: Merge (MODEL, CLIP, VAE, no file), Save Merge, Extract LoRA, Merge LoRA Stack,
and Clear Merge Cache. The work is in comfy_merge/runtime.py; data flow: docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from comfy_api.latest import io

from ..comfy_merge import files, runtime
from ..merge.io import ARCHITECTURE_POLICIES, OUT_DTYPES
from ..merge.plan import MISSING_POLICIES, SHAPE_POLICIES
from . import v3

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

RECIPE = "PATCHBAY_RECIPE"
CATEGORY = "Patchbay/merge"
CACHE_MB = runtime.DEFAULT_CACHE_MB
_STRENGTH = {"default": 1.0, "min": -20.0, "max": 20.0, "step": 0.01}


def seed_and_cache_inputs() -> list[io.Input]:
    """merge_seed and cache_mb, the inputs of every node that merges."""
    return [
        io.Int.Input("merge_seed", default=0, min=0, max=2**32 - 1,
                     tooltip="Seed of the random methods (dropout, DARE, randomised SVD); the same seed "
                             "gives the same merge."),
        io.Int.Input("cache_mb", default=CACHE_MB, min=0, max=1 << 20, step=256,
                     tooltip="Memory for merge results kept across runs (a changed parameter recomputes only "
                             "what depends on it); 0 = no cache (and empty it)."),
    ]


def common_inputs() -> list[io.Input]:
    """The inputs Merge, Save Merge and Merge Grid share: seed, cache and the shape and key policies."""
    return [
        *seed_and_cache_inputs(),
        io.Combo.Input("shape_policy", options=list(SHAPE_POLICIES),
                       tooltip="Inputs of different shapes (inpainting conv_in): merge the overlap, keep the "
                               "first, or stop."),
        io.Combo.Input("missing_policy", options=list(MISSING_POLICIES),
                       tooltip="Keys some inputs lack: take the first that has them, leave them out, or "
                               "stop."),
    ]


def policy_input() -> io.Input:
    """architecture_policy: optional, after every other input, so saved workflows' widget values keep
    their positions."""
    return io.Combo.Input(
        "architecture_policy", options=list(ARCHITECTURE_POLICIES), default="refuse", optional=True,
        tooltip="Inputs of different model families or block counts (Flux.1 and Flux.2, Wan 1.3B and 14B): "
                "refuse (stop before anything is written), or allow to merge them key by key (rarely a "
                "model ComfyUI can load).")


def _if_exists() -> io.Input:
    return io.Combo.Input("if_exists", options=list(files.IF_EXISTS),
                          tooltip="When the file exists: number (a new name with _00001, ...), error, or "
                                  "overwrite.")


def option_fields(merge_seed: int, cache_mb: int, shape_policy: str, missing_policy: str,
                  architecture_policy: str) -> dict[str, Any]:
    """The merge options (runtime.merge_run's fields) from the inputs every merging node shares
    (common_inputs, policy_input)."""
    return {"seed": merge_seed, "cache_mb": cache_mb, "shape_policy": shape_policy,
            "missing_policy": missing_policy, "architecture_policy": architecture_policy}


class PatchbayMerge(v3.Node):
    NODE_ID = "PatchbayMerge"
    DISPLAY_NAME = "Merge (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        # the node id in the cache key, as V1's hidden UNIQUE_ID put it (V3 lists hidden inputs in a form
        # ComfyUI's cache does not look for): two Merge nodes of one graph each show their own warnings
        return v3.schema(
            cls, category=CATEGORY, hidden=[io.Hidden.unique_id], not_idempotent=True,
            description=("Runs a recipe into a MODEL, CLIP and VAE for this graph, key by key (about one "
                         "model in memory, no file written); unchanged results come from the merge cache. "
                         "Stops on inf or NaN; values far beyond the inputs' range are warned about in the "
                         "node and the log."),
            inputs=[v3.RECIPE.Input("recipe", tooltip="The recipe to run (a method node, recipe text)."),
                    *common_inputs(), policy_input()],
            outputs=[v3.output(io.Model, "model", "The merged diffusion model."),
                     v3.output(io.Clip, "clip", "The merged text encoder (None when no input has one)."),
                     v3.output(io.Vae, "vae", "The merged VAE (None when no input has one).")])

    @classmethod
    def execute(cls, recipe: Any, merge_seed: int = 0, cache_mb: int = CACHE_MB,
                shape_policy: str = "overlap", missing_policy: str = "first",
                architecture_policy: str = "refuse") -> io.NodeOutput:
        fields = option_fields(merge_seed, cache_mb, shape_policy, missing_policy, architecture_policy)
        return _merge(recipe, fields, cls.hidden.unique_id if cls.hidden is not None else None)

    @classmethod
    def merge(cls, recipe: Any, merge_seed: int = 0, cache_mb: int = CACHE_MB, shape_policy: str = "overlap",
              missing_policy: str = "first", architecture_policy: str = "refuse",
              unique_id: str | None = None) -> dict:
        """V1's node function, for Python callers; ``unique_id`` (V1's hidden input): the node that shows
        the warnings."""
        fields = option_fields(merge_seed, cache_mb, shape_policy, missing_policy, architecture_policy)
        return v3.v1_result(_merge(recipe, fields, unique_id))


def _merge(recipe: Any, fields: dict[str, Any], node_id: str | None) -> io.NodeOutput:
    """The Merge node's outputs; warnings are shown under node ``node_id`` too (and logged)."""
    model, clip, vae, lines = runtime.merge_models(recipe, **fields)
    if len(lines) > 1:
        show_in_node(node_id, "\n".join(lines))
    return io.NodeOutput(model, clip, vae, ui={"text": lines})


def show_in_node(node_id: str | None, text: str) -> None:
    """``text`` shown in node ``node_id`` of the frontend, through core's progress text (no extension
    needed); nothing without a running server (tests in-process, scripts)."""
    from server import PromptServer  # ComfyUI's

    instance = getattr(PromptServer, "instance", None)
    if instance is not None and node_id is not None:
        instance.send_progress_text(text, node_id)


class PatchbayMergeSave(v3.Node):
    NODE_ID = "PatchbayMergeSave"
    DISPLAY_NAME = "Save Merge (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY, is_output_node=True,
            description=("Streams a recipe into a .safetensors checkpoint in the output folder, key by key "
                         "(never the whole model in memory), recipe in its metadata; the same bytes as the "
                         "command line."),
            inputs=[
                v3.RECIPE.Input("recipe", tooltip="The recipe to run."),
                io.String.Input("filename", default="checkpoints/patchbay-merge",
                                tooltip="Name under the output folder (subfolders allowed; .safetensors "
                                        "added)."),
                _if_exists(),
                io.Combo.Input("dtype", options=list(OUT_DTYPES), tooltip="Float type of the saved weights."),
                *common_inputs(), policy_input(),
            ],
            outputs=[v3.output(io.String, "path", "The full path of the file written.")])

    @classmethod
    def execute(cls, recipe: Any, filename: str, if_exists: str = "number", dtype: str = "fp16",
                merge_seed: int = 0, cache_mb: int = CACHE_MB, shape_policy: str = "overlap",
                missing_policy: str = "first", architecture_policy: str = "refuse") -> io.NodeOutput:
        fields = option_fields(merge_seed, cache_mb, shape_policy, missing_policy, architecture_policy)
        path, report = runtime.save_merge(recipe, filename, if_exists, dtype=dtype, **fields)
        text = f"{path.name}: {report.keys} keys, {report.bytes_written / 2**20:.1f} MiB, {report.arch}"
        return io.NodeOutput(str(path), ui={"text": [text, *report.warnings]})

    save = v3.v1_entry()


def _lora_inputs(name: str) -> list[io.Input]:
    """The LoRA file inputs Extract LoRA and Merge LoRA Stack share, after ``filename`` (default ``name``)."""
    return [
        io.String.Input("filename", default=name, tooltip="Name in the loras folder (.safetensors added)."),
        _if_exists(),
        io.Combo.Input("size_by", options=["rank", "energy"],
                       tooltip="A fixed rank per module, or the smallest rank that keeps `energy` of each "
                               "delta."),
        io.Int.Input("rank", default=32, min=1, max=4096, tooltip="Rank (size_by rank)."),
        io.Float.Input("energy", default=0.9, min=0.01, max=1.0, step=0.01,
                       tooltip="Share of each delta's squared singular values kept (size_by energy)."),
    ]


def _apply_inputs() -> list[io.Input]:
    """Optional MODEL and CLIP returned with the new LoRA applied, and its strengths."""
    return [
        io.Model.Input("model", optional=True, tooltip="Optional: returned with the LoRA applied (as "
                                                       "LoraLoader)."),
        io.Clip.Input("clip", optional=True, tooltip="Optional: returned with the LoRA applied (as "
                                                     "LoraLoader)."),
        io.Float.Input("strength_model", optional=True, **_STRENGTH, tooltip="LoRA strength on the model."),
        io.Float.Input("strength_clip", optional=True, **_STRENGTH, tooltip="LoRA strength on the CLIP."),
    ]


def _lora_outputs() -> list[io.Output]:
    return [v3.output(io.Model, "model", "The model input with the LoRA applied (None without one)."),
            v3.output(io.Clip, "clip", "The CLIP input with the LoRA applied (None without one)."),
            v3.output(io.String, "lora_name", "The LoRA's name in the loras list.")]


def _lora_dtype() -> io.Input:
    return io.Combo.Input("dtype", options=list(OUT_DTYPES), tooltip="Float type of the LoRA.")


class PatchbayMergeExtractLora(v3.Node):
    NODE_ID = "PatchbayMergeExtractLora"
    DISPLAY_NAME = "Extract LoRA from Merge (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY, is_output_node=True,
            description=("Decomposes a delta recipe (e.g. subtract(tuned, base)) into a kohya LoRA in the "
                         "loras folder (LoraLoader lists it at the next queue); optionally applies it to a "
                         "MODEL/CLIP."),
            inputs=[
                v3.RECIPE.Input("recipe",
                                tooltip="A delta recipe: subtract(tuned, base), a LoRA delta, TIES."),
                *_lora_inputs("patchbay-extracted"),
                io.Int.Input("conv_rank", default=0, min=0, max=4096,
                             tooltip="Rank of 3x3 convolutions; 0 = the same as rank."),
                _lora_dtype(), *_apply_inputs(), policy_input(),
            ],
            outputs=_lora_outputs())

    @classmethod
    def execute(cls, recipe: Any, filename: str, if_exists: str = "number", size_by: str = "rank",
                rank: int = 32, energy: float = 0.9, conv_rank: int = 0, dtype: str = "fp16",
                model: ModelPatcher | None = None, clip: CLIP | None = None, strength_model: float = 1.0,
                strength_clip: float = 1.0, architecture_policy: str = "refuse") -> io.NodeOutput:
        size = {"rank": rank, "energy": None} if size_by == "rank" else {"rank": None, "energy": energy}
        name, report = runtime.extract(recipe, filename, if_exists, conv_rank=conv_rank or None,
                                             dtype=dtype, architecture_policy=architecture_policy, **size)
        if model is not None or clip is not None:
            model, clip = runtime.apply_lora(model, clip, name, strength_model, strength_clip)
        text = f"{name}: {report.modules} modules, mean relative error {report.mean_error:.4f}"
        return io.NodeOutput(model, clip, name, ui={"text": [text, *report.warnings]})

    extract = v3.v1_entry()


class PatchbayMergeLoraStack(v3.Node):
    NODE_ID = "PatchbayMergeLoraStack"
    DISPLAY_NAME = "Merge LoRA Stack (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        lines = ("One LoRA a line: name.safetensors: strength[, clip strength] [| block map], e.g.\n"
                 "ink.safetensors: 0.8\nstyle.safetensors: -0.5, 0 | OUT*=0, default=1")
        # no architecture_policy: LoRAs of different families are always refused (merge/stack_to_lora.py)
        return v3.schema(
            cls, category=CATEGORY, is_output_node=True,
            description=("Merges several LoRAs (strengths, block weights) into one LoRA of the loras folder: "
                         "their factors joined exactly, then cut to a rank or energy per module; reports "
                         "each module's error and where the LoRAs pull in opposite directions."),
            inputs=[
                io.String.Input("loras", multiline=True, default="", tooltip=lines),
                *_lora_inputs("patchbay-lora-stack"), _lora_dtype(),
                v3.LORA_STACK.Input("lora_stack", optional=True,
                                    tooltip="Another pack's LoRA stack: its LoRAs are merged after the lines "
                                            "above."),
                *_apply_inputs(),
            ],
            outputs=[*_lora_outputs(),
                     v3.output(io.String, "report", "Per module: rank kept, relative truncation error, "
                                                    "opposed LoRAs (cosine < 0).")])

    @classmethod
    def execute(cls, loras: str, filename: str, if_exists: str = "number", size_by: str = "rank",
                rank: int = 32, energy: float = 0.9, dtype: str = "fp16", lora_stack: Any = None,
                model: ModelPatcher | None = None, clip: CLIP | None = None, strength_model: float = 1.0,
                strength_clip: float = 1.0) -> io.NodeOutput:
        size = {"rank": rank, "energy": None} if size_by == "rank" else {"rank": None, "energy": energy}
        name, report = runtime.merge_lora_stack(loras, lora_stack, filename, if_exists, dtype=dtype,
                                                      **size)
        if model is not None or clip is not None:
            model, clip = runtime.apply_lora(model, clip, name, strength_model, strength_clip)
        lines = report.lines()
        text = "\n".join([*lines, *(f"{m.name}: rank {m.rank}/{m.full_rank}, error {m.error:.4f}"
                                    for m in report.modules.values())])
        return io.NodeOutput(model, clip, name, text, ui={"text": lines})

    merge = v3.v1_entry()


class PatchbayMergeCacheClear(v3.Node):
    NODE_ID = "PatchbayMergeCacheClear"
    DISPLAY_NAME = "Clear Merge Cache (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(cls, category=CATEGORY, is_output_node=True, inputs=[], outputs=[],
                         description=("Empties the merge cache (results kept across runs by Merge and Save "
                                      "Merge); runs every queue."))

    @classmethod
    def fingerprint_inputs(cls) -> float:
        return float("nan")  # never equal to itself: ComfyUI runs it every time

    @classmethod
    def execute(cls) -> io.NodeOutput:
        before = runtime.CACHE.stats()
        runtime.CACHE.clear()
        text = f"merge cache cleared: {before.entries} entries, {before.bytes / 2**20:.1f} MiB"
        return io.NodeOutput(ui={"text": [text]})

    clear = v3.v1_entry()


NODES = [PatchbayMerge, PatchbayMergeSave, PatchbayMergeExtractLora, PatchbayMergeLoraStack,
         PatchbayMergeCacheClear]
