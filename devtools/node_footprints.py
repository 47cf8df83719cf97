"""The room a node of a bundled workflow needs on screen, in both node designs, before and after a run.

Why: devtools/build_workflows.py lays workflows out with the frontend they are built with (1.32.9,
the classic canvas), from the sizes it gives each node. The newest frontend (1.58.1) also draws
nodes in its "Nodes 2.0" design: DOM elements at least 225 wide and often taller (a row for the
pack's badge, roomier widgets), so a layout spaced for the canvas put widgets under their neighbours
there. And a run grows the nodes that show pictures (SaveImage, PreviewImage ...) in both designs.
The builder spaces nodes by the footprint given here instead of the canvas size alone; T3
(tests/test_t3_frontend.py ``TestOnA1080pScreen``) checks the result on 1.58.1 in both designs.

``NODES_2_EXTRA_HEIGHT`` is measured (``python devtools/node_footprints.py`` prints it again: the
bundled workflows on a server with the newest frontend, Nodes 2.0 on, each node's DOM height less its
canvas height). A type not measured gets ``UNMEASURED_EXTRA`` plus ``PER_WIDGET_EXTRA`` per widget,
more than any measured type needs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NODES_2_EXTRA_HEIGHT", "NODES_2_MIN_WIDTH", "RUN_PICTURE_HEIGHT", "RUN_PICTURE_TYPES",
           "footprint", "measure"]

TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT: drawn above a node's pos
NODES_2_MIN_WIDTH = 225  # 1.58.1 draws no node narrower (VAE Decode: 140 on the canvas)
# Output nodes that show a picture after a run: on 1.58.1 they grow to 300 tall on the canvas and 332
# in Nodes 2.0 (title included, 270 wide), square or portrait picture alike, as T3 replays a run.
RUN_PICTURE_TYPES = frozenset({"SaveImage", "PreviewImage", "SaveAnimatedPNG", "SaveAnimatedWEBP"})
RUN_PICTURE_HEIGHT = 340
UNMEASURED_EXTRA, PER_WIDGET_EXTRA = 36, 10
# Nodes 2.0 height less canvas height (title included), per node type, on frontend 1.58.1.
NODES_2_EXTRA_HEIGHT = {
    "CLIPLoader": 8, "CheckpointLoaderSimple": 4, "ConditioningCombine": 8,
    "ConditioningSetProperties": 32, "CreateHookLora": 36, "EmptyHunyuanLatentVideo": 16,
    "EmptyLatentImage": 12, "LoraLoader": 12, "MaskComposite": 12, "ModelSamplingSD3": 4,
    "PairConditioningSetProperties": 32, "PatchbayAttentionCouple": 314, "PatchbayAttentionCoupleRegions": 42,
    "PatchbayCoupleRegion": 58, "PatchbayFloatsRamp": 40,
    "PatchbayFloatsRepeat": 44, "PatchbayHookBlockWeights": 42, "PatchbayHookEngine": 32,
    "PatchbayHookKeyframe": 32, "PatchbayHookKeyframesFromFloats": 32, "PatchbayHookKeyframesFromText": 4,
    "PatchbayHookKeyframesInterpolated": 48, "PatchbayHookLora": 36, "PatchbayHookLoraStack": 108,
    "PatchbayHookModelAsLora": 36, "PatchbayHookSchedulePreview": 36, "PatchbayLoraStackHooks": 24,
    "PatchbayLoraStacker": 72, "PatchbayMerge": 44, "PatchbayMergeBlockWeightsSD15": 128,
    "PatchbayMergeBlockWeightsSDXL": 104, "PatchbayMergeCheckpoint": 28, "PatchbayMergeDiffusionModel": 28,
    "PatchbayMergeExtractLora": 53, "PatchbayMergeGrid": 124, "PatchbayMergeKeyPatterns": 4,
    "PatchbayMergeLora": 28, "PatchbayMergeLoraStack": 78, "PatchbayMergeModelInput": 32,
    "PatchbayMergeRecipeText": 56, "PatchbayMergeRecipeToText": 9, "PatchbayMergeSave": 45,
    "PatchbayMethodAddDifference": 28, "PatchbayMethodPickComponent": 36, "PatchbayMethodSubtract": 32,
    "PatchbayMethodTiesSum": 32, "PatchbayMethodWeightedSum": 28, "PatchbayPatchOrder": 32,
    "PatchbayPromptLora": 16, "PatchbayRecipeHook": 40, "PatchbayRegionalLora": 60,
    "PatchbayScheduledLora": 58, "PatchbayTrace": 32, "PatchbayTraceTimeline": 32, "PreviewAny": 16,
    "SaveAnimatedPNG": 16, "SaveImage": 12, "SetClipHooks": 4, "SetHookKeyframes": 32, "SolidMask": 12,
    "UNETLoader": 4, "VAEDecode": 8, "VAELoader": 4,
    "CLIPTextEncode": 0, "KSampler": 0, "KSamplerAdvanced": 0, "MarkdownNote": 0, "Note": 0,
    "PatchbayFloatsFromText": 0, "PatchbayMergeCacheClear": 0,
}


def footprint(node: dict[str, Any], *, after_run: bool = True) -> tuple[float, float]:
    """Width and height (title bar included) a UI-format node needs in either design, before a run
    and, with ``after_run``, after it: the canvas size, widened and heightened to what Nodes 2.0 and a
    run's picture take."""
    width, height = node["size"][0], node["size"][1] + TITLE_HEIGHT
    extra = NODES_2_EXTRA_HEIGHT.get(node["type"])
    if extra is None:
        extra = UNMEASURED_EXTRA + PER_WIDGET_EXTRA * len(node.get("widgets_values") or [])
    height += extra
    if after_run and node["type"] in RUN_PICTURE_TYPES:
        height = max(height, RUN_PICTURE_HEIGHT)
    return max(width, NODES_2_MIN_WIDTH), height


