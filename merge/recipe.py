"""The recipe graph's builders: checked calls of registered methods (defaults filled, so equal recipes
compare equal), walking, and binding of open inputs and parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from . import method_registry as registry
from .graph import (
    TENSOR_NODES,
    CallNode,
    FreeInput,
    LiteralNode,
    ModelNode,
    Node,
    ParamNode,
    RecipeError,
    Scalar,
    SourceNode,
    label,
    shown,
)
from .method_registry import MergeMethod
from .names import ANY, PARAM, did_you_mean

__all__ = ["CallNode", "FreeInput", "LiteralNode", "ModelNode", "Node", "ParamNode", "RecipeError", "Scalar",
           "SourceNode", "bind", "call", "check_call", "free_input", "free_inputs", "literal", "model",
           "output_space", "param", "params", "source", "validate", "walk"]


# ---- builders ------------------------------------------------------------------------------------

def model(path: str, space: str = "weight", config: str | None = None) -> ModelNode:
    """A model file as a recipe input."""
    return ModelNode(str(path), space, config)


def source(obj: Any, space: str = "weight") -> SourceNode:
    """A model that is no file as a recipe input: ``obj`` has ``name``, ``fingerprint`` and ``open(space)``
    (merge/sources.py; a ``MemorySource`` has them)."""
    return SourceNode(str(getattr(obj, "name", "") or "source"), space, source=obj)


def literal(value: Scalar | Mapping[str, Scalar]) -> LiteralNode:
    """A scalar, or a per-block / per-key map with an optional ``default``."""
    return LiteralNode(value)


def free_input(name: str, space: str = ANY) -> FreeInput:
    """An open tensor input named ``name``."""
    return FreeInput(name, space)


def param(name: str) -> ParamNode:
    """An open scalar parameter named ``name``."""
    return ParamNode(name)


def call(method: str, *args: Any, **kwargs: Any) -> CallNode:
    """``method`` applied to tensor recipes ``args`` and scalars ``kwargs``, checked and with defaults.

    For a method without variadic input, positional values after its tensor inputs fill its
    parameters in order (sd-mecha's calling convention).

    A recipe is an immutable DAG of five node kinds::

        ModelNode(path)       a model file (weight space unless told otherwise); its kind SourceNode(name,
                              source=obj) a model that is no file (a MODEL of ComfyUI's graph)
        LiteralNode(value)    a scalar, or a map block-name / key-glob -> scalar with an optional "default"
        CallNode(method, args, kwargs)   a registered merge method applied to tensor args and scalar kwargs
        FreeInput(name)       a tensor input left open, bound later to another recipe
        ParamNode(name)       a scalar parameter left open, bound later to a value

    Python users build recipes with the builders, which check every call against the method's
    signature and fill in defaults (so equal recipes compare equal)::

        from patchbay_merge.recipe import model, weighted_sum
        r = weighted_sum(model("a.safetensors"), model("b.safetensors"), alpha=0.3)

    Every method in the registry is a builder of this module (``recipe.add_difference(...)``), and
    ``call("name", ...)`` reaches them by name. Errors are ``RecipeError``s whose message starts with
    the path through the graph (``weighted_sum.b > add_difference.b``).
    """
    try:
        spec = registry.get(method)
    except registry.UnknownMethodError as exc:
        raise RecipeError((method,), str(exc)) from None
    tensors, kwargs = _split_positional(spec, args, kwargs)
    node = CallNode(method, tuple(_as_tensor(spec, i, a) for i, a in enumerate(tensors)),
                    _complete_kwargs(spec, kwargs))
    check_call(node, (), spec)
    return node


def __getattr__(name: str) -> Callable[..., CallNode]:
    """Every registered method is a builder: ``recipe.weighted_sum(a, b, alpha=0.3)``."""
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        registry.get(name)
    except registry.UnknownMethodError as exc:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {exc}") from None
    builder = functools.partial(call, name)
    builder.__doc__ = registry.get(name).doc
    return builder


def _split_positional(spec: MergeMethod, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if spec.variadic or len(args) <= len(spec.inputs):
        return args, kwargs
    extra = args[len(spec.inputs):]
    if len(extra) > len(spec.params):
        raise RecipeError((spec.name,), f"takes {len(spec.inputs)} tensor inputs and {len(spec.params)} "
                                        f"parameters, got {len(args)} positional values")
    named = dict(zip(spec.param_names(), extra, strict=False))
    clash = set(named) & set(kwargs)
    if clash:
        raise RecipeError((spec.name,), f"parameter {sorted(clash)[0]!r} given twice")
    return args[: len(spec.inputs)], {**named, **kwargs}


def _as_tensor(spec: MergeMethod, index: int, value: Any) -> Node:
    if isinstance(value, TENSOR_NODES):
        return value
    name = _input_label(spec, index)
    hint = " (wrap a file path in model(...))" if isinstance(value, str) else ""
    got = shown(value) if isinstance(value, (LiteralNode, ParamNode)) else f"{type(value).__name__} {value!r}"
    raise RecipeError((name,), f"expects a tensor recipe (model, method call or free input), got {got}{hint}")


def _complete_kwargs(spec: MergeMethod, kwargs: Mapping[str, Any]) -> tuple[tuple[str, Node], ...]:
    out: dict[str, Node] = {}
    for name, value in kwargs.items():
        if name not in spec.param_names():
            _unknown_param(spec, name)
        out[name] = value if isinstance(value, (LiteralNode, ParamNode, CallNode)) else LiteralNode(value)
    for p in spec.params:
        out.setdefault(p.name, LiteralNode(p.default))
    return tuple(sorted(out.items()))


def _unknown_param(spec: MergeMethod, name: str) -> None:
    try:
        spec.param(name)
    except KeyError as exc:
        raise RecipeError((f"{spec.name}.{name}",), str(exc.args[0])) from None


# ---- checking ------------------------------------------------------------------------------------

def check_call(node: CallNode, path: tuple[str, ...], spec: MergeMethod | None = None) -> str:
    """Check one call against its method (arity, spaces, scalar types); return its output space."""
    spec = spec or _method(node.method, path)
    fixed = sum(1 for i in spec.inputs if not i.variadic)
    if len(node.args) < max(fixed, 1) or (not spec.variadic and len(node.args) != fixed):
        wanted = f"at least {max(fixed, 1)}" if spec.variadic else str(fixed)
        raise RecipeError(path, f"takes {wanted} tensor inputs, got {len(node.args)}")
    any_space = None
    for index, arg in enumerate(node.args):
        wanted, got = spec.input_space(index), output_space(arg)
        where = path + (_input_label(spec, index),)
        _check_tensor(arg, where)
        if wanted == ANY and got != ANY:
            if any_space not in (None, got):
                raise RecipeError(where, f"is in {got} space but the other inputs are in {any_space} space")
            any_space = got
        elif ANY not in (wanted, got) and wanted != got:
            hint = (' (a LoRA or another difference file: write merge_space="delta" on its model line)'
                    if wanted == "delta" and isinstance(arg, ModelNode) else "")
            raise RecipeError(where, f"expects a {wanted}-space input, got {got} ({label(arg)}){hint}")
    for name, value in node.kwargs:
        _check_kwarg(spec, name, value, path + (f"{spec.name}.{name}",))
    return (any_space or ANY) if spec.output == ANY else spec.output


def _check_kwarg(spec: MergeMethod, name: str, value: Node, path: tuple[str, ...]) -> None:
    if name not in spec.param_names():
        _unknown_param(spec, name)
    pspec = spec.param(name)
    if isinstance(value, LiteralNode):
        for key, scalar in value.mapping.items():
            entry = f" (entry {key!r})" if value.is_map else ""
            if not pspec.accepts(scalar):
                raise RecipeError(path, f"{scalar!r}{entry} is not a {pspec.type.__name__}")
            if why := pspec.out_of_range(scalar):
                raise RecipeError(path, f"{scalar!r}{entry} {why}")
    elif isinstance(value, CallNode) and (returns := _method(value.method, path).returns) is not None:
        if not (returns is pspec.type or (returns is int and pspec.type is float)):
            raise RecipeError(path, f"{value.method} gives one {returns.__name__} per key, but {name} takes "
                                    f"a {pspec.type.__name__}")
    elif isinstance(value, CallNode):
        if pspec.type is not float or output_space(value, path) != PARAM:
            raise RecipeError(path, "only a float parameter takes a method call, and that call must "
                                    "return a param-space tensor (e.g. train_difference_mask)")
    elif not isinstance(value, ParamNode):
        raise RecipeError(path, f"expects a scalar, got {type(value).__name__}")


def output_space(node: Node, path: tuple[str, ...] = ()) -> str:
    """The merge space a tensor node produces (``any`` when it cannot be known yet)."""
    return _space(node, path, {})


def _space(node: Node, path: tuple[str, ...], memo: dict[int, str]) -> str:
    if id(node) in memo:  # shared sub-graphs are looked at once
        return memo[id(node)]
    space = PARAM
    if isinstance(node, (ModelNode, FreeInput)):
        space = node.space
    elif isinstance(node, CallNode):
        spec = _method(node.method, path)
        space = spec.output
        if space == ANY:
            spaces = {_space(a, path + (_input_label(spec, i),), memo) for i, a in enumerate(node.args)
                      if spec.input_space(i) == ANY} - {ANY}
            space = spaces.pop() if len(spaces) == 1 else ANY
    memo[id(node)] = space
    return space


def validate(root: Node) -> None:
    """Check the whole graph; the first problem raises ``RecipeError`` with its path."""
    for path, node in walk(root):
        if isinstance(node, CallNode):
            check_call(node, path)
        elif isinstance(node, (LiteralNode, ParamNode)) and not path:
            raise RecipeError(path, "a recipe's result must be a tensor recipe, not a scalar")
    _check_tensor(root, ())


def _check_tensor(node: Node, path: tuple[str, ...]) -> None:
    """Refuse a call that gives one value per key (``get_rank_from_ratio``) where a tensor is wanted."""
    if isinstance(node, CallNode) and (returns := _method(node.method, path).returns) is not None:
        raise RecipeError(path, f"{node.method} gives one {returns.__name__} per key, not a tensor: pass it "
                                f"to such a parameter (truncate_rank(d, rank={node.method}(d)))")


def walk(root: Node) -> Iterator[tuple[tuple[str, ...], Node]]:
    """(path, node) for every node, depth first, each shared node once; a path is the chain of
    edges from the root (``weighted_sum.a``, ``add_difference.b``), empty for the root."""
    seen: set[int] = set()
    stack: list[tuple[tuple[str, ...], Node]] = [((), root)]
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield path, node
        if isinstance(node, CallNode):
            spec = _method(node.method, path)
            children = [(path + (_input_label(spec, i),), a) for i, a in enumerate(node.args)]
            children += [(path + (f"{node.method}.{k}",), v) for k, v in node.kwargs]
            stack.extend(reversed(children))


def free_inputs(root: Node) -> tuple[str, ...]:
    """Names of the open tensor inputs, sorted."""
    return tuple(sorted({n.name for _, n in walk(root) if isinstance(n, FreeInput)}))


def params(root: Node) -> tuple[str, ...]:
    """Names of the open scalar parameters, sorted."""
    return tuple(sorted({n.name for _, n in walk(root) if isinstance(n, ParamNode)}))


def _method(name: str, path: tuple[str, ...]) -> MergeMethod:
    try:
        return registry.get(name)
    except registry.UnknownMethodError as exc:
        raise RecipeError(path, str(exc)) from None


def _input_label(spec: MergeMethod, index: int) -> str:
    if index < len(spec.inputs) and not spec.inputs[index].variadic:
        return f"{spec.name}.{spec.inputs[index].name}"
    fixed = sum(1 for i in spec.inputs if not i.variadic)
    return f"{spec.name}.{spec.inputs[-1].name}[{index - fixed}]"


# ---- binding -------------------------------------------------------------------------------------

def bind(root: Node, inputs: Mapping[str, Node] | None = None, params: Mapping[str, Any] | None = None,
         shared: Iterable[str] | Mapping[str, Any] = ()) -> Node:
    """Plug recipes into open inputs and values into open parameters; returns a new recipe.

    ``inputs`` maps FreeInput names to recipes (which may leave inputs and parameters open
    themselves); ``params`` maps ParamNode names, of ``root`` or of a plugged-in recipe, to scalars,
    maps or param-space nodes. When ``root`` and a plugged-in recipe (or two plugged-in recipes)
    use the same open name, binding fails naming it unless ``shared`` declares them one; a mapping
    for ``shared`` also binds the values it gives. Names left unbound stay open.
    """
    inputs = dict(inputs or {})
    values = dict(params or {})
    if isinstance(shared, Mapping):
        values.update(shared)
    _check_bind_names(root, inputs, values)
    _check_collisions(root, inputs, set(shared))
    plugged = _substitute(root, lambda n: inputs.get(n.name) if isinstance(n, FreeInput) else None, {})
    bound = _substitute(plugged, lambda n: _param_value(n, values), {})
    validate(bound)
    return bound


def _check_bind_names(root: Node, inputs: Mapping[str, Node], values: Mapping[str, Any]) -> None:
    open_inputs = free_inputs(root)
    for name, value in inputs.items():
        if name not in open_inputs:
            raise RecipeError(("bind",), f"no open input {name!r}{did_you_mean(name, open_inputs)}; "
                                         f"open inputs: {', '.join(open_inputs) or 'none'}")
        if not isinstance(value, TENSOR_NODES):
            raise RecipeError(("bind", f"input {name!r}"), f"expects a tensor recipe, got {shown(value)}")
    open_params = set(params(root)).union(*(params(v) for v in inputs.values()))
    for name in values:
        if name not in open_params:
            raise RecipeError(("bind",), f"no open parameter {name!r}"
                                         f"{did_you_mean(name, open_params)}; "
                                         f"open parameters: {', '.join(sorted(open_params)) or 'none'}")


def _check_collisions(root: Node, inputs: Mapping[str, Node], shared: set[str]) -> None:
    owners: dict[str, list[str]] = {}
    components = [("the recipe", set(params(root)) | (set(free_inputs(root)) - set(inputs)))]
    distinct: list[Node] = []
    for name, sub in inputs.items():
        if sub not in distinct:
            distinct.append(sub)
            components.append((f"the recipe bound to {name!r}", set(params(sub)) | set(free_inputs(sub))))
    for owner, names in components:
        for name in names:
            owners.setdefault(name, []).append(owner)
    for name, labels in sorted(owners.items()):
        if len(labels) > 1 and name not in shared:
            raise RecipeError(("bind",), f"parameter {name!r} is used by both {labels[0]} and {labels[1]}; "
                                         f"pass shared={{{name!r}}} if they are one parameter, "
                                         f"or rename one of them")


def _param_value(node: Node, values: Mapping[str, Any]) -> Node | None:
    if not isinstance(node, ParamNode) or node.name not in values:
        return None
    value = values[node.name]
    return value if isinstance(value, (LiteralNode, ParamNode, CallNode)) else LiteralNode(value)


def _substitute(node: Node, replace: Callable[[Node], Node | None], memo: dict[int, Node]) -> Node:
    if id(node) in memo:
        return memo[id(node)]
    new = replace(node)
    if new is None:
        new = node
        if isinstance(node, CallNode):
            args = tuple(_substitute(a, replace, memo) for a in node.args)
            kwargs = tuple((k, _substitute(v, replace, memo)) for k, v in node.kwargs)
            if args != node.args or kwargs != node.kwargs:
                new = CallNode(node.method, args, kwargs)
    memo[id(node)] = new
    return new
