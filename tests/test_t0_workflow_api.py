"""T0: the UI-to-API workflow converter on small hand-written graphs (no ComfyUI, no browser).

The graphs use a made-up ``OBJECT_INFO`` shaped like the server's ``/object_info``. The T3 tests hold
the converter to the real frontend; these pin down each quirk on its own.
"""

from __future__ import annotations

import random

import pytest
import workflow_api as wa

pytestmark = pytest.mark.t0


def _def(name: str, required: dict, output: list[str] = (), optional: dict | None = None,
         display: str | None = None) -> dict:
    inputs = {"required": required, **({"optional": optional} if optional else {})}
    return {"input": inputs, "output": list(output), "name": name, "display_name": display or name}


OBJECT_INFO = {
    "Loader": _def("Loader", {"ckpt_name": [["a.safetensors", "b.safetensors"], {}]}, ["MODEL", "CLIP"],
                   display="Load Model"),
    "Sampler": _def("Sampler", {
        "model": ["MODEL", {}],
        "seed": ["INT", {"default": 0, "control_after_generate": True}],
        "steps": ["INT", {"default": 20}],
        "text": ["STRING", {"multiline": True, "dynamicPrompts": True}],
    }, ["LATENT"]),
    "Filter": _def("Filter", {"model": ["MODEL"], "strength": ["FLOAT", {"default": 1.0}]}, ["MODEL"]),
    "Noise": _def("Noise", {"noise_seed": ["INT", {"default": 0}]}, ["NOISE"]),
    "Pick": _def("Pick", {"choice": ["COMBO", {"options": ["x", "y"], "control_after_generate": True}],
                          "amount": ["FLOAT", {}]}, ["STRING"]),
    "Upload": _def("Upload", {"image": [["cat.png"], {"image_upload": True}], "tag": ["STRING", {}]},
                   ["IMAGE"]),
    "Forced": _def("Forced", {"value": ["INT", {"forceInput": True}], "scale": ["FLOAT", {}]}, ["INT"]),
    "Listy": _def("Listy", {"values": ["COMBO", {"options": ["p", "q"], "multi_select": True}]}, ["STRING"]),
    "IntOut": _def("IntOut", {"value": ["INT", {}]}, ["INT"]),
    # ComfyUI 0.33's V3 dynamic inputs, shaped as its /object_info gives them.
    "Resize": _def("Resize", {
        "input": ["COMFY_MATCHTYPE_V3", {"template": {"template_id": "t", "allowed_types": "IMAGE,MASK"}}],
        "how": ["COMFY_DYNAMICCOMBO_V3", {"options": [
            {"key": "size", "inputs": {"required": {"width": ["INT", {"default": 512}],
                                                    "crop": ["COMBO", {"options": ["no", "center"]}]}}},
            {"key": "factor", "inputs": {"required": {"factor": ["FLOAT", {"default": 1.0}]}}}]}],
        "method": ["COMBO", {"options": ["lanczos", "area"]}],
    }, ["IMAGE"]),
    "Batch": _def("Batch", {"images": ["COMFY_AUTOGROW_V3", {"template": {
        "input": {"required": {"image": ["IMAGE", {}]}}, "prefix": "image", "min": 1, "max": 50}}]},
        ["IMAGE"]),
}
NEW_FRONTEND = "1.49.6"


def node(nid, kind, widgets=None, inputs=(), outputs=(), mode=0, title=None):
    """A serialized litegraph node.

    inputs: (name, type, link) or (name, type, link, widget name); outputs: (name, type, links).
    """
    slots = [{"name": i[0], "type": i[1], "link": i[2], **({"widget": {"name": i[3]}} if len(i) > 3 else {})}
             for i in inputs]
    data = {"id": nid, "type": kind, "pos": [0, 0], "size": [100, 50], "flags": {}, "order": 0, "mode": mode,
            "inputs": slots, "outputs": [{"name": o[0], "type": o[1], "links": list(o[2])} for o in outputs],
            "properties": {}}
    if widgets is not None:
        data["widgets_values"] = widgets
    if title:
        data["title"] = title
    return data


def graph(nodes, links):
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": len(links), "nodes": nodes,
            "links": links, "groups": [], "config": {}, "extra": {}, "version": 0.4}


def loader(nid=1, links=(), clip_links=()):
    outputs = [("MODEL", "MODEL", links), ("CLIP", "CLIP", clip_links)]
    return node(nid, "Loader", ["a.safetensors"], outputs=outputs)


