"""T3: the merge nodes in the real frontend: Merge Recipe to Text shows the recipe the node returns in
the node itself (web/js/recipe_text.js), Save Merge, Extract LoRA and Clear Merge Cache show their
reports (web/js/merge_reports.js), and a method node's widgets carry the registry's values."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.t3

SHOW_JS = """async ([type, name, text]) => {
  const node = LiteGraph.createNode(type);
  app.graph.add(node);
  const widget = node.widgets.find((w) => w.name === name);
  const before = widget ? widget.value : null;
  node.onExecuted({text: text});
  const after = node.widgets.find((w) => w.name === name).value;
  const readOnly = widget && widget.element ? widget.element.readOnly : null;
  app.graph.remove(node);
  return {before, after, readOnly, names: node.widgets.map((w) => w.name)};
}"""

METHOD_JS = """() => {
  const node = LiteGraph.createNode('PatchbayMethodTiesSumWithDropout');
  app.graph.add(node);
  const values = Object.fromEntries(node.widgets.map((w) => [w.name, w.value]));
  const inputs = node.inputs.map((i) => [i.name, i.type]);
  app.graph.remove(node);
  return {values, inputs};
}"""


@pytest.fixture(scope="module")
def frontend(comfy_server):
    from frontend import Frontend

    with Frontend(comfy_server.url) as fe:
        yield fe


def test_recipe_to_text_shows_the_returned_text_read_only_in_the_node(frontend):
    text = 'version 0.1.0\nmodel "checkpoints/a.safetensors"\nmerge "pick_component" &0 component="vae"'
    shown = frontend.evaluate(SHOW_JS, ["PatchbayMergeRecipeToText", "recipe_text", [text]])
    assert shown["before"] == "" and shown["after"] == text and shown["readOnly"] is True
    assert shown["names"] == ["form", "recipe_text"]
    assert "Patchbay.MergeRecipeToText" in frontend.evaluate("() => app.extensions.map((e) => e.name)")
    assert not [e for e in frontend.console_errors if "Patchbay" in e]  # the extension loaded cleanly


@pytest.mark.parametrize("node_type", ["PatchbayMergeSave", "PatchbayMergeExtractLora",
                                       "PatchbayMergeCacheClear"])
def test_save_extract_and_cache_clear_show_their_report_in_the_node(frontend, node_type):
    lines = ["saved merged.safetensors (12.5 MiB)", "warning: 3 keys only in model a"]
    shown = frontend.evaluate(SHOW_JS, [node_type, "report", lines])
    assert shown["before"] == "" and shown["after"] == "\n".join(lines) and shown["readOnly"] is True
    assert shown["names"][-1] == "report"
    assert "Patchbay.MergeReports" in frontend.evaluate("() => app.extensions.map((e) => e.name)")
    assert not [e for e in frontend.console_errors if "Patchbay" in e]


def test_a_method_node_has_the_registrys_defaults_and_recipe_sockets(frontend):
    node = frontend.evaluate(METHOD_JS)
    assert node["values"]["probability"] == 0.9 and node["values"]["ftol"] == 1e-20
    assert node["values"]["seed"] == -1 and "control_after_generate" not in node["values"]
    sockets = dict(node["inputs"])
    assert sockets["deltas_1"] == "PATCHBAY_RECIPE" and sockets["deltas_10"] == "PATCHBAY_RECIPE"
