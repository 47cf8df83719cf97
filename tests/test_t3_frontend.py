"""T3: the real ComfyUI frontend in headless Chromium, served by the T2 session's server.

The frontend is the one the server's ComfyUI pins (1.32.9 with ComfyUI 0.3.75, 1.49.6 with 0.33),
except for the layout checks on 0.33, which run on the newest frontend (1.58.1) in both node designs,
classic and Nodes 2.0 (``NEWEST_FRONTEND_FROM_COMFYUI`` says why). Every bundled workflow must load
with no missing node type and no error toast or dialog; its screenshot goes to
output/screenshots/<ComfyUI version>/. The frontend's own ``graphToPrompt()`` is the reference for
devtools/workflow_api.py (run with that frontend's rules): on the bundled workflows, on a graph built
here with every quirk the converter handles (V3 dynamic inputs too where the server has nodes with
them), and on the widget layout of every node type the server offers.
"""

from __future__ import annotations

import json

import devpaths
import pytest
import workflow_api as wa
import workflow_catalog
from stand_ins import absent_text_encoders
from vendor_packs import packs_for

pytestmark = pytest.mark.t3

WORKFLOWS = sorted(devpaths.WORKFLOWS_DIR.glob("*.json"))

# Core nodes wired with a Reroute chain, a bypassed and a muted node, notes, a group, a PrimitiveNode
# and a linked widget input, a seed control, an upload widget and a dynamic-prompt comment.
QUIRK_GRAPH_JS = """async () => {
  app.graph.clear();
  const add = (type, pos) => {
    const node = LiteGraph.createNode(type); node.pos = pos; app.graph.add(node); return node;
  };
  const slot = (node, name) => node.inputs.findIndex((i) => i.name === name);
  const ckpt = add('CheckpointLoaderSimple', [0, 0]);
  const r1 = add('Reroute', [300, 0]), r2 = add('Reroute', [400, 0]);
  ckpt.connect(0, r1, 0); r1.connect(0, r2, 0);
  const lora = add('LoraLoaderModelOnly', [500, 0]); r2.connect(0, lora, 0); lora.mode = 4;
  const pos = add('CLIPTextEncode', [300, 200]); ckpt.connect(1, pos, 0);
  pos.widgets.find((w) => w.name === 'text').value = 'a red cat // not sent\\nin a hat /* nor this */';
  const neg = add('CLIPTextEncode', [300, 450]); ckpt.connect(1, neg, 0);
  const latent = add('EmptyLatentImage', [300, 700]);
  const sampler = add('KSampler', [800, 0]);
  lora.connect(0, sampler, 0); pos.connect(0, sampler, 1); neg.connect(0, sampler, 2);
  latent.connect(0, sampler, 3);
  sampler.title = 'Renamed sampler';
  const steps = add('PrimitiveInt', [500, 400]); steps.widgets[0].value = 3;
  steps.connect(0, sampler, slot(sampler, 'steps'));
  const prim = add('PrimitiveNode', [500, 600]); prim.connect(0, sampler, slot(sampler, 'seed'));
  prim.widgets[0].value = 4242;
  const decode = add('VAEDecode', [1100, 0]); sampler.connect(0, decode, 0); ckpt.connect(2, decode, 1);
  decode.mode = 2;
  const save = add('SaveImage', [1300, 0]); decode.connect(0, save, 0);
  add('LoadImage', [0, 400]).widgets[0].value = 'example.png';  // the input folder is empty
  add('Note', [0, 900]).widgets[0].value = 'a note';
  add('MarkdownNote', [300, 900]).widgets[0].value = '# notes are never sent';
  const group = new LiteGraph.LGraphGroup('A group'); group.pos = [-20, -60]; group.size = [700, 400];
  app.graph.add(group);
  return JSON.parse(JSON.stringify(await app.graphToPrompt()));
}"""


