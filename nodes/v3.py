"""Patchbay's conventions for nodes on ComfyUI's V3 node API (``comfy_api.latest.io``), in one place.

A V3 node is one declaration: ``define_schema`` returns an ``io.Schema`` (inputs with tooltips, outputs,
description, category) and ``execute``, ``validate_inputs`` and ``fingerprint_inputs`` are classmethods.
ComfyUI derives the V1 attributes (``INPUT_TYPES``, ``RETURN_TYPES``, ``DESCRIPTION`` ...) from the
schema, so V3 classes go into ``NODE_CLASS_MAPPINGS`` like V1 ones (nodes/__init__.py, one loop).

What this module adds to ``io``:
- ``Node``: the base class; ``NODE_ID`` and ``DISPLAY_NAME`` name the node, as on every Patchbay node.
- ``schema``: the ``io.Schema`` of a node from its class, refusing an input or output without a tooltip
  and adding the words of nodes/search_terms.py as ``search_aliases`` where ComfyUI's Schema has them
  (0.33; 0.3.75's has no such field, and its server sends no aliases for any node).
- ``output``: an output named as V1's ``RETURN_NAMES`` named it.
- ``FLOATS``, ``LORA_STACK``, ``COUPLE_REGIONS``, ``RECIPE``: the socket types that are not core's.
- ``v1_entry``, ``v1_result``: V1's ``FUNCTION`` name kept as a Python entry point (scripts and tests
  call ``Node().build(...)``), returning what V1 returned; ComfyUI itself calls ``execute``.

V3 has no per-node instance state: ``execute`` runs on a locked copy of the class, and the node object
ComfyUI keeps per node id never reaches it. Nodes that keep their last LoRA files between runs (as
core's CreateHookLora does, which 0.33 keeps on V1 for that reason) stay V1: see nodes/lora_files.py.
"""

from __future__ import annotations

import dataclasses

from comfy_api.latest import io

from . import search_terms

__all__ = ["COUPLE_REGIONS", "FLOATS", "LORA_STACK", "RECIPE", "SEARCH_ALIASES", "Node", "output", "schema",
           "v1_entry", "v1_result"]

FLOATS = io.Custom("FLOATS")
LORA_STACK = io.Custom("LORA_STACK")
COUPLE_REGIONS = io.Custom("COUPLE_REGIONS")  # nodes/couple_region.py: a chain of attention couple regions
RECIPE = io.Custom("PATCHBAY_RECIPE")  # a merge recipe (merge/recipe.py), nodes/merge_*.py
SEARCH_ALIASES = "search_aliases" in {field.name for field in dataclasses.fields(io.Schema)}


class Node(io.ComfyNode):
    """Base of Patchbay's V3 nodes; a subclass sets ``NODE_ID``, ``DISPLAY_NAME`` and ``define_schema``."""

    NODE_ID: str
    DISPLAY_NAME: str


def schema(node: type[Node], *, category: str, description: str, inputs: list[io.Input],
           outputs: list[io.Output], **options) -> io.Schema:
    """The node's ``io.Schema``: id and display name from the class, aliases from nodes/search_terms.py;
    ``options``: further Schema fields (``is_output_node`` ...)."""
    untold = [part.id or part.display_name for part in (*inputs, *outputs) if not part.tooltip]
    if untold:
        raise ValueError(f"{node.NODE_ID}: give {untold} a tooltip (every input and output has one)")
    if SEARCH_ALIASES:
        options["search_aliases"] = search_terms.aliases(node)
    return io.Schema(node_id=node.NODE_ID, display_name=node.DISPLAY_NAME, category=category,
                     description=description, inputs=inputs, outputs=outputs, **options)


def output(kind: type[io.ComfyTypeIO], name: str, tooltip: str) -> io.Output:
    """An output shown as ``name`` (V1's RETURN_NAMES); its id is left to ComfyUI, since 0.3.75 refuses
    an output id equal to an input id (a node taking and returning ``model``)."""
    return kind.Output(display_name=name, tooltip=tooltip)


def v1_result(output: io.NodeOutput) -> tuple | dict:
    """``output`` as a V1 node function returned it: the outputs as a tuple, or ``{"ui": ..., "result":
    ...}`` where the node shows something."""
    return tuple(output.args) if output.ui is None else {"ui": output.ui, "result": tuple(output.args)}


def v1_entry() -> classmethod:
    """V1's node function (``build``, ``make``, ``save`` ...) as a classmethod that runs ``execute`` and
    returns ``v1_result``. For Python callers only (scripts, tests, other packs); ComfyUI calls
    ``execute``."""
    def entry(cls: type[Node], *args, **kwargs) -> tuple | dict:
        return v1_result(cls.execute(*args, **kwargs))
    return classmethod(entry)
