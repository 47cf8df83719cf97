"""Recipe Hook: a merge recipe minus its base as a core HOOKS value (model-as-LoRA style), so a merge can be
keyframed over the steps and masked per region. Data flow: docs/architecture.md (Recipe Hook)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from comfy_api.latest import io

from ..comfy_merge import runtime
from . import v3
from .merge_outputs import CACHE_MB, policy_input, seed_and_cache_inputs

if TYPE_CHECKING:
    from comfy.hooks import HookGroup, HookKeyframeGroup


class PatchbayRecipeHook(v3.Node):
    NODE_ID = "PatchbayRecipeHook"
    DISPLAY_NAME = "Recipe Hook (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category="Patchbay/merge/hooks",
            description=("A merge as a hook: adds strength x (recipe - base) to the model for the conds that "
                         "carry it, so keyframes can fade a merge in over the steps and masks limit it to a "
                         "region; each weight's difference is merged when sampling first needs it."),
            inputs=[
                v3.RECIPE.Input("recipe", tooltip="The merge (a method node, recipe text), or a difference "
                                                  "(subtract, a LoRA input) with base left unconnected."),
                io.Float.Input("strength_model", default=1.0, min=-20.0, max=20.0, step=0.01,
                               tooltip="1: the base model becomes the merged model; 0: unchanged."),
                *seed_and_cache_inputs(),
                v3.RECIPE.Input("base", optional=True,
                                tooltip="The model the merge is a change of: the checkpoint you sample (a "
                                        "Merge Input node). Needed unless the recipe is a difference."),
                io.Hooks.Input("prev_hooks", optional=True,
                               tooltip="Optional hooks to add this one to (not changed)."),
                io.HookKeyframes.Input("hook_kf", optional=True,
                                       tooltip="Optional schedule for this hook (Patchbay or core keyframe "
                                               "nodes)."),
                policy_input(),
            ],
            outputs=[v3.output(io.Hooks, "hooks",
                               "Hooks for Cond Set Props, Set CLIP Hooks or any node taking HOOKS (with Fast "
                               "Hooks the differences run as forward deltas).")])

    @classmethod
    def execute(cls, recipe: Any, strength_model: float = 1.0, merge_seed: int = 0, cache_mb: int = CACHE_MB,
                base: Any = None, prev_hooks: HookGroup | None = None,
                hook_kf: HookKeyframeGroup | None = None,
                architecture_policy: str = "refuse") -> io.NodeOutput:
        return io.NodeOutput(runtime.recipe_hook(recipe, base, strength_model, keyframes=hook_kf,
                                                       prev=prev_hooks, seed=merge_seed, cache_mb=cache_mb,
                                                       architecture_policy=architecture_policy))

    create = v3.v1_entry()


NODES = [PatchbayRecipeHook]
