"""Patchbay's per-patcher state on any ModelPatcher, also plain ones that were never upgraded.

The registry, step events and tracing keep their data in the "patchbay" attachment
(``PatchbayState.extras``), which core copies on every clone through ``on_model_patcher_clone``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import comfy.model_patcher

from .errors import NotAModelError
from .model_patcher import ATTACHMENT_KEY, PatchbayState
from .ordering import RegistryMeta

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

__all__ = ["existing_state", "patchbay_state", "registry_meta", "require_model"]


def require_model(model: object) -> ModelPatcher:
    """``model`` if it is a ComfyUI ModelPatcher (the MODEL type), else NotAModelError saying what to pass."""
    if not isinstance(model, comfy.model_patcher.ModelPatcher):
        raise NotAModelError(
            f"expected a MODEL (comfy ModelPatcher), got {type(model).__name__}; pass the MODEL a loader "
            "node returns (or a clone of it)."
        )
    return model


def existing_state(model: ModelPatcher) -> PatchbayState | None:
    """The attachment if ``model`` has one (never creates it)."""
    state = model.get_attachment(ATTACHMENT_KEY)
    return state if isinstance(state, PatchbayState) else None


def patchbay_state(model: ModelPatcher) -> PatchbayState:
    """The Patchbay attachment of any patcher (ours or plain), created on first use.

    On a plain ModelPatcher this adds the attachment to ``model`` itself: call it on a clone you own.
    """
    state = existing_state(model)
    if state is None:
        state = PatchbayState()
        model.set_attachments(ATTACHMENT_KEY, state)
    return state


def registry_meta(model: ModelPatcher) -> RegistryMeta:
    """``extras["registry"]``: the priorities of the keys patcher/registry.py registered."""
    return patchbay_state(model).extras.setdefault("registry", RegistryMeta())
