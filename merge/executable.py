"""The executable form of a recipe (``Leaf``, ``Call``, scalars), compiled once per merge: model paths
resolved and deduplicated, methods looked up, and ``CompiledRecipe.key_id``, what one key's result depends on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import io as mio
from . import method_registry as registry
from .fingerprint import file_fingerprint
from .graph import CallNode, FreeInput, LiteralNode, ModelNode, ParamNode, RecipeError, SourceNode


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
    """A model input: resolved path (or a source object) and the merge space it enters the recipe in."""

    path: Path | None
    space: str
    source: Any = None  # a source object (merge/sources.py: open(space)) instead of a file
    fingerprint: Any = None  # the file's (merge/fingerprint.py) or the source's, taken when compiled


@dataclass
class CompiledRecipe:
    """A compiled recipe: the root step and the distinct sources its leaves refer to."""

    root: Any
    sources: list[SourceSpec]
    fingerprints: list = field(default_factory=list)
    seed: int = 0  # the merge seed: part of the key ids of random calls only
    notes: list[str] = field(default_factory=list)  # what the architecture check let through
    keys: frozenset[str] = frozenset()  # every source's keys (set by ``open_sources``), for ``related``

    def open_sources(self, architecture_policy: str = "refuse") -> list:
        """Open every source lazily (headers only); LoRA files become delta-space sources mapped onto the
        first weight source; every weight source must share one family and block layout unless
        ``architecture_policy`` is ``"allow"`` (then ``notes`` says what differs)."""
        from . import lora

        opened: list = []
        try:
            for spec in self.sources:
                opened.append(mio.SafetensorsFile(spec.path) if spec.source is None
                              else spec.source.open(spec.space))
            weights = [s for s in opened if not s.arch.startswith("lora")]
            named = [(s.path if hasattr(s, "path") else s.name, s.arch, _canonical_keys(s)) for s in weights]
            self.notes = mio.check_same_architecture(named, architecture_policy)
            base = next((FileSource(s) if isinstance(s, mio.SafetensorsFile) else s for s in weights), None)
            for i, (spec, item) in enumerate(zip(self.sources, opened, strict=True)):
                if isinstance(item, mio.SafetensorsFile):
                    lora_file = item.arch.startswith("lora")
                    opened[i] = lora.LoraSource(item, base, spec.fingerprint) if lora_file \
                        else FileSource(item, spec.space, spec.fingerprint)
        except BaseException:
            for item in opened:
                item.close()
            raise
        self.fingerprints = [s.fingerprint for s in opened]
        self.keys = frozenset().union(*(s.keys() for s in opened))
        return opened

    def related(self, step: Call, key: str, arch: str) -> tuple[str, ...]:
        """The keys a ``related=`` method reads to evaluate ``key`` (merge/method_registry.py)."""
        return step.method.related(key, arch, self.keys)

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

    def key_id(self, step: Any, key: str, arch: str) -> tuple:
        """What ``step``'s result for ``key`` depends on: the methods, their parameters resolved for this
        key, the inputs' fingerprints (set by ``open_sources``) at every key a ``related=`` method reads
        and, for random methods only, the merge seed. Equal ids give equal results under equal merge
        policies, which the caller adds."""
        if isinstance(step, Leaf):
            return ("leaf", self.fingerprints[step.index], key)
        if not isinstance(step, Call):
            return ("value", step)
        if step.method.related is not None:
            args = tuple(tuple((k, self.key_id(arg, k, arch)) for k in self.related(step, key, arch))
                         for arg in step.args)
        else:
            args = tuple(self.key_id(arg, key, arch) for arg in step.args)
        params = tuple((name, self.key_id(v, key, arch) if isinstance(v, Call) else self.scalar(v, key, arch))
                       for name, v in step.kwargs.items())
        passed = _passed_input(step.method, args, params)
        return passed if passed is not None else (step.method.name, args, params,
                                                  self.seed if step.method.random else None)


def _passed_input(method: Any, args: tuple, params: tuple) -> tuple | None:
    """The id of the input a call gives back unchanged for this key, as its method declares
    (``passes_input``, merge/method_registry.py: weighted_sum at alpha 0 returns a, at 1 b, and of two equal
    inputs that input), or None. So the cells of a merge grid whose alpha leaves a key at an input (a
    block preset's 0 blocks) share that key's id: its cached result, and Merge Grid leaves it in the model
    instead of writing it again. A parameter given per key as a tensor (a param-space call) never passes."""
    if method.passes_input is None or any(isinstance(value, tuple) for _, value in params):
        return None
    values = {spec.name: spec.default for spec in method.params} | dict(params)
    index = method.passes_input(values, len(args) > 1 and len(set(args)) == 1)
    return None if index is None else args[index]


def _canonical_keys(source: Any) -> list[str]:
    return source.canonical_keys() if isinstance(source, mio.SafetensorsFile) else source.keys()


class FileSource:
    """A model file used as an input, in weight space unless the recipe says otherwise."""

    def __init__(self, file: mio.SafetensorsFile, space: str = "weight",
                 fingerprint: tuple | None = None) -> None:
        self.file, self.space, self.arch = file, space, file.arch
        self.name = file.path.name
        self.path = file.path
        self._keys = {file.canonical(k): k for k in file.tensors}
        self.fingerprint = fingerprint or file_fingerprint(file.path)

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

    def map(self, key: str, first: int | None = None, last: int | None = None):
        """``key`` (or elements ``first:last``) read in place from the file (``SafetensorsFile.map``)."""
        return self.file.map(self._keys[key], first, last)

    def tensor(self, key: str):
        """A fresh copy of ``key`` in its stored dtype."""
        return self.file.read(self._keys[key])

    def close(self) -> None:
        self.file.close()


def compile_recipe(recipe: Any, search_dirs: tuple[Path, ...] = (), cache: Any = None,
                   resolve: Callable[[str], Any] | None = None, seed: int = 0) -> CompiledRecipe:
    """Compile a closed recipe into steps; model paths are resolved against cwd, then ``search_dirs``,
    or by ``resolve(path)`` when given (a ``Path``, or a source object such as a ``MemorySource``); a
    ``SourceNode`` brings its source object itself.

    Model inputs are deduplicated into source indices, files by path and source objects by fingerprint
    (``resolve`` is ``MergeRuntime.resolve``: the ComfyUI nodes map folder names to files; a graph MODEL
    is a ``SourceNode``, merge/sources.py), method names are looked up in the registry, scalars stay
    numbers and map literals stay ``LiteralNode``s that ``CompiledRecipe.scalar`` resolves per key
    (``check_maps`` resolves them against every planned key at plan time, so that a recipe that
    validates merges). A param-space call given as a
    parameter (``alpha=train_difference_mask(a, b, c)``) is a ``Call`` in ``kwargs``, evaluated per key
    like a tensor input. Unbound ``FreeInput``/``ParamNode`` nodes are refused here with the names to
    bind. ``CompiledRecipe.key_id`` names what one key's result of a step depends on, for the cache
    (merge/cache.py).

    ``cache``: a dict, or a ``MergeCache`` (merge/cache.py), the caller keeps between merges; each method
    call gets the per-key caches stored under (method, its tensor inputs), so a call whose scalars
    changed (``rotate`` with a new ``alpha``) finds the work of the previous merge. None: fresh caches.
    """
    sources: list[SourceSpec] = []
    index: dict[Any, int] = {}
    memo: dict[int, Any] = {}

    def leaf(node: ModelNode) -> Leaf:
        if isinstance(node, SourceNode):
            target = node.source
        elif resolve is not None:
            target = resolve(node.path)
        else:
            target = resolve_path(Path(node.path), search_dirs)
        ident = target if isinstance(target, Path) else ("source", target.fingerprint)
        if ident not in index:
            index[ident] = len(sources)
            is_file = isinstance(target, Path)
            sources.append(SourceSpec(target if is_file else None, node.space, None if is_file else target,
                                      file_fingerprint(target) if is_file else target.fingerprint))
        return Leaf(index[ident])

    def visit(node: Any) -> Any:
        if id(node) in memo:
            return memo[id(node)]
        if isinstance(node, ModelNode):
            step: Any = leaf(node)
        elif isinstance(node, CallNode):
            method = _method_of(node)
            step = Call(method, tuple(visit(a) for a in node.args), {k: visit(v) for k, v in node.kwargs})
            if cache is not None:
                step.cache = _call_cache(cache, node, step, sources)
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
    if isinstance(root, Call) and root.method.returns is not None:
        raise RecipeError((root.method.name,), f"gives one {root.method.returns.__name__} per key: a "
                                               f"recipe's result must be a tensor recipe")
    return CompiledRecipe(root, sources, seed=seed)


def _call_cache(cache: Any, node: CallNode, step: Call, sources: list[SourceSpec]) -> Any:
    """The method caches of one call site: keyed by the method and its tensor inputs, not its scalars."""
    if isinstance(cache, dict):
        return cache.setdefault((node.method, node.args), {})
    return cache.method_store((node.method, _inputs_id(step.args, sources)))


def _inputs_id(args: tuple, sources: list[SourceSpec]) -> tuple:
    out = []
    for arg in args:
        if isinstance(arg, Leaf):
            out.append(sources[arg.index].fingerprint)
        elif isinstance(arg, Call):
            params = tuple((k, v if not isinstance(v, Call) else _inputs_id((v,), sources))
                           for k, v in arg.kwargs.items())
            out.append((arg.method.name, _inputs_id(arg.args, sources), params))
        else:
            out.append(arg)
    return tuple(out)


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


def check_maps(graph: CompiledRecipe, arch: str, keys: list[str]) -> None:
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


def models_arch(recipe: Any, search_dirs: tuple[Path, ...] = (), resolve: Callable[[str], Any] | None = None
                ) -> str | None:
    """The architecture of a recipe's weight inputs when they can be opened (headers only), else None;
    printing block maps in sd-mecha's form needs it."""
    try:
        sources = compile_recipe(recipe, search_dirs, resolve=resolve).open_sources()
    except (ValueError, OSError):
        return None
    try:
        return next((s.arch for s in sources if s.space == "weight"), sources[0].arch)
    finally:
        for source in sources:
            source.close()
