"""T1: the pack as ComfyUI loads it: node registry rules, and FLOATS driving core hook keyframes."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.t1


def workflow_node_types() -> set[str]:
    import devpaths

    types: set[str] = set()
    for path in sorted(devpaths.WORKFLOWS_DIR.glob("*.json")):
        graph = json.loads(path.read_text())
        graphs = [graph] + graph.get("definitions", {}).get("subgraphs", [])
        types |= {node["type"] for g in graphs for node in g.get("nodes", [])}
    return types


def test_registry_ids_prefixed_unique_and_not_colliding_with_core(comfy):
    ours = comfy.pack.NODE_CLASS_MAPPINGS
    assert ours, "the pack registers no node"
    our_classes = set(ours.values())
    core = {node_id for node_id, cls in comfy.nodes.NODE_CLASS_MAPPINGS.items() if cls not in our_classes}
    for node_id, cls in ours.items():
        assert node_id.startswith("Patchbay"), node_id
        assert node_id == cls.NODE_ID
        assert node_id not in core, f"{node_id} collides with a core node id (ComfyUI would drop ours)"
        assert comfy.nodes.NODE_CLASS_MAPPINGS[node_id] is cls, f"{node_id} was not registered by ComfyUI"
        assert comfy.pack.NODE_DISPLAY_NAME_MAPPINGS[node_id] == cls.DISPLAY_NAME
        assert cls.CATEGORY.startswith("Patchbay/")
    display_names = list(comfy.pack.NODE_DISPLAY_NAME_MAPPINGS.values())
    assert len(display_names) == len(set(display_names)), "two nodes share a display name"


def test_every_node_has_a_help_page(comfy):
    """web/docs/<NodeId>/en.md (what the frontend asks for first) and its fallback copy <NodeId>.md (for
    the other locales), both written by devtools/build_merge_docs.py."""
    import build_merge_docs

    missing = [node_id for node_id in comfy.pack.NODE_CLASS_MAPPINGS
               if not build_merge_docs.help_page(node_id).is_file()]
    assert not missing, f"write web/docs/<NodeId>/en.md for {missing}"
    stale = [str(path) for path, text in build_merge_docs.pages(comfy.pack.merge.method_registry).items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"run devtools/build_merge_docs.py: {stale}"


def test_every_node_has_search_aliases(comfy):
    """nodes/search_terms.py names only registered nodes, and every node gets words to be found by."""
    search_terms = comfy.pack.nodes.search_terms
    nodes = comfy.pack.NODE_CLASS_MAPPINGS
    assert set(search_terms.ALIASES) <= set(nodes), sorted(set(search_terms.ALIASES) - set(nodes))
    for node_id, cls in nodes.items():
        assert cls.SEARCH_ALIASES and all(a == a.strip().lower() for a in cls.SEARCH_ALIASES), node_id


def test_every_node_documents_itself(comfy):
    """A description, a tooltip on every input (required and optional) and one per output."""
    problems = []
    for node_id, cls in comfy.pack.NODE_CLASS_MAPPINGS.items():
        if not getattr(cls, "DESCRIPTION", "").strip():
            problems.append(f"{node_id} has no DESCRIPTION")
        if len(getattr(cls, "OUTPUT_TOOLTIPS", ())) != len(cls.RETURN_TYPES):
            problems.append(f"{node_id}: one OUTPUT_TOOLTIPS per output")
        inputs = cls.INPUT_TYPES()
        for group in ("required", "optional"):
            for name, spec in inputs.get(group, {}).items():
                options = spec[1] if len(spec) > 1 else {}
                if not options.get("tooltip"):
                    problems.append(f"{node_id}.{name} has no tooltip")
    assert not problems, "\n".join(problems)


# Merge nodes that no bundled workflow shows yet. Flux's block weights are one widget per block (60): the
# node alone is taller than a 1080p screen shows readably, and the tiny Flux model is 1 GiB to merge on
# every T2 run. Each is covered by T1 tests of its own; the list may only shrink: a node listed here that
# a workflow uses, or that no longer exists, fails the test below. LoRA Stack to Hooks gets its workflow (a
# LORA_STACK source scheduled as hooks) with issue 34's bundled workflows; T1: test_t1_hook_nodes.
# Attention Couple's 8 fixed slots (40 widgets, 1644 tall in Nodes 2.0) make its workflow unreadable at fit
# zoom: the bundled one uses the chain (Couple Region -> Attention Couple from Regions), which samples the
# same regions exactly alike (test_t1_attention_couple_chain); the node stays for workflows saved with it.
NOT_YET_IN_A_WORKFLOW = {"PatchbayMergeBlockWeightsFlux", "PatchbayAttentionCouple"}


def test_every_node_is_used_by_a_bundled_workflow(comfy):
    """Hand-written nodes each appear in a workflow. The method nodes are generated from the merge
    registry by one class factory (tested for every method in test_t1_merge_nodes), so a few of them
    in workflows show them all."""
    nodes = comfy.pack.NODE_CLASS_MAPPINGS
    used = workflow_node_types()
    generated = {node_id for node_id, cls in nodes.items() if getattr(cls, "METHOD", None)}
    assert len(generated & used) >= 3, f"bundled workflows use {sorted(generated & used)} of the method nodes"
    unused = set(nodes) - generated - used - NOT_YET_IN_A_WORKFLOW
    assert not unused, f"no bundled workflow in workflows/ uses {sorted(unused)}"
    stale = NOT_YET_IN_A_WORKFLOW - (set(nodes) - used)
    assert not stale, f"{sorted(stale)} are in a workflow or gone: remove them from NOT_YET_IN_A_WORKFLOW"


# Workflows whose note is not the first thing one reads (the top node, left-most of the top ones): above
# and left of every node, each of them would fit Fit View on 1080p below devtools/workflow_layout.py's
# READ_FIRST_ZOOM, so the note goes where the graph grows least (the layout's rule).
NOTE_NOT_FIRST = {"attention_couple_four_characters", "regional_two_characters_core_hooks",
                  "regional_lora_four_regions", "merge_grid_alpha_blocks", "trace_timeline_hook_schedule",
                  "wan22_two_stage_lora"}


def test_every_bundled_workflow_opens_with_a_note_on_what_to_change_and_look_at():
    import devpaths
    from workflow_catalog import bundled_path

    late = {bundled_path(name).stem for name in NOTE_NOT_FIRST}
    for path in sorted(devpaths.WORKFLOWS_DIR.glob("*.json")):
        nodes = json.loads(path.read_text())["nodes"]
        notes = [node for node in nodes if node["type"] in ("Note", "MarkdownNote")]
        assert len(notes) == 1, f"{path.name}: {len(notes)} note nodes, want one"
        text = notes[0]["widgets_values"][0]
        assert "**Change:**" in text and "**Look at:**" in text, f"{path.name}: note lacks Change/Look at"
        top_left = min(nodes, key=lambda node: (node["pos"][1], node["pos"][0]))
        if path.stem not in late:
            assert top_left is notes[0], f"{path.name}: the note is not the first thing in the graph"


def test_floats_nodes_return_floats_lists(comfy):
    """The FLOATS nodes (V3) as Python calls them (V1's ``make``) and as ComfyUI does (``execute``)."""
    nodes = comfy.pack.NODE_CLASS_MAPPINGS
    assert nodes["PatchbayFloatsFromText"]().make("0, 0.5") == ([0.0, 0.5], 2)
    assert nodes["PatchbayFloatsRamp"]().make(0.0, 1.0, 3, "linear") == ([0.0, 0.5, 1.0],)
    assert nodes["PatchbayFloatsRepeat"]().make("1, 0", 3, "cycle") == ([1.0, 0.0, 1.0],)
    assert nodes["PatchbayFloatsRepeat"].execute("1, 0", 3, "pingpong").args == ([1.0, 0.0, 1.0],)
    easing_choices = nodes["PatchbayFloatsRamp"].INPUT_TYPES()["required"]["easing"][1]["options"]
    assert easing_choices[0] == "linear"


def test_floats_text_errors_come_at_validation_time(comfy):
    """ComfyUI calls validate_inputs when a prompt is queued: a typo stops it before anything runs."""
    nodes = comfy.pack.NODE_CLASS_MAPPINGS
    text, repeat = nodes["PatchbayFloatsFromText"], nodes["PatchbayFloatsRepeat"]
    assert text.validate_inputs("0, 0.25\n1  # end") is True
    assert text.validate_inputs(None) is True  # linked: checked when it runs
    message = text.validate_inputs("0, half, 1")
    assert "FLOATS text" in message and "'half' at line 1, column 4" in message
    assert "holds no number" in text.validate_inputs("# nothing")
    assert repeat.VALIDATE_INPUTS("1, 0") is True
    assert "repeat pattern" in repeat.validate_inputs("1, x")


def test_floats_nodes_document_themselves(comfy):
    for node_id in ("PatchbayFloatsFromText", "PatchbayFloatsRamp", "PatchbayFloatsRepeat"):
        node = comfy.pack.NODE_CLASS_MAPPINGS[node_id]
        assert node.DESCRIPTION and node.CATEGORY.startswith("Patchbay")
        assert len(node.OUTPUT_TOOLTIPS) == len(node.RETURN_TYPES) and all(node.OUTPUT_TOOLTIPS)
        for name, spec in node.INPUT_TYPES()["required"].items():
            assert spec[1].get("tooltip"), f"{node_id}.{name} has no tooltip"


def test_floats_make_core_keyframes(comfy):
    floats_node = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayFloatsRamp"]()
    (values,) = floats_node.make(start=1.0, end=0.0, count=5, easing="linear")
    keyframes_node = comfy.nodes.NODE_CLASS_MAPPINGS["CreateHookKeyframesFromFloats"]()
    (group,) = keyframes_node.create_hook_keyframes(values, start_percent=0.0, end_percent=1.0)
    assert [kf.strength for kf in group.keyframes] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert [kf.start_percent for kf in group.keyframes] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_floats_text_error_reaches_the_user_with_its_column(comfy):
    node = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayFloatsFromText"]()
    with pytest.raises(ValueError, match="'0.5x' at line 1, column 4"):
        node.make("1, 0.5x")


@pytest.fixture(scope="module")
def sampling(comfy, sd15):
    n, model, latent = sd15.nodes, sd15.model, sd15.latent
    positive, negative = sd15.encode("a knight in armor"), sd15.encode("blurry")

    def sample(model_in, pos):
        (out,) = n["KSampler"]().sample(model_in, 7, 4, 7.0, "euler", "normal", pos, negative, latent)
        return out["samples"]

    def hooked(strength_text: str | None):
        hooks = sd15.lora_hooks()
        if strength_text is not None:
            (values, _count) = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayFloatsFromText"]().make(strength_text)
            (kf,) = n["CreateHookKeyframesFromFloats"]().create_hook_keyframes(values, 0.0, 1.0)
            (hooks,) = n["SetHookKeyframes"]().set_hook_keyframes(hooks, kf)
        return sample(model, sd15.hooked(positive, hooks))

    return sample, hooked, model, positive


def test_floats_schedule_drives_a_lora_hook_in_sampling(sampling):
    sample, hooked, model, positive = sampling
    plain = sample(model, positive)
    always = hooked(None)
    assert not torch.equal(plain, always), "the LoRA hook has no effect on the tiny model"
    assert torch.equal(hooked("1, 1, 1, 1"), always), "a constant 1 schedule must equal the unscheduled hook"
    # Core runs a hooked cond as its own forward pass, so batching may change the last bits.
    tolerance = 1e-4 * plain.abs().max().item()
    torch.testing.assert_close(hooked("0, 0, 0, 0"), plain, rtol=0, atol=tolerance)
    ramp = hooked("0, 0.25, 0.75, 1")
    assert torch.isfinite(ramp).all()
    assert (ramp - plain).abs().max() > tolerance and (ramp - always).abs().max() > tolerance
