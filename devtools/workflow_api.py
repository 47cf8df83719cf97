"""Convert a workflow in the frontend's UI (litegraph) format into ComfyUI's API prompt format.

Why: the bundled ``workflows/*.json`` are UI-format files (what the frontend saves and the template
browser opens), but the HTTP API (``POST /prompt``) takes the API format. The demo and the T2 tests
run the workflows without a browser, so this module does what the frontend's ``graphToPrompt()``
does (ComfyUI_frontend 1.32.9 and 1.49.6, ``executionUtil.ts`` and ``ExecutableNodeDTO``), given the
server's ``/object_info`` and the frontend's version (the widget rules per version, V3 dynamic inputs
included, are in devtools/widget_layout.py). The T3 tests hold it to the real frontend's output.

What it reproduces: widget values mapped to input names in the frontend's widget order, including
the frontend-only widgets that take a slot in ``widgets_values`` but are never sent
(``control_after_generate`` after seed-like INTs and after inputs whose options ask for it, the
combo filter list, the image ``upload`` button); linked widget inputs; Reroute nodes followed;
PrimitiveNode values applied to their targets; muted nodes (mode 2) dropped together with the
inputs they fed; bypassed nodes (mode 4) passed through by matching types; Note, MarkdownNote and
other frontend-only nodes dropped; dynamic prompts (comments stripped, ``{a|b}`` choices picked);
``_meta.title``. Standard library only.
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from widget_layout import (
    DEFAULT_FRONTEND,
    DYNAMIC_COMBO,
    SEED_NAMES,
    Widget,
    input_slots,
    ordered_inputs,
    unsupported_types,
    widget_layout,
)

__all__ = [
    "DEFAULT_FRONTEND", "FRONTEND_ONLY_TYPES", "Widget", "WorkflowConversionError", "input_slots",
    "process_dynamic_prompt", "widget_layout", "workflow_to_prompt",
]

MODE_NEVER = 2  # "mute": not executed, not sent
MODE_BYPASS = 4  # not executed; consumers get the node's matching input instead

FRONTEND_ONLY_TYPES = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
# loadGraphData() renames these old types before it builds the graph.
RENAMED_TYPES = {"T2IAdapterLoader": "ControlNetLoader", "ConditioningAverage ": "ConditioningAverage",
                 "SDV_img2vid_Conditioning": "SVD_img2vid_Conditioning", "Load3DAnimation": "Load3D",
                 "Preview3DAnimation": "Preview3D"}
UNSUPPORTED_TYPES = unsupported_types(DEFAULT_FRONTEND)


class WorkflowConversionError(ValueError):
    """The workflow cannot be converted; the message names the node and what to change."""


# -- dynamic prompts ---------------------------------------------------------------------------------


def process_dynamic_prompt(text: str, rng: random.Random | None = None) -> str:
    """The frontend's processDynamicPrompt: strip ``//`` and ``/* */`` comments, pick ``{a|b}`` choices."""
    rng = rng or random.Random()
    text = re.sub(r"/\*[\s\S]*?\*/|//.*", "", text)
    out, i = [], 0
    while i < len(text):
        char, i = text[i], i + 1
        if char == "\\":
            out.append("\\" + text[i:i + 1])
            i += 1
        elif char == "{":
            choice, i = _parse_choice(text, i, rng)
            out.append(process_dynamic_prompt(choice, rng))
        else:
            out.append(char)
    return re.sub(r"\\([{}|])", r"\1", "".join(out))


def _parse_choice(text: str, i: int, rng: random.Random) -> tuple[str, int]:
    options, current, depth = [], "", 0
    while i < len(text):
        char, i = text[i], i + 1
        if char == "\\":
            current += "\\" + text[i:i + 1]
            i += 1
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            if not depth:
                break
            depth -= 1
        elif char == "|" and not depth:
            options.append(current)
            current = ""
            continue
        current += char
    options.append(current)
    return options[int(rng.random() * len(options))], i


# -- the graph ---------------------------------------------------------------------------------------


class _Link(NamedTuple):
    origin_id: Any
    origin_slot: int
    target_id: Any
    target_slot: int


def _links(workflow: Mapping[str, Any]) -> dict[Any, _Link]:
    links = {}
    for link in workflow.get("links") or []:
        if isinstance(link, Mapping):  # schema version 1
            links[link["id"]] = _Link(link["origin_id"], link["origin_slot"], link["target_id"],
                                      link["target_slot"])
        else:  # version 0.4: [id, origin_id, origin_slot, target_id, target_slot, type]
            links[link[0]] = _Link(link[1], link[2], link[3], link[4])
    return links


