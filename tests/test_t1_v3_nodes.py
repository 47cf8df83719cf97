"""T1: the nodes moved to ComfyUI's V3 node API (``comfy_api.latest.io``) declare exactly what their V1
classes did, so workflows saved before the move load unchanged.

tests/data/v1_node_schemas.json was written from the V1 classes before the move (``describe`` below,
ComfyUI 0.3.75; the merge nodes' entries from their V1 classes before their move): per node its inputs
in order (a saved workflow's ``widgets_values`` follow that order), types, defaults, ranges and
tooltips, its outputs, names and tooltips, description, category and output-node flag. File lists
(LoRAs, checkpoints, diffusion models, recipes) and core's sampler and scheduler lists stand as tokens,
so the snapshot holds on both ComfyUI versions and with any models folder. A V3 combo is ``("COMBO",
{"options": [...]})`` where V1 wrote the list as the type, and V3 writes ``multiline``/``multiselect``
False where V1 left them out, and leaves out an empty ``optional`` section that V1 wrote as ``{}``;
``describe`` writes both forms alike, nothing else. That ComfyUI runs the
converted classes is tested by the node tests (test_t1_hook_nodes.py, test_t1_lora_stacker.py, ...)
and the bundled workflows (test_t2_server.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.t1

SNAPSHOT = Path(__file__).resolve().parent / "data" / "v1_node_schemas.json"
MERGE_NODES = ("PatchbayMergeCheckpoint", "PatchbayMergeDiffusionModel", "PatchbayMergeLora",
               "PatchbayMergeModelInput", "PatchbayMergeBlockWeightsSD15", "PatchbayMergeBlockWeightsSDXL",
               "PatchbayMergeBlockWeightsFlux", "PatchbayMergeKeyPatterns", "PatchbayMergeRecipeText",
               "PatchbayMergeRecipeToText", "PatchbayMerge", "PatchbayMergeSave", "PatchbayMergeExtractLora",
               "PatchbayMergeLoraStack", "PatchbayMergeCacheClear", "PatchbayMergeGrid", "PatchbayRecipeHook")
# one node per registered merge method (nodes/merge_methods.py), every one of them in the snapshot
METHOD_NODES = tuple(sorted(node_id for node_id in json.loads(SNAPSHOT.read_text())
                            if node_id.startswith("PatchbayMethod")))
V3_NODES = ("PatchbayHookEngine", "PatchbayHookBlockWeights", "PatchbayHookSchedulePreview",
            "PatchbayHookKeyframe", "PatchbayHookKeyframesInterpolated", "PatchbayHookKeyframesFromFloats",
            "PatchbayHookKeyframesFromText", "PatchbayLoraStacker", "PatchbayPatchOrder", "PatchbayTrace",
            "PatchbayTraceTimeline", "PatchbayFloatsFromText", "PatchbayFloatsRamp", "PatchbayFloatsRepeat",
            *MERGE_NODES, *METHOD_NODES)
# V1's Merge took a hidden UNIQUE_ID, which puts the node id in ComfyUI's cache key (two Merge nodes with
# the same inputs each run and show their own warnings); V3 writes hidden inputs in a form the cache does
# not look for, so the V3 Merge says not_idempotent, which does the same
NODE_ID_IN_CACHE_KEY = ("PatchbayMerge",)


def _tokens(comfy) -> dict[tuple, object]:
    """Option lists that depend on the models folder or the ComfyUI version -> their stand-in."""
    from comfy.samplers import KSampler

    files = comfy.folder_paths.get_filename_list
    loras = files("loras")
    return {tuple(loras): "<loras>", ("None", *loras): ["None", "<loras>"],
            tuple(files("checkpoints")): "<checkpoints>",
            tuple(files("diffusion_models")): "<diffusion_models>",
            ("(textbox)", *files("recipes")): ["(textbox)", "<recipes>"],
            tuple(KSampler.SAMPLERS): "<samplers>", tuple(KSampler.SCHEDULERS): "<schedulers>"}


def _input(entry: tuple, tokens: dict) -> list:
    kind, options = (entry[0], dict(entry[1]) if len(entry) > 1 else {})
    if isinstance(kind, list):  # V1: the choices are the type
        kind, options = "COMBO", {**options, "options": kind}
    for key in ("multiline", "multiselect"):  # V3 writes these False where V1 left them out
        if options.get(key) is False:
            del options[key]
    if "options" in options:
        options["options"] = tokens.get(tuple(options["options"]), options["options"])
    return [str(kind), options]


def describe(cls: type, tokens: dict) -> dict:
    """What a saved workflow and the frontend see of a node class, as ComfyUI reads it (V1 attributes)."""
    inputs = cls.INPUT_TYPES()
    return {
        "inputs": {section: [[name, *_input(entry, tokens)] for name, entry in inputs[section].items()]
                   for section in ("required", "optional") if inputs.get(section)},
        "outputs": [list(map(str, cls.RETURN_TYPES)), list(getattr(cls, "RETURN_NAMES", ())),
                    list(getattr(cls, "OUTPUT_TOOLTIPS", ()))],
        "description": cls.DESCRIPTION,
        "category": cls.CATEGORY,
        "output_node": bool(getattr(cls, "OUTPUT_NODE", False)),
    }


@pytest.mark.parametrize("node_id", V3_NODES)
def test_converted_node_is_v3_registered_and_declares_what_v1_did(comfy, node_id):
    from comfy_api.latest import io

    cls = comfy.pack.NODE_CLASS_MAPPINGS[node_id]
    assert issubclass(cls, io.ComfyNode), f"{node_id} is still a V1 node"
    assert comfy.nodes.NODE_CLASS_MAPPINGS[node_id] is cls
    assert comfy.pack.NODE_DISPLAY_NAME_MAPPINGS[node_id] == cls.GET_SCHEMA().display_name
    before = json.loads(SNAPSHOT.read_text())[node_id]
    assert describe(cls, _tokens(comfy)) == before
    hidden = cls.INPUT_TYPES().get("hidden", {})
    assert ("unique_id" in hidden) == (node_id in NODE_ID_IN_CACHE_KEY), hidden
    assert set(hidden) <= {"unique_id", "prompt", "extra_pnginfo"}, hidden  # V3 adds the last two to outputs


def test_the_node_id_is_in_the_cache_key_of_the_v3_nodes_where_v1_put_it(comfy):
    """ComfyUI's cache keys a node by its id too when it is not idempotent or takes a hidden UNIQUE_ID
    (comfy_execution/caching.py); V1 did so for Merge only (its hidden UNIQUE_ID)."""
    from comfy_execution import caching

    for node_id in V3_NODES:
        cls = comfy.nodes.NODE_CLASS_MAPPINGS[node_id]
        keyed = bool(getattr(cls, "NOT_IDEMPOTENT", False)) or caching.include_unique_id_in_input(node_id)
        assert keyed == (node_id in NODE_ID_IN_CACHE_KEY), node_id


def test_snapshot_still_describes_every_node_left_on_v1(comfy):
    """The nodes of the snapshot not yet moved read the same too (the snapshot is of the code, not stale)."""
    from comfy_api.latest import io

    tokens = _tokens(comfy)
    snapshot = json.loads(SNAPSHOT.read_text())
    for node_id, before in snapshot.items():
        cls = comfy.pack.NODE_CLASS_MAPPINGS[node_id]
        assert issubclass(cls, io.ComfyNode) == (node_id in V3_NODES), node_id
        assert describe(cls, tokens) == before, node_id


def test_search_aliases_reach_node_info_where_comfyui_has_them(comfy):
    """0.33 sends a V3 schema's search_aliases to the frontend; 0.3.75's Schema has no such field."""
    import dataclasses

    from comfy_api.latest import io

    supported = "search_aliases" in {field.name for field in dataclasses.fields(io.Schema)}
    search_terms = comfy.pack.nodes.search_terms
    for node_id in V3_NODES:
        cls = comfy.pack.NODE_CLASS_MAPPINGS[node_id]
        info = cls.GET_NODE_INFO_V1()
        assert info.get("search_aliases") == (search_terms.aliases(cls) if supported else None), node_id


def _execute(comfy, node_id: str, **inputs) -> tuple[list, dict]:
    """The node's outputs and what it shows, as ComfyUI's executor makes them (V3: ``execute`` on a locked
    class clone)."""
    import asyncio

    import execution

    cls = comfy.nodes.NODE_CLASS_MAPPINGS[node_id]
    data = {name: [value] for name, value in inputs.items()}
    output, ui, _subgraph, _pending = asyncio.run(execution.get_output_data("t1", "1", cls(), data))
    return [values[0] for values in output], ui


def _run(comfy, node_id: str, **inputs) -> list:
    """The node's outputs as ComfyUI's executor makes them."""
    return _execute(comfy, node_id, **inputs)[0]


def test_comfyui_executes_the_v3_nodes_as_their_references(comfy):
    lora = "patchbay-lora-r4.safetensors"
    slots = {f"lora_{i}": "None" for i in range(2, 5)}
    (stack,) = _run(comfy, "PatchbayLoraStacker", lora_stack=[("a.safetensors", 1.0, 0.5)], lora_1=lora,
                    model_strength_1=0.8, clip_strength_1=0.25, **slots)
    assert stack == [("a.safetensors", 1.0, 0.5), (lora, 0.8, 0.25)]  # the LORA_STACK format of other packs
    (ours,) = _run(comfy, "PatchbayHookKeyframe", strength=0.3, start_percent=0.25)
    (core,) = _run(comfy, "CreateHookKeyframe", strength_mult=0.3, start_percent=0.25)
    assert [(k.strength, k.start_percent, k.guarantee_steps) for k in ours.keyframes] == \
        [(k.strength, k.start_percent, k.guarantee_steps) for k in core.keyframes]


def test_comfyui_runs_validate_inputs_of_a_v3_node_before_the_prompt(comfy):
    """ComfyUI's validation calls ``validate_inputs`` and reports its message, as it did VALIDATE_INPUTS."""
    import asyncio

    import execution

    def validate(text: str) -> tuple:
        prompt = {"1": {"class_type": "PatchbayHookKeyframesFromText",
                        "inputs": {"text": text, "positions": "percent"}}}
        valid, errors, _ = asyncio.run(execution.validate_inputs("t1", prompt, "1", {}))
        return valid, [error["details"] for error in errors]

    message = comfy.pack.nodes.hook_keyframes._validate("0@0, 1@half", "percent")
    assert isinstance(message, str) and "half" in message
    assert validate("0@0, 1@half") == (False, [f"text - {message}", f"positions - {message}"])
    assert validate("0@0, 1@0.5") == (True, [])