# Nodes with V3 dynamic inputs (ComfyUI 0.33 has them, 0.3.75 none): a matched-type socket, a dynamic
# combo set to its second option, an autogrow list with a linked entry. Each is exported alone.
V3_GRAPH_JS = """async () => {
  app.graph.clear();
  const add = (type, pos) => {
    const node = LiteGraph.createNode(type); node.pos = pos; app.graph.add(node); return node;
  };
  const image = add('EmptyImage', [0, 0]);
  const resize = add('ResizeImageMaskNode', [300, 0]);
  image.connect(0, resize, resize.inputs.findIndex((i) => i.name === 'input'));
  const kind = resize.widgets.find((w) => w.name === 'resize_type');
  kind.value = kind.options.values[1]; kind.callback?.(kind.value);
  const batch = add('BatchImagesNode', [700, 0]);
  resize.connect(0, batch, batch.inputs.findIndex((i) => i.name === 'images.image0'));
  const save = add('PreviewImage', [1000, 0]); batch.connect(0, save, 0);
  return JSON.parse(JSON.stringify(await app.graphToPrompt()));
}"""
V3_NODES = ("ResizeImageMaskNode", "BatchImagesNode")
V3_FROM_COMFYUI = (0, 33)


@pytest.fixture(scope="module")
def frontend(comfy_server):
    from frontend import Frontend

    with Frontend(comfy_server.url) as fe:
        yield fe


# The zoom below which the frontend draws nodes without their text (LiteGraph's low-quality threshold);
# a workflow should be readable when Fit View shows it whole on a 1080p screen. Larger graphs get a
# floor each, so a layout change cannot make them smaller still unnoticed.
READABLE_ZOOM = 0.6
LARGE_WORKFLOWS = {  # by source name (devtools/workflow_sources); the bundled file is named by its title
    # The floors are the lower of the two designs' zooms on 1.58.1. Every other workflow reaches
    # READABLE_ZOOM in both (devtools/workflow_layout.py folds long chains into two bands for it).
}
SMALLEST_FONT = 10  # px: Nodes 2.0's smallest labels; at READABLE_ZOOM they are 6 px on screen
NOTE_CONTRAST = 4.5  # WCAG AA for body text
# The layout checks run on the frontend users have. On ComfyUI 0.33 that is the newest frontend
# (devtools/newest_frontend.py, 1.58.1), in both node designs, instead of the 1.49.6 that 0.33 pins:
# users update the frontend sooner than ComfyUI, and Nodes 2.0 (1.58.1's DOM nodes, taller than the
# canvas' ones) is where neighbours first covered widgets. The rest of this tier stays on the pinned
# frontends (1.49.6's widget and queue rules, which workflow_api follows, and t2's discovery tests).
# On ComfyUI 0.3.75 they run on its 1.32.9 (classic: the design it has), which the workflows are built
# with.
NEWEST_FRONTEND_FROM_COMFYUI = (0, 33)


def _layout_designs() -> list[str]:
    try:
        version = tuple(int(part) for part in devpaths.comfyui_version().split(".")[:2])
    except RuntimeError:  # no ComfyUI given (a collection without PATCHBAY_COMFYUI): nothing runs anyway
        return ["classic"]
    return ["classic", "nodes-2.0"] if version >= NEWEST_FRONTEND_FROM_COMFYUI else ["classic"]


LAYOUT_DESIGNS = _layout_designs()


@pytest.fixture(scope="module")
def newest_frontend_server(tmp_path_factory):
    """A second server of this ComfyUI, serving the newest frontend (``--front-end-root``)."""
    from comfy_server import ComfyServer
    from frontend import HEADLESS_SETTINGS
    from newest_frontend import ensure_static
    from stand_ins import PACKS
    from vendor_packs import ensure_packs

    with ComfyServer(tmp_path_factory.mktemp("newest-frontend"), settings=HEADLESS_SETTINGS,
                     extra_packs={**ensure_packs(devpaths.comfyui_version()), **PACKS},
                     extra_args=("--front-end-root", str(ensure_static()))) as server:
        yield server


