"""The recipe graph's node types: six frozen dataclasses and the error that carries a path, kept apart
from the builders (merge/recipe.py, which re-exports them) so they import only the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from .names import ANY, SPACES

Scalar = Union[float, int, bool, str, None]  # noqa: UP007 - a runtime alias used by isinstance-free code
_SCALAR_TYPES = (float, int, bool, str, type(None))


class RecipeError(ValueError):
    """A recipe that cannot be built or bound; ``path`` locates the offending node."""

    def __init__(self, path: Iterable[str], problem: str) -> None:
        self.path = tuple(path)
        self.problem = problem
        where = " > ".join(self.path) if self.path else "recipe"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class ModelNode:
    """A model file; ``space`` is its merge space, ``config`` an sd-mecha model config id if known."""

    path: str
    space: str = "weight"
    config: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise RecipeError((), f"a model path must be a non-empty string, got {shown(self.path)}")
        if self.space not in SPACES or self.space == ANY:
            raise RecipeError((label(self),), f"merge space {self.space!r} is not weight, delta or param")
        if self.config is not None and not isinstance(self.config, str):
            raise RecipeError((label(self),), f"model_config {shown(self.config)} is not a config name; give "
                                              f"a quoted id such as \"sd1-ldm\", or leave it out")


@dataclass(frozen=True)
class SourceNode(ModelNode):
    """A model that is no file: ``source`` (merge/sources.py: ``name``, ``fingerprint``, ``open(space)``),
    read key by key, as sd-mecha lets a leaf be a tensor or a dict. ``path`` is the source's name, which
    messages and .mecha text show; nodes compare by it, their space and the source's fingerprint."""

    source: Any = field(default=None, compare=False, repr=False)
    fingerprint: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not callable(getattr(self.source, "open", None)) or not hasattr(self.source, "fingerprint"):
            raise RecipeError((label(self),), f"{shown(self.source)} is no model source: give an object with "
                                              f"name, fingerprint and open(space) (merge/sources.py)")
        object.__setattr__(self, "fingerprint", self.source.fingerprint)


@dataclass(frozen=True)
class LiteralNode:
    """A scalar, or an ordered map (block name, key or fnmatch glob, "default") -> scalar.

    A map is stored as a tuple of pairs so the node stays hashable; ``mapping`` gives a dict. Ranges of
    blocks (``double_blocks.0-7``, ``IN00-05``) are written out into their blocks (blocks.expand_ranges).
    """

    value: Any

    def __post_init__(self) -> None:
        from .blocks import expand_ranges

        value = self.value
        if isinstance(value, Mapping | tuple):
            try:
                value = tuple(expand_ranges(dict(value)).items())
            except (TypeError, ValueError) as error:
                raise RecipeError((), f"map {shown(self.value)}: {error}") from None
            object.__setattr__(self, "value", value)
        if isinstance(value, tuple):
            for key, item in value:
                _check_map_key(key)
                if not isinstance(item, _SCALAR_TYPES):
                    raise RecipeError((), f"map entry {key!r}: {shown(item)} is not a scalar")
        elif not isinstance(value, _SCALAR_TYPES):
            raise RecipeError((), f"a literal is a scalar or a dict of scalars, not {shown(value)}")

    @property
    def is_map(self) -> bool:
        return isinstance(self.value, tuple)

    @property
    def mapping(self) -> dict[str, Scalar]:
        """The map as a dict (a scalar literal reads as ``{"default": value}``)."""
        return dict(self.value) if self.is_map else {"default": self.value}

    def scalar_for(self, arch: str, key: str) -> Scalar:
        """The scalar this literal gives ``key`` of an ``arch`` model (see blocks.resolve)."""
        from .blocks import resolve

        return resolve(self.mapping, arch, key) if self.is_map else self.value


@dataclass(frozen=True)
class CallNode:
    """A merge method applied to tensor ``args`` and scalar ``kwargs`` (sorted (name, node) pairs)."""

    method: str
    args: tuple[Node, ...] = ()
    kwargs: tuple[tuple[str, Node], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        kwargs = self.kwargs.items() if isinstance(self.kwargs, Mapping) else self.kwargs
        object.__setattr__(self, "kwargs", tuple(sorted(kwargs, key=lambda item: item[0])))
        # hashed once: children cache theirs, so hashing a DAG with shared parts stays linear
        object.__setattr__(self, "_hash", hash((self.method, self.args, self.kwargs)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, CallNode) or self._hash != other._hash:
            return False
        return _same(self, other, set())

    def kwarg(self, name: str) -> Node:
        return dict(self.kwargs)[name]


@dataclass(frozen=True)
class FreeInput:
    """An open tensor input, bound later with ``bind(recipe, inputs={name: other_recipe})``."""

    name: str
    space: str = ANY

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise RecipeError((), f"input name {shown(self.name)} must be an identifier (a quoted name "
                                  f"such as \"alpha\")")


@dataclass(frozen=True)
class ParamNode:
    """An open scalar parameter, bound later with ``bind(recipe, params={name: value})``."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise RecipeError((), f"parameter name {shown(self.name)} must be an identifier (a quoted name "
                                  f"such as \"alpha\")")


Node = Union[ModelNode, LiteralNode, CallNode, FreeInput, ParamNode]  # noqa: UP007
TENSOR_NODES = (ModelNode, CallNode, FreeInput)



def _same(a: Node, b: Node, seen: set[tuple[int, int]]) -> bool:
    """Structural equality that visits each pair of shared sub-graphs once (plain == is exponential)."""
    if a is b or (id(a), id(b)) in seen:
        return True
    if not (isinstance(a, CallNode) and isinstance(b, CallNode)):
        return a == b
    seen.add((id(a), id(b)))
    return (a._hash == b._hash and a.method == b.method and len(a.args) == len(b.args)
            and [k for k, _ in a.kwargs] == [k for k, _ in b.kwargs]
            and all(_same(x, y, seen) for x, y in zip(a.args, b.args, strict=True))
            and all(_same(x, y, seen) for (_, x), (_, y) in zip(a.kwargs, b.kwargs, strict=True)))


def label(node: Node) -> str:
    if isinstance(node, ModelNode):
        return f"model {node.path!r}"
    if isinstance(node, CallNode):
        return node.method
    if isinstance(node, FreeInput):
        return f"input {node.name!r}"
    if isinstance(node, ParamNode):
        return f"param {node.name!r}"
    return f"literal {node.value!r}"


def shown(value: object) -> str:
    """A value as messages show it: a recipe node by its label (``model 'a.safetensors'``), never its
    dataclass repr; anything else by its repr."""
    if isinstance(value, CallNode):
        return f"a {value.method} call"
    if isinstance(value, (ModelNode, FreeInput, ParamNode, LiteralNode)):
        return label(value)
    return repr(value)


def _check_map_key(key: object) -> None:
    if not isinstance(key, str) or not key or any(c.isspace() or c in '="&' for c in key):
        raise RecipeError((), f"map key {key!r} must be a non-empty block name or key glob without "
                              f"spaces, '=', '\"' or '&'")
