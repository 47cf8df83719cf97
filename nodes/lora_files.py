"""LoRA and checkpoint files by name for the hook nodes, read and kept per node (the lookup in ComfyUI's
folders, with its did-you-mean, is comfy_merge/files.py's, which the merge nodes share); hooks/ only sees
state dicts.
"""

from __future__ import annotations

from collections import OrderedDict

import comfy.hooks
import comfy.sd
import comfy.utils
import folder_paths

from ..comfy_merge.files import names, resolve

__all__ = ["NONE", "LoraFiles", "ReadsLoras", "lora_names"]

NONE = "None"


def lora_names() -> list[str]:
    return names("loras")


class LoraFiles:
    """Per-node cache of the last ``size`` files read (as core's CreateHookLora keeps its last LoRA)."""

    def __init__(self, size: int = 4) -> None:
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._size = size

    def _get(self, path: str, load):
        if path in self._cache:
            self._cache.move_to_end(path)
        else:
            self._cache[path] = load(path)
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return self._cache[path]

    def lora(self, name: str) -> tuple[str, dict]:
        """(resolved name, state dict) of the LoRA ``name``."""
        found, path = resolve(name, "loras")
        return found, self._get(path, lambda p: comfy.utils.load_torch_file(p, safe_load=True))

    def checkpoint_weights(self, name: str) -> tuple[dict, dict | None]:
        """(model weights, CLIP weights or None) of the checkpoint ``name``, for model-as-LoRA hooks."""
        _, path = resolve(name, "checkpoints")
        return self._get(path, _checkpoint_weights)


def _checkpoint_weights(path: str) -> tuple[dict, dict | None]:
    model, clip, *_ = comfy.sd.load_checkpoint_guess_config(
        path, output_vae=False, output_clip=True,
        embedding_directory=folder_paths.get_folder_paths("embeddings"))
    return (comfy.hooks.get_patch_weights_from_model(model),
            comfy.hooks.get_patch_weights_from_model(clip.patcher if clip is not None else None))


class ReadsLoras:
    """Base of the nodes that read LoRA files: each node instance keeps its last ``FILES_KEPT`` files.

    These nodes stay on ComfyUI's V1 API: a V3 ``execute`` runs on a locked copy of the class and never
    sees the node object ComfyUI keeps per node id, so the files could only be kept process-wide or under
    a hidden UNIQUE_ID (which puts the node id into the node's cache key). Kept files keep their tensors,
    and with them the CLIP encodings hooks/clip_cache.py keys on, when the node runs again with another
    strength or schedule (core's CreateHookLora keeps its last LoRA the same way and stays V1 in 0.33)."""

    FILES_KEPT = 4

    def __init__(self) -> None:
        self.files = LoraFiles(self.FILES_KEPT)
