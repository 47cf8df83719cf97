"""A MODEL from the graph as a recipe input, read key by key with its patches applied the way ComfyUI's
patcher applies them when it loads the model; the model itself is never written.
"""

from __future__ import annotations

import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import comfy.lora
import torch

from ..merge.graph import ModelNode
from ..merge.sources import MemorySource, tensor_info

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

PREFIX = "graph:model-"
UNET = "diffusion_model."
CANONICAL = "model."  # checkpoint keys: model.diffusion_model.X

_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PATCHERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class GraphModel(ModelNode):
    """A recipe input that is a MODEL of the graph; ``patcher`` keeps it alive (not compared)."""

    patcher: Any = field(default=None, compare=False, repr=False)


def graph_model(patcher: ModelPatcher) -> GraphModel:
    """The recipe input for ``patcher`` (the same token for the same patcher object)."""
    token = _TOKENS.get(patcher)
    if token is None:
        token = _TOKENS[patcher] = uuid.uuid4().hex[:12]
        _PATCHERS[token] = patcher
    return GraphModel(PREFIX + token, patcher=patcher)


def is_graph_path(path: str) -> bool:
    return path.startswith(PREFIX)


def graph_source(path: str) -> MemorySource:
    """The ``MemorySource`` for a ``graph:model-<token>`` path (see the module docstring).

    ``graph_model(patcher)`` gives a recipe ``ModelNode`` whose path is ``graph:model-<token>`` (one token
    per patcher object, so an unchanged upstream model keeps its cache entries across runs) and which
    holds the patcher. For such a path this returns a ``MemorySource`` (merge/sources.py) whose
    ``fetch(key)`` takes the unpatched weight (``get_key_patches`` respects the backups of a model
    patched in place) in fp32, its convert function, then ``comfy.lora.calculate_weight`` over its
    patches (LoraLoader, ModelMergeSimple and friends, nested patches included).
    """
    patcher = _PATCHERS.get(path.removeprefix(PREFIX))
    if patcher is None:
        raise ValueError(f"recipe input {path!r}: no MODEL of this graph has that name (a recipe text copied "
                         f"from another run?); connect the model to a Merge Model Input node, or save it "
                         f"and use checkpoints/<name>")
    patches = patcher.get_key_patches(UNET)
    infos = {CANONICAL + key: tensor_info(entry[0][0].dtype, tuple(entry[0][0].shape))
             for key, entry in patches.items()}

    def fetch(key: str) -> torch.Tensor:
        name = key.removeprefix(CANONICAL)
        (weight, convert, *_), *rest = patches[name]
        value = convert(weight.to(device="cpu", dtype=torch.float32, copy=True), inplace=True)
        return comfy.lora.calculate_weight(rest, value, name) if rest else value

    fingerprint = f"{path}:{getattr(patcher, 'patches_uuid', '')}"
    return MemorySource(f"graph MODEL {path.removeprefix('graph:')}", infos, fetch, fingerprint)


def canonical_key(comfy_key: str) -> str:
    """``diffusion_model.X`` (a MODEL's key) -> ``model.diffusion_model.X`` (the recipe's key)."""
    return CANONICAL + comfy_key


def comfy_key(canonical: str) -> str:
    """``model.diffusion_model.X`` -> ``diffusion_model.X``."""
    return canonical.removeprefix(CANONICAL)