def _node_label(node: Mapping[str, Any]) -> str:
    return f"node {node.get('id')} ({node.get('type')})"


class _Converter:
    """One conversion: the graph, its definitions, and the frontend's link resolution rules."""

    def __init__(self, workflow: Mapping[str, Any], object_info: Mapping[str, Any],
                 frontend_only: Collection[str], rng: random.Random | None, frontend: str) -> None:
        if (workflow.get("definitions") or {}).get("subgraphs") or (workflow.get("extra") or {}).get(
                "groupNodes"):
            raise WorkflowConversionError("subgraphs and group nodes are not supported by workflow_api; "
                                          "unpack them in the frontend (right click > Unpack) and save again")
        self.object_info = object_info
        self.frontend_only = frozenset(frontend_only)
        self.frontend = frontend
        self.unsupported = unsupported_types(frontend)
        self.rng = rng
        self.nodes = {node["id"]: self._checked(dict(node)) for node in workflow.get("nodes") or []}
        self.links = _links(workflow)
        self.widgets: dict[Any, list[Widget]] = {}
        self.choices: dict[Any, dict[str, Any]] = {}
        self.values = {nid: self._widget_values(node) for nid, node in self.nodes.items()
                       if not self.is_virtual(node)}
        self._inputs: dict[Any, list[dict]] = {}

    def _checked(self, node: dict) -> dict:
        node["type"] = RENAMED_TYPES.get(node.get("type"), node.get("type"))
        kind = node["type"]
        if kind in self.frontend_only:
            return node
        if kind not in self.object_info:
            raise WorkflowConversionError(
                f"{_node_label(node)}: unknown node type {kind!r}: the server's /object_info has no such "
                f"node; install the custom node pack that provides it (or fix the type name)")
        if kind in self.unsupported:
            raise WorkflowConversionError(
                f"{_node_label(node)}: its widgets are built by a frontend extension that workflow_api does "
                f"not reproduce; queue this workflow from the browser instead")
        return node

    def is_virtual(self, node: Mapping[str, Any]) -> bool:
        return node["type"] in self.frontend_only

    # widgets ------------------------------------------------------------------------------------

    def _widget_values(self, node: Mapping[str, Any]) -> dict[str, Any]:
        """Values by widget name. A dynamic combo's value decides the widgets after it, so the layout is
        redone with the values read until the combos' choices stop changing (once per nested level)."""
        definition, choices = self.object_info[node["type"]], {}
        while True:
            widgets = widget_layout(definition, self.frontend, choices)
            found = {w.name: v for w, v in self._pair(node, widgets, strict=False) if w.kind == DYNAMIC_COMBO}
            if found == choices:
                break
            choices = found
        self.widgets[node["id"]], self.choices[node["id"]] = widgets, choices
        values = {w.name: v for w, v in self._pair(node, widgets, strict=True)}
        return {w.name: values.get(w.name, w.default) for w in widgets}

    def _pair(self, node: Mapping[str, Any], widgets: list[Widget], strict: bool) -> list[tuple[Widget, Any]]:
        stored = [w for w in widgets if w.stored]
        raw = node.get("widgets_values")
        if isinstance(raw, Mapping):  # some packs save {name: value}
            return [(w, raw.get(w.name, w.default)) for w in stored]
        raw = _migrate_force_inputs(self.object_info[node["type"]], widgets, list(raw or []))
        if strict and len(raw) != len(stored):
            raise WorkflowConversionError(
                f"{_node_label(node)}: widgets_values has {len(raw)} values but the node has "
                f"{len(stored)} widgets {[w.name for w in stored]}; the workflow was saved with "
                f"another version of this node: open it in the frontend and save it again")
        return list(zip(stored, raw, strict=False))

    def apply_primitives(self) -> None:
        """PrimitiveNode.applyToGraph: each target widget takes the primitive's value."""
        for node in self.nodes.values():
            if node["type"] != "PrimitiveNode" or not node.get("widgets_values"):
                continue
            for link_id in (node.get("outputs") or [{}])[0].get("links") or []:
                link = self.links.get(link_id)
                target = self.nodes.get(link.target_id) if link else None
                name = _linked_widget_name(target, link_id) if target else None
                if name is not None and name in self.values.get(target["id"], {}):
                    self.values[target["id"]][name] = node["widgets_values"][0]

    # link resolution (ExecutableNodeDTO.resolveInput / resolveOutput) ------------------------------

    def inputs_of(self, node: Mapping[str, Any]) -> list[dict]:
        """The node's live input slots: definition order, each with its saved link (if any)."""
        if node["id"] not in self._inputs:
            self._inputs[node["id"]] = self._make_inputs(node)
        return self._inputs[node["id"]]

    def _make_inputs(self, node: Mapping[str, Any]) -> list[dict]:
        saved = {entry.get("name"): entry for entry in node.get("inputs") or []}
        if self.is_virtual(node):
            return [dict(entry) for entry in node.get("inputs") or []]
        live = input_slots(self.object_info[node["type"]], self.widgets[node["id"]], self.frontend,
                           self.choices[node["id"]])
        names = {name for name, _ in live}
        slots = [{"name": name, "type": kind, "link": (saved.get(name) or {}).get("link")}
                 for name, kind in live]
        return slots + [dict(entry) for name, entry in saved.items() if name not in names]

    def output_type(self, node: Mapping[str, Any], slot: int) -> str:
        if not self.is_virtual(node):
            outputs = self.object_info[node["type"]].get("output") or []
            if slot < len(outputs):
                value = outputs[slot]
                return "COMBO" if isinstance(value, list) else str(value)
        outputs = node.get("outputs") or []
        return str(outputs[slot].get("type", "*")) if slot < len(outputs) else "*"

    def resolve_input(self, node: Mapping[str, Any], slot: int, visited: set,
                      kind: str | None = None) -> tuple[str, int] | None:
        """The (node id, output slot) feeding ``slot``, through reroutes and bypasses; None if nothing."""
        key = (node["id"], "I", slot)
        if key in visited:
            raise WorkflowConversionError(f"{_node_label(node)}: circular link through input {slot}")
        visited.add(key)
        inputs = self.inputs_of(node)
        if not 0 <= slot < len(inputs):
            raise WorkflowConversionError(f"{_node_label(node)}: a link points at input slot {slot}, "
                                          f"but the node has {len(inputs)} inputs")
        entry = inputs[slot]
        if entry.get("link") is None:
            return None
        link = self.links.get(entry["link"])
        origin = self.nodes.get(link.origin_id) if link else None
        if origin is None:
            raise WorkflowConversionError(
                f"{_node_label(node)}: input {entry.get('name')!r} uses link {entry['link']}, which has no "
                f"origin node in the workflow; reconnect it in the frontend and save again")
        return self.resolve_output(origin, link.origin_slot, kind or entry.get("type"), visited)

    def resolve_output(self, node: Mapping[str, Any], slot: int, kind: str,
                       visited: set) -> tuple[str, int] | None:
        """Where output ``slot`` really comes from: itself, or what a bypassed/virtual node passes on."""
        key = (node["id"], "O", slot)
        if key in visited:
            raise WorkflowConversionError(f"{_node_label(node)}: circular link through output {slot}")
        visited.add(key)
        if node.get("mode") == MODE_BYPASS:
            index = self._bypass_slot(node, slot, kind)
            return None if index == -1 else self.resolve_input(node, index, visited)
        if self.is_virtual(node):
            inputs = self.inputs_of(node)
            return self.resolve_input(node, slot, visited, kind) if slot < len(inputs) else None
        return (str(node["id"]), int(slot))

    def _bypass_slot(self, node: Mapping[str, Any], slot: int, kind: str) -> int:
        """getBypassSlotIndex: same slot if compatible, else first exact type, else first compatible."""
        inputs = self.inputs_of(node)
        if kind in ("*", ""):
            return slot if len(inputs) > slot else 0
        out_type = self.output_type(node, slot)
        same = inputs[slot]["type"] if slot < len(inputs) else None
        if same is not None and _valid(same, out_type) and _valid(same, kind):
            return slot
        exact = [i for i, entry in enumerate(inputs) if entry["type"] == kind]
        if exact:
            return exact[0]
        return next((i for i, entry in enumerate(inputs)
                     if _valid(entry["type"], out_type) and _valid(entry["type"], kind)), -1)

    # the prompt ---------------------------------------------------------------------------------

    def node_prompt(self, node: Mapping[str, Any]) -> dict[str, Any]:
        inputs: dict[str, Any] = {}
        for widget in self.widgets[node["id"]]:
            if widget.api:
                inputs[widget.name] = self._api_value(node, widget)
        for slot, entry in enumerate(self.inputs_of(node)):
            resolved = self.resolve_input(node, slot, set())
            if resolved is not None:
                inputs[entry["name"]] = list(resolved)
        definition = self.object_info[node["type"]]
        title = node.get("title") or definition.get("display_name") or definition.get("name") or node["type"]
        return {"inputs": inputs, "class_type": node["type"], "_meta": {"title": title}}

    def _api_value(self, node: Mapping[str, Any], widget: Widget) -> Any:
        value = self.values[node["id"]][widget.name]
        if widget.dynamic_prompts and isinstance(value, str):
            value = process_dynamic_prompt(value, self.rng)
        if (node["type"] in ("KSampler", "KSamplerAdvanced") and widget.name == "sampler_name"
                and isinstance(value, str) and value.startswith("sample_")):
            value = value[len("sample_"):]
        return {"__value__": value} if isinstance(value, list) else value

    def prompt(self) -> dict[str, dict[str, Any]]:
        self.apply_primitives()
        output = {str(nid): self.node_prompt(node) for nid, node in self.nodes.items()
                  if not self.is_virtual(node) and node.get("mode") not in (MODE_NEVER, MODE_BYPASS)}
        for entry in output.values():  # drop inputs fed by muted (removed) nodes
            for name, value in list(entry["inputs"].items()):
                if isinstance(value, list) and len(value) == 2 and str(value[0]) not in output:
                    del entry["inputs"][name]
        return output


