"""Recipe Hook: a merge recipe minus its base as a core HOOKS value (model-as-LoRA style), so a merge can be
keyframed over the steps and masked per region. Data flow: merge/delta.py, hooks/recipe_hook.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import merge_runtime
from .merge_outputs import CACHE_MB, COMMON_INPUTS, POLICY_INPUTS, RECIPE

if TYPE_CHECKING:
    from comfy.hooks import HookGroup, HookKeyframeGroup


class PatchbayRecipeHook:
    NODE_ID = "PatchbayRecipeHook"
    DISPLAY_NAME = "Recipe Hook (Patchbay)"
    DESCRIPTION = ("A merge as a hook: adds strength x (recipe - base) to the model for the conds that carry "
                   "it, so keyframes can fade a merge in over the steps and masks limit it to a region; each "
                   "weight's difference is merged when sampling first needs it.")
    FUNCTION = "create"
    CATEGORY = "Patchbay/merge/hooks"
    RETURN_TYPES = ("HOOKS",)
    RETURN_NAMES = ("hooks",)
    OUTPUT_TOOLTIPS = ("Hooks for Cond Set Props, Set CLIP Hooks or any node taking HOOKS (with Fast Hooks "
                       "the differences run as forward deltas).",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "recipe": (RECIPE, {"tooltip": "The merge (a method node, recipe text), or a difference "
                                               "(subtract, a LoRA input) with base left unconnected."}),
                "strength_model": ("FLOAT", {"default": 1.0, "min": -20.0, "max": 20.0, "step": 0.01,
                                             "tooltip": "1: the base model becomes the merged model; 0: "
                                                        "unchanged."}),
                "merge_seed": COMMON_INPUTS["merge_seed"],
                "cache_mb": COMMON_INPUTS["cache_mb"],
            },
            "optional": {
                "base": (RECIPE, {"tooltip": "The model the merge is a change of: the checkpoint you "
                                             "sample (a Merge Input node). Needed unless the recipe is a "
                                             "difference."}),
                "prev_hooks": ("HOOKS", {"tooltip": "Optional hooks to add this one to (not changed)."}),
                "hook_kf": ("HOOK_KEYFRAMES", {"tooltip": "Optional schedule for this hook (Patchbay or core "
                                                          "keyframe nodes)."}),
                **POLICY_INPUTS,
            },
        }

    def create(self, recipe: Any, strength_model: float = 1.0, merge_seed: int = 0, cache_mb: int = CACHE_MB,
               base: Any = None, prev_hooks: HookGroup | None = None,
               hook_kf: HookKeyframeGroup | None = None, architecture_policy: str = "refuse") -> tuple:
        return (merge_runtime.recipe_hook(recipe, base, strength_model, keyframes=hook_kf, prev=prev_hooks,
                                          seed=merge_seed, cache_mb=cache_mb,
                                          architecture_policy=architecture_policy),)


NODES = [PatchbayRecipeHook]
