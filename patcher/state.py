"""Patchbay's per-patcher state (attachments["patchbay"]) on any ModelPatcher, also plain ones never
upgraded; each field has its clone policy next to it, and the fields belong to the package's modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import comfy.model_patcher

from .errors import NotAModelError
from .ordering import RegistryMeta
from .patch_order import PatchOrder

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

    from .events import ListenerTable

__all__ = ["ATTACHMENT_KEY", "PatchbayState", "existing_state", "patchbay_state", "require_model"]

ATTACHMENT_KEY = "patchbay"


@dataclass
class PatchbayState:
    """Everything Patchbay keeps per patcher (``patchbay_state``: attachments["patchbay"], made on first
    use); core's clone gives the clone what each field's policy, written next to it, says.

    The fields belong to the other modules of the package: ``order`` to patch_order.py (read by
    model_patcher.py), ``registry`` to registry.py, ``events`` to events.py, ``claimers`` to whoever claims
    weight hooks at registration (the hook engine, hooks/enable.py, through ``set_hook_claimer``).
    """

    order: PatchOrder = PatchOrder()
    """clone: the same value (immutable, validated when it is made)."""
    registry: RegistryMeta = field(default_factory=RegistryMeta)
    """clone: a copy, so a clone's priorities change without touching its source's."""
    events: ListenerTable | None = None
    """clone: a copy of the table, holding the same listener functions (None: no listener yet)."""
    claimers: dict[str, Any] = field(default_factory=dict)
    """clone: the same claimer objects in a new dict; a claimer's caches serve every clone."""

    def on_model_patcher_clone(self) -> PatchbayState:
        """Called by core's ``ModelPatcher.clone`` for every attachment that has it."""
        return PatchbayState(order=self.order, registry=self.registry.copy(),
                             events=None if self.events is None else self.events.copy(),
                             claimers=dict(self.claimers))

    def restore(self, saved: PatchbayState) -> None:
        """Take every field from ``saved`` (a clone of this state made earlier), in place."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(saved, f.name))


def require_model(model: object) -> ModelPatcher:
    """``model`` if it is a ComfyUI ModelPatcher (the MODEL type), else NotAModelError saying what to pass."""
    if not isinstance(model, comfy.model_patcher.ModelPatcher):
        raise NotAModelError(
            f"expected a MODEL (comfy ModelPatcher), got {type(model).__name__}; connect the MODEL output "
            "of a loader node (or pass a clone of one)."
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
