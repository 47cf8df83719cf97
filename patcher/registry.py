"""Wrappers and callbacks by name on any ModelPatcher: keyed, prioritised, checked, inspectable, and
stored in core's own dict so other packs see ours and we see theirs. API: docs/node-authors.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import comfy.patcher_extension

from .errors import DuplicateKeyError, UnknownCallbackTypeError, UnknownWrapperTypeError
from .ordering import DEFAULT_PRIORITY, did_you_mean, namespaced_key
from .signatures import CALLBACK_SHAPES, WRAPPER_SHAPES, check_signature
from .state import ATTACHMENT_KEY, existing_state, patchbay_state, require_model

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

__all__ = [
    "CALLBACK",
    "WRAPPER",
    "Registration",
    "add_callback",
    "add_wrapper",
    "callback_types",
    "describe",
    "remove_callback",
    "remove_wrapper",
    "registrations",
    "resolve_type",
    "scope",
    "set_callback",
    "set_wrapper",
    "wrapper",
    "wrapper_types",
]

WRAPPER = "wrapper"
CALLBACK = "callback"
PATCHER = "patcher"
MODEL_OPTIONS = "model_options"


@dataclass(frozen=True)
class Registration:
    """One key of one wrapper/callback type, as core will run it.

    position: index in the effective run order of its type (0 = outermost wrapper / first callback).
    source: "patcher" (``model.wrappers``/``model.callbacks``) or "model_options"
    (``model_options["transformer_options"]``). ours: registered through this module.
    """

    kind: str
    type: str
    key: str | None
    functions: tuple[Callable, ...]
    priority: int
    position: int
    source: str
    ours: bool


def _enum_values(enum_class: type) -> dict[str, str]:
    return {name: value for name, value in vars(enum_class).items()
            if name.isupper() and isinstance(value, str)}


def wrapper_types() -> dict[str, str]:
    """Core's wrapper types: attribute name -> value (``{"OUTER_SAMPLE": "outer_sample", ...}``)."""
    return _enum_values(comfy.patcher_extension.WrappersMP)


def callback_types() -> dict[str, str]:
    """Core's callback types: attribute name -> value (``{"ON_LOAD": "on_load_after", ...}``)."""
    return _enum_values(comfy.patcher_extension.CallbacksMP)


def _spellings(name: object, known: dict[str, str]) -> list[str]:
    """Choices for "did you mean", in the style of ``name`` (UPPER attribute names or lower values)."""
    upper = isinstance(name, str) and name.isupper()
    return [*known, *known.values()] if upper else [*known.values(), *known]


def resolve_type(kind: str, name: str) -> str:
    """Core's value for a wrapper/callback type given by value or attribute name; typed error otherwise."""
    known = wrapper_types() if kind == WRAPPER else callback_types()
    if name in known.values():
        return name
    if isinstance(name, str) and name.upper() in known:
        return known[name.upper()]
    error = UnknownWrapperTypeError if kind == WRAPPER else UnknownCallbackTypeError
    source = "WrappersMP" if kind == WRAPPER else "CallbacksMP"
    raise error(
        f"unknown {kind} type {name!r}.{did_you_mean(name, _spellings(name, known))} "
        f"Use one of comfy.patcher_extension.{source}: {', '.join(sorted(known.values()))}."
    )


def _store(model: ModelPatcher, kind: str) -> dict[str, dict[Any, list[Callable]]]:
    return model.wrappers if kind == WRAPPER else model.callbacks


def _options_store(model: ModelPatcher, kind: str) -> dict[str, dict[Any, list[Callable]]]:
    options = model.model_options.get("transformer_options", {})
    return options.get("wrappers" if kind == WRAPPER else "callbacks", {})


def _check(kind: str, type_: str, fn: Callable) -> None:
    if kind == WRAPPER:
        check_signature(fn, WRAPPER_SHAPES.get(type_), what=f"wrapper {type_!r}", leading=("executor",))
    else:
        check_signature(fn, CALLBACK_SHAPES.get(type_), what=f"callback {type_!r}")


def _remove(model: ModelPatcher, kind: str, type_: str, key: str) -> bool:
    found = False
    for store in (_store(model, kind), _options_store(model, kind)):
        if key in store.get(type_, {}):
            store[type_].pop(key)
            found = True
    return found


