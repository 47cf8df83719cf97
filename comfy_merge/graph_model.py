"""A MODEL from the graph as a recipe leaf, read key by key with its patches applied the way ComfyUI's
patcher applies them when it loads the model; the model itself is never written.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import comfy.lora
import torch

from ..merge.graph import SourceNode
from ..merge.sources import MemorySource, tensor_info

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

PREFIX = "graph:model-"
UNET = "diffusion_model."
CANONICAL = "model."  # checkpoint keys: model.diffusion_model.X


class GraphModelError(ValueError):
    """A recipe text names a graph MODEL, which only a recipe built in the graph can hold."""


class GraphModel:
    """The source object (merge/sources.py) of a ``SourceNode`` that holds a MODEL of the graph.

    ``fingerprint``: the diffusion model ComfyUI loaded and the id ComfyUI gives its weight patches
    (``patches_uuid``: new with every ``add_patches``; a clone keeps it and shares the model, and so the
    values), so an unchanged upstream model keeps its merge-cache entries across runs. ``name``
    (``graph:model-<token>``, the token taken from the fingerprint) is what .mecha text prints.
    """

    def __init__(self, patcher: ModelPatcher) -> None:
        self.patcher = patcher
        self.name = PREFIX + hashlib.sha1(repr(self.fingerprint).encode()).hexdigest()[:12]

    @property
    def fingerprint(self) -> tuple:
        uuid = getattr(self.patcher, "patches_uuid", None)
        return ("graph MODEL", id(self.patcher.model), str(uuid) if uuid is not None else id(self.patcher))

    def open(self, space: str) -> MemorySource:
        """A ``MemorySource`` whose ``fetch(key)`` takes the unpatched weight (``get_key_patches`` respects
        the backups of a model patched in place) in fp32, its convert function, then
        ``comfy.lora.calculate_weight`` over its patches (LoraLoader, ModelMergeSimple and friends, nested
        patches included). Read when a merge opens its inputs, not when the recipe is built."""
        patches = self.patcher.get_key_patches(UNET)
        infos = {CANONICAL + key: tensor_info(entry[0][0].dtype, tuple(entry[0][0].shape))
                 for key, entry in patches.items()}

        def fetch(key: str) -> torch.Tensor:
            name = key.removeprefix(CANONICAL)
            (weight, convert, *_), *rest = patches[name]
            value = convert(weight.to(device="cpu", dtype=torch.float32, copy=True), inplace=True)
            return comfy.lora.calculate_weight(rest, value, name) if rest else value

        return MemorySource(f"graph MODEL {self.name.removeprefix('graph:')}", infos, fetch, self.fingerprint,
                            space)


def graph_model(patcher: ModelPatcher) -> SourceNode:
    """The recipe leaf holding ``patcher`` (equal leaves for the same unchanged model)."""
    source = GraphModel(patcher)
    return SourceNode(source.name, source=source)


def refuse_graph_name(path: str) -> None:
    """A model path that names a graph MODEL (a recipe text printed by Merge Recipe to Text) is refused,
    saying what to do: only a recipe built in the graph holds the model itself."""
    if path.startswith(PREFIX):
        raise GraphModelError(f"recipe input {path!r}: no MODEL of this graph has that name (a recipe text "
                              f"copied from another run?); connect the model to a Merge Model Input node, "
                              f"or save it and use checkpoints/<name>")


def canonical_key(comfy_key: str) -> str:
    """``diffusion_model.X`` (a MODEL's key) -> ``model.diffusion_model.X`` (the recipe's key)."""
    return CANONICAL + comfy_key


def comfy_key(canonical: str) -> str:
    """``model.diffusion_model.X`` -> ``diffusion_model.X``."""
    return canonical.removeprefix(CANONICAL)
