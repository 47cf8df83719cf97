"""The executable form of a recipe: ``Leaf`` (one input source), ``Call`` (a resolved method), scalars.

``compile_recipe`` turns a closed recipe graph (merge/recipe.py) into these steps once per merge:
model paths are resolved and deduplicated into source indices, method names are looked up in the
registry, scalars stay numbers and map literals stay ``LiteralNode``s that ``Graph.scalar``
resolves per key (``check_maps`` resolves them against every planned key at plan time, so that a
recipe that validates merges). A param-space call given as a parameter
(``alpha=train_difference_mask(a, b, c)``) is a ``Call`` in ``kwargs``, evaluated per key like a
tensor input. Unbound ``FreeInput``/``ParamNode`` nodes are refused here with the names to bind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import io as mio
from . import registry
from .graph import CallNode, FreeInput, LiteralNode, ModelNode, ParamNode, RecipeError


@dataclass(frozen=True)
class Leaf:
    """Input source number ``index`` (a model file or a LoRA)."""

    index: int


@dataclass(eq=False)
class Call:
    """A method call: the registry entry, its tensor arguments and its scalar keyword arguments."""

    method: Any
    args: tuple
    kwargs: dict[str, Any]
    cache: dict[str, dict] = field(default_factory=dict)

    @property
    def elementwise(self) -> bool:
        """Whether the method may run slice by slice (``@merge_method(elementwise=True)``)."""
        return self.method.elementwise


@dataclass(frozen=True)
class SourceSpec:
    """A model input: resolved path and the merge space it enters the recipe in."""

    path: Path
    space: str


@dataclass
class Graph:
    """A compiled recipe: the root step and the distinct sources its leaves refer to."""

    root: Any
    sources: list[SourceSpec]

    def open_sources(self) -> list:
        """Open every source lazily (headers only); LoRA files become delta-space sources."""
        from . import lora

        files = mio.open_models(spec.path for spec in self.sources)
        base = next((f for f in files if not f.arch.startswith("lora")), None)
        opened = []
        for spec, file in zip(self.sources, files, strict=True):
            if file.arch.startswith("lora"):
                opened.append(lora.LoraSource(file, base))
            else:
                opened.append(FileSource(file, spec.space))
        return opened

    def maps(self) -> list[tuple[str, Any]]:
        """``("method.param", LiteralNode)`` for every per-block / per-key map the recipe uses."""
        found, seen, stack = [], set(), [self.root]
        while stack:
            step = stack.pop()
            if not isinstance(step, Call) or id(step) in seen:
                continue
            seen.add(id(step))
            found += [(f"{step.method.name}.{name}", v) for name, v in step.kwargs.items()
                      if isinstance(v, LiteralNode)]  # compiled scalars are plain values
            stack += [*step.args, *step.kwargs.values()]
        return found

    @staticmethod
    def scalar(value: Any, key: str, arch: str) -> Any:
        """A scalar for ``key``: numbers pass through, a map literal is resolved per block or key glob."""
        return value.scalar_for(arch, key) if isinstance(value, LiteralNode) else value


class FileSource:
    """A model file used as an input, in weight space unless the recipe says otherwise."""

    def __init__(self, file: mio.SafetensorsFile, space: str = "weight") -> None:
        self.file, self.space, self.arch = file, space, file.arch
        self.name = file.path.name
        self._keys = {file.canonical(k): k for k in file.tensors}

    def keys(self) -> list[str]:
        return list(self._keys)

    def has(self, key: str) -> bool:
        return key in self._keys

    def info(self, key: str) -> mio.TensorInfo:
        return self.file.tensors[self._keys[key]]

    def read_bytes(self, key: str) -> int:
        return self.info(key).nbytes

    def read_into(self, key: str, buffer):
        return self.file.read_into(self._keys[key], buffer)

    def read_range(self, key: str, buffer, first: int, last: int):
        return self.file.read_range(self._keys[key], buffer, first, last)

    def close(self) -> None:
        self.file.close()


def compile_recipe(recipe: Any, search_dirs: tuple[Path, ...] = (), cache: dict | None = None) -> Graph:
    """Compile a closed recipe into steps; model paths are resolved against cwd, then ``search_dirs``.

    ``cache``: a dict the caller keeps between merges; each method call gets the per-key caches
    stored under (method, its tensor inputs), so a call whose scalars changed (``rotate`` with a new
    ``alpha``) finds the work of the previous merge. None: fresh caches for this merge.
    """
    sources: list[SourceSpec] = []
    index: dict[Path, int] = {}
    memo: dict[int, Any] = {}

    def visit(node: Any) -> Any:
        if id(node) in memo:
            return memo[id(node)]
        if isinstance(node, ModelNode):
            path = resolve_path(Path(os.fspath(node.path)), search_dirs)
            if path not in index:
                index[path] = len(sources)
                sources.append(SourceSpec(path, node.space))
            step: Any = Leaf(index[path])
        elif isinstance(node, CallNode):
            method = _method_of(node)
            step = Call(method, tuple(visit(a) for a in node.args), {k: visit(v) for k, v in node.kwargs})
            if cache is not None:
                step.cache = cache.setdefault((node.method, node.args), {})
        elif isinstance(node, LiteralNode):
            step = node if node.is_map else node.value
        elif isinstance(node, (FreeInput, ParamNode)):
            raise RecipeError((node.name,), f"the recipe has an unbound {type(node).__name__}; bind it first "
                              "(recipe.bind(root, inputs=..., params=...), or --param NAME=VALUE)")
        else:
            raise RecipeError((), f"cannot execute recipe node {node!r} ({type(node).__name__})")
        memo[id(node)] = step
        return step

    root = visit(recipe)
    if not sources:
        raise RecipeError((), "the recipe has no model input; nothing to merge")
    return Graph(root, sources)


def _method_of(node: CallNode) -> registry.MergeMethod:
    """The registered method a call names, after checking its parameter names (a RecipeError if not)."""
    try:
        method = registry.get(node.method)
    except registry.UnknownMethodError as error:
        raise RecipeError((node.method,), str(error)) from None
    for name, _ in node.kwargs:
        try:
            method.param(name)
        except KeyError as error:
            raise RecipeError((node.method,), str(error.args[0])) from None
    return method


def check_maps(graph: Graph, arch: str, keys: list[str]) -> None:
    """Resolve every map of the recipe against the planned float ``keys`` of an ``arch`` model, so that
    a merge that validates never meets a map entry that names nothing or a key that no entry covers.

    Raises ``RecipeError`` naming the parameter and the entry (with the nearest block names) or the
    blocks left without a value.
    """
    from .blocks import check_map

    for where, literal in graph.maps():
        try:
            check_map(literal.mapping, arch, set(keys))
        except ValueError as error:
            raise RecipeError((where,), str(error)) from None
        if uncovered := _uncovered(literal, arch, keys):
            names = ", ".join(list(uncovered)[:8]) + (", ..." if len(uncovered) > 8 else "")
            example = next(iter(uncovered.values()))
            raise RecipeError((where,), f"the map has no entry for {names} (e.g. {example!r}) and no "
                                        f"'default'; add those blocks or a 'default' entry")


def _uncovered(literal: Any, arch: str, keys: list[str]) -> dict[str, str]:
    """Block (or key) -> an example key, for the keys no entry of a map without ``default`` covers."""
    from .blocks import block_of

    if "default" in literal.mapping:
        return {}
    uncovered: dict[str, str] = {}
    for key in keys:
        try:
            literal.scalar_for(arch, key)
        except KeyError:
            uncovered.setdefault(block_of(arch, key) or key, key)
    return uncovered


def resolve_path(path: Path, search_dirs: tuple[Path, ...]) -> Path:
    """``path`` if it exists (or is absolute), else the first ``search_dirs`` entry that has it."""
    path = path.expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve() if path.exists() else path
    for folder in search_dirs:
        candidate = Path(folder) / path
        if candidate.exists():
            return candidate.resolve()
    return path


def recipe_text(recipe: Any, arch: str | None = None) -> str:
    """The recipe as .mecha text for the output's metadata, in the form sd-mecha reads back (block
    maps in ``arch``'s block config)."""
    from . import mecha_write

    try:
        return mecha_write.dumps(recipe, arch=arch)
    except Exception as error:  # noqa: BLE001 - metadata must never fail a finished merge
        return f"# not printable as .mecha ({error}): {recipe!r}"
