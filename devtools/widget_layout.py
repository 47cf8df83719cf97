"""The widgets and input slots the ComfyUI frontend gives a node definition, per frontend version.

Why: devtools/workflow_api.py pairs a saved node's ``widgets_values`` with input names and sends
them to ``/prompt``, so it must know each node's widgets in the frontend's order, which of them take
a ``widgets_values`` slot and which are sent. That depends on the node definition (``/object_info``)
and on the frontend: the two tested here are 1.32.9 (ComfyUI 0.3.75) and 1.49.6 (ComfyUI 0.33).
1.49.6 also builds ComfyUI's V3 dynamic inputs:

- ``COMFY_MATCHTYPE_V3``: a socket whose type is the template's ``allowed_types``;
- ``COMFY_AUTOGROW_V3``: ``min + 1`` sockets (at most ``max`` or ``len(names)``) named
  ``<input>.<names[i]>`` or ``<input>.<prefix><i>``, of the template input's type;
- ``COMFY_DYNAMICCOMBO_V3``: a combo of the option keys, followed by the inputs of the chosen option
  named ``<input>.<sub input>`` (nested combos recurse); their slots come before the combo's own.

T3 (tests/test_t3_frontend.py) holds every node type the server offers to the real frontend.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["DEFAULT_FRONTEND", "Widget", "frontend_key", "input_slots", "ordered_inputs", "unsupported_types",
           "widget_layout"]

DEFAULT_FRONTEND = "1.32.9"
NEWER = (1, 49)  # the rules marked "newer" hold for 1.49.6; 1.32.9 follows the others
WIDGET_TYPES = frozenset({"INT", "FLOAT", "BOOLEAN", "STRING", "MARKDOWN", "COMBO", "IMAGEUPLOAD", "COLOR",
                          "IMAGECOMPARE", "CHART", "GALLERIA", "TEXTAREA"})
NEWER_WIDGET_TYPES = frozenset({"COMFY_DYNAMICCOMBO_V3", "BOUNDING_BOXES", "COLORS", "CURVE", "LOAD_3D"})
NEWER_UNSTORED_KINDS = frozenset({"IMAGECOMPARE"})  # widgets that keep no widgets_values slot from 1.49
SEED_NAMES = ("seed", "noise_seed")
UPLOAD_OPTIONS = ("image_upload", "video_upload", "animated_image_upload")
MATCH_TYPE, AUTOGROW, DYNAMIC_COMBO = "COMFY_MATCHTYPE_V3", "COMFY_AUTOGROW_V3", "COMFY_DYNAMICCOMBO_V3"
# Nodes whose widgets a frontend extension builds (3D viewer, webcam, auto-refreshing file list ...).
UNSUPPORTED_TYPES = frozenset({"Load3D", "Preview3D", "SaveGLB", "WebcamCapture", "LoadImageOutput"})
NEWER_UNSUPPORTED_TYPES = frozenset({
    "Load3DAdvanced", "ImageCropV2", "ImageCompositor", "CustomCombo", "RecordAudio", "LoadAudio",
    "SaveAudio", "SaveAudioMP3", "SaveAudioOpus", "SaveAudioAdvanced", "PreviewAudio",
})


class Widget(NamedTuple):
    """One frontend widget: ``stored`` takes a ``widgets_values`` slot, ``api`` is sent to /prompt."""

    name: str
    kind: str
    stored: bool = True
    api: bool = True
    default: Any = None
    dynamic_prompts: bool = False


# Widgets a frontend extension adds to a node, by frontend: (newer, older).
EXTENSION_WIDGETS: dict[str, tuple[tuple[Widget, ...], tuple[Widget, ...]]] = {
    "PreviewAny": ((Widget("preview_text", "MARKDOWN", stored=False, api=False, default=""),
                    Widget("preview_mode", "COMBO", stored=False, api=False)),
                   (Widget("preview", "MARKDOWN", stored=False, api=True, default=""),)),
    "SaveText": ((Widget("preview_text", "MARKDOWN", stored=False, api=False, default=""),
                  Widget("preview_mode", "COMBO", stored=False, api=False)), ()),
    # web/js/recipe_text.js: the recipe shown in the node (saved with the workflow, never queued)
    "PatchbayMergeRecipeToText": ((Widget("recipe_text", "patchbay_recipe_text", api=False, default=""),),
                                  (Widget("recipe_text", "patchbay_recipe_text", api=False, default=""),)),
    # web/js/merge_reports.js: the report a save / extract / cache node returns, shown in the node
    **{node: ((Widget("report", "patchbay_merge_report", api=False, default=""),),
              (Widget("report", "patchbay_merge_report", api=False, default=""),))
       for node in ("PatchbayMergeSave", "PatchbayMergeExtractLora", "PatchbayMergeCacheClear")},
}


def frontend_key(version: str) -> tuple[int, ...]:
    """``"1.49.6"`` -> ``(1, 49, 6)``; refuses anything else with the value in the message."""
    try:
        return tuple(int(part) for part in version.split("."))
    except (AttributeError, ValueError):
        raise ValueError(f"frontend version {version!r} is not dotted numbers like '1.49.6'") from None


def _newer(frontend: str) -> bool:
    return frontend_key(frontend) >= NEWER


def unsupported_types(frontend: str = DEFAULT_FRONTEND) -> frozenset[str]:
    """Node types whose widgets a frontend extension builds: workflow_api cannot convert them."""
    return UNSUPPORTED_TYPES | (NEWER_UNSUPPORTED_TYPES if _newer(frontend) else frozenset())


class _Input(NamedTuple):
    """One input as the frontend sees it; ``children``: a dynamic combo's chosen option's inputs."""

    name: str
    kind: str
    options: dict
    widget: bool
    children: tuple = ()


def _spec(spec: Any) -> tuple[str, dict]:
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return ("COMBO" if isinstance(spec[0], list) else str(spec[0])), options


def _sections(inputs: Mapping[str, Any], order: Mapping[str, Any]) -> list[tuple[str, str, dict]]:
    """(name, type, options) for required then optional inputs, in ``input_order`` when given."""
    out = []
    for section in ("required", "optional"):
        specs = inputs.get(section) or {}
        for name in order.get(section) or list(specs):
            if name in specs:
                out.append((name, *_spec(specs[name])))
    return out


def ordered_inputs(node_def: Mapping[str, Any]) -> list[tuple[str, str, dict]]:
    """(name, type, options) of a definition's top-level inputs, as the frontend orders them."""
    return _sections(node_def.get("input") or {}, node_def.get("input_order") or {})