def _add(model: ModelPatcher, kind: str, type_name: str, key: str, fn: Callable, *, priority: int,
         replace: bool, verbatim: bool) -> Registration:
    model = require_model(model)
    type_ = resolve_type(kind, type_name)
    full_key = namespaced_key(key, verbatim=verbatim)
    _check(kind, type_, fn)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority {priority!r} is not an int; pass e.g. priority=10 (higher runs first).")
    existing = _store(model, kind).get(type_, {}).get(full_key)
    if existing and not replace and existing != [fn]:
        setter = "set_wrapper" if kind == WRAPPER else "set_callback"
        raise DuplicateKeyError(
            f"{kind} key {full_key!r} of type {type_!r} already holds {existing!r}; use {setter}(...) to "
            f"replace it, or remove_{kind}(model, {type_!r}, {key!r}) first."
        )
    meta = patchbay_state(model).registry
    meta.priorities[(kind, type_, full_key)] = priority
    if replace or not existing:
        _remove(model, kind, type_, full_key)
        if kind == WRAPPER:
            model.add_wrapper_with_key(type_, full_key, fn)
        else:
            model.add_callback_with_key(type_, full_key, fn)
    meta.reorder(kind, type_, _store(model, kind).get(type_))
    return _lookup(model, kind, type_, full_key)


def add_wrapper(model: ModelPatcher, wrapper_type: str, key: str, fn: Callable, *, priority: int = 0,
                verbatim: bool = False) -> Registration:
    """Register ``fn(executor, *args, **kwargs)`` as a wrapper; idempotent for the same ``fn``.

    Everything is stored where ComfyUI keeps it, so other packs see ours and we see theirs::

        add_wrapper(model, "predict_noise", "blur", fn, priority=10)
          -> model.wrappers["predict_noise"]["patchbay.blur"] = [fn]   (core's own dict, re-ordered)
          -> attachment "patchbay": PatchbayState.registry.priorities[
                 ("wrapper", "predict_noise", "patchbay.blur")] = 10

    - Types: the values of comfy.patcher_extension.WrappersMP / CallbacksMP ("predict_noise") or their
      attribute names ("PREDICT_NOISE"); anything else raises with a "did you mean".
    - Keys: ``patchbay.<name>``, or the caller's own namespaced key (``mypack.name``); ``verbatim=True``
      addresses any key as given (another pack's ``"ADE"``).
    - Order: higher priority runs first (outermost wrapper); ties keep insertion order; other packs' keys
      count as 0. Wrappers other packs put into ``model_options["transformer_options"]`` always run
      outside the patcher's own (core merges them first); ``registrations`` reports that effective order.
    - ``add_*`` is idempotent for the same function and refuses a different one; ``set_*`` replaces
      (remove by key, then add); ``remove_*`` removes every function under the key.

    These functions change ``model`` in place, like core's ``add_wrapper_with_key``: call them on a
    clone you own (``upgrade(model)`` returns one).
    """
    return _add(model, WRAPPER, wrapper_type, key, fn, priority=priority, replace=False, verbatim=verbatim)


def set_wrapper(model: ModelPatcher, wrapper_type: str, key: str, fn: Callable, *, priority: int = 0,
                verbatim: bool = False) -> Registration:
    """Register ``fn`` under ``key``, replacing whatever the key held (remove by key, then add)."""
    return _add(model, WRAPPER, wrapper_type, key, fn, priority=priority, replace=True, verbatim=verbatim)


def add_callback(model: ModelPatcher, callback_type: str, key: str, fn: Callable, *, priority: int = 0,
                 verbatim: bool = False) -> Registration:
    """Register ``fn(patcher, ...)`` as a callback; idempotent for the same ``fn``."""
    return _add(model, CALLBACK, callback_type, key, fn, priority=priority, replace=False, verbatim=verbatim)


def set_callback(model: ModelPatcher, callback_type: str, key: str, fn: Callable, *, priority: int = 0,
                 verbatim: bool = False) -> Registration:
    """Register ``fn`` under ``key``, replacing whatever the key held (remove by key, then add)."""
    return _add(model, CALLBACK, callback_type, key, fn, priority=priority, replace=True, verbatim=verbatim)


def _remove_key(model: ModelPatcher, kind: str, type_name: str, key: str, verbatim: bool) -> bool:
    model = require_model(model)
    type_ = resolve_type(kind, type_name)
    full_key = namespaced_key(key, verbatim=verbatim)
    state = existing_state(model)
    if state is not None:
        state.registry.priorities.pop((kind, type_, full_key), None)
    return _remove(model, kind, type_, full_key)


def remove_wrapper(model: ModelPatcher, wrapper_type: str, key: str, *, verbatim: bool = False) -> bool:
    """Remove every wrapper under ``key`` (patcher and model_options); False if there was none."""
    return _remove_key(model, WRAPPER, wrapper_type, key, verbatim)