@pytest.fixture(scope="module")
def newest_frontend(newest_frontend_server):
    from frontend import Frontend

    with Frontend(newest_frontend_server.url, viewport=(1920, 1080)) as fe:
        yield fe


class TestOnA1080pScreen:
    """Each bundled workflow at Fit View on a 1920x1080 window, in each design: readable (zoom, smallest
    text, notes' contrast) and no node covering another, before a run and after it (output nodes show
    their pictures and reports, and grow). The window is resized once for the class, and back after."""

    @pytest.fixture(scope="class", params=LAYOUT_DESIGNS)
    @classmethod
    def screen(cls, request):
        if "nodes-2.0" not in LAYOUT_DESIGNS:  # ComfyUI 0.3.75: the session's frontend, 1.32.9
            fe = request.getfixturevalue("frontend")
            before = fe.viewport
            fe.resize((1920, 1080))
            yield fe
            fe.resize(before)
            return
        fe = request.getfixturevalue("newest_frontend")
        fe.set_nodes_2(request.param == "nodes-2.0")
        yield fe

    @pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
    def test_bundled_workflow_is_readable_and_uncovered(self, screen, path):
        screen.load_workflow(json.loads(path.read_text()), path.stem)
        zoom = screen.fit_zoom()
        floor = READABLE_ZOOM
        for slug, large in LARGE_WORKFLOWS.items():
            if workflow_catalog.bundled_path(slug).name == path.name:
                floor = large
        assert zoom >= floor, (f"{path.stem}: Fit View on 1920x1080 zooms to {zoom:.3f} < {floor}; make the "
                               f"graph smaller (devtools/build_workflows.py lays it out)")
        smallest = screen.smallest_text_px()
        assert smallest >= floor * SMALLEST_FONT - 1e-6, f"{path.stem}: text {smallest:.1f} px on screen"
        contrasts = screen.note_contrasts()
        dim = {nid: round(ratio, 2) for nid, ratio in contrasts.items() if ratio < NOTE_CONTRAST}
        assert not dim, f"{path.stem}: notes whose text contrast is below {NOTE_CONTRAST}: {dim}"
        assert _covered(screen.node_boxes()) == [], f"{path.stem}: nodes cover each other before a run"
        screen.show_run_outputs()
        assert _covered(screen.node_boxes()) == [], (
            f"{path.stem}: nodes cover each other after a run (pictures and reports shown); "
            f"devtools/build_workflows.py leaves room for them")


def _covered(boxes: dict[str, tuple[float, float, float, float]]) -> list[tuple[str, str]]:
    """Pairs of node ids whose boxes share more than a pixel each way."""
    ids = sorted(boxes, key=int)
    return [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]
            if min(boxes[a][2], boxes[b][2]) - max(boxes[a][0], boxes[b][0]) > 1
            and min(boxes[a][3], boxes[b][3]) - max(boxes[a][1], boxes[b][1]) > 1]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_bundled_workflow_loads_cleanly(frontend, path):
    workflow = json.loads(path.read_text())
    assert frontend.missing_node_types(workflow) == [], "node types unknown to the frontend"
    frontend.load_workflow(workflow, path.stem)
    assert frontend.error_messages() == [], f"{path.stem}: the frontend showed errors"
    absent = absent_text_encoders(workflow)  # umT5-XXL: no tiny file (1.49.6 flags its loader as missing)
    flagged = [node for node in frontend.nodes_with_errors() if str(node[0]) not in absent]
    assert flagged == [], f"{path.stem}: nodes flagged with errors"
    assert frontend.evaluate("() => app.graph.nodes.length") == len(workflow["nodes"])
    folder = devpaths.output_dir() / "screenshots" / devpaths.comfyui_version()
    shot = frontend.screenshot_graph(folder / f"{path.stem}.png")
    assert shot.stat().st_size > 1000


