"""Core's arguments by name, read from the signature of the function ComfyUI is calling, so a wrapper
that reads them this way keeps working when a new ComfyUI inserts a parameter (which wrappers do:
docs/architecture.md, A MODEL upgraded).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["argument", "position", "with_argument"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@functools.lru_cache(maxsize=256)
def _positions(function: Callable, bound: bool) -> dict[str, int]:
    names = [p.name for p in inspect.signature(function).parameters.values() if p.kind in _POSITIONAL]
    return {name: index for index, name in enumerate(names[1:] if bound else names)}


def position(function: Callable, name: str) -> int | None:
    """Where ``function`` (plain or bound: ``self`` not counted) takes ``name`` positionally, or None
    when it takes it only by keyword (or not at all).

    Pure: stdlib ``inspect`` only. Signatures are read once per function (a bound method by its function,
    so no model is kept alive by the cache).
    """
    inner = getattr(function, "__func__", None)
    positions = _positions(inner, True) if inner is not None else _positions(function, False)
    return positions.get(name)


def argument(function: Callable, name: str, args: tuple, kwargs: dict, default: Any = None) -> Any:
    """The value of parameter ``name`` in a call ``function(*args, **kwargs)``, or ``default``."""
    index = position(function, name)
    if index is not None and len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def with_argument(function: Callable, name: str, value: Any, args: tuple,
                  kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the same call with ``name`` set to ``value``, where the caller passed it
    (by position or keyword; by keyword when it was not passed)."""
    index = position(function, name)
    if index is not None and len(args) > index:
        return (*args[:index], value, *args[index + 1:]), kwargs
    return args, {**kwargs, name: value}
