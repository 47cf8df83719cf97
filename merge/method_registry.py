"""The merge-method registry: one decorator (``@merge_method``), signatures checked at registration,
duplicates refused with "did you mean", scoped for tests. Importing it registers the built-in methods
(merge/methods/, declared through merge/declare.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import declare
from .context import KeyContext
from .declare import (  # noqa: F401  (re-exported: user methods annotate with these)
    AnyGroup,
    AnySpace,
    Count,
    Delta,
    Fraction,
    Param,
    PassesInput,
    Range,
    Related,
    Space,
    Weight,
    WeightGroup,
)
from .names import ANY, PARAM, did_you_mean

SCALAR_TYPES: tuple[type, ...] = (float, int, bool, str)


class MethodDefinitionError(TypeError):
    """A function handed to ``@merge_method`` does not follow the method contract."""


class UnknownMethodError(KeyError):
    """``get(name)`` found no such method; the message suggests the nearest names."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class InputSpec:
    name: str
    space: str
    variadic: bool = False
    group: bool = False


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: type
    default: Any
    optional: bool = False
    range: Range | None = None

    def out_of_range(self, value: object) -> str | None:
        """Why an accepted ``value`` is still refused (not finite, outside the range), or None."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if not math.isfinite(value):
            return "is not a finite number"
        if self.range is not None and not self.range.low <= value <= self.range.high:
            return f"is outside [{self.range.low:g}, {self.range.high:g}], the range of {self.name}"
        return None

    def accepts(self, value: object) -> bool:
        """Whether a scalar ``value`` fits this parameter (an int fits a float, a bool fits nothing else)."""
        if value is None:
            return self.optional
        if self.type is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.type is int:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, self.type)


@dataclass(frozen=True)
class MergeMethod:
    """A registered method: its name, one-line doc, paper link, typed specs and callable."""

    name: str
    doc: str
    paper: str | None
    inputs: tuple[InputSpec, ...]
    params: tuple[ParamSpec, ...]
    output: str
    fn: Callable[..., Any]
    accepts_missing: bool = False
    elementwise: bool = False
    random: bool = False
    related: Related | None = None
    returns: type | None = None  # int or str: one such value per key (output space param), not a tensor
    passes_input: PassesInput | None = None  # which input it returns unchanged (merge_method)

    @property
    def variadic(self) -> bool:
        return any(spec.variadic for spec in self.inputs)

    def param(self, name: str) -> ParamSpec:
        for spec in self.params:
            if spec.name == name:
                return spec
        raise KeyError(f"{self.name} has no parameter {name!r}{did_you_mean(name, self.param_names())}; "
                       f"parameters: {', '.join(self.param_names()) or 'none'}")

    def param_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.params)

    def input_space(self, index: int) -> str:
        """The merge space of the ``index``-th positional tensor (variadic inputs repeat)."""
        if index < len(self.inputs):
            return self.inputs[index].space
        return self.inputs[-1].space


_REGISTRY: dict[str, MergeMethod] = {}


def merge_method(fn: Callable[..., Any] | None = None, *, name: str | None = None, paper: str | None = None,
                 accepts_missing: bool = False, elementwise: bool = False, random: bool = False,
                 related: Related | None = None, passes_input: PassesInput | None = None) -> Any:
    """Register ``fn`` as a merge method; usable bare (``@merge_method``) or with options.

    ``name`` defaults to the function name; ``paper`` is a URL shown in the methods table;
    ``accepts_missing`` makes the executor pass ``None`` for inputs that lack the key;
    ``elementwise`` declares that output element i depends only on element i of the inputs, with
    no randomness, so the executor may evaluate the method slice by slice; ``random`` that it draws
    random numbers from ``ctx.seed``; ``related`` that it reads other keys, ``passes_input`` which input
    it returns unchanged for given parameters.
    Raises ``MethodDefinitionError`` for a bad signature or an already registered name.

    A merge method evaluates ONE key. Its positional parameters are tensor inputs annotated with a
    merge space (``Weight``, ``Delta``, ``Param`` or ``AnySpace``; ``*models: Weight`` for a variadic
    input), its keyword-only parameters are scalars (``float``, ``int``, ``bool``, ``str``, optionally
    ``| None``) with defaults, and it may take a keyword-only ``ctx: KeyContext``. A numeric parameter
    may carry its range (``Fraction``, ``Count`` or ``Annotated[float, Range(lo, hi)]``); recipes are
    checked against it when they are built, and every float must be finite. The return annotation
    gives the output space (``AnySpace`` = the space of the ``AnySpace`` inputs).

    The executor calls ``method.fn(*tensors, **scalars, ctx=KeyContext(...))``; ``fn`` always accepts
    ``ctx`` even when the decorated function does not declare it. ``elementwise=True`` lets it call
    ``fn`` on slices of the tensors. ``random=True`` says the method draws random numbers (from
    ``ctx.seed`` / ``ctx.generator()``): only such methods see the merge seed (the others get 0), so
    only their results, and what is computed from them, are cached per seed.

    A method that needs other keys than the one it evaluates (``exchange_ema`` reads the EMA copy of a
    key, ``balance_attention`` the q, k, v and o of one attention layer) is registered with
    ``related=fn``: ``fn(key, arch, keys)`` names the keys it reads (``keys`` are every input's keys),
    and each tensor input, annotated ``WeightGroup`` / ``AnyGroup``, arrives as a dict from those keys
    to that input's tensor (a key the input lacks is absent). It returns the tensor of ``ctx.key`` alone.

    A method that gives back one of its inputs unchanged for some parameters (``weighted_sum`` at alpha
    0 or 1, or of two equal inputs) says so with ``passes_input=fn``: ``fn(params, same_inputs)`` gets
    the call's scalar parameters resolved for a key (defaults filled in) and whether every tensor input
    is the same, and returns the index of the input returned, or None. The cache ids
    (``CompiledRecipe.key_id``) of such a call are its input's, so a merge grid's variants share the keys a
    parameter leaves at an input.

    A method annotated ``-> int`` (or ``-> str``) returns one number per key instead of a tensor
    (``get_rank_from_ratio``): it is a param-space call that only a parameter of that type takes
    (``truncate_rank(d, rank=get_rank_from_ratio(d))``), never a tensor input or a recipe's result.

    Importing this module registers the built-in methods (merge/methods/, imported at its end); a
    built-in module that fails to import fails this import too, so no caller sees methods missing.
    """
    def register(func: Callable[..., Any]) -> MergeMethod:
        method = _build(func, name or func.__name__, paper, accepts_missing, elementwise, random, related,
                        passes_input)
        if method.name in _REGISTRY:
            raise MethodDefinitionError(
                f"merge method {method.name!r} is already registered; pick another name "
                f"(or register inside registry.scope() in tests)")
        _REGISTRY[method.name] = method
        return method

    return register(fn) if fn is not None else register


def get(name: str) -> MergeMethod:
    """The method registered as ``name``; a miss raises ``UnknownMethodError`` with suggestions."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(
            f"unknown merge method {name!r}{did_you_mean(name, _REGISTRY)}; "
            f"list them with `patchbay_merge.py methods` (Python: registry.all_methods())") from None


