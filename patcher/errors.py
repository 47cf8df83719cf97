"""Typed errors of Patchbay's patcher API; each message names the offending value and the fix. Imports
nothing from ComfyUI, so node code and T0 tests can catch them without it.
"""

from __future__ import annotations

__all__ = [
    "DuplicateKeyError",
    "InvalidKeyError",
    "NotAModelError",
    "SignatureMismatchError",
    "UnknownCallbackTypeError",
    "UnknownEventError",
    "UnknownNameError",
    "UnknownWrapperTypeError",
]


class UnknownNameError(ValueError):
    """A wrapper type, callback type or event name that does not exist (the message suggests one)."""


class UnknownWrapperTypeError(UnknownNameError):
    """Not one of comfy.patcher_extension.WrappersMP."""


class UnknownCallbackTypeError(UnknownNameError):
    """Not one of comfy.patcher_extension.CallbacksMP."""


class UnknownEventError(UnknownNameError):
    """Not one of patcher.events.EVENTS."""


class SignatureMismatchError(TypeError):
    """A wrapper, callback or listener that cannot take the arguments ComfyUI (or Patchbay) passes."""


class DuplicateKeyError(ValueError):
    """``add_*`` found a different function under the key; use ``set_*`` to replace it."""


class InvalidKeyError(ValueError):
    """A registration key that is not a non-empty string."""


class NotAModelError(TypeError):
    """Something other than a ComfyUI ModelPatcher (the MODEL type) where one is needed."""
