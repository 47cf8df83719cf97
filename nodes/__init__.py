"""Node registration: every ``nodes/*.py`` ends with a ``NODES`` list; this is the one loop over them,
giving each class its id, display name and ``SEARCH_ALIASES`` (nodes/search_terms.py). V1 classes and
V3 ones (``io.ComfyNode``, nodes/v3.py, whose schema carries the aliases itself) share the mapping, as
in ComfyUI's own loader.
"""

from __future__ import annotations

from . import (
    attention_couple,
    couple_region,
    floats,
    hook_blocks,
    hook_keyframes,
    hook_lora,
    hook_preview,
    hook_regional,
    hooks,
    lora_stacker,
    merge_grid,
    merge_hook,
    merge_inputs,
    merge_methods,
    merge_outputs,
    merge_recipes,
    patcher,
    search_terms,
)

_MODULES = (floats, hooks, hook_lora, lora_stacker, hook_blocks, hook_keyframes, hook_regional,
            couple_region, attention_couple, hook_preview, patcher, merge_inputs, merge_methods,
            merge_recipes, merge_outputs, merge_grid, merge_hook)

NODE_CLASS_MAPPINGS: dict[str, type] = {}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {}

for _module in _MODULES:
    for _node in _module.NODES:
        if _node.NODE_ID in NODE_CLASS_MAPPINGS:
            raise RuntimeError(f"Patchbay node id {_node.NODE_ID!r} is registered twice")
        _node.SEARCH_ALIASES = search_terms.aliases(_node)
        NODE_CLASS_MAPPINGS[_node.NODE_ID] = _node
        NODE_DISPLAY_NAME_MAPPINGS[_node.NODE_ID] = _node.DISPLAY_NAME
