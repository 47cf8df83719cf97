"""Patch order: whether weight patches (LoRAs) see the model's own modules or the object patches over them
(a ``torch.compile``d diffusion_model hides every key from a LoRA), as a per-model setting instead of
a process-wide patch of ``ModelPatcher``. User guide: docs/patch-order.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .ordering import closest

__all__ = [
    "FULL_LOAD_MODES", "PATCH_ORDERS", "PatchOrder", "PatchOrderError", "lifted_object_patches",
    "resolve_full_load",
]

PATCH_ORDERS = ("object_patch_first", "weight_patch_first")
FULL_LOAD_MODES = ("auto", "enabled", "disabled")


class PatchOrderError(ValueError):
    """An option value outside its allowed set; the message names the value, the choices and the fix."""


def _check(option: str, value: object, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    near = closest(str(value), allowed)
    hint = f" (did you mean {near!r}?)" if near else ""
    raise PatchOrderError(f"{option}={value!r} is not allowed{hint}; use one of {', '.join(allowed)}.")


@dataclass(frozen=True)
class PatchOrder:
    """How one model applies its patches.

    patch_order: ``object_patch_first`` (ComfyUI's own order) or ``weight_patch_first`` (weights are
        patched into the model's own modules; object patches such as compiled modules wrap them).
    full_load: ``auto`` (ComfyUI decides), ``enabled`` (always load every layer, ignoring the VRAM
        budget) or ``disabled`` (never force it: layers beyond the budget stay in RAM and are streamed).

    Why: ComfyUI (0.3.75) installs object patches first and then walks the module tree by name to patch
    weights; under a compiled module every name gains ``_orig_mod.``, no LoRA key matches, and the LoRA
    is skipped without a word. KJNodes' PatchModelPatcherOrder fixed this by replacing
    ``ModelPatcher.patch_model`` for every model in the process; Patchbay's patcher reads this setting
    (patcher/model_patcher.py).
    """

    patch_order: str = "object_patch_first"
    full_load: str = "auto"

    def __post_init__(self) -> None:
        _check("patch_order", self.patch_order, PATCH_ORDERS)
        _check("full_load", self.full_load, FULL_LOAD_MODES)

    @property
    def weights_first(self) -> bool:
        return self.patch_order == "weight_patch_first"


def resolve_full_load(mode: str, core_choice: bool) -> bool:
    """The ``full_load`` flag for core's ``load()``: forced on or off, or core's own choice for ``auto``."""
    return {"enabled": True, "disabled": False}.get(_check("full_load", mode, FULL_LOAD_MODES), core_choice)


def _holds_weights(obj: object) -> bool:
    return isinstance(obj, torch.nn.Module) and next(obj.parameters(), None) is not None


def _swap(root: torch.nn.Module, name: str, value: Any) -> Any:
    *parents, leaf = name.split(".")
    owner = root
    for part in parents:
        owner = getattr(owner, part)
    previous = getattr(owner, leaf)
    setattr(owner, leaf, value)
    return previous


@contextmanager
def lifted_object_patches(root: torch.nn.Module, backup: Mapping[str, Any]) -> Iterator[list[str]]:
    """Put the originals of installed object patches back under ``root`` for the duration of the block.

    ``backup`` maps an object patch's dotted name to the object it replaced (ComfyUI's
    ``ModelPatcher.object_patches_backup``: filled while the patches are installed). Only originals
    that hold weights (modules with parameters) are lifted: a compiled UNet or block is, a patched
    ``model_sampling`` is not, so it still moves with the model. The patches go back on exit, in the
    order they were installed. Yields the lifted names.
    """
    names = [name for name, original in backup.items() if _holds_weights(original)]
    installed = {name: _swap(root, name, backup[name]) for name in reversed(names)}
    try:
        yield names
    finally:
        for name in names:
            _swap(root, name, installed[name])