def _validate(prompt_node: dict) -> tuple[bool, list[str]]:
    """ComfyUI's validation of a one-node prompt: (valid, each error's details)."""
    import asyncio

    import execution

    valid, errors, _ = asyncio.run(execution.validate_inputs("t1", {"1": prompt_node}, "1", {}))
    return valid, [error["details"] for error in errors]


def test_comfyui_executes_the_merge_nodes_and_their_v1_entry_points_give_the_same(comfy):
    """Inputs, generated method nodes (a variadic one with a gap between its slots) and Recipe to Text
    through ComfyUI's executor make the recipes the library makes; the V1 node functions, kept as Python
    entry points (``make``, ``build``, ``show``), return the same values in V1's form."""
    pack = comfy.pack
    R, nodes = pack.merge.recipe, pack.NODE_CLASS_MAPPINGS
    (a,) = _run(comfy, "PatchbayMergeCheckpoint", ckpt_name="patchbay-sd15-tiny-a.safetensors")
    (b,) = _run(comfy, "PatchbayMergeCheckpoint", ckpt_name="patchbay-sd15-tiny-b.safetensors")
    assert a == R.model("checkpoints/patchbay-sd15-tiny-a.safetensors")
    assert nodes["PatchbayMergeCheckpoint"]().make(ckpt_name="patchbay-sd15-tiny-a.safetensors") == (a,)
    (lora,) = _run(comfy, "PatchbayMergeLora", lora_name="patchbay-lora-r4.safetensors")
    assert lora == R.model("loras/patchbay-lora-r4.safetensors", space="delta")
    (blend,) = _run(comfy, "PatchbayMethodWeightedSum", a=a, b=b, alpha=0.3)
    assert blend == R.weighted_sum(a, b, alpha=0.3)
    assert nodes["PatchbayMethodWeightedSum"]().build(a=a, b=b, alpha=0.3) == (blend,)
    delta_a, delta_b = R.subtract(a, b), R.subtract(b, a)
    (ties,) = _run(comfy, "PatchbayMethodTiesSum", models_1=delta_a, models_3=delta_b, k=0.5, vote_sgn=True)
    assert ties == R.call("ties_sum", delta_a, delta_b, k=0.5, vote_sgn=True)
    (patterns,) = _run(comfy, "PatchbayMergeKeyPatterns", patterns="IN00=0.2, default=1", check_blocks="sd15")
    (mapped,) = _run(comfy, "PatchbayMethodWeightedSum", a=a, b=b, alpha=0.5, alpha_map=patterns)
    assert mapped == R.call("weighted_sum", a, b, alpha=patterns)
    (text,), shown = _execute(comfy, "PatchbayMergeRecipeToText", recipe=blend, form="sd-mecha")
    assert text == pack.nodes.merge_recipes.recipe_to_text(blend) and 'merge "weighted_sum"' in text
    assert shown == {"text": [text]}
    assert nodes["PatchbayMergeRecipeToText"]().show(blend, "sd-mecha") == {"ui": shown, "result": (text,)}
    scaled = 'version 0.1.0\ninput "x"\nmerge "scale" &0 alpha=2'
    (bound,) = _run(comfy, "PatchbayMergeRecipeText", text=scaled, recipe_file="(textbox)", params="",
                    input_1=delta_a)
    assert bound == R.call("scale", delta_a, alpha=2)


