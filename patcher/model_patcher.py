"""Patchbay's ModelPatcher subclass: core's patcher plus one attachment holding our state, a keyed slot for
hook claimers, and the patch order around weight work. It stays minimal and forward compatible: no
constructor of its own, ``clone`` passes every argument to ``super()``. Data flow: docs/architecture.md.
"""

from __future__ import annotations

import functools
import types
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import comfy.model_patcher
from comfy.hooks import EnumHookType, EnumWeightTarget, HookGroup

from .calls import argument, position, with_argument
from .ordering import reorder_registered
from .patch_order import FULL_LOAD_MODES, PATCH_ORDERS, PatchOrder, lifted_object_patches, resolve_full_load
from .state import PatchbayState, existing_state, patchbay_state, require_model

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

__all__ = ["FULL_LOAD_MODES", "PATCH_ORDERS", "DynamicHookError", "HookClaimer", "PatchbayModelPatcher",
           "PatchbayPatcherMixin", "hook_claimer", "is_upgraded", "set_hook_claimer", "set_patch_order",
           "upgrade"]


class HookClaimer(Protocol):
    """Something that runs some WeightHooks itself, so core never registers them as hook patches."""

    def claim(self, patcher: ModelPatcher, hooks: HookGroup, model_options: dict) -> list[Any]:
        """The hooks of ``hooks`` it runs in this sampling run (set up in ``model_options``)."""

    def for_core(self, patcher: ModelPatcher, hook: Any) -> Any:
        """``hook`` as core should register it, for the hooks it leaves to core."""

    def runs_hooks_on(self, patcher: ModelPatcher) -> bool:
        """Whether it claims hooks on ``patcher`` at all (if not, core needs a non-dynamic delegate)."""



@functools.cache
def _load_naming_full_load(cls: type) -> Callable:
    """The first ``load`` after the mixin in ``cls``'s MRO that takes ``full_load`` by name: core's, or an
    override's that names it (ComfyUI-GGUF's passes ``*args`` on to core's)."""
    mro = cls.__mro__
    for klass in mro[mro.index(PatchbayPatcherMixin) + 1:]:
        function = klass.__dict__.get("load")
        if function is not None and position(types.MethodType(function, object()), "full_load") is not None:
            return types.MethodType(function, object())  # a stand-in self: only its signature is read
    raise TypeError(f"no load method of {cls.__qualname__} takes full_load: this ComfyUI renamed it")


class PatchbayPatcherMixin:
    """Mixed into a ModelPatcher class: the Patchbay attachment, and the patch order around weight work.

    Every override calls core's method through ``super()`` with its arguments passed through.
    """

    def clone(self, *args, **kwargs):
        """Core's clone (through the input class's own); our class again where that one forces its own
        (ComfyUI-GGUF's GGUFModelPatcher.clone sets GGUFModelPatcher on every clone it makes)."""
        clone = super().clone(*args, **kwargs)
        if not isinstance(clone, PatchbayPatcherMixin):
            clone.__class__ = patchbay_class_for(type(clone))
        return clone

    def add_wrapper_with_key(self, wrapper_type, key, wrapper, *args, **kwargs):
        """Core's method, then registry priorities re-applied (so they hold for other packs' keys too)."""
        super().add_wrapper_with_key(wrapper_type, key, wrapper, *args, **kwargs)
        reorder_registered(self, existing_state(self), "wrapper", wrapper_type)

    def add_callback_with_key(self, call_type, key, callback, *args, **kwargs):
        """Core's method, then registry priorities re-applied (see patcher/registry.py)."""
        super().add_callback_with_key(call_type, key, callback, *args, **kwargs)
        reorder_registered(self, existing_state(self), "callback", call_type)

    @property
    def patchbay(self) -> PatchbayState:
        return patchbay_state(self)

    def _own_modules(self) -> AbstractContextManager:
        """For weight_patch_first: the model's own modules in place of installed object patches."""
        if not self.patchbay.order.weights_first:
            return nullcontext()
        return lifted_object_patches(self.model, self.object_patches_backup)

    def load(self, *args, **kwargs):
        """Core's load with the state's full_load applied; every argument passed on as the caller gave
        it (positional or keyword: ComfyUI-GGUF's patcher sets ``force_patch_weights`` by keyword)."""
        names = _load_naming_full_load(type(self))  # where full_load is, by core's signature
        full_load = resolve_full_load(self.patchbay.order.full_load,
                                      argument(names, "full_load", args, kwargs, False))
        args, kwargs = with_argument(names, "full_load", full_load, args, kwargs)
        with self._own_modules():
            return super().load(*args, **kwargs)

    def partially_unload(self, *args, **kwargs):
        with self._own_modules():
            return super().partially_unload(*args, **kwargs)

    def add_patches(self, *args, **kwargs):
        with self._own_modules():
            return super().add_patches(*args, **kwargs)

    def add_hook_patches(self, *args, **kwargs):
        with self._own_modules():
            return super().add_hook_patches(*args, **kwargs)

    def patch_hooks(self, *args, **kwargs):
        with self._own_modules():
            return super().patch_hooks(*args, **kwargs)

    def get_non_dynamic_delegate(self, *args, **kwargs):
        """Under dynamic VRAM (ComfyUI 0.33+), what CFGGuider samples with when the conds carry hooks.

        Core reloads the checkpoint as a plain ModelPatcher, because its hook path rewrites weights. A
        hook claimer (the hook engine) does not: while the claimers run hooks on this model, the dynamic
        patcher itself stays in use, with no second model load. Otherwise the delegate keeps our class.
        """
        claimers = self.patchbay.claimers.values()
        if claimers and all(claimer.runs_hooks_on(self) for claimer in claimers):
            return self
        delegate = super().get_non_dynamic_delegate(*args, **kwargs)
        delegate.__class__ = patchbay_class_for(type(delegate))
        return delegate

    def register_all_hook_patches(self, hooks, target_dict, model_options=None, registered=None,
                                  *args, **kwargs):
        """Core's registration, less the WeightHooks that the hook claimers run.

        Claimed hooks are added to ``registered`` (so core keeps them on the conds) but never become
        hook patches: no weight is swapped for them and ``patches_uuid`` is left alone.
        """
        claimers = list(self.patchbay.claimers.values())
        if not claimers or model_options is None or target_dict.get("target") == EnumWeightTarget.Clip:
            return super().register_all_hook_patches(hooks, target_dict, model_options, registered,
                                                     *args, **kwargs)
        claimed: list = []
        rest = hooks
        for claimer in claimers:
            mine = claimer.claim(self, rest, model_options)
            claimed += mine
            left = HookGroup()
            for hook in rest.hooks:
                if hook not in mine:
                    left.add(claimer.for_core(self, hook))
            rest = left
        if _is_dynamic(self) and rest.get_type(EnumHookType.Weight):
            raise DynamicHookError(
                f"{len(rest.get_type(EnumHookType.Weight))} weight hook(s) cannot run on Patchbay's hook "
                "engine here (the DEBUG log of 'patchbay.hooks' says why) and ComfyUI's own hook path "
                "does not run on a dynamic-VRAM model. Start ComfyUI with --disable-dynamic-vram, or "
                "remove the Fast Hooks node so that ComfyUI reloads the model for its own hook path.")
        registered = super().register_all_hook_patches(rest, target_dict, model_options, registered,
                                                       *args, **kwargs)
        for hook in claimed:
            registered.add(hook)
        return registered


