"""Patchbay's ModelPatcher subclass: core's patcher plus one attachment holding our state.

Data flow::

    MODEL (any ModelPatcher, also another pack's subclass)
      --upgrade()--> a fresh clone whose class mixes PatchbayPatcherMixin into the input's class
                     (the input is never changed); attachments["patchbay"] = PatchbayState
    clone(*args, **kwargs)  -> core's clone (it builds ``self.__class__``, so our class survives);
                               core copies the attachment through PatchbayState.on_model_patcher_clone
    patch_model(...)        -> core's patch_model, ordered by PatchbayState.patch_order and
                               PatchbayState.full_load (see patcher/patch_order.py)

The subclass stays minimal and forward compatible: no constructor of its own, ``clone`` passes every
argument to ``super()``, and only our own attachment is copied.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import comfy.model_patcher

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

ATTACHMENT_KEY = "patchbay"

PATCH_ORDERS = ("object_patch_first", "weight_patch_first")
FULL_LOAD_MODES = ("auto", "enabled", "disabled")


@dataclass
class PatchbayState:
    """Everything Patchbay keeps per patcher; copied (not shared) on every clone.

    ``extras`` is a namespaced dict for the other parts of the pack (registry metadata, event and
    trace settings, the hook engine's handles): ``{"registry": ..., "trace": ...}``.
    """

    patch_order: str = "object_patch_first"
    full_load: str = "auto"
    extras: dict[str, Any] = field(default_factory=dict)

    def on_model_patcher_clone(self) -> PatchbayState:
        return PatchbayState(self.patch_order, self.full_load, copy.deepcopy(self.extras))


class PatchbayPatcherMixin:
    """Mixed into a ModelPatcher class; adds nothing but access to the Patchbay attachment."""

    def clone(self, *args, **kwargs):
        return super().clone(*args, **kwargs)

    @property
    def patchbay(self) -> PatchbayState:
        state = self.get_attachment(ATTACHMENT_KEY)
        if state is None:
            state = PatchbayState()
            self.set_attachments(ATTACHMENT_KEY, state)
        return state


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
    if not isinstance(model, comfy.model_patcher.ModelPatcher):
        raise TypeError(
            f"expected a MODEL (comfy ModelPatcher), got {type(model).__name__}; "
            "connect the MODEL output of a loader node."
        )
    clone = model.clone()
    clone.__class__ = patchbay_class_for(type(clone))
    _ = clone.patchbay  # create the attachment
    return clone