def test_comfyui_runs_merge_and_clear_cache_as_v3_nodes(comfy):
    """Merge through the executor (hidden inputs on the locked class) gives the model its V1 entry point
    gives; Clear Merge Cache runs and shows its line, and its fingerprint is never equal to itself (NaN),
    so ComfyUI runs it every queue as V1's IS_CHANGED made it."""
    import asyncio
    import math

    import execution
    import torch
    from comfy_execution.graph import DynamicPrompt

    R = comfy.pack.merge.recipe
    a, b = (R.model(f"checkpoints/patchbay-sd15-tiny-{n}.safetensors") for n in "ab")
    recipe = R.call("pick_component", R.weighted_sum(a, b, alpha=0.3), component="diffuser")
    settings = {"merge_seed": 0, "cache_mb": 0, "shape_policy": "overlap", "missing_policy": "first"}
    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        (model, clip, vae), shown = _execute(comfy, "PatchbayMerge", recipe=recipe, **settings)
        direct = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayMerge"]().merge(recipe, **settings)
    assert clip is None and vae is None and shown == direct["ui"] and shown["text"]
    ours, reference = (m.model.diffusion_model.state_dict() for m in (model, direct["result"][0]))
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    outputs, shown = _execute(comfy, "PatchbayMergeCacheClear")
    assert outputs == [] and shown["text"][0].startswith("merge cache cleared: ")
    cache = execution.IsChangedCache("t1", DynamicPrompt({"1": {"class_type": "PatchbayMergeCacheClear",
                                                               "inputs": {}}}), None)
    fingerprint = asyncio.run(cache.get("1"))
    assert isinstance(fingerprint, list) and math.isnan(fingerprint[0])  # a float NaN: fingerprint raised


