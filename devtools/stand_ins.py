"""Stand-ins for the parts of a bundled workflow that cannot be made tiny, for the tests and the demo.

The Wan 2.2 workflow loads umT5-XXL with ``CLIPLoader`` (type ``wan``): ComfyUI builds it from a fixed
5.7 B-parameter config (comfy/text_encoders/wan.py), so no tiny file can stand in for it, and the
diffusion model's text input is fixed at 4096 wide. ``replace_text_encoders`` rewrites an API prompt so
that every ``CLIPTextEncode`` fed by such a loader becomes the test-only ``TinyTextConditioning`` node
(devtools/stand_in_nodes, loaded as the ``PACKS`` pack) with the same text, and drops the loader.
Everything downstream (hooks on the conditioning, samplers, VAE) runs as bundled.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

PACKS = {"patchbay-stand-ins": Path(__file__).with_name("stand_in_nodes")}
TEXT_WIDTHS = {"wan": 4096}  # CLIPLoader type -> the width of the conditioning it gives


def replace_text_encoders(prompt: dict[str, Any]) -> dict[str, Any]:
    """``prompt`` (not changed) with the text encoders of TEXT_WIDTHS' types replaced by stand-ins."""
    out = copy.deepcopy(prompt)
    loaders = {nid: TEXT_WIDTHS[node["inputs"].get("type")] for nid, node in out.items()
               if node["class_type"] == "CLIPLoader" and node["inputs"].get("type") in TEXT_WIDTHS}
    for node in out.values():
        clip = node["inputs"].get("clip")
        if node["class_type"] == "CLIPTextEncode" and isinstance(clip, list) and clip[0] in loaders:
            node["class_type"] = "TinyTextConditioning"
            node["inputs"] = {"text": node["inputs"]["text"], "width": loaders[clip[0]]}
    used = {value[0] for node in out.values() for value in node["inputs"].values() if isinstance(value, list)}
    if left := sorted(set(loaders) & used):
        raise ValueError(f"nodes {left} (CLIPLoader) feed more than CLIPTextEncode: no stand-in for that")
    for nid in loaders:
        del out[nid]
    return out


def absent_text_encoders(workflow: dict[str, Any]) -> set[str]:
    """Ids of the UI-format ``workflow``'s CLIPLoader nodes of TEXT_WIDTHS' types: their files are not
    in the test models (a frontend may flag them as missing, as it would for a user without them)."""
    return {str(node["id"]) for node in workflow["nodes"] if node["type"] == "CLIPLoader"
            and (node.get("widgets_values") or [None, None])[1] in TEXT_WIDTHS}