def remove_callback(model: ModelPatcher, callback_type: str, key: str, *, verbatim: bool = False) -> bool:
    """Remove every callback under ``key`` (patcher and model_options); False if there was none."""
    return _remove_key(model, CALLBACK, callback_type, key, verbatim)


def wrapper(model: ModelPatcher, wrapper_type: str, key: str, *, priority: int = 0
            ) -> Callable[[Callable], Callable]:
    """Decorator form of ``add_wrapper``: ``@wrapper(model, "predict_noise", "blur")``."""
    def register(fn: Callable) -> Callable:
        add_wrapper(model, wrapper_type, key, fn, priority=priority)
        return fn
    return register


def _entries(model: ModelPatcher, kind: str, type_: str) -> Iterator[tuple[Any, str, list[Callable]]]:
    """(key, source, functions) in the order core merges them for a run (model_options first)."""
    options = _options_store(model, kind).get(type_, {})
    patcher = _store(model, kind).get(type_, {})
    for key, fns in options.items():
        yield key, MODEL_OPTIONS, fns
        if key in patcher:
            yield key, PATCHER, patcher[key]
    for key, fns in patcher.items():
        if key not in options:
            yield key, PATCHER, fns


def registrations(model: ModelPatcher, kind: str | None = None, type: str | None = None
                  ) -> tuple[Registration, ...]:
    """Every registered wrapper/callback key (ours and other packs'), in run order per type.

    kind: "wrapper", "callback" or None for both; type: one type (value or name) or None for all.
    """
    model = require_model(model)
    if kind not in (None, WRAPPER, CALLBACK):
        raise ValueError(f"kind {kind!r} is neither {WRAPPER!r} nor {CALLBACK!r} (or None for both)")
    state = existing_state(model)
    meta = state.registry if state is not None else None
    out: list[Registration] = []
    for k in (WRAPPER, CALLBACK) if kind is None else (kind,):
        types = set(_store(model, k)) | set(_options_store(model, k))
        chosen = sorted(types) if type is None else [resolve_type(k, type)]
        for type_ in chosen:
            position = 0
            for key, source, fns in _entries(model, k, type_):
                priority = meta.priority(k, type_, key) if meta else DEFAULT_PRIORITY
                ours = bool(meta and source == PATCHER and meta.is_ours(k, type_, key))
                out.append(Registration(k, type_, key, tuple(fns), priority, position, source, ours))
                position += len(fns)
    return tuple(out)


def _lookup(model: ModelPatcher, kind: str, type_: str, key: str) -> Registration:
    for registration in registrations(model, kind, type_):
        if registration.key == key and registration.source == PATCHER:
            return registration
    raise LookupError(f"{kind} {key!r} of type {type_!r} vanished right after registration")


def describe(model: ModelPatcher) -> str:
    """A text table of ``registrations(model)`` for logs and bug reports."""
    lines = []
    for r in registrations(model):
        names = ", ".join(getattr(fn, "__qualname__", repr(fn)) for fn in r.functions)
        owner = "patchbay-registry" if r.ours else "other"
        lines.append(f"{r.kind:8} {r.type:28} #{r.position:<2} {r.key!s:32} prio={r.priority:<5} "
                     f"{r.source:13} {owner:17} {names}")
    return "\n".join(lines) if lines else "(no wrappers or callbacks)"


def _snapshot_store(store: dict) -> dict:
    return {t: {k: list(fns) for k, fns in keys.items()} for t, keys in store.items()}


def _restore_store(store: dict, snapshot: dict) -> None:
    store.clear()
    store.update(_snapshot_store(snapshot))


@contextmanager
def scope(model: ModelPatcher) -> Iterator[ModelPatcher]:
    """Undo every wrapper, callback, priority and event listener change made inside the block.

    Restores core's dicts in place (also ``model_options["transformer_options"]`` ones) and the
    Patchbay attachment's fields as they were; meant for tests and temporary instrumentation.
    """
    model = require_model(model)
    options = model.model_options.setdefault("transformer_options", {})
    had_option_stores = {name: name in options for name in ("wrappers", "callbacks")}
    stores = [model.wrappers, model.callbacks, options.setdefault("wrappers", {}),
              options.setdefault("callbacks", {})]
    saved = [_snapshot_store(store) for store in stores]
    state = existing_state(model)
    saved_state = state.on_model_patcher_clone() if state is not None else None
    try:
        yield model
    finally:
        for store, snapshot in zip(stores, saved, strict=True):
            _restore_store(store, snapshot)
        for name, existed in had_option_stores.items():
            if not existed:
                options.pop(name, None)
        if state is None:
            model.remove_attachments(ATTACHMENT_KEY)
        else:
            model.set_attachments(ATTACHMENT_KEY, state)
            state.restore(saved_state)