class DynamicHookError(RuntimeError):
    """Hooks that only core's weight-swapping path can run, on a dynamic-VRAM patcher that has none."""


def _is_dynamic(patcher: Any) -> bool:
    """ComfyUI's own test (``ModelPatcher.is_dynamic``, 0.33+; no dynamic VRAM before it)."""
    is_dynamic = getattr(patcher, "is_dynamic", None)
    return bool(is_dynamic and is_dynamic())


class PatchbayModelPatcher(PatchbayPatcherMixin, comfy.model_patcher.ModelPatcher):
    """ComfyUI's ModelPatcher with Patchbay's attachment (same constructor, same clone signature)."""


_MIXED_CLASSES: dict[type, type] = {comfy.model_patcher.ModelPatcher: PatchbayModelPatcher}


def patchbay_class_for(cls: type) -> type:
    """Our class for a patcher class: PatchbayModelPatcher for core's, a mixed subclass for others'."""
    if issubclass(cls, PatchbayPatcherMixin):
        return cls
    if cls not in _MIXED_CLASSES:
        _MIXED_CLASSES[cls] = type(f"Patchbay{cls.__name__}", (PatchbayPatcherMixin, cls), {})
    return _MIXED_CLASSES[cls]


def is_upgraded(model: ModelPatcher) -> bool:
    return isinstance(model, PatchbayPatcherMixin)


def upgrade(model: ModelPatcher) -> ModelPatcher:
    """A fresh clone of ``model`` as a Patchbay patcher; ``model`` itself is left as it was.

    Already-upgraded models are cloned too, so callers may always change the result freely.
    """
    clone = require_model(model).clone()
    clone.__class__ = patchbay_class_for(type(clone))
    _ = clone.patchbay  # create the attachment
    return clone


def set_patch_order(model: ModelPatcher, patch_order: str = "weight_patch_first",
                    full_load: str = "auto") -> ModelPatcher:
    """A Patchbay clone of ``model`` that applies its patches in ``patch_order`` and loads per ``full_load``.

    patch_order: "object_patch_first" (ComfyUI's order) or "weight_patch_first" (LoRAs and hooks
        patch the model's own weights; object patches, e.g. a ``torch.compile``d diffusion_model,
        wrap them). full_load: "auto", "enabled" or "disabled" (see patcher/patch_order.py).
    Raises PatchOrderError (a ValueError) naming the allowed values. ``model`` is not changed. When
    the setting differs from the input's, the clone gets a fresh ``patches_uuid`` (as ``add_patches``
    does), so a model that is already loaded is re-patched in the new order on its next load.
    """
    wanted = PatchOrder(patch_order, full_load)
    previous = existing_state(require_model(model))
    clone = upgrade(model)
    clone.patchbay.order = wanted
    if (previous.order if previous is not None else PatchOrder()) != wanted:
        clone.patches_uuid = uuid.uuid4()
    return clone


def set_hook_claimer(model: ModelPatcher, key: str, claimer: HookClaimer | None) -> None:
    """Put ``claimer`` in ``model``'s keyed slot for hook claimers (None empties the slot).

    ``model`` must be a Patchbay patcher (``upgrade`` returns one); it is changed in place, so call it
    on a clone you own. Later clones share the claimer object.
    """
    if not is_upgraded(require_model(model)):
        raise TypeError(f"hook claimers need a Patchbay patcher, got {type(model).__name__}; "
                        "pass upgrade(model) (a clone) instead.")
    if claimer is None:
        model.patchbay.claimers.pop(key, None)
    else:
        model.patchbay.claimers[key] = claimer


def hook_claimer(model: ModelPatcher, key: str) -> HookClaimer | None:
    """The claimer in ``model``'s slot ``key``, or None (also for a plain ModelPatcher)."""
    state = existing_state(require_model(model))
    return None if state is None else state.claimers.get(key)