def sampler(nid, model_link, widgets=(7, "randomize", 4, "hello"), extra_inputs=(), title=None):
    return node(nid, "Sampler", list(widgets), inputs=[("model", "MODEL", model_link), *extra_inputs],
                outputs=[("LATENT", "LATENT", [])], title=title)


def convert(workflow, **kwargs):
    return wa.workflow_to_prompt(workflow, OBJECT_INFO, **kwargs)


# -- widgets -------------------------------------------------------------------------------------


def test_links_widgets_and_titles():
    prompt = convert(graph([loader(links=[1]), sampler(2, 1, title="My sampler")],
                           [[1, 1, 0, 2, 0, "MODEL"]]))
    assert prompt == {
        "1": {"inputs": {"ckpt_name": "a.safetensors"}, "class_type": "Loader",
              "_meta": {"title": "Load Model"}},
        "2": {"inputs": {"seed": 7, "steps": 4, "text": "hello", "model": ["1", 0]}, "class_type": "Sampler",
              "_meta": {"title": "My sampler"}},
    }


def test_control_after_generate_takes_a_slot_but_is_never_sent():
    layout = wa.widget_layout(OBJECT_INFO["Sampler"])
    assert [(w.name, w.stored, w.api) for w in layout] == [
        ("seed", True, True), ("control_after_generate", True, False), ("steps", True, True),
        ("text", True, True)]
    assert "control_after_generate" not in convert(graph([sampler(1, None)], []))["1"]["inputs"]


def test_seed_named_int_gets_a_control_widget_without_the_option():
    prompt = convert(graph([node(1, "Noise", [99, "fixed"], outputs=[("NOISE", "NOISE", [])])], []))
    assert prompt["1"]["inputs"] == {"noise_seed": 99}


def test_combo_with_control_after_generate_has_control_and_filter_widgets():
    assert [w.name for w in wa.widget_layout(OBJECT_INFO["Pick"])] == [
        "choice", "control_after_generate", "control_filter_list", "amount"]
    pick = node(1, "Pick", ["y", "increment", "", 0.5], outputs=[("STRING", "STRING", [])])
    prompt = convert(graph([pick], []))
    assert prompt["1"]["inputs"] == {"choice": "y", "amount": 0.5}


def test_upload_button_is_stored_after_the_inputs_and_not_sent():
    assert [w.name for w in wa.widget_layout(OBJECT_INFO["Upload"])] == ["image", "tag", "upload"]
    assert wa.input_slots(OBJECT_INFO["Upload"]) == [
        ("image", "COMBO"), ("tag", "STRING"), ("upload", "IMAGEUPLOAD")]
    upload = node(1, "Upload", ["cat.png", "t", "image"], outputs=[("IMAGE", "IMAGE", [])])
    prompt = convert(graph([upload], []))
    assert prompt["1"]["inputs"] == {"image": "cat.png", "tag": "t"}


def test_v3_dynamic_inputs_on_the_newer_frontend():
    assert [(w.name, w.stored, w.api) for w in wa.widget_layout(OBJECT_INFO["Resize"], NEW_FRONTEND)] == [
        ("how", True, True), ("how.width", True, True), ("how.crop", True, True), ("method", True, True)]
    assert wa.input_slots(OBJECT_INFO["Resize"], frontend=NEW_FRONTEND) == [
        ("input", "IMAGE,MASK"), ("how.width", "INT"), ("how.crop", "COMBO"),
        ("how", "COMFY_DYNAMICCOMBO_V3"), ("method", "COMBO")]
    assert wa.input_slots(OBJECT_INFO["Batch"], frontend=NEW_FRONTEND) == [
        ("images.image0", "IMAGE"), ("images.image1", "IMAGE")]


def test_a_dynamic_combo_value_picks_the_widgets_after_it():
    resize = node(2, "Resize", ["factor", 0.5, "area"], inputs=[("input", "IMAGE,MASK", 1)],
                  outputs=[("IMAGE", "IMAGE", [2])])
    batch = node(3, "Batch", None, inputs=[("images.image0", "IMAGE", 2), ("images.image1", "IMAGE", None)],
                 outputs=[("IMAGE", "IMAGE", [])])
    source = node(1, "IntOut", [1], outputs=[("INT", "INT", [1])])
    links = [[1, 1, 0, 2, 0, "IMAGE"], [2, 2, 0, 3, 0, "IMAGE"]]
    prompt = convert(graph([source, resize, batch], links), frontend=NEW_FRONTEND)
    assert prompt["2"]["inputs"] == {"how": "factor", "how.factor": 0.5, "method": "area", "input": ["1", 0]}
    assert prompt["3"]["inputs"] == {"images.image0": ["2", 0]}


