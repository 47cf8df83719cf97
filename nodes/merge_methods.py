"""One node per merge method, generated from ``merge.method_registry``: a method registered with
``@merge_method`` becomes ``PatchbayMethod<Name>`` with no node code of its own.
"""

from __future__ import annotations

from typing import Any

from ..merge import recipe as R
from ..merge import method_registry as registry
from ..merge.method_registry import MergeMethod, ParamSpec

RECIPE = "PATCHBAY_RECIPE"
VARIADIC_SLOTS = 10
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


def input_types(method: MergeMethod) -> dict:
    """ComfyUI's INPUT_TYPES for ``method``.

    Tensor inputs are PATCHBAY_RECIPE sockets (a variadic input gets ``VARIADIC_SLOTS`` sockets, the first
    required, the rest optional), parameters widgets with the registry's type, default and range, and
    every numeric parameter an optional ``<param>_map`` socket for a block-weight or key-pattern map, or a
    param-space recipe (``train_difference_mask``), which replaces the widget. DESCRIPTION is the method's
    one-line doc; its help page (web/docs/<NodeId>/en.md, devtools/build_merge_docs.py) adds the paper.
    """
    required: dict[str, tuple] = {}
    optional: dict[str, tuple] = {}
    for spec in method.inputs:
        tip = f"{_SPACE_TIP[spec.space].capitalize()}."
        if not spec.variadic:
            required[spec.name] = (RECIPE, {"tooltip": tip})
            continue
        many = f"{tip} Connect any number (up to {VARIADIC_SLOTS}); unconnected ones are left out."
        required[f"{spec.name}_1"] = (RECIPE, {"tooltip": many})
        for i in range(2, VARIADIC_SLOTS + 1):
            optional[f"{spec.name}_{i}"] = (RECIPE, {"tooltip": f"{tip} Optional."})
    for spec in method.params:
        required[spec.name] = _widget(spec)
        if spec.type in (float, int):
            tip = (f"Optional: {spec.name} per block or key (Block Weights, Key Patterns) or a param-space "
                   f"recipe; replaces the {spec.name} widget.")
            optional[f"{spec.name}_map"] = (RECIPE, {"tooltip": tip})
    return {"required": required, "optional": optional}


def _widget(spec: ParamSpec) -> tuple:
    low = spec.range.low if spec.range else -_BOUND
    high = spec.range.high if spec.range else _BOUND
    where = f" in [{low:g}, {high:g}]" if spec.range else ""
    if spec.type is bool:
        return ("BOOLEAN", {"default": spec.default, "tooltip": f"{spec.name} (default {spec.default})."})
    if spec.type is int:  # never a "control after generate" widget (the frontend adds one to a "seed"):
        fixed = {"control_after_generate": False}  # a randomised parameter would re-run every merge
        if spec.optional:
            return ("INT", {"default": NONE_INT if spec.default is None else spec.default, "min": NONE_INT,
                            "max": int(min(high, 2**32 - 1)), **fixed,
                            "tooltip": f"{spec.name}; {NONE_INT} = none (a seed: the merge's seed)."})
        return ("INT", {"default": spec.default, "min": int(max(low, -_BOUND)), "max": int(min(high, _BOUND)),
                        "step": 1, **fixed, "tooltip": f"{spec.name} (default {spec.default}){where}."})
    if spec.type is float and not spec.optional:
        step = 0.01 if spec.default == 0 or abs(spec.default) >= 0.01 else abs(spec.default)
        return ("FLOAT", {"default": spec.default, "min": max(low, -_BOUND), "max": min(high, _BOUND),
                          "step": step, "round": False,
                          "tooltip": f"{spec.name} (default {spec.default:g}){where}."})
    return ("STRING", {"default": "" if spec.default is None else str(spec.default),
                       "tooltip": f"{spec.name} ({spec.type.__name__}; empty = none)."})


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


class _MethodNode:
    METHOD = ""
    FUNCTION = "build"
    CATEGORY = "Patchbay/merge/methods"
    RETURN_TYPES = (RECIPE,)
    RETURN_NAMES = ("recipe",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return input_types(registry.get(cls.METHOD))

    def build(self, **values: Any) -> tuple:
        return (build_call(registry.get(self.METHOD), values),)


def method_node(method: MergeMethod) -> type:
    """The node class of one registered method."""
    return type(node_id(method), (_MethodNode,), {
        "NODE_ID": node_id(method), "METHOD": method.name,
        "DISPLAY_NAME": f"{method.name} (Patchbay merge)",
        "DESCRIPTION": method.doc,
        "OUTPUT_TOOLTIPS": (_output_tip(method),),
    })


def _output_tip(method: MergeMethod) -> str:
    if method.returns is not None:  # one value per key (get_rank_from_ratio), for a parameter
        return (f"One {method.returns.__name__} per key: connect it to the _map input of a parameter of "
                f"that type (truncate_rank's rank_map).")
    return (f"The recipe ({_SPACE_TIP[method.output]}): connect it to another method, or to Merge, "
            f"Save Merge or Extract LoRA.")


NODES = [method_node(method) for method in registry.all_methods()]
