"""What a merge method's signature is written with (merge spaces, ranges, ``PassesInput``) and
``builtin_method``, the decorator of merge/methods/: the methods import this leaf, not the registry, so
the registry imports them without an import cycle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import torch

from .names import ANY, DELTA, PARAM, WEIGHT


@dataclass(frozen=True)
class Space:
    """The merge space an annotation stands for (merge/names.py), read by the registry."""

    name: str
    group: bool = False  # the input is a dict key -> tensor of the keys ``related`` names


Weight = Annotated[torch.Tensor, Space(WEIGHT)]
Delta = Annotated[torch.Tensor, Space(DELTA)]
Param = Annotated[torch.Tensor, Space(PARAM)]
AnySpace = Annotated[torch.Tensor, Space(ANY)]
WeightGroup = Annotated[dict[str, torch.Tensor], Space(WEIGHT, group=True)]
AnyGroup = Annotated[dict[str, torch.Tensor], Space(ANY, group=True)]
Related = Callable[[str, str, frozenset[str]], tuple[str, ...]]  # (key, arch, every input key) -> keys read
# (scalar parameters resolved for a key, every tensor input the same) -> the input returned unchanged, or None
PassesInput = Callable[[dict[str, Any], bool], int | None]


@dataclass(frozen=True)
class Range:
    """The closed interval a numeric parameter must lie in: ``k: Annotated[float, Range(0, 1)] = 0.2``."""

    low: float = -math.inf
    high: float = math.inf


Fraction = Annotated[float, Range(0.0, 1.0)]  # a probability or a share, 0 to 1
Count = Annotated[int, Range(0)]  # a rank or an iteration count, 0 or more

BUILTINS: list[tuple[Callable[..., Any], dict[str, Any]]] = []  # (function, registry options), in order


def builtin_method(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Declare a built-in merge method; ``options`` are ``registry.merge_method``'s. The function is
    returned unchanged (call it directly); the registry checks and registers it on import."""
    def declare(func: Callable[..., Any]) -> Callable[..., Any]:
        BUILTINS.append((func, options))
        return func

    return declare(fn) if fn is not None else declare