def test_extension_widgets_follow_the_frontend_version():
    preview = _def("PreviewAny", {"source": ["*", {}]})
    assert [(w.name, w.api) for w in wa.widget_layout(preview)] == [("preview", True)]
    assert [(w.name, w.api) for w in wa.widget_layout(preview, NEW_FRONTEND)] == [
        ("preview_text", False), ("preview_mode", False)]


def test_sockets_come_before_widget_inputs():
    assert wa.input_slots(OBJECT_INFO["Sampler"]) == [
        ("model", "MODEL"), ("seed", "INT"), ("steps", "INT"), ("text", "STRING")]


def test_list_values_are_wrapped_so_they_are_not_read_as_links():
    prompt = convert(graph([node(1, "Listy", [["p", "q"]], outputs=[("STRING", "STRING", [])])], []))
    assert prompt["1"]["inputs"] == {"values": {"__value__": ["p", "q"]}}


def test_old_saves_with_a_value_for_a_force_input_are_migrated():
    prompt = convert(graph([node(1, "Forced", [5, 2.0], inputs=[("value", "INT", None)],
                                 outputs=[("INT", "INT", [])])], []))
    assert prompt["1"]["inputs"] == {"scale": 2.0}


def test_widget_values_as_a_name_map():
    prompt = convert(graph([node(1, "Filter", {"strength": 0.3}, inputs=[("model", "MODEL", None)],
                                 outputs=[("MODEL", "MODEL", [])])], []))
    assert prompt["1"]["inputs"] == {"strength": 0.3}


def test_linked_widget_input_overrides_the_widget_value():
    nodes = [loader(links=[1]), node(3, "IntOut", [123], outputs=[("INT", "INT", [2])]),
             sampler(2, 1, extra_inputs=[("seed", "INT", 2, "seed")])]
    prompt = convert(graph(nodes, [[1, 1, 0, 2, 0, "MODEL"], [2, 3, 0, 2, 1, "INT"]]))
    assert prompt["2"]["inputs"]["seed"] == ["3", 0]


def test_primitive_node_value_is_applied_to_its_target_widget():
    nodes = [loader(links=[1]), node(5, "PrimitiveNode", [555, "fixed"], outputs=[("INT", "INT", [2])]),
             sampler(2, 1, extra_inputs=[("seed", "INT", 2, "seed")])]
    prompt = convert(graph(nodes, [[1, 1, 0, 2, 0, "MODEL"], [2, 5, 0, 2, 1, "INT"]]))
    assert "5" not in prompt
    assert prompt["2"]["inputs"]["seed"] == 555


# -- graph rewrites --------------------------------------------------------------------------------


def test_reroutes_are_followed():
    nodes = [loader(links=[1]), node(7, "Reroute", inputs=[("", "*", 1)], outputs=[("", "MODEL", [2])]),
             node(8, "Reroute", inputs=[("", "*", 2)], outputs=[("", "MODEL", [3])]), sampler(2, 3)]
    links = [[1, 1, 0, 7, 0, "*"], [2, 7, 0, 8, 0, "*"], [3, 8, 0, 2, 0, "MODEL"]]
    prompt = convert(graph(nodes, links))
    assert set(prompt) == {"1", "2"}
    assert prompt["2"]["inputs"]["model"] == ["1", 0]


def test_bypassed_node_passes_its_matching_input_through():
    bypassed = node(3, "Filter", [0.5], inputs=[("model", "MODEL", 1)], outputs=[("MODEL", "MODEL", [2])],
                    mode=4)
    nodes = [loader(links=[1]), bypassed, sampler(2, 2)]
    prompt = convert(graph(nodes, [[1, 1, 0, 3, 0, "MODEL"], [2, 3, 0, 2, 0, "MODEL"]]))
    assert "3" not in prompt
    assert prompt["2"]["inputs"]["model"] == ["1", 0]


def test_bypass_without_a_matching_input_type_drops_the_input():
    nodes = [node(4, "Noise", [1, "fixed"], outputs=[("NOISE", "NOISE", [])]),
             node(3, "IntOut", [3], outputs=[("INT", "INT", [1])], mode=4),
             node(2, "Filter", [0.5], inputs=[("model", "MODEL", None), ("strength", "FLOAT", 1, "strength")],
                  outputs=[("MODEL", "MODEL", [])])]
    prompt = convert(graph(nodes, [[1, 3, 0, 2, 1, "INT"]]))
    assert prompt["2"]["inputs"] == {"strength": 0.5}  # node 3 has no FLOAT input: the link gives nothing