def all_methods() -> tuple[MergeMethod, ...]:
    """Every registered method, sorted by name."""
    return tuple(_REGISTRY[key] for key in sorted(_REGISTRY))


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Undo every registration made inside the block (tests register throwaway methods here)."""
    saved = dict(_REGISTRY)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


# ---- signature checking ---------------------------------------------------------------------------

def _build(func: Callable[..., Any], name: str, paper: str | None, accepts_missing: bool,
           elementwise: bool, random: bool = False, related: Related | None = None,
           passes_input: PassesInput | None = None) -> MergeMethod:
    where = f"merge method {name!r} ({func.__module__}.{func.__qualname__})"
    if not name.isidentifier():
        raise MethodDefinitionError(f"{where}: the name must be an identifier")
    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except Exception as exc:  # noqa: BLE001 - any failure to resolve annotations is a definition error
        raise MethodDefinitionError(f"{where}: cannot resolve annotations: {exc}") from exc
    inputs: list[InputSpec] = []
    params: list[ParamSpec] = []
    takes_ctx = False
    for p in inspect.signature(func).parameters.values():
        if p.name == "ctx" and p.kind is p.KEYWORD_ONLY:
            takes_ctx = True
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL):
            inputs.append(_input_spec(where, p, hints))
        elif p.kind is p.KEYWORD_ONLY:
            params.append(_param_spec(where, p, hints))
        else:
            raise MethodDefinitionError(f"{where}: **{p.name} is not allowed; declare each scalar by name")
    if not inputs:
        raise MethodDefinitionError(f"{where}: needs at least one tensor input")
    if any(spec.variadic for spec in inputs[:-1]):
        raise MethodDefinitionError(f"{where}: the variadic input must come last")
    if "return" not in hints:
        raise MethodDefinitionError(f"{where}: annotate the return with a merge space (Weight, Delta, ...)")
    returns = hints["return"] if hints["return"] in (int, str) else None
    output = PARAM if returns is not None else _space_of(hints["return"])
    if output is None:
        raise MethodDefinitionError(f"{where}: the return annotation must be a merge space (or int / str "
                                    f"for one value per key), got {hints['return']!r}")
    if output == ANY and all(spec.space != ANY for spec in inputs):
        raise MethodDefinitionError(f"{where}: returns AnySpace but has no AnySpace input to take it from")
    doc = (inspect.getdoc(func) or "").strip().splitlines()
    if not doc:
        raise MethodDefinitionError(f"{where}: give it a docstring; its first line is the method's doc")
    if random and elementwise:
        raise MethodDefinitionError(f"{where}: a random method cannot be elementwise (its slices would "
                                    f"draw differently from the whole tensor)")
    _check_groups(where, inputs, related, elementwise or accepts_missing)
    if passes_input is not None and not callable(passes_input):
        raise MethodDefinitionError(f"{where}: passes_input must be a function (params, same_inputs) -> "
                                    f"the index of the input returned unchanged, or None")
    return MergeMethod(name, doc[0], paper, tuple(inputs), tuple(params), output,
                       func if takes_ctx else _drop_ctx(func), accepts_missing, elementwise, random, related,
                       returns, passes_input)


def _check_groups(where: str, inputs: list[InputSpec], related: Related | None, flagged: bool) -> None:
    """``related`` and group inputs (``WeightGroup`` / ``AnyGroup``) come together, and alone."""
    grouped = {spec.group for spec in inputs}
    if related is not None and grouped != {True}:
        raise MethodDefinitionError(f"{where}: with related=, annotate every tensor input WeightGroup or "
                                    f"AnyGroup (each arrives as a dict key -> tensor)")
    if related is None and True in grouped:
        raise MethodDefinitionError(f"{where}: group inputs (WeightGroup, AnyGroup) need related=, the "
                                    f"function that names the keys they hold")
    if related is not None and flagged:
        raise MethodDefinitionError(f"{where}: a method with related= cannot be elementwise or "
                                    f"accepts_missing (it gets whole tensors of several keys)")


def _input_spec(where: str, p: inspect.Parameter, hints: dict[str, Any]) -> InputSpec:
    space = _space_of(hints.get(p.name))
    group = any(getattr(m, "group", False) for m in getattr(hints.get(p.name), "__metadata__", ()))
    if space is None:
        raise MethodDefinitionError(
            f"{where}: tensor input {p.name!r} must be annotated Weight, Delta, Param or AnySpace "
            f"(WeightGroup or AnyGroup with related=; scalars go after '*' as keyword-only parameters)")
    if p.default is not p.empty:
        raise MethodDefinitionError(f"{where}: tensor input {p.name!r} cannot have a default")
    return InputSpec(p.name, space, p.kind is p.VAR_POSITIONAL, group)


def _param_spec(where: str, p: inspect.Parameter, hints: dict[str, Any]) -> ParamSpec:
    hint = hints.get(p.name)
    bounds = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Range)), None)
    hint = typing.get_args(hint)[0] if bounds is not None else hint
    optional = False
    args = typing.get_args(hint)
    if args and type(None) in args and len(args) == 2:
        optional = True
        hint = next(a for a in args if a is not type(None))
    if hint not in SCALAR_TYPES:
        raise MethodDefinitionError(
            f"{where}: parameter {p.name!r} must be annotated float, int, bool or str "
            f"(optionally '| None'), got {hints.get(p.name)!r}")
    if p.default is p.empty:
        raise MethodDefinitionError(f"{where}: parameter {p.name!r} needs a default value")
    spec = ParamSpec(p.name, hint, p.default, optional, bounds)
    if not spec.accepts(p.default) or spec.out_of_range(p.default):
        raise MethodDefinitionError(
            f"{where}: default {p.default!r} of {p.name!r} is not a {hint.__name__}")
    return spec


def _space_of(hint: Any) -> str | None:
    for meta in getattr(hint, "__metadata__", ()):
        if isinstance(meta, Space):
            return meta.name
    return None


def _drop_ctx(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def call(*tensors: Any, ctx: KeyContext | None = None, **scalars: Any) -> Any:
        return func(*tensors, **scalars)

    return call


# ---- the built-in methods, declared in merge/methods/ (merge/declare.py) -----------------------------


def _load_builtins() -> None:
    """Import merge/methods/ (each module declares its methods) and register them; a module that fails
    to import makes importing the registry fail, every time, rather than leave a registry without its
    methods."""
    try:
        from . import methods  # noqa: F401  (they import merge/declare.py, not this module: no cycle)
    except Exception as error:
        raise ImportError(f"the built-in merge methods failed to load ({type(error).__name__}: {error}); "
                          f"the merge engine cannot run without them: reinstall or fix merge/methods/"
                          ) from error
    for func, options in declare.BUILTINS:
        merge_method(func, **options)


_load_builtins()
