"""One node per merge method, generated from ``merge.method_registry``: a method registered with
``@merge_method`` becomes ``PatchbayMethod<Name>``, a V3 node (nodes/v3.py) with no node code of its own.
"""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io

from ..merge import method_registry as registry
from ..merge import recipe as R
from ..merge.method_registry import MergeMethod, ParamSpec
from . import v3

RECIPE = "PATCHBAY_RECIPE"
VARIADIC_SLOTS = 10  # fixed slots, not V3's growing inputs: 0.3.75 and 0.33 name grown slots differently
NONE_INT = -1  # the widget value that means "None" for an optional integer (a seed: the merge's seed)
_BOUND = 1e9
_SPACE_TIP = {"weight": "a model (weight space)", "delta": "a difference (delta space: subtract, a LoRA)",
              "param": "a param-space recipe (a per-element parameter)", "any": "a model or a difference"}


def node_id(method: MergeMethod) -> str:
    return "PatchbayMethod" + "".join(part.capitalize() for part in method.name.split("_"))


def socket_names(method: MergeMethod) -> list[str]:
    """The tensor sockets in call order: fixed inputs, then the variadic slots."""
    names = [spec.name for spec in method.inputs if not spec.variadic]
    variadic = next((spec.name for spec in method.inputs if spec.variadic), None)
    return names + ([f"{variadic}_{i}" for i in range(1, VARIADIC_SLOTS + 1)] if variadic else [])


def inputs(method: MergeMethod) -> list[io.Input]:
    """The inputs of ``method``'s node, required ones first (the order of a saved workflow's widgets).

    Tensor inputs are PATCHBAY_RECIPE sockets (a variadic input gets ``VARIADIC_SLOTS`` sockets, the first
    required, the rest optional), parameters widgets with the registry's type, default and range, and
    every numeric parameter an optional ``<param>_map`` socket for a block-weight or key-pattern map, or a
    param-space recipe (``train_difference_mask``), which replaces the widget. The description is the
    method's one-line doc; its help page (web/docs/<NodeId>/en.md, devtools/build_merge_docs.py) adds the
    paper.
    """
    required: list[io.Input] = []
    optional: list[io.Input] = []
    for spec in method.inputs:
        tip = f"{_SPACE_TIP[spec.space].capitalize()}."
        if not spec.variadic:
            required.append(v3.RECIPE.Input(spec.name, tooltip=tip))
            continue
        many = f"{tip} Connect any number (up to {VARIADIC_SLOTS}); unconnected ones are left out."
        required.append(v3.RECIPE.Input(f"{spec.name}_1", tooltip=many))
        optional += [v3.RECIPE.Input(f"{spec.name}_{i}", optional=True, tooltip=f"{tip} Optional.")
                     for i in range(2, VARIADIC_SLOTS + 1)]
    for spec in method.params:
        required.append(_widget(spec))
        if spec.type in (float, int):
            tip = (f"Optional: {spec.name} per block or key (Block Weights, Key Patterns) or a param-space "
                   f"recipe; replaces the {spec.name} widget.")
            optional.append(v3.RECIPE.Input(f"{spec.name}_map", optional=True, tooltip=tip))
    return required + optional


def _widget(spec: ParamSpec) -> io.Input:
    low = spec.range.low if spec.range else -_BOUND
    high = spec.range.high if spec.range else _BOUND
    where = f" in [{low:g}, {high:g}]" if spec.range else ""
    if spec.type is bool:
        return io.Boolean.Input(spec.name, default=spec.default,
                                tooltip=f"{spec.name} (default {spec.default}).")
    if spec.type is int:  # never a "control after generate" widget (the frontend adds one to a "seed"):
        if spec.optional:  # a randomised parameter would re-run every merge
            return io.Int.Input(spec.name, default=NONE_INT if spec.default is None else spec.default,
                                min=NONE_INT, max=int(min(high, 2**32 - 1)), control_after_generate=False,
                                tooltip=f"{spec.name}; {NONE_INT} = none (a seed: the merge's seed).")
        return io.Int.Input(spec.name, default=spec.default, min=int(max(low, -_BOUND)),
                            max=int(min(high, _BOUND)), step=1, control_after_generate=False,
                            tooltip=f"{spec.name} (default {spec.default}){where}.")
    if spec.type is float and not spec.optional:
        step = 0.01 if spec.default == 0 or abs(spec.default) >= 0.01 else abs(spec.default)
        return io.Float.Input(spec.name, default=spec.default, min=max(low, -_BOUND), max=min(high, _BOUND),
                              step=step, round=False,
                              tooltip=f"{spec.name} (default {spec.default:g}){where}.")
    return io.String.Input(spec.name, default="" if spec.default is None else str(spec.default),
                           tooltip=f"{spec.name} ({spec.type.__name__}; empty = none).")


def build_call(method: MergeMethod, values: dict[str, Any]) -> R.CallNode:
    """The recipe a method node makes from its socket and widget values."""
    args = [values[name] for name in socket_names(method) if values.get(name) is not None]
    params = {spec.name: _param_value(spec, values) for spec in method.params}
    return R.call(method.name, *args, **params)


def _param_value(spec: ParamSpec, values: dict[str, Any]) -> Any:
    mapped = values.get(f"{spec.name}_map")
    if mapped is not None:
        if isinstance(mapped, (R.ModelNode, R.FreeInput)) or (
                isinstance(mapped, R.CallNode) and R.output_space(mapped) != "param"):
            raise ValueError(f"{spec.name}_map takes a parameter map (Block Weights, Key Patterns) or a "
                             f"param-space recipe such as train_difference_mask, not a model or a "
                             f"difference ({R.label(mapped)})")
        return mapped
    value = values.get(spec.name, spec.default)
    if spec.optional and (value == NONE_INT if spec.type is int else value in ("", None)):
        return None
    if spec.type is not str and isinstance(value, str):
        try:
            return spec.type(value)
        except ValueError:
            raise ValueError(f"{spec.name}: {value!r} is not a {spec.type.__name__}") from None
    return value


class _MethodNode(v3.Node):
    """The node of one registered method (``METHOD``); subclasses come from ``method_node``."""

    METHOD = ""

    @classmethod
    def define_schema(cls) -> io.Schema:
        method = registry.get(cls.METHOD)
        return v3.schema(cls, category="Patchbay/merge/methods", description=method.doc,
                         inputs=inputs(method), outputs=[v3.output(v3.RECIPE, "recipe", _output_tip(method))])

    @classmethod
    def execute(cls, **values: Any) -> io.NodeOutput:
        return io.NodeOutput(build_call(registry.get(cls.METHOD), values))

    build = v3.v1_entry()


def method_node(method: MergeMethod) -> type[v3.Node]:
    """The node class of one registered method."""
    return type(node_id(method), (_MethodNode,), {
        "NODE_ID": node_id(method), "METHOD": method.name,
        "DISPLAY_NAME": f"{method.name} (Patchbay merge)",
    })


def _output_tip(method: MergeMethod) -> str:
    if method.returns is not None:  # one value per key (get_rank_from_ratio), for a parameter
        return (f"One {method.returns.__name__} per key: connect it to the _map input of a parameter of "
                f"that type (truncate_rank's rank_map).")
    return (f"The recipe ({_SPACE_TIP[method.output]}): connect it to another method, or to Merge, "
            f"Save Merge or Extract LoRA.")


NODES = [method_node(method) for method in registry.all_methods()]