def test_muted_node_is_dropped_with_the_inputs_it_fed():
    muted = node(3, "Filter", [0.5], inputs=[("model", "MODEL", 1)], outputs=[("MODEL", "MODEL", [2])],
                 mode=2)
    nodes = [loader(links=[1]), muted, sampler(2, 2)]
    prompt = convert(graph(nodes, [[1, 1, 0, 3, 0, "MODEL"], [2, 3, 0, 2, 0, "MODEL"]]))
    assert "3" not in prompt
    assert "model" not in prompt["2"]["inputs"]


def test_notes_and_frontend_only_nodes_are_dropped():
    nodes = [loader(), node(9, "Note", ["read me"]), node(10, "MarkdownNote", ["# read me"])]
    assert set(convert(graph(nodes, []))) == {"1"}


def test_links_in_schema_version_1_objects():
    links = [{"id": 1, "origin_id": 1, "origin_slot": 0, "target_id": 2, "target_slot": 0, "type": "MODEL"}]
    prompt = convert(graph([loader(links=[1]), sampler(2, 1)], links))
    assert prompt["2"]["inputs"]["model"] == ["1", 0]


def test_renamed_legacy_types_are_mapped():
    info = {**OBJECT_INFO, "ControlNetLoader": _def("ControlNetLoader", {"name": [["c.pt"], {}]}, ["CN"])}
    legacy = node(1, "T2IAdapterLoader", ["c.pt"], outputs=[("CN", "CN", [])])
    prompt = wa.workflow_to_prompt(graph([legacy], []), info)
    assert prompt["1"]["class_type"] == "ControlNetLoader"


# -- dynamic prompts -----------------------------------------------------------------------------


def test_dynamic_prompt_strips_comments_and_keeps_escapes():
    assert wa.process_dynamic_prompt("a cat // a comment\nin /* big */ hat") == "a cat \nin  hat"
    assert wa.process_dynamic_prompt(r"literal \{braces\} and \| bar") == "literal {braces} and | bar"


def test_dynamic_prompt_choices_follow_the_random_source():
    text = "{red|green|blue} {x|{y|z}}"
    picks = {wa.process_dynamic_prompt(text, random.Random(seed)) for seed in range(40)}
    assert all(p.split()[0] in {"red", "green", "blue"} and p.split()[1] in {"x", "y", "z"} for p in picks)
    assert len(picks) > 3
    again = wa.process_dynamic_prompt("{red|green|blue}", random.Random(7))
    assert again == wa.process_dynamic_prompt("{red|green|blue}", random.Random(7))


def test_dynamic_prompts_apply_only_to_widgets_that_ask_for_them():
    prompt = convert(graph([sampler(1, None, widgets=(1, "fixed", 2, "a // b"))], []))
    assert prompt["1"]["inputs"]["text"] == "a "


# -- errors --------------------------------------------------------------------------------------


def test_unknown_node_type_names_the_node():
    with pytest.raises(wa.WorkflowConversionError, match=r"node 4 \(Mystery\): unknown node type 'Mystery'"):
        convert(graph([node(4, "Mystery", [])], []))


def test_extra_frontend_only_types_can_be_declared():
    prompt = convert(graph([loader(), node(4, "Label", ["hi"])], []),
                     frontend_only=wa.FRONTEND_ONLY_TYPES | {"Label"})
    assert set(prompt) == {"1"}


def test_widget_count_mismatch_names_the_node_and_the_widgets():
    with pytest.raises(wa.WorkflowConversionError, match=r"node 2 \(Sampler\): widgets_values has 3 values .*"
                                                          r"'control_after_generate'"):
        convert(graph([sampler(2, None, widgets=(1, 2, "x"))], []))


def test_broken_link_is_reported():
    with pytest.raises(wa.WorkflowConversionError, match="node 2 \\(Sampler\\).*link 9"):
        convert(graph([sampler(2, 9)], []))


def test_subgraphs_are_refused_with_a_remedy():
    workflow = graph([loader()], [])
    workflow["definitions"] = {"subgraphs": [{"id": "x", "nodes": []}]}
    with pytest.raises(wa.WorkflowConversionError, match="Unpack"):
        convert(workflow)


def test_frontend_extension_nodes_are_refused():
    info = {**OBJECT_INFO, "WebcamCapture": _def("WebcamCapture", {"width": ["INT", {}]}, ["IMAGE"])}
    with pytest.raises(wa.WorkflowConversionError, match=r"node 3 \(WebcamCapture\).*browser"):
        wa.workflow_to_prompt(graph([node(3, "WebcamCapture", [1])], []), info)