def test_the_clean_load_check_sees_a_broken_workflows_errors(frontend):
    """The check above sees what a broken load shows as soon as ``load_workflow`` returns, which waits
    for the frontend to be idle instead of a fixed pause: a node whose outputs are no list makes loading
    throw, so the frontend shows its error dialog and an error toast (its report could not fetch the
    server's logs). The page is reloaded after: the half-loaded graph would break the next load."""
    workflow = json.loads(WORKFLOWS[0].read_text())
    workflow["nodes"][0]["outputs"] = 5
    try:
        frontend.load_workflow(workflow, "broken")
        errors = frontend.error_messages()
    finally:
        frontend.reload()
    assert any(e.startswith("dialog: Loading aborted") for e in errors), errors
    assert any(e.startswith("toast: Error Failed to fetch server logs") for e in errors), errors


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_converter_equals_frontend_graph_to_prompt(frontend, object_info, frontend_version, path):
    workflow = json.loads(path.read_text())
    frontend.load_workflow(workflow, path.stem)
    reference = frontend.graph_to_prompt()["output"]
    assert wa.workflow_to_prompt(workflow, object_info, frontend=frontend_version) == reference


def test_converter_equals_frontend_on_v3_dynamic_inputs(frontend, object_info, frontend_version):
    version = devpaths.comfyui_version()
    offered = [node_type for node_type in V3_NODES if node_type in object_info]
    has_v3 = tuple(int(p) for p in version.split(".")[:2]) >= V3_FROM_COMFYUI
    assert offered == (list(V3_NODES) if has_v3 else []), f"V3 nodes offered by ComfyUI {version}"
    if not has_v3:  # 0.3.75 has no node with dynamic inputs; the rest of this tier still runs on it
        return
    exported = frontend.evaluate(V3_GRAPH_JS)
    output = exported["output"]
    resize = next(entry for entry in output.values() if entry["class_type"] == "ResizeImageMaskNode")
    second = object_info["ResizeImageMaskNode"]["input"]["required"]["resize_type"][1]["options"][1]
    assert resize["inputs"]["resize_type"] == second["key"]
    assert {f"resize_type.{name}" for name in second["inputs"]["required"]} <= set(resize["inputs"])
    batch = next(entry for entry in output.values() if entry["class_type"] == "BatchImagesNode")
    assert "images.image0" in batch["inputs"]
    _assert_converter_follows_the_round_trip(frontend, object_info, frontend_version, exported, "v3")


def test_converter_equals_frontend_on_every_quirk(frontend, object_info, frontend_version):
    exported = frontend.evaluate(QUIRK_GRAPH_JS)
    output = exported["output"]
    classes = {entry["class_type"] for entry in output.values()}
    dropped = {"LoraLoaderModelOnly", "VAEDecode", "Reroute", "Note", "MarkdownNote", "PrimitiveNode"}
    assert not classes & dropped
    sampler = next(entry for entry in output.values() if entry["class_type"] == "KSampler")
    checkpoint = next(nid for nid, entry in output.items() if entry["class_type"] == "CheckpointLoaderSimple")
    assert sampler["inputs"]["model"] == [checkpoint, 0] and sampler["inputs"]["seed"] == 4242
    assert sampler["_meta"]["title"] == "Renamed sampler"
    _assert_converter_follows_the_round_trip(frontend, object_info, frontend_version, exported, "quirks")


def _assert_converter_follows_the_round_trip(frontend, object_info, frontend_version, exported, name):
    """The converter gives the frontend's prompt from the exported workflow, and again after the
    frontend saved and opened it (which must not change the prompt)."""
    output = exported["output"]
    assert wa.workflow_to_prompt(exported["workflow"], object_info, frontend=frontend_version) == output
    frontend.load_workflow(exported["workflow"], name)
    again = frontend.graph_to_prompt()
    assert again["output"] == output
    assert wa.workflow_to_prompt(again["workflow"], object_info, frontend=frontend_version) == output


