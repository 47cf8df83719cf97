"""Cached text encoding for CLIPs with hooks: core encodes once per keyframe range but remembers nothing,
so a re-run after a change downstream encodes every prompt again. Data flow: docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import pickle
import weakref
from collections import OrderedDict
from typing import Any

import comfy.hooks
import comfy.model_management
import torch

__all__ = ["CachedEncode"]

_CLIP_OPTIONS = ("layer", "layer_idx", "return_projected_pooled")


class CachedEncode:
    """Stands in for ``cond_stage_model.encode_token_weights`` (an object patch); shared by clones.

    The key: (tokens, active CLIP hook contents and strengths, the patcher's ordinary patches, clip layer
    options). A hit returns the stored (cond, pooled, extras); a miss calls the model's own
    encode_token_weights and stores the result (LRU, ``max_entries``). The key never holds a tensor's
    identity only where its content could change under it: hook content is the LoRA state dict object a
    hook holds (CreateHookLora caches the file it loaded).
    """

    def __init__(self, cond_stage_model: torch.nn.Module, max_entries: int = 64) -> None:
        self._model = weakref.ref(cond_stage_model)
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __deepcopy__(self, memo: dict) -> CachedEncode:
        return self

    def __call__(self, tokens: Any) -> Any:
        model = self._model()
        hooks_key, held = _hooks_key(model)
        key = (_tokens_key(tokens), hooks_key, _options_key(model))
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key][0]
        self.misses += 1
        out = type(model).encode_token_weights(model, tokens)
        self._entries[key] = (out, held)  # held: the hook contents whose ids are in the key stay alive
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return out


def _tokens_key(tokens: Any) -> str:
    return hashlib.sha256(pickle.dumps(tokens, protocol=4)).hexdigest()


def _loaded_patcher(model: torch.nn.Module) -> Any:
    """The patcher ComfyUI has loaded for ``model`` (only one clone of a model is loaded at a time)."""
    for loaded in comfy.model_management.current_loaded_models:
        patcher = loaded.model
        if patcher is not None and patcher.model is model:
            return patcher
    return None


def _hooks_key(model: torch.nn.Module) -> tuple[tuple, tuple]:
    """(key, objects whose ids the key holds): the loaded patcher's ordinary patches and CLIP hooks."""
    patcher = _loaded_patcher(model)
    if patcher is None:
        return ("unloaded",), ()
    hooks = patcher.current_hooks
    weight_hooks = [] if hooks is None else hooks.get_type(comfy.hooks.EnumHookType.Weight)
    held = tuple(h.weights_clip if h.weights_clip is not None else h.weights for h in weight_hooks)
    contents = tuple(sorted((id(w), float(h.strength_clip)) for w, h in zip(held, weight_hooks, strict=True)))
    # ordinary patches by content, not patches_uuid: registering CLIP hooks rerolls that uuid
    patches = tuple((k, tuple((p[0], id(p[1]), p[2], p[3]) for p in v))
                    for k, v in sorted(patcher.patches.items()))
    held += tuple(p[1] for v in patcher.patches.values() for p in v)
    return (patches, contents), held


def _options_key(model: torch.nn.Module) -> tuple:
    return tuple((name, tuple(repr(getattr(m, o, None)) for o in _CLIP_OPTIONS))
                 for name, m in model.named_modules() if hasattr(m, "layer_idx"))