def _linked_widget_name(node: Mapping[str, Any], link_id: Any) -> str | None:
    for entry in node.get("inputs") or []:
        if entry.get("link") == link_id:
            return (entry.get("widget") or {}).get("name")
    return None


def _valid(type_a: Any, type_b: Any) -> bool:
    """LiteGraph.isValidConnection: '*' and '' match anything; 'A,B' lists match any member."""
    a = "" if type_a in ("*", "", None, 0) else str(type_a)
    b = "" if type_b in ("*", "", None, 0) else str(type_b)
    if not a or not b or a == b:
        return True
    a, b = a.lower(), b.lower()
    if "," not in a and "," not in b:
        return a == b
    return any(_valid(x, y) for x in a.split(",") for y in b.split(","))


def _migrate_force_inputs(node_def: Mapping[str, Any], widgets: list[Widget], values: list) -> list:
    """migrateWidgetsValues: old saves kept a value for forceInput inputs; drop those values."""
    names = {w.name for w in widgets}
    inputs = [(name, kind, options) for name, kind, options in ordered_inputs(node_def)
              if name in names or options.get("forceInput")]
    sizes = [2 if options.get("control_after_generate") or name in SEED_NAMES else 1
             for name, _, options in inputs]
    if not any(options.get("forceInput") for _, _, options in inputs) or sum(sizes) != len(values):
        return values
    # Like the frontend, pair values with inputs by position (a control widget's value shifts the rest).
    return [value for i, value in enumerate(values) if i >= len(inputs) or not inputs[i][2].get("forceInput")]


def workflow_to_prompt(
    workflow: Mapping[str, Any],
    object_info: Mapping[str, Any],
    *,
    frontend_only: Collection[str] = FRONTEND_ONLY_TYPES,
    rng: random.Random | None = None,
    frontend: str = DEFAULT_FRONTEND,
) -> dict[str, dict[str, Any]]:
    """The API prompt (``{node_id: {inputs, class_type, _meta}}``) the frontend would queue.

    Args:
        workflow: a UI-format workflow (``nodes``, ``links``, ...), as saved by the frontend.
        object_info: the server's ``GET /object_info`` answer.
        frontend_only: node types that exist only in the browser and are never sent.
        rng: random source for ``{a|b}`` dynamic-prompt choices (default: unseeded).
        frontend: the frontend version whose rules apply (``ComfyServer.frontend_version()``), e.g.
            ``"1.49.6"`` with ComfyUI 0.33; the widget rules differ between versions (widget_layout.py).

    Raises:
        WorkflowConversionError: unknown node type, widget-count mismatch, broken link, subgraph.
    """
    return _Converter(workflow, object_info, frontend_only, rng, frontend).prompt()