def test_widget_layout_of_every_node_type_matches_the_frontend(frontend, object_info, frontend_version):
    import widget_layout

    layouts = frontend.widget_layouts()
    assert not set(object_info) - set(layouts), "node types the frontend did not register"
    # The vendored packs' node types (AnimateDiff-Evolved's JS adds widgets of its own, e.g. a
    # deprecation warning) are not the converter's to follow: it converts core's and Patchbay's.
    others = {f"custom_nodes.{pack.name}" for pack in packs_for(devpaths.comfyui_version())}
    mismatched = {}
    for node_type, definition in object_info.items():
        built_by_js = node_type in widget_layout.unsupported_types(frontend_version)
        if built_by_js or definition.get("python_module") in others:
            continue
        widgets = wa.widget_layout(definition, frontend_version)
        ours = {"widgets": [[w.name, w.stored, w.api] for w in widgets],
                "inputs": [list(slot) for slot in wa.input_slots(definition, widgets, frontend_version)]}
        if ours != layouts[node_type]:
            mismatched[node_type] = {"frontend": layouts[node_type], "workflow_api": ours}
    assert not mismatched, json.dumps(mismatched, indent=1)[:3000]


SOURCES = sorted(p for p in (devpaths.ROOT / "devtools" / "workflow_sources").glob("*.json"))


def test_every_bundled_workflow_has_a_source():
    bundled = sorted(path.name for path in WORKFLOWS)
    sources = [path for path in SOURCES if not path.name.startswith("_")]
    assert bundled == sorted(workflow_catalog.bundled_path(path.stem).name for path in sources)
    assert set(LARGE_WORKFLOWS) <= {path.stem for path in sources}, "LARGE_WORKFLOWS names no source"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_builder_output_is_current_and_laid_out(frontend, object_info, frontend_version, source):
    """On the frontend the bundled file was built with (its ``extra.frontendVersion``) the builder
    must give it byte for byte; on another it must give a workflow that queues the same prompt."""
    import build_workflows

    built = build_workflows.build_one(frontend, source.stem, json.loads(source.read_text()))
    bundled_path = workflow_catalog.bundled_path(source.stem)
    if not source.name.startswith("_"):
        bundled = json.loads(bundled_path.read_text())
        if bundled["extra"]["frontendVersion"] == frontend_version:
            assert bundled == built, (
                f"{bundled_path.name} is out of date: run 'python devtools/build_workflows.py {source.stem}'")
        else:  # titles left out: an untitled node shows its display name, which ComfyUI may change
            assert built["extra"]["frontendVersion"] == frontend_version
            assert (_queued(wa.workflow_to_prompt(bundled, object_info, frontend=frontend_version))
                    == _queued(wa.workflow_to_prompt(built, object_info, frontend=frontend_version))), (
                f"{bundled_path.name} (built with frontend {bundled['extra']['frontendVersion']}) queues "
                f"another prompt than a build with frontend {frontend_version}")
    boxes = {node["id"]: _box(node) for node in built["nodes"]}
    overlapping = [(a, b) for a in boxes for b in boxes if a < b and _overlap(boxes[a], boxes[b])]
    assert not overlapping, f"nodes overlap: {overlapping}"
    # Links run left to right, but for those from one band of a folded chain down to the next
    # (devtools/workflow_layout.py): their target lies wholly below their origin.
    backwards = [(link[1], link[3]) for link in built["links"]
                 if boxes[link[1]][2] > boxes[link[3]][0] and boxes[link[3]][1] < boxes[link[1]][3]]
    assert not backwards, f"links that run right to left within a band: {backwards}"


def _queued(prompt: dict) -> dict:
    return {nid: (entry["class_type"], entry["inputs"]) for nid, entry in prompt.items()}


def _box(node: dict) -> tuple[float, float, float, float]:
    """left, top, right, bottom, title bar included (litegraph draws it above pos)."""
    (x, y), (w, h) = node["pos"], node["size"]
    return x, y - 30, x + w, y + h


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