def _is_widget(kind: str, options: Mapping[str, Any], newer: bool) -> bool:
    types = WIDGET_TYPES | NEWER_WIDGET_TYPES if newer else WIDGET_TYPES
    return (kind in types or options.get("widgetType") in types) and not options.get("forceInput")


def _expand(entries: list[tuple[str, str, dict]], prefix: str, newer: bool,
            choices: Mapping[str, Any]) -> list[_Input]:
    out = []
    for name, kind, options in entries:
        full = prefix + name
        template = options.get("template") or {}
        if newer and kind == MATCH_TYPE:
            out.append(_Input(full, str(template.get("allowed_types", "*")), options, False))
        elif newer and kind == AUTOGROW:
            out += _autogrow(full, template, newer, choices)
        elif newer and kind == DYNAMIC_COMBO:
            keys = [option["key"] for option in options.get("options") or []]
            chosen = choices.get(full, options.get("default", keys[0] if keys else None))
            picked = next((o for o in options.get("options") or [] if o["key"] == chosen), None)
            sub = _sections((picked or {}).get("inputs") or {}, {})
            combo = {**options, "default": chosen}
            out.append(_Input(full, kind, combo, True, tuple(_expand(sub, full + ".", newer, choices))))
        else:
            out.append(_Input(full, kind, options, _is_widget(kind, options, newer)))
    return out