_MEASURE_JS = """() => { const ds = app.canvas.ds, out = {};
  for (const el of document.querySelectorAll('.lg-node[data-node-id]'))
    out[el.dataset.nodeId] = el.getBoundingClientRect().height / ds.scale;
  return app.graph.nodes.map((n) => [n.type, n.size[1] + LiteGraph.NODE_TITLE_HEIGHT,
                                     out[String(n.id)]]); }"""


def measure() -> dict[str, int]:
    """Load every bundled workflow into the newest frontend with Nodes 2.0 on; per node type the most
    its DOM height exceeds its canvas height (``NODES_2_EXTRA_HEIGHT``)."""
    import json
    import tempfile
    from pathlib import Path

    import devpaths
    from comfy_server import ComfyServer
    from frontend import HEADLESS_SETTINGS, Frontend
    from newest_frontend import ensure_static
    from stand_ins import PACKS
    from vendor_packs import ensure_packs

    extra: dict[str, int] = {}
    packs = {**ensure_packs(devpaths.comfyui_version()), **PACKS}
    with tempfile.TemporaryDirectory() as scratch, \
            ComfyServer(Path(scratch), settings=HEADLESS_SETTINGS, extra_packs=packs,
                        extra_args=("--front-end-root", str(ensure_static()))) as server, \
            Frontend(server.url, viewport=(1920, 1080)) as frontend:
        frontend.set_nodes_2(True)
        for path in sorted(devpaths.WORKFLOWS_DIR.glob("*.json")):
            frontend.load_workflow(json.loads(path.read_text()), path.stem)
            frontend.fit_zoom()
            for node_type, canvas, dom in frontend.evaluate(_MEASURE_JS):
                extra[node_type] = max(extra.get(node_type, 0), round(dom - canvas))
    return dict(sorted(extra.items()))


if __name__ == "__main__":
    print(measure())
