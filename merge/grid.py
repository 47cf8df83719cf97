"""Merge grids: one recipe, up to two parameter axes with a list of values each, and the recipe of every
variant (the Merge Grid node, nodes/merge_grid.py, merges and samples them). Reads no file.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from . import recipe as R
from .names import did_you_mean

MAX_VARIANTS = 64  # more only when asked (allow_large): each variant is a merge and a sampling run


class GridError(ValueError):
    """An axis or a value list that cannot make a grid; the message names it and the fix."""


def axis_choices(root: R.Node) -> list[str]:
    """Every name an axis may give for ``root``: its free parameters, ``method.parameter`` of every call,
    and ``parameter`` alone where one method has it."""
    qualified: set[str] = set()
    owners: dict[str, set[str]] = {}
    for _, node in R.walk(root):
        if isinstance(node, R.CallNode):
            for name, _value in node.kwargs:
                qualified.add(f"{node.method}.{name}")
                owners.setdefault(name, set()).add(node.method)
    plain = {name for name, methods in owners.items() if len(methods) == 1}
    return sorted(set(R.params(root))) + sorted(plain) + sorted(qualified)


def axis_target(root: R.Node, name: str) -> tuple[str, str | None, str]:
    """``(kind, method, parameter)`` that the axis ``name`` sets in ``root``: kind ``"param"`` (a free
    parameter) or ``"kwarg"`` (a parameter of every call of ``method``); GridError when it names none.

    An axis names what it sets in one of three ways, tried in this order:

    - a free parameter of the recipe (``R.param("alpha")``, a ``.mecha`` text's open ``&alpha``): bound;
    - ``method.parameter`` (``weighted_sum.alpha``): that parameter of every call of that method;
    - ``parameter`` alone (``alpha``): that parameter of the calls that have it, when they are calls of
      one method only (else the error lists the ``method.parameter`` names to choose from).
    """
    name = name.strip()
    if not name:
        raise GridError("an axis has values but no parameter name: give one (e.g. alpha)")
    if name in R.params(root):
        return "param", None, name
    method, dot, parameter = name.rpartition(".")
    calls = [node for _, node in R.walk(root) if isinstance(node, R.CallNode)]
    if dot:
        if any(c.method == method and parameter in dict(c.kwargs) for c in calls):
            return "kwarg", method, parameter
    else:
        methods = sorted({c.method for c in calls if name in dict(c.kwargs)})
        if len(methods) == 1:
            return "kwarg", methods[0], name
        if len(methods) > 1:
            raise GridError(f"axis {name!r} is a parameter of {len(methods)} methods of the recipe: name one "
                            f"of {', '.join(f'{m}.{name}' for m in methods)}")
    choices = axis_choices(root)
    known = choices + sorted({k for c in calls for k, _ in c.kwargs})
    raise GridError(f"axis {name!r} names no free parameter and no method parameter of the recipe"
                    f"{did_you_mean(name, known)}; it has: {', '.join(choices) or 'none'}")


def set_value(root: R.Node, target: tuple[str, str | None, str], value: Any) -> R.Node:
    """``root`` with the axis ``target`` (from ``axis_target``) set to ``value`` (a number or a literal)."""
    kind, method, parameter = target
    literal = value if isinstance(value, R.LiteralNode) else R.literal(value)
    if kind == "param":
        return R.bind(root, params={parameter: literal})
    memo: dict[int, R.Node] = {}

    def visit(node: R.Node) -> R.Node:
        if id(node) in memo:
            return memo[id(node)]
        new = node
        if isinstance(node, R.CallNode):
            args = tuple(visit(a) for a in node.args)
            kwargs = tuple((k, literal if node.method == method and k == parameter else visit(v))
                           for k, v in node.kwargs)
            if args != node.args or kwargs != node.kwargs:
                new = R.CallNode(node.method, args, kwargs)
        memo[id(node)] = new
        return new

    changed = visit(root)
    R.validate(changed)  # a map where the method takes none, a value out of its range: named here
    return changed


def variants(root: R.Node, x: tuple[str, Sequence[Any]], y: tuple[str, Sequence[Any]] | None = None,
             allow_large: bool = False) -> list[tuple[tuple[str, ...], R.Node]]:
    """``[(labels, recipe)]`` for every (x value, y value), row by row (y outer, x inner); ``labels``
    holds ``name=value`` per axis. Free parameters that no axis binds stay an error of the merge, as
    for any recipe.

    A value is a number or a parameter map (a block-weight or key-pattern ``LiteralNode``, as the Key
    Patterns node makes). Each variant is an ordinary recipe, so the merge cache recomputes only the
    keys whose resolved values changed (``CompiledRecipe.key_id``): a block-map axis that changes the OUT
    blocks
    leaves every other key of the previous variant in the cache (``cache_wants``)."""
    if not x[0].strip():
        raise GridError("x_param is empty: name the parameter the x values set (e.g. alpha)")
    axes = [(name.strip(), list(values)) for name, values in (x, y or ("", ())) if name.strip()]
    if len(axes) == 2 and axes[0][0] == axes[1][0]:
        raise GridError(f"x and y both set {axes[0][0]!r}: give y another parameter, or leave it empty")
    targets = []
    for name, values in axes:
        if not values:
            raise GridError(f"axis {name!r} has no values: give numbers (0.2, 0.5, 0.8) or one map per line")
        targets.append(axis_target(root, name))
    if len(targets) == 2 and targets[0] == targets[1]:
        kind, method, parameter = targets[0]
        both = parameter if kind == "param" else f"{method}.{parameter}"
        raise GridError(f"x and y both set {both} ({axes[0][0]!r}, {axes[1][0]!r}): give y another "
                        f"parameter, or leave it empty")
    total = len(axes[0][1]) * (len(axes[1][1]) if len(axes) == 2 else 1)
    if total > MAX_VARIANTS and not allow_large:
        raise GridError(f"the grid has {total} variants (over {MAX_VARIANTS}): each is a merge and a "
                        f"sampling run; give fewer values, or set allow_large_grid")
    rows = [(("",), root)]
    if len(axes) == 2:
        name, values = axes[1]
        rows = [((f"{name}={label(v)}",), set_value(root, targets[1], v)) for v in values]
    name, values = axes[0]
    out = []
    for row_label, row in rows:
        for value in values:
            labels = (f"{name}={label(value)}",) + (row_label if len(axes) == 2 else ())
            out.append((labels, set_value(row, targets[0], value)))
    return out


def label(value: Any) -> str:
    """A value as a grid label: numbers as written (0.5), maps as their entries (IN*=0.2, default=1)."""
    if isinstance(value, R.LiteralNode):
        if value.is_map:
            return ", ".join(f"{k}={label(v)}" for k, v in value.mapping.items())
        value = value.value
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def cache_wants(ids: Sequence[Mapping[str, Hashable]], in_place: Sequence[bool]) -> list[frozenset]:
    """For variants merged in this order (``ids``: each one's key -> result id, ``CompiledRecipe.key_id`` as
    the
    merge cache stores it), the result ids worth keeping in the cache after each: those a later variant
    merges. A variant ``in_place`` fills the previous variant's model and merges only the keys whose id
    changed; any other merges every key. The rest would push the useful results out of the cache and
    cost a copy each."""
    merges, previous = [], {}
    for current, reused in zip(ids, in_place, strict=True):
        merges.append({v for k, v in current.items() if not reused or previous.get(k) != v})
        previous = current
    wants, later = [], set()
    for merged in reversed(merges):
        wants.append(frozenset(later))
        later |= merged
    return wants[::-1]