def test_comfyui_runs_validate_inputs_of_the_merge_nodes(comfy):
    """Key Patterns and Recipe Text: ComfyUI calls ``validate_inputs`` and reports its message; inputs it
    names skip ComfyUI's own combo check, as with V1's VALIDATE_INPUTS (check_blocks gets our message)."""
    patterns = comfy.pack.nodes.merge_inputs.PatchbayMergeKeyPatterns
    message = patterns.validate_inputs("IN0=0.2, default=1", "sd15")
    assert isinstance(message, str) and "IN0" in message
    node = {"class_type": "PatchbayMergeKeyPatterns", "inputs": {"patterns": "IN0=0.2, default=1",
                                                                 "check_blocks": "sd15"}}
    assert _validate(node) == (False, [f"patterns - {message}", f"check_blocks - {message}"])
    node["inputs"] = {"patterns": "OUT05=0.5", "check_blocks": "sd4"}
    valid, details = _validate(node)
    assert not valid and all("check_blocks 'sd4'" in detail for detail in details), details
    node["inputs"] = {"patterns": "OUT05=0.5, default=1", "check_blocks": "sdxl"}
    assert _validate(node) == (True, [])
    text = 'version 0.1.0\nmodel "checkpoints/a.safetensors"\nmerge "weighted_sum" &0 &0 alpha='
    node = {"class_type": "PatchbayMergeRecipeText", "inputs": {"text": text, "recipe_file": "(textbox)",
                                                                "params": ""}}
    valid, details = _validate(node)
    assert not valid and details and all("recipe text: " in detail for detail in details), details



def test_every_node_is_v3_but_those_that_keep_their_lora_files(comfy):
    """Issue 33: every node on the V3 API where both ComfyUI versions have what it needs. The nodes that
    read LoRA files keep the last ones per node (nodes/lora_files.ReadsLoras), which V3's locked class
    copy cannot (nodes/v3.py); they, and only they, stay V1."""
    from comfy_api.latest import io

    reads_loras = comfy.pack.nodes.lora_files.ReadsLoras
    v1 = sorted(node_id for node_id, cls in comfy.pack.NODE_CLASS_MAPPINGS.items()
                if not issubclass(cls, io.ComfyNode))
    assert v1 == sorted(node_id for node_id, cls in comfy.pack.NODE_CLASS_MAPPINGS.items()
                        if issubclass(cls, reads_loras))
    assert len(v1) == 9, v1
