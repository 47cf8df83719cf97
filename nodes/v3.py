"""Patchbay's conventions for nodes on ComfyUI's V3 node API (``comfy_api.latest.io``), in one place: the
base class, a schema that requires tooltips and adds search aliases, V1-named outputs and Python entry
points, and the socket types that are not core's. Which nodes stay V1, and why: nodes/lora_files.py.
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

    @classmethod
    def VALIDATE_INPUTS(cls, *args, **kwargs) -> bool | str:  # noqa: N802 (V1's name)
        """``validate_inputs`` under V1's name, for Python callers (ComfyUI calls ``validate_inputs`` on a
        V3 node: execution.py's ``first_real_override``)."""
        return cls.validate_inputs(*args, **kwargs)


def schema(node: type[Node], *, category: str, description: str, inputs: list[io.Input],
           outputs: list[io.Output], **options) -> io.Schema:
    """The node's ``io.Schema``: id and display name from the class, aliases from nodes/search_terms.py;
    ``options``: further Schema fields (``is_output_node`` ...).

    Raises ValueError for an input or output without a tooltip. Aliases go in only where ComfyUI's
    Schema has the field (0.33; 0.3.75's has none, and its server sends no aliases for any node)."""
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
