"""A full per-key delta computed on first use, as a core WeightHook: the Recipe Hook's machinery, so a
merge recipe can be scheduled like a model-as-LoRA hook without merging up front. Knows no merge code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import comfy.hooks
import comfy.model_management
import comfy.weight_adapter
import torch

from .lora_hooks import combine

__all__ = ["LazyDelta", "RecipeMismatchError", "RecipeWeightHook", "recipe_hook"]

Fetch = Callable[[str], "torch.Tensor | None"]


class RecipeMismatchError(ValueError):
    """A recipe hook used on a model whose weights are not the recipe's (another architecture)."""


class LazyDelta(comfy.weight_adapter.WeightAdapterBase):
    """``strength * fetch(key)`` added to one weight; ``linear_in_strength`` tells Fast Hooks one delta
    serves every strength."""

    name = "patchbay_lazy_delta"
    linear_in_strength = True

    def __init__(self, fetch: Fetch, key: str, shape: tuple[int, ...]) -> None:
        self.fetch, self.key, self.shape = fetch, key, tuple(shape)
        self.loaded_keys: set[str] = set()
        self.weights: list[torch.Tensor] = []

    def calculate_shape(self, key: str) -> None:
        return None  # never changes the weight's shape (ComfyUI 0.33 asks)

    def calculate_weight(self, weight: torch.Tensor, key: str, strength: float, strength_model: float,
                         offset: Any, function: Callable | None,
                         intermediate_dtype: torch.dtype = torch.float32, original_weight: Any = None
                         ) -> torch.Tensor:
        if tuple(weight.shape) != self.shape:
            raise RecipeMismatchError(f"recipe hook: {key} is {list(weight.shape)} in the model but "
                                      f"{list(self.shape)} in the recipe; use the hook with the model "
                                      f"architecture the recipe was made for")
        if strength == 0:  # a keyframe at 0 (core's path scales the patch): nothing to merge yet
            return weight
        delta = self.fetch(self.key)
        if delta is None:
            return weight
        function = function or (lambda a: a)
        delta = comfy.model_management.cast_to_device(delta, weight.device, weight.dtype)
        weight += function(strength * delta)
        return weight


class RecipeWeightHook(comfy.hooks.WeightHook):
    """A WeightHook that refuses a model whose weights are not the recipe's (see check_model)."""

    def __init__(self, strength_model: float = 1.0, strength_clip: float = 1.0) -> None:
        super().__init__(strength_model=strength_model, strength_clip=strength_clip)
        self.label = "recipe"

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise RecipeMismatchError unless every key of the hook is a weight of ``model`` (a BaseModel)
        with the recipe's shape."""
        if not self.weights:
            return
        state = model.state_dict()
        bad = [key for key, patch in self.weights.items()
               if key not in state or tuple(state[key].shape) != patch.shape]
        if bad:
            key = bad[0]
            found = list(state[key].shape) if key in state else "missing"
            raise RecipeMismatchError(
                f"recipe hook {self.label}: {len(bad)} of its {len(self.weights)} weights do not fit "
                f"{type(model).__name__} (e.g. {key}: {found} in the model, "
                f"{list(self.weights[key].shape)} in the recipe); the recipe was made for another model "
                f"architecture: use it on that model, or merge models of this one")

    def add_hook_patches(self, model: Any, model_options: dict, target_dict: dict, registered: Any) -> bool:
        if target_dict.get("target") != comfy.hooks.EnumWeightTarget.Clip:
            self.check_model(model.model)
        return super().add_hook_patches(model, model_options, target_dict, registered)

    def clone(self) -> RecipeWeightHook:
        c = super().clone()
        c.label = self.label
        return c


def recipe_hook(fetch: Fetch, shapes: dict[str, tuple[int, ...]], strength_model: float,
                keyframes: comfy.hooks.HookKeyframeGroup | None = None,
                prev: comfy.hooks.HookGroup | None = None, name: str | None = None) -> comfy.hooks.HookGroup:
    """``prev``'s hooks plus a recipe hook adding ``strength_model * fetch(key)`` to each model key of
    ``shapes``, scheduled by ``keyframes``; ``name`` is its hook_id and appears in its errors.

    A recipe hook is core's model-as-LoRA hook with deltas that are not in memory yet::

        recipe_hook(fetch, shapes, strength, keyframes, prev, name) -> HookGroup
          one RecipeWeightHook (a core WeightHook: keyframes, masks, Cond Set Props, core's hook nodes)
          .weights = {model key: LazyDelta(fetch, key)}        need_weight_init False, like model-as-LoRA
        LazyDelta: a weight adapter (comfy.weight_adapter) whose calculate_weight adds
          ``strength * fetch(key)``; fetch runs when the weight is first needed, never at hook creation
          core's hook path   patch_hooks -> calculate_weight -> LazyDelta (per key it patches)
          Fast Hooks         a dense delta (hooks/delta_plan.py; linear in strength: fetched once at
                             strength 1,
                             scaled per step), kept in the engine's byte-budgeted cache
        RecipeWeightHook.check_model(model): before either path patches anything, every key of the
          recipe must be a weight of the model with the same shape, else RecipeMismatchError (core's
          hook path would silently skip keys the model lacks).

    ``fetch(key) -> fp32 tensor | None`` comes from the node layer (a merge session); None leaves the key
    unchanged.
    """
    hook = RecipeWeightHook(strength_model=strength_model, strength_clip=0.0)
    hook.weights = {key: LazyDelta(fetch, key, shape) for key, shape in shapes.items()}
    hook.weights_clip = {}  # model only: on a CLIP (Set CLIP Hooks) the hook patches nothing
    hook.need_weight_init = False
    hook.label = repr(name) if name else "recipe"
    hook.hook_id = name
    group = comfy.hooks.HookGroup()
    group.add(hook)
    if keyframes is not None:
        group.set_keyframes_on_hooks(keyframes)
    return combine(prev, group)
