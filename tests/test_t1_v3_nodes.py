"""T1: the nodes moved to ComfyUI's V3 node API (``comfy_api.latest.io``) declare exactly what their V1
classes did, so workflows saved before the move load unchanged.

tests/data/v1_node_schemas.json was written from the V1 classes before the move (``describe`` below,
ComfyUI 0.3.75): per node its inputs in order (a saved workflow's ``widgets_values`` follow that
order), types, defaults, ranges and tooltips, its outputs, names and tooltips, description, category
and output-node flag. File lists (LoRAs, checkpoints) and core's scheduler list stand as tokens, so the
snapshot holds on both ComfyUI versions and with any models folder. A V3 combo is ``("COMBO",
{"options": [...]})`` where V1 wrote the list as the type, and V3 writes ``multiline``/``multiselect``
False where V1 left them out; ``describe`` writes both forms alike, nothing else. That ComfyUI runs the
converted classes is tested by the node tests (test_t1_hook_nodes.py, test_t1_lora_stacker.py, ...)
and the bundled workflows (test_t2_server.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.t1

SNAPSHOT = Path(__file__).resolve().parent / "data" / "v1_node_schemas.json"
V3_NODES = ("PatchbayHookEngine", "PatchbayHookBlockWeights", "PatchbayHookSchedulePreview",
            "PatchbayHookKeyframe", "PatchbayHookKeyframesInterpolated", "PatchbayHookKeyframesFromFloats",
            "PatchbayHookKeyframesFromText", "PatchbayLoraStacker", "PatchbayPatchOrder", "PatchbayTrace",
            "PatchbayTraceTimeline")


def _tokens(comfy) -> dict[tuple, object]:
    """Option lists that depend on the models folder or the ComfyUI version -> their stand-in."""
    from comfy.samplers import KSampler

    loras = comfy.folder_paths.get_filename_list("loras")
    return {tuple(loras): "<loras>", ("None", *loras): ["None", "<loras>"],
            tuple(comfy.folder_paths.get_filename_list("checkpoints")): "<checkpoints>",
            tuple(KSampler.SCHEDULERS): "<schedulers>"}


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
        "outputs": [list(map(str, cls.RETURN_TYPES)), list(cls.RETURN_NAMES), list(cls.OUTPUT_TOOLTIPS)],
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
    assert "hidden" not in cls.INPUT_TYPES(), "a hidden UNIQUE_ID would put the node id in its cache key"


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


def _run(comfy, node_id: str, **inputs) -> list:
    """The node's outputs as ComfyUI's executor makes them (V3: ``execute`` on a locked class clone)."""
    import asyncio

    import execution

    cls = comfy.nodes.NODE_CLASS_MAPPINGS[node_id]
    data = {name: [value] for name, value in inputs.items()}
    output, _ui, _subgraph, _pending = asyncio.run(execution.get_output_data("t1", "1", cls(), data))
    return [values[0] for values in output]


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
