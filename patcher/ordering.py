"""Pure logic of Patchbay's registries: key namespaces, priority order and "did you mean", unit-tested
without ComfyUI.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import InvalidKeyError

__all__ = [
    "DEFAULT_PRIORITY",
    "NAMESPACE",
    "RegistryMeta",
    "did_you_mean",
    "namespaced_key",
    "ordered_keys",
    "reorder_in_place",
    "reorder_registered",
]

NAMESPACE = "patchbay"
DEFAULT_PRIORITY = 0

K = TypeVar("K")


def namespaced_key(name: object, *, verbatim: bool = False) -> str:
    """The key Patchbay registers under: ``patchbay.<name>``, or ``name`` itself if it has a namespace.

    A name with a dot (``mypack.blur``, ``patchbay.trace``) is kept as given; ``verbatim=True`` keeps
    any name as given (to address another pack's key such as AnimateDiff's ``"ADE"``).
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidKeyError(
            f"registration key {name!r} is not a non-empty string; pass a name such as 'my_wrapper' "
            f"(stored as '{NAMESPACE}.my_wrapper') so that exactly this registration can be removed later."
        )
    if verbatim or "." in name:
        return name
    return f"{NAMESPACE}.{name}"


def ordered_keys(keys: Iterable[K], priority: Callable[[K], int]) -> list[K]:
    """``keys`` sorted by descending priority; ties keep their given (insertion) order."""
    indexed = list(enumerate(keys))
    indexed.sort(key=lambda item: (-priority(item[1]), item[0]))
    return [key for _, key in indexed]


def reorder_in_place(mapping: MutableMapping[K, Any], priority: Callable[[K], int]) -> bool:
    """Re-insert ``mapping``'s items in priority order, keeping the dict object; True if it changed.

    ComfyUI keeps wrappers and callbacks in one dict shape, ``{type: {key: [fn, ...]}}``, and runs them
    in insertion order (the first key is the outermost wrapper, the first callback called). Patchbay
    adds an integer priority per key and re-orders that same dict (never a copy that runs elsewhere):
    higher priority runs first (outermost wrapper); equal priorities keep insertion order; keys Patchbay
    did not register (other packs', core's ``None`` key) have priority 0.
    """
    current = list(mapping)
    wanted = ordered_keys(current, priority)
    if wanted == current:
        return False
    items = [(key, mapping[key]) for key in wanted]
    mapping.clear()
    mapping.update(items)
    return True


def closest(name: object, choices: Iterable[str]) -> str | None:
    """The choice closest to ``name`` (case-insensitive), or None; the patcher's one name matcher.

    When two choices differ only in case, the one listed first is suggested.
    """
    if not isinstance(name, str):
        return None
    lowered: dict[str, str] = {}
    for choice in choices:  # the first spelling of a name wins
        lowered.setdefault(choice.lower(), choice)
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[close[0]] if close else None


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest choice (``closest``), or an empty string."""
    near = closest(name, choices)
    return f" Did you mean {near!r}?" if near else ""


@dataclass
class RegistryMeta:
    """Priorities of the keys Patchbay registered, per ``(kind, type, key)``; lives in the attachment.

    ``kind`` is "wrapper" or "callback", ``type`` core's type value (e.g. "outer_sample").
    """

    priorities: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def copy(self) -> RegistryMeta:
        return RegistryMeta(dict(self.priorities))

    def priority(self, kind: str, type_: str, key: object) -> int:
        if not isinstance(key, str):
            return DEFAULT_PRIORITY
        return self.priorities.get((kind, type_, key), DEFAULT_PRIORITY)

    def is_ours(self, kind: str, type_: str, key: object) -> bool:
        return isinstance(key, str) and (kind, type_, key) in self.priorities

    def has_order_for(self, kind: str, type_: str) -> bool:
        return any(k == kind and t == type_ and p != DEFAULT_PRIORITY
                   for (k, t, _), p in self.priorities.items())

    def reorder(self, kind: str, type_: str, mapping: MutableMapping[Any, Any] | None) -> bool:
        """Apply the priorities to core's ``{key: [fn]}`` dict of one type (no-op without priorities)."""
        if not mapping or not self.has_order_for(kind, type_):
            return False
        return reorder_in_place(mapping, lambda key: self.priority(kind, type_, key))


def reorder_registered(model: Any, state: Any, kind: str, type_: str) -> bool:
    """Re-apply the registry priorities kept in ``state.registry`` to one type of ``model``.

    Duck-typed (``state.registry``, ``model.wrappers``/``model.callbacks``) so that the ModelPatcher
    subclass can call it after core's ``add_wrapper_with_key`` without importing the registry.
    """
    meta = getattr(state, "registry", None)
    if not isinstance(meta, RegistryMeta):
        return False
    store = model.wrappers if kind == "wrapper" else model.callbacks
    return meta.reorder(kind, type_, store.get(type_))