def _autogrow(name: str, template: Mapping[str, Any], newer: bool,
              choices: Mapping[str, Any]) -> list[_Input]:
    entries = _sections(template.get("input") or {}, {})
    names = template.get("names")
    limit = len(names) if names else template.get("max", float("inf"))
    count = int(min(template.get("min", 0) + 1, limit))
    out = []
    for index in range(count):
        slot = names[index] if names else f"{template.get('prefix', '')}{index}"
        for entry in _expand(entries[:1], "", newer, choices):
            out.append(entry._replace(name=f"{name}.{slot}"))
    return out


def _inputs(node_def: Mapping[str, Any], frontend: str, choices: Mapping[str, Any]) -> list[_Input]:
    return _expand(ordered_inputs(node_def), "", _newer(frontend), choices)


def _walk(inputs: list[_Input]):
    for entry in inputs:
        yield entry
        yield from _walk(list(entry.children))


def _input_widgets(entry: _Input, newer: bool) -> list[Widget]:
    name, options = entry.name, entry.options
    kind = options.get("widgetType") or entry.kind
    stored = not (newer and kind in NEWER_UNSTORED_KINDS)
    widgets = [Widget(name, kind, stored=stored, default=options.get("default"),
                      dynamic_prompts=bool(options.get("dynamicPrompts")))]
    control = options.get("control_after_generate")
    if kind == "INT" and (control if control is not None else name in SEED_NAMES):
        control_name = control if isinstance(control, str) else "control_after_generate"
        widgets.append(Widget(control_name, "combo", api=False, default="randomize"))
    elif kind == "COMBO" and control:
        widgets.append(Widget("control_after_generate", "combo", api=False, default="randomize"))
        widgets.append(Widget("control_filter_list", "string", api=False, default=""))
    return widgets


def widget_layout(node_def: Mapping[str, Any], frontend: str = DEFAULT_FRONTEND,
                  choices: Mapping[str, Any] | None = None) -> list[Widget]:
    """The widgets the frontend gives a node of this definition, in order.

    ``choices``: the value of each dynamic combo (by full name), which decides the widgets after it;
    a combo not named shows its default (first) option, as a new node does.
    """
    newer = _newer(frontend)
    inputs = _inputs(node_def, frontend, choices or {})
    widgets = [w for entry in _walk(inputs) if entry.widget for w in _input_widgets(entry, newer)]
    required = (node_def.get("input") or {}).get("required") or {}
    if any(entry.kind == "COMBO" and entry.name in required
           and any(entry.options.get(o) for o in UPLOAD_OPTIONS) for entry in inputs):
        widgets.append(Widget("upload", "IMAGEUPLOAD", api=False, default="image"))
    newer_widgets, older_widgets = EXTENSION_WIDGETS.get(node_def.get("name", ""), ((), ()))
    return widgets + list(newer_widgets if newer else older_widgets)


def _slots(inputs: list[_Input], widget_names: set[str]) -> tuple[list, list]:
    """(socket slots, widget slots); a dynamic combo's own slot follows those of its chosen inputs."""
    sockets, widgets = [], []
    for entry in inputs:
        if entry.children or entry.kind == DYNAMIC_COMBO:
            sub_sockets, sub_widgets = _slots(list(entry.children), widget_names)
            widgets += sub_sockets + sub_widgets + [(entry.name, entry.kind)]
        elif entry.widget:
            widgets += [(entry.name, entry.kind)] if entry.name in widget_names else []
        else:
            sockets.append((entry.name, entry.kind))
    return sockets, widgets


def input_slots(node_def: Mapping[str, Any], widgets: list[Widget] | None = None,
                frontend: str = DEFAULT_FRONTEND,
                choices: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
    """(name, type) of the input slots the frontend creates: sockets first, then one per widget input."""
    widgets = widget_layout(node_def, frontend, choices) if widgets is None else widgets
    inputs = _inputs(node_def, frontend, choices or {})
    sockets, widget_slots = _slots(inputs, {w.name for w in widgets})
    return sockets + widget_slots + [(w.name, w.kind) for w in widgets if w.kind == "IMAGEUPLOAD"]
