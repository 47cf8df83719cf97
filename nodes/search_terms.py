"""The words ComfyUI's node search finds each Patchbay node by, besides its id and display name: one
table for every hand-written node (method nodes get theirs from the method name).
"""

from __future__ import annotations

_SCHEDULE = "lora schedule"
_KEYFRAME = "keyframe"

ALIASES: dict[str, tuple[str, ...]] = {
    # hooks
    "PatchbayHookEngine": ("fast hooks", "hook engine", "speed up lora hooks", "regional lora fast"),
    "PatchbayHookLora": ("lora hook", "create hook lora", "hook lora"),
    "PatchbayHookModelAsLora": ("model as lora", "checkpoint as hook", "model hook"),
    "PatchbayHookLoraStack": ("lora stack hook", "multiple lora hooks"),
    "PatchbayLoraStackHooks": ("lora stack to hooks", "lora stack hook"),
    "PatchbayLoraStacker": ("lora stack", "lora stacker", "multiple loras", "lora list"),
    "PatchbayHookBlockWeights": ("block weight", "lora block weight", "lbw", "lora blocks"),
    "PatchbayPromptLora": ("lora tags", "prompt lora", "a1111 lora", "lora in prompt"),
    # schedules
    "PatchbayScheduledLora": (_SCHEDULE, "scheduled lora", "lora keyframes", "lora fade",
                              "lora strength schedule"),
    "PatchbayHookKeyframe": (_KEYFRAME, "hook keyframe", "lora schedule keyframe", "strength keyframe"),
    "PatchbayHookKeyframesInterpolated": (_KEYFRAME, "interpolated keyframes", "lora schedule fade", "ease"),
    "PatchbayHookKeyframesFromFloats": (_KEYFRAME, "keyframes from floats", "lora schedule from floats"),
    "PatchbayHookKeyframesFromText": (_KEYFRAME, "keyframes from text", "lora schedule text"),
    "PatchbayFloatsFromText": ("floats", "float list", "lora schedule values", "strength list"),
    "PatchbayFloatsRamp": ("floats ramp", "fade", "lora schedule ramp", "ease"),
    "PatchbayFloatsRepeat": ("floats repeat", "pulse", "lora schedule pattern"),
    "PatchbayHookSchedulePreview": ("schedule plot", "keyframe preview", "lora schedule preview"),
    # regions
    "PatchbayRegionalLora": ("regional lora", "region lora", "masked lora", "area lora", "lora mask"),
    "PatchbayAttentionCouple": ("attention couple", "regional prompt", "regional prompting",
                                "lora per region", "multiple characters"),
    "PatchbayAttentionCoupleRegions": ("attention couple", "regional prompt", "regional prompting",
                                       "lora per region", "multiple characters", "region chain"),
    "PatchbayCoupleRegion": ("attention couple region", "regional prompt", "region prompt", "region mask",
                             "lora per region"),
    # patcher
    "PatchbayPatchOrder": ("patch order", "torch compile lora"),
    "PatchbayTrace": ("trace hooks", "debug hooks", "step trace"),
    "PatchbayTraceTimeline": ("trace timeline", "hook timeline", "trace plot"),
    # merging
    "PatchbayMerge": ("merge", "merge models", "merge checkpoints", "model merge", "sd-mecha"),
    "PatchbayMergeSave": ("save merge", "save merged checkpoint", "merge to file"),
    "PatchbayMergeExtractLora": ("extract lora", "lora from merge", "merge to lora"),
    "PatchbayMergeGrid": ("merge grid", "xy plot", "merge xy", "alpha grid", "compare merges", "supermerger"),
    "PatchbayMergeLoraStack": ("merge lora stack", "lora stack to one lora", "combine loras", "lora merge"),
    "PatchbayMergeCacheClear": ("clear merge cache", "merge cache"),
    "PatchbayMergeCheckpoint": ("merge input", "merge checkpoint"),
    "PatchbayMergeDiffusionModel": ("merge input", "merge unet", "merge diffusion model"),
    "PatchbayMergeLora": ("merge input", "merge lora", "bake lora"),
    "PatchbayMergeModelInput": ("merge input", "merge graph model"),
    "PatchbayMergeBlockWeightsSD15": ("block weight", "merge block weight", "mbw sd15"),
    "PatchbayMergeBlockWeightsSDXL": ("block weight", "merge block weight", "mbw sdxl"),
    "PatchbayMergeBlockWeightsFlux": ("block weight", "merge block weight", "mbw flux"),
    "PatchbayMergeKeyPatterns": ("merge key patterns", "merge by key"),
    "PatchbayMergeRecipeText": ("merge recipe", "mecha recipe", "sd-mecha recipe"),
    "PatchbayMergeRecipeToText": ("merge recipe text", "mecha recipe"),
    "PatchbayRecipeHook": ("merge hook", "recipe hook", "merge fade in"),
}


def aliases(node: type) -> list[str]:
    """The search aliases of one node class (``NODE_ID``; a method node's ``METHOD``).

    ComfyUI 0.33 sends a V1 node's ``SEARCH_ALIASES`` to the frontend as ``search_aliases`` (server.py
    ``node_info``); 0.3.75 sends none. Frontends 1.49.6 and newer match a query against ``name``,
    ``display_name`` and ``search_aliases`` (NodeSearchService, Fuse, all words of a query in one of
    them), then rank the matches by ``name`` and ``display_name`` alone: exact, prefix, whole word,
    substring, then usage frequency (core nodes first). An alias therefore makes a node *found* by words
    its name lacks ("lora schedule" finds the keyframe and FLOATS nodes); its rank comes from its display
    name. Frontend 1.32.9 searches ``name`` and ``display_name`` only. ``nodes/__init__.py`` sets
    ``SEARCH_ALIASES`` from this in its registration loop.
    """
    method = getattr(node, "METHOD", "")
    if method:
        words = method.replace("_", " ")
        return [f"{words} merge", "merge method"]
    try:
        return list(ALIASES[node.NODE_ID])
    except KeyError:
        raise KeyError(f"{node.NODE_ID} has no entry in nodes/search_terms.py ALIASES; add the words a "
                       f"user would search it by") from None
